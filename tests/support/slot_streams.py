"""Datagram streams for the slot tables and their packet-at-a-time reference: a core and a
protocol.slot_reference joined to the same jobs, replay of a stream into both with the state compared after
every burst, streams recorded from the in-process harness, and hypothesis's strategy of valid and mutated
datagrams (the slot-reference, reduce-scatter and P4-model tests share them)."""

from __future__ import annotations

import numpy as np
from support.harness import TOKEN, Network, addr_key, core_receive, handshake, make_inputs, msg_type, new_core, worker_addr
from hypothesis import strategies as st

from intml.aggregator.core import AggregatorCore
from intml.protocol import wire
from intml.protocol.codec import Codec
from intml.protocol.siphash import key_words, tag_ref
from intml.protocol.slot_reference import COMPLETE, Job, SlotReference
from intml.protocol.stats import STAT_NAMES
from intml.protocol.wire import NO_EXP, MsgType

P = 32
GROUP = (0xEFFF0000, 4000)  # 239.255.0.0, port 4000
Item = tuple[bytes | None, int]  # (datagram or None for one truncated on receive, source address key)


def joined_pair(specs: list[dict], *, core: int = 0, cores: int = 1, group: tuple[int, int] | None = None,
                layout: tuple[int, int] | None = None) -> tuple[AggregatorCore, SlotReference]:
    """A core and a reference with the same jobs joined. specs: job, world, codec, pool, seed, addr(rank).
    ``layout``: (first_core, total_cores) of the jobs, spread over several aggregators (the reference is then
    the job's core first_core + core of total_cores)."""
    agg = new_core(core=core, cores=cores, rows=64, max_elements=P, results_group=group)
    first, total = layout or (0, cores)
    ref = SlotReference(first + core, total)
    for s in specs:
        params = {"world_size": s["world"], "packet_elements": s.get("packet_elements", P), "pool_size": s["pool"],
                  "codec": int(s["codec"]), "seed": s["seed"], "first_core": first, "total_cores": total}
        members = {r: s["addr"](r) for r in range(s["world"])}
        acks = [ack for r, a in members.items() for ack in handshake(agg, a, 0.0, s["job"], r, token=TOKEN, **params)]
        assert [msg_type(d) for d, _ in acks] == [MsgType.JOIN_ACK] * s["world"]
        ack = wire.unpack_join(acks[0][0])[1]
        if "mac_key" in s:  # the job's data key, as the control plane sets it at registration
            j = agg.info[s["job"]].index
            agg.datapath.jobs.data_mac[j], agg.datapath.jobs.mac_key[j] = True, s["mac_key"]
        ref.join(Job(s["job"], s["world"], params["packet_elements"], s["pool"], int(s["codec"]), s["seed"], members,
                     addr_key(int(ack["group"]), int(ack["group_port"])) if ack["group"] else 0, s.get("mac_key")))
    ref.core_stats.update(nonzero(core_row(agg)))  # the JOINs, which the control plane handles
    return agg, ref


def replay(agg: AggregatorCore, ref: SlotReference, stream: list[Item], sizes: list[int]) -> None:
    """Feed the stream to the reference one packet at a time and to the core in bursts of `sizes` (cycled), and
    hold the core to the reference."""
    expected = [out for datagram, src in stream for out in ref.receive(datagram, src)]
    got, start, k = [], 0, 0
    while start < len(stream):
        part = stream[start:start + sizes[k % len(sizes)]]
        got += core_receive(agg, [(d or b"", src) for d, src in part], 1.0, [-1 if d is None else len(d)
                                                                              for d, _ in part])
        start += len(part)
        k += 1
    assert got == expected
    assert_same_state(agg, ref)


def nonzero(counters: dict) -> dict:
    return {k: v for k, v in counters.items() if v}


def core_row(agg: AggregatorCore) -> dict:
    """The kernel's own row of core events (the reference's core_stats); the core's reported counters add its
    jobs' events to it."""
    return dict(zip(STAT_NAMES, agg.counters.core_stats.tolist()))


def assert_same_state(agg: AggregatorCore, ref: SlotReference) -> None:
    stats = agg.stats(1.0)
    assert nonzero(core_row(agg)) == nonzero(ref.core_stats)
    assert set(ref.core_stats) <= set(STAT_NAMES)
    for job in ref.jobs.values():
        assert nonzero(stats["jobs"][str(job.job_id)]["counters"]) == nonzero(job.stats), job.job_id
        rows = agg.info[job.job_id].rows
        stride, offset = agg.info[job.job_id].slots.stride, agg.info[job.job_id].slots.offset
        t = agg.datapath.table
        used = {(int(r) * stride + offset, int(x))
                for r, x in zip(*np.nonzero(t.bitmap[rows.start:rows.stop]))}  # an opened round has a bit
        assert used == {(slot, x) for (j, slot, x), s in ref.sets.items() if j == job.job_id and s.key >= 0}
        for (j, slot, x), s in ref.sets.items():
            if j != job.job_id or s.key < 0:
                continue
            row = rows.start + slot // stride
            assert int(t.round_key[row, x]) % (1 << 64) == s.key  # the kernel's int64 holds the same 64 bits
            assert int(t.bitmap[row, x]) == sum(1 << r for r in s.ranks)
            assert int(t.count[row, x]) == len(s.ranks)
            assert t.acc[row, x, :s.elements].tolist() == s.sums
            if s.state(job.world) == COMPLETE:
                assert t.result[row, x, :t.result_len[row, x]].tobytes() == s.result


# ---- (a) recorded streams ----------------------------------------------------------------------------------


def recorded(n: int, codec: str, seed: int, *, cores: int = 1, job: int = 7, port: int = 5000,
             aggregators: list[AggregatorCore] | None = None,
             data_mac_key: tuple[int, int] | None = None) -> tuple[Network, list]:
    """Every DATA datagram the workers of a faulty two-allreduce run sent: (datagram, source, destination)."""
    net = Network(n, codec=codec, packet_elements=P, pool_size=4, cores=cores, job=job, worker_port=port,
                  drop=0.1, duplicate=0.1, reorder=0.2, fault_seed=seed, record=True, aggregators=aggregators,
                  data_mac_key=data_mac_key)
    for seq in range(2):
        net.start(make_inputs(n, 9 * P + 3, P, "normal", seed=seed + seq))
        net.run()
    return net, [(d, s, dst) for d, s, dst in net.sent_up if msg_type(d) == MsgType.DATA]


def spec_of(net: Network) -> dict:
    return {"job": net.job, "world": net.n, "codec": net.codec, "pool": net.pool_size, "seed": net.seed,
            "addr": net.addr}


MAC_KEY = key_words(bytes(range(16, 32)))
JOBS = ({"job": 7, "world": 2, "codec": Codec.CNAT8, "pool": 2, "seed": 3, "addr": worker_addr},
        {"job": 8, "world": 3, "codec": Codec.INT32, "pool": 2, "seed": 4, "addr": lambda r: worker_addr(r, 6000)},
        {"job": 9, "world": 2, "codec": Codec.CNAT8, "pool": 2, "seed": 5, "addr": lambda r: worker_addr(r, 7000),
         "mac_key": MAC_KEY})
STRANGER = addr_key(0x0A000001, 4242)
# Values that fit a round (for C_nat: k <= T - f = 29 at exponents 0 and 3, s(n) = 29 for both jobs; only 0 for
# none) and values that do not.
VALID_CODES = {0: [0x00, 0x40 | 29, 0xC0 | 27, 0x40 | 9], 3: [0x00, 0x40 | 29, 0xC0 | 14], NO_EXP: [0x00]}
INVALID_CODES = [0x40 | 30, 0x40 | 31, 0x40 | 63, 0x80, 0x3F]
VALID_INT32 = [0, 1, -7, 1 << 29, -(1 << 29), 1 << 28]
INVALID_INT32 = [(1 << 29) + 1, -(1 << 29) - 1]
MUTATIONS = ("truncated", "short", "magic", "version", "type", "job", "source", "rank", "slot", "codec", "count",
             "length", "shadow", "exp", "next_exp", "owners", "disagree", "values", "tag")


def owner_codes(world: int) -> list[int]:
    """Every valid owners code of a job of `world` ranks (protocol.wire, "Owners"): every rank, then ranks
    first .. first + span."""
    return [0] + [1 + 64 * span + first for span in range(4) for first in range(world - span)]


def bad_owner_codes(world: int) -> list[int]:
    """Codes naming a rank >= world."""
    return [1 + world, 1 + 64 + world - 1, 255]


@st.composite
def packets(draw) -> Item:
    """A DATA packet of one of a few rounds per job (chunks 0 and 4, 1 and 5 share a set: newer and older
    rounds meet), so that rounds complete; one in four is malformed or disagrees with its round. Each round has
    its owners (a reduce-scatter chunk's, or every rank: an allreduce's). A packet of the job with a data key
    carries its tag (after any other change: a malformed packet can be authentic), or with the "tag" mutation a
    wrong, missing or other key's tag (a packet of another job gets 8 stray bytes)."""
    spec = draw(st.sampled_from(JOBS))
    codec = spec["codec"]
    allreduce, chunk = draw(st.integers(0, 1)), draw(st.integers(-1, 5))
    count, exp = [(2, 0), (3, 3), (0, NO_EXP), (2, NO_EXP)][(allreduce + chunk) % 4]
    codes = owner_codes(spec["world"])
    owners = codes[(allreduce * 7 + chunk) % len(codes)]
    mutations = MUTATIONS if len(codes) > 1 else [m for m in MUTATIONS if m != "owners"]
    mutation = draw(st.sampled_from(mutations)) if draw(st.integers(0, 3)) == 0 else "none"
    if mutation == "disagree":
        other_exp = (count, 0 if exp else 3, owners)
        count, exp, owners = draw(st.sampled_from([other_exp, other_exp, (count + 1, exp, owners),
                                                   (count, exp, codes[(codes.index(owners) + 1) % len(codes)])]))
    if mutation == "owners":
        owners = draw(st.sampled_from(bad_owner_codes(spec["world"])))
    rank = draw(st.integers(0, spec["world"] - 1))
    if codec == Codec.CNAT8:
        pool = INVALID_CODES if mutation == "values" else VALID_CODES[exp]
    else:
        pool = INVALID_INT32 if mutation == "values" else VALID_INT32
    values = [draw(st.sampled_from(pool)) for _ in range(count)]
    header = {"type": int(MsgType.DATA), "job": spec["job"], "allreduce": allreduce, "chunk": chunk,
              "rank": owners << 8 | rank,
              "slot": chunk % 2, "count": count, "codec": int(codec), "shadow": chunk // 2 % 2, "exp": exp,
              "next_exp": draw(st.sampled_from([NO_EXP, 1, 2]))}
    src = spec["addr"](rank)
    payload = np.array(values, np.uint8 if codec == Codec.CNAT8 else ">i4").tobytes()
    changes = {"magic": {"magic": 0x1234}, "version": {"version": 9}, "job": {"job": 99},
               "type": {"type": draw(st.sampled_from([int(MsgType.RESULT), int(MsgType.ERROR), 77]))},
               "rank": {"rank": owners << 8 | spec["world"]}, "slot": {"slot": spec["pool"]}, "codec": {"codec": 1 - int(codec)},
               "count": {"count": P + 1}, "shadow": {"shadow": 2}, "exp": {"exp": -127}, "next_exp": {"next_exp": -127}}
    header.update(changes.get(mutation, {}))
    datagram = wire.pack(header, payload)
    if mutation == "truncated":
        return None, src
    if mutation == "length":
        datagram += b"\x00"
    if "mac_key" in spec or mutation == "tag":
        tag = tag_ref(*spec.get("mac_key", MAC_KEY), datagram)
        if mutation == "tag":
            k0, k1 = MAC_KEY
            tag = draw(st.sampled_from([bytes(8), tag[:7] + bytes([tag[7] ^ 1]), tag_ref(k0 ^ 1, k1, datagram)]))
            datagram = draw(st.sampled_from([datagram + tag, datagram, datagram[:-1] + bytes([datagram[-1] ^ 0x80])
                                             + tag_ref(*MAC_KEY, datagram)]))
        else:
            datagram += tag
    if mutation == "short":
        datagram = datagram[:draw(st.integers(0, wire.HEADER_SIZE - 1))]
    return datagram, (STRANGER if mutation == "source" else src)
