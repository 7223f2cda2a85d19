"""Tests of aggregator.core.AggregatorCore (and its burst kernel, aggregator.slots) through the in-process
harness (tests/support/harness.py): malformed and foreign packets (one test per drop reason), retransmission
semantics, the control plane (JOIN / LEAVE / STATS_REQUEST, idle teardown, several jobs), and the partition of
a job's slots over several data-plane cores."""

import json

import numpy as np
import pytest
from support.harness import (
    HDR,
    Network,
    addr_key,
    agg_addr,
    assert_table_equal,
    core_receive,
    counter_diff,
    engine_receive,
    header,
    join_datagram,
    make_inputs,
    handshake,
    msg_type,
    new_core,
    stored,
    table_snapshot,
    with_header,
    with_payload_byte,
    worker_addr,
    TOKEN,
)

from intml.aggregator.core import UNPROVED, AggregatorCore
from intml.protocol import keys, reference, wire
from intml.protocol.arith import data_k_max
from intml.protocol.codec import Codec
from intml.protocol.job import MAX_WORLD
from intml.protocol.stats import STAT_NAMES
from intml.protocol.wire import NO_EXP, MsgType

SEED = 123
STRANGER = addr_key(0x0A000001, 4242)  # 10.0.0.1:4242, never joined


def ref(xs, codec, P, seq=0, seed=SEED):
    return reference.allreduce(xs, codec=codec, seed=seed, allreduce_seq=seq, packet_elements=P)


def assert_results(net, xs, seq=0):
    expected = ref(xs, net.codec.name.lower(), net.packet_elements, seq, net.seed)
    for rank, e in enumerate(net.engines):
        assert np.array_equal(e.result.view(np.uint32), expected.view(np.uint32)), f"rank {rank}"


def error_text(datagram: bytes) -> str:
    assert msg_type(datagram) == MsgType.ERROR
    return datagram[HDR:].decode()


def stats_request(job: int, size: int = 64) -> bytes:
    """A STATS_REQUEST of ``size`` bytes without a credential (its MAC is zero)."""
    return wire.pack({"type": int(MsgType.STATS_REQUEST), "job": job}, bytes(size - HDR))


# ---- 4. malformed packets: one per drop reason --------------------------------------------------------------

N3, P, POOL = 3, 64, 2
SIZE = 3 * P + 5  # chunks 0..3: slot 0 carries chunks 0 and 2, slot 1 chunks 1 and 3


def malformed_setup(codec="cnat8", opened=False):
    """A job in the middle of its first allreduce: the bootstrap rounds are done and every rank's chunk 0 / 1
    DATA is in flight. Returns (net, xs, victim, src): rank 0's chunk-0 DATA (slot 0) and its source. With
    ``opened``, rank 1's chunk-0 packet has already reached the core, so the round is open."""
    net = Network(N3, codec=codec, packet_elements=P, pool_size=POOL)
    xs = [x * 4 for x in make_inputs(N3, SIZE, P, "normal", seed=1)]
    xs[0][0] = 5.0  # an element of rank 0's chunk 0 that is surely nonzero
    net.start(xs)
    net.step()
    assert len(net.up) == N3 * POOL

    def find(rank, slot):
        return next(i for i, (d, src, _) in enumerate(net.up) if src == net.addr(rank) and header(d)["slot"] == slot)

    victim = net.up[find(0, 0)]
    assert header(victim[0])["chunk"] == 0 and header(victim[0])["count"] == P
    if codec == "cnat8":  # room for a code just above the exponent
        assert _k_max(victim[0]) < 63
    if opened:
        data, src, _ = net.up.pop(find(1, 0))
        assert net.to_core(0, [(data, src)]) == []
    return net, xs, victim[0], victim[1]


def inject_and_check(net, datagram, src, reason, *, core_level, lengths=None):
    """Inject one datagram: exactly `reason` (and packets_in) count it, nothing is sent, the slot table is
    unchanged; then the allreduce still completes with the reference result."""
    core = net.cores[0]
    before_core, before_job = net.core_counters(), net.job_counters()
    snap = table_snapshot(core, net.job)
    assert net.to_core(0, [(datagram, src)], lengths) == []
    d_core = counter_diff(before_core, net.core_counters())
    d_job = counter_diff(before_job, net.job_counters())
    assert d_core == {"packets_in": 1, reason: 1}  # the core counts every event, its jobs' too
    assert d_job == ({} if core_level else {"packets_in": 1, reason: 1})
    assert_table_equal(snap, table_snapshot(core, net.job))


def _exp(d):
    return int(header(d)["exp"])


def _with_owners(d, code):
    """The DATA packet with owners code `code` in its rank field's high byte (docs/protocol.md, "Reduce-scatter")."""
    return with_header(d, rank=code << 8 | int(header(d)["rank"]))


def _k_max(d):
    """The largest k the chunk's codes may hold (the agreed exponent's, relative to the round's floor)."""
    return data_k_max(_exp(d), 31 - N3.bit_length())


# (reason, core_level, mutate(datagram, src) -> (datagram, src, lengths))
CNAT_MUTATIONS = {
    "truncated": ("drop_truncated", True, lambda d, s: (d, s, [-1])),
    "short header": ("drop_short", True, lambda d, s: (d[:HDR - 1], s, None)),
    "empty": ("drop_short", True, lambda d, s: (b"", s, None)),
    "bad magic": ("drop_bad_magic", True, lambda d, s: (with_header(d, magic=0x4E49), s, None)),
    "bad version 2": ("drop_bad_version", True, lambda d, s: (with_header(d, version=2), s, None)),
    "bad version 0": ("drop_bad_version", True, lambda d, s: (with_header(d, version=0), s, None)),
    "RESULT to the switch": ("drop_unknown_type", True, lambda d, s: (with_header(d, type=MsgType.RESULT), s, None)),
    "JOIN_ACK to the switch": ("drop_unknown_type", True,
                               lambda d, s: (with_header(d, type=MsgType.JOIN_ACK), s, None)),
    "ERROR to the switch": ("drop_unknown_type", True, lambda d, s: (with_header(d, type=MsgType.ERROR), s, None)),
    "type 0": ("drop_unknown_type", True, lambda d, s: (with_header(d, type=0), s, None)),
    "type 99": ("drop_unknown_type", True, lambda d, s: (with_header(d, type=99), s, None)),
    "unknown job": ("drop_unknown_job", True, lambda d, s: (with_header(d, job=8), s, None)),
    "rank = n": ("drop_rank_out_of_range", False, lambda d, s: (with_header(d, rank=N3), s, None)),
    "rank 65535": ("drop_rank_out_of_range", False, lambda d, s: (with_header(d, rank=0xFFFF), s, None)),
    "unregistered source": ("drop_unregistered_source", False, lambda d, s: (d, STRANGER, None)),
    "another rank's source": ("drop_unregistered_source", False, lambda d, s: (d, worker_addr(1), None)),
    "slot = pool": ("drop_slot_out_of_range", False, lambda d, s: (with_header(d, slot=POOL), s, None)),
    "slot 65535": ("drop_slot_out_of_range", False, lambda d, s: (with_header(d, slot=0xFFFF), s, None)),
    "int32 codec": ("drop_wrong_codec", False, lambda d, s: (with_header(d, codec=Codec.INT32), s, None)),
    "codec 7": ("drop_wrong_codec", False, lambda d, s: (with_header(d, codec=7), s, None)),
    "length > count": ("drop_wrong_count", False, lambda d, s: (d + b"\x00", s, None)),
    "length < count": ("drop_wrong_count", False, lambda d, s: (d[:-1], s, None)),
    "count > packet_elements": ("drop_wrong_count", False,
                                lambda d, s: (with_header(d, count=P + 1) + b"\x00", s, None)),
    "shadow 2": ("drop_bad_shadow", False, lambda d, s: (with_header(d, shadow=2), s, None)),
    "shadow 255": ("drop_bad_shadow", False, lambda d, s: (with_header(d, shadow=255), s, None)),
    "exp -127": ("drop_bad_exponent", False, lambda d, s: (with_header(d, exp=-127), s, None)),  # int8: none above
    "next_exp -127": ("drop_bad_exponent", False, lambda d, s: (with_header(d, next_exp=-127), s, None)),
    "owner = n": ("drop_bad_owner", False, lambda d, s: (_with_owners(d, 1 + N3), s, None)),
    "owners n-1 .. n": ("drop_bad_owner", False, lambda d, s: (_with_owners(d, 1 + 64 + N3 - 1), s, None)),
    "owners code 255": ("drop_bad_owner", False, lambda d, s: (_with_owners(d, 255), s, None)),
    "code 0x80": ("drop_invalid_code", False, lambda d, s: (with_payload_byte(d, 0, 0x80), s, None)),
    "code 0x3F": ("drop_invalid_code", False, lambda d, s: (with_payload_byte(d, 5, 0x3F), s, None)),
    "code k=61": ("drop_invalid_code", False, lambda d, s: (with_payload_byte(d, P - 1, 0x40 | 61), s, None)),
    "code 0xFF": ("drop_invalid_code", False, lambda d, s: (with_payload_byte(d, 1, 0xFF), s, None)),
    "code above exp": ("drop_invalid_code", False,
                       lambda d, s: (with_payload_byte(d, 0, 0x40 | (_k_max(d) + 1)), s, None)),
    "negative code above exp": ("drop_invalid_code", False,
                                lambda d, s: (with_payload_byte(d, 3, 0xC0 | (_k_max(d) + 1)), s, None)),
    "stale key": ("drop_stale", False,  # slot 0's set 0 holds the bootstrap round (chunk -2): -3 is older
                  lambda d, s: (with_header(d, chunk=-POOL - 1, shadow=1 - int(header(d)["shadow"])), s, None)),
}
OPEN_ONLY = {  # need the round's first packet to disagree with
    "exponent mismatch": ("drop_exponent_mismatch", False, lambda d, s: (with_header(d, exp=_exp(d) - 1), s, None)),
    "count mismatch": ("drop_wrong_count", False, lambda d, s: (with_header(d, count=P - 1)[:-1], s, None)),
    "owners mismatch": ("drop_bad_owner", False, lambda d, s: (_with_owners(d, 1), s, None)),  # the round's: all
}


@pytest.mark.parametrize("opened", [False, True], ids=["fresh round", "open round"])
@pytest.mark.parametrize("name", list(CNAT_MUTATIONS))
def test_malformed_cnat_packet_is_counted_and_dropped(name, opened):
    reason, core_level, mutate = CNAT_MUTATIONS[name]
    net, xs, victim, src = malformed_setup("cnat8", opened)
    datagram, source, lengths = mutate(victim, src)
    inject_and_check(net, datagram, source, reason, core_level=core_level, lengths=lengths)
    net.run()
    assert_results(net, xs)


@pytest.mark.parametrize("name", list(OPEN_ONLY))
def test_mismatch_with_round_first_packet(name):
    reason, core_level, mutate = OPEN_ONLY[name]
    net, xs, victim, src = malformed_setup("cnat8", opened=True)
    datagram, source, lengths = mutate(victim, src)
    inject_and_check(net, datagram, source, reason, core_level=core_level, lengths=lengths)
    net.run()
    assert_results(net, xs)


def _int32_set(d, index, value):
    b = bytearray(d)
    b[HDR + 4 * index: HDR + 4 * index + 4] = int(value).to_bytes(4, "big", signed=True)
    return bytes(b)


S3 = 31 - N3.bit_length()  # int32 contributions are bounded by 2**s(n)
INT32_MUTATIONS = {
    "value above 2**s": ("drop_invalid_code", lambda d: _int32_set(d, 0, 2**S3 + 1)),
    "value below -2**s": ("drop_invalid_code", lambda d: _int32_set(d, P - 1, -(2**S3) - 1)),
    "cnat8 codec": ("drop_wrong_codec", lambda d: with_header(d, codec=Codec.CNAT8)),
    "length not 4 * count": ("drop_wrong_count", lambda d: d[:-1]),
    "count as bytes": ("drop_wrong_count", lambda d: with_header(d, count=P)[:HDR + P]),
    "exp -127": ("drop_bad_exponent", lambda d: with_header(d, exp=-127)),
    "next_exp -127": ("drop_bad_exponent", lambda d: with_header(d, next_exp=-127)),
}


@pytest.mark.parametrize("opened", [False, True], ids=["fresh round", "open round"])
@pytest.mark.parametrize("name", list(INT32_MUTATIONS))
def test_malformed_int32_packet_is_counted_and_dropped(name, opened):
    reason, mutate = INT32_MUTATIONS[name]
    net, xs, victim, src = malformed_setup("int32", opened)
    assert header(victim)["codec"] == Codec.INT32 and len(victim) == HDR + 4 * P
    inject_and_check(net, mutate(victim), src, reason, core_level=False)
    net.run()
    assert_results(net, xs)


def test_int32_boundary_values_are_accepted():
    net, _, victim, src = malformed_setup("int32", opened=False)
    before = net.job_counters()
    edge = _int32_set(_int32_set(victim, 0, 2**S3), 1, -(2**S3))
    assert net.to_core(0, [(edge, src)]) == []
    assert counter_diff(before, net.job_counters()) == {"packets_in": 1, "contributions": 1}


def test_every_drop_reason_is_tested():
    tested = {r for r, *_ in CNAT_MUTATIONS.values()} | {r for r, *_ in OPEN_ONLY.values()}
    tested |= {"drop_duplicate_incomplete"}  # test_duplicate_to_incomplete_round_is_answered_with_pending
    tested |= {"drop_bad_control"}  # test_malformed_control_datagram_is_counted_and_answered
    tested |= {"drop_refused_join", "drop_leave_non_member"}  # test_hardening: test_refused_joins_and_foreign_...
    tested |= {"drop_control_rate"}  # test_flood: the kernel against slot_reference, and live floods
    tested |= {"drop_bad_mac"}  # test_data_mac (DATA), test_auth (JOIN proofs, LEAVEs, STATS_REQUESTs)
    tested |= {"drop_bad_package"}  # test_host_mode: test_malformed_packages_are_counted_and_never_summed
    tested |= {"drop_duplicate_resent"}  # test_leafspine: test_a_racks_duplicates_send_its_partial_up_once_per_hold
    assert tested == {name for name in STAT_NAMES if name.startswith("drop_")}


def test_all_malformed_in_one_burst_then_round_completes():
    """Every mutation above in a single burst, interleaved with the valid packets of the round."""
    net, xs, victim, src = malformed_setup("cnat8", opened=False)
    bad, expected = [], {}
    for reason, _, mutate in CNAT_MUTATIONS.values():
        datagram, source, length = mutate(victim, src)
        bad.append((datagram, source, length[0] if length else len(datagram)))
        expected[reason] = expected.get(reason, 0) + 1
    good = [(d, s, len(d)) for d, s, _ in net.up]
    net.up = []
    # rank 0's own packets go last: after them, a mutation of the same round would be a duplicate (its bit is set)
    others, own = [g for g in good if g[1] != src], [g for g in good if g[1] == src]
    mixed = bad[: len(bad) // 2] + others + bad[len(bad) // 2:] + own
    burst = [(d, s) for d, s, _ in mixed]
    burst_lengths = [length for _, _, length in mixed]
    core_before, job_before = net.core_counters(), net.job_counters()
    out = net.to_core(0, burst, burst_lengths)
    d_core = counter_diff(core_before, net.core_counters())
    d_job = counter_diff(job_before, net.job_counters())
    drops = {k: v for k, v in {**d_core, **d_job}.items() if k.startswith("drop_")}
    assert drops == expected
    assert d_job["contributions"] == len(good) == N3 * POOL
    assert d_job["completions"] == POOL and len(out) == N3 * POOL  # both rounds complete, results to all
    for data, dst in out:
        net.down.append((data, agg_addr(0), dst))
    net.run()
    assert_results(net, xs)


# ---- 5. retransmission semantics ----------------------------------------------------------------------------


def two_workers_first_packets(codec: str, seed: int):
    """A 2-worker job with one slot, started: the network, the inputs, and rank 0's and rank 1's first DATA
    datagram (with its source), not yet delivered."""
    net = Network(2, codec=codec, packet_elements=P, pool_size=1)
    xs = make_inputs(2, 3 * P, P, "normal", seed=seed)
    net.start(xs)
    net.step()
    (d0, s0, _), (d1, s1, _) = sorted(net.up, key=lambda item: item[1])
    net.up = []
    return net, xs, (d0, s0), (d1, s1)


@pytest.mark.parametrize("codec", ["cnat8", "int32"])
def test_duplicate_to_incomplete_round_is_answered_with_pending(codec):
    net, xs, (d0, s0), (d1, s1) = two_workers_first_packets(codec, seed=3)
    assert (s0, s1) == (net.addr(0), net.addr(1)) and header(d0)["chunk"] == 0
    assert net.to_core(0, [(d0, s0)]) == []
    snap = table_snapshot(net.cores[0], net.job)
    before = net.job_counters()
    (answer, dst), = net.to_core(0, [(d0, s0)])
    assert counter_diff(before, net.job_counters()) == {"packets_in": 1, "retransmissions": 1,
                                                         "drop_duplicate_incomplete": 1, "packets_out": 1}
    assert_table_equal(snap, table_snapshot(net.cores[0], net.job))  # never added twice
    # to rank 0 alone: the DATA's header as type PENDING with count 0, then the ranks the round has (rank 0's bit)
    want = bytearray(d0[:wire.HEADER_SIZE])
    want[3], want[20:22] = MsgType.PENDING, b"\0\0"
    assert dst == net.addr(0) and answer == bytes(want) + (1).to_bytes(wire.HAVE_SIZE, "big")
    results = net.to_core(0, [(d1, s1)])
    assert sorted(dst for _, dst in results) == [net.addr(0), net.addr(1)]
    for data, dst in results:
        net.down.append((data, agg_addr(0), dst))
    net.run()
    assert_results(net, xs)


@pytest.mark.parametrize("codec", ["cnat8", "int32"])
def test_duplicate_to_complete_round_resends_to_that_worker_alone(codec):
    net, xs, (d0, s0), (d1, s1) = two_workers_first_packets(codec, seed=4)
    results = {dst: data for data, dst in net.to_core(0, [(d0, s0), (d1, s1)])}
    assert set(results) == {s0, s1} and results[s0] == results[s1]  # the same result to every rank
    h, _ = wire.unpack(results[s0])
    assert (h["type"], h["chunk"], h["slot"], h["shadow"], h["count"]) == (MsgType.RESULT, 0, 0, 1, P)
    snap = table_snapshot(net.cores[0], net.job)
    for data, src in ((d0, s0), (d1, s1), (d0, s0)):
        before = net.job_counters()
        out = net.to_core(0, [(data, src)])
        assert out == [(stored(results[src]), src)]  # exactly one datagram, to that rank: the result, marked STORED
        assert counter_diff(before, net.job_counters()) == {"packets_in": 1, "packets_out": 1,
                                                             "retransmissions": 1, "results_resent": 1}
    assert_table_equal(snap, table_snapshot(net.cores[0], net.job))
    # rank 1 moves on: its result makes it send chunk 1 into the same slot's other set (pool 1)
    (c1, dst), = engine_receive(net.engines[1], [(results[s1], agg_addr(0))], net.now)
    assert header(c1)["chunk"] == 1 and header(c1)["shadow"] == 0 and dst == agg_addr(0)
    assert net.to_core(0, [(c1, s1)]) == []  # opens the round in set 0
    assert net.to_core(0, [(d0, s0)]) == [(stored(results[s0]), s0)]  # set 1 still holds chunk 0's result
    net.down.append((results[s0], agg_addr(0), s0))
    net.run()
    assert_results(net, xs)


# ---- 6. control plane ---------------------------------------------------------------------------------------


def test_join_ack_echoes_parameters():
    net = Network(3, join=False, pool_size=5, packet_elements=256, seed=2**64 - 1, token="s3cret")
    replies = net.join_all()
    assert [dst for _, dst in replies] == [net.addr(r) for r in range(3)]
    for rank, (data, _) in enumerate(replies):
        h, body, bitmap = wire.unpack_join(data)
        assert (h["type"], h["job"], h["rank"]) == (MsgType.JOIN_ACK, net.job, rank)
        unicast = {"group": 0, "group_port": 0}
        numeric = [k for k in wire.JOIN.names if wire.JOIN.fields[k][0].kind != "V"]
        assert {k: int(body[k]) for k in numeric} == {**net.join_params(), "flags": 0, "cores": 1, "allreduce": 0,
                                                      "first_core": 0, "total_cores": 1, **unicast,
                                                          "idle_timeout": round(net.cores[0].idle_timeout * 1000)}
        assert bitmap == bytes(1)  # a fresh job: every slot starts at shadow set 0
    # a repeated JOIN from the same address is answered again, identically
    again = net.join(1)
    assert net.join(1) == again and msg_type(again[0][0]) == MsgType.JOIN_ACK


def test_join_ack_reports_cores():
    net = Network(2, cores=3, join=False)
    for data, _ in net.join_all():
        assert int(wire.unpack_join(data)[1]["cores"]) == 3


def test_same_rank_proving_the_token_from_another_address_takes_its_seat():
    """A restarted rank (a new address) replaces its old binding: the old address's data is dropped from then on."""
    net = Network(2, join=False)
    net.join_all()
    (reply, dst), = net.join(1, src=STRANGER)
    assert dst == STRANGER and msg_type(reply) == MsgType.JOIN_ACK
    xs = make_inputs(2, 100, P, "normal", seed=1)
    net.start(xs)
    (d1, _, _), = [item for item in net.up if item[1] == net.addr(1)][:1]
    before = net.job_counters()
    assert net.to_core(0, [(d1, net.addr(1))]) == []
    assert counter_diff(before, net.job_counters()) == {"packets_in": 1, "drop_unregistered_source": 1}
    assert net.to_core(0, [(d1, STRANGER)]) == []
    assert counter_diff(before, net.job_counters()) == {"packets_in": 2, "drop_unregistered_source": 1,
                                                        "contributions": 1}
    (reply, _), = net.join(1)  # and back: the seat follows the latest proof
    assert msg_type(reply) == MsgType.JOIN_ACK
    net.run()
    assert_results(net, xs)


@pytest.mark.parametrize("param,value", [("world_size", 4), ("packet_elements", 32), ("pool_size", 3),
                                         ("codec", int(Codec.INT32)), ("seed", 1)])
def test_join_with_other_parameters_is_refused(param, value):
    net = Network(2)
    (reply, _), = net.join(1, **{param: value})
    text = error_text(reply)
    assert param in text and header(reply)["job"] == net.job
    for other in {"world_size", "packet_elements", "pool_size", "codec", "seed", "token"} - {param}:
        assert f"{other}=" not in text  # names only what differs
    xs = make_inputs(2, 200, P, "normal", seed=2)
    assert_results_of(net, xs)


def test_join_with_wrong_token_is_refused():
    net = Network(2, token="right")
    (reply, _), = net.join(1, token="wrong")
    assert error_text(reply) == UNPROVED
    xs = make_inputs(2, 200, P, "normal", seed=2)
    assert_results_of(net, xs)


def test_join_with_wrong_token_does_not_reveal_the_token():
    net = Network(2, token="5ec2e7")
    (reply, _), = net.join(1, src=STRANGER, token="guess")
    assert "5ec2e7" not in error_text(reply) and error_text(reply) == UNPROVED


def assert_results_of(net, xs):
    net.allreduce(xs)
    assert_results(net, xs)


@pytest.mark.parametrize("overrides,needle", [
    ({"world_size": 0}, "world size"),
    ({"world_size": MAX_WORLD + 1}, "world size"),
    ({"world_size": 2, "rank": 2}, "rank 2"),
    ({"codec": 2}, "codec"),
    ({"codec": 255}, "codec"),
    ({"packet_elements": 0}, "packet elements"),
    ({"packet_elements": P + 1}, "packet elements"),  # above this aggregator's max_elements (= P)
    ({"pool_size": 0}, "pool size"),
])
def test_join_with_bad_parameters_is_refused(overrides, needle):
    net = Network(2, join=False)
    overrides = dict(overrides)
    rank = overrides.pop("rank", 0)
    (reply, dst), = net.join(rank, **overrides)
    assert dst == net.addr(rank) and needle in error_text(reply)
    assert net.cores[0].info == {} and not net.cores[0].counters.row_used.any()


def test_join_without_free_rows_is_refused():
    core = new_core(rows=4, max_elements=P)
    a = Network(2, pool_size=3, aggregators=[core])
    b = Network(2, pool_size=2, aggregators=[core], job=8, worker_port=6000, join=False)
    (reply, _), = b.join(0)
    assert "no free slots" in error_text(reply) and "2 consecutive slot rows" in error_text(reply)
    assert "1 of 4 are free (intml-aggregator --slots)" in error_text(reply)
    assert set(core.info) == {a.job}


def test_join_past_the_job_limit_names_it():
    """A full job table is refused as such (not as a lack of slots, which a user would try to fix with a
    smaller pool)."""
    core = new_core(rows=64, max_elements=P, max_jobs=1)
    a = Network(2, pool_size=2, aggregators=[core])
    b = Network(2, pool_size=2, aggregators=[core], job=8, worker_port=6000, join=False)
    (reply, _), = b.join(0)
    assert "already holds its maximum of 1 jobs (intml-aggregator --max-jobs)" in error_text(reply)
    assert set(core.info) == {a.job} and int(core.counters.row_used.sum()) == 2


def test_join_with_a_pool_over_the_limit_reserves_nothing():
    """One JOIN may not reserve more than --max-pool slots: refused before any row is taken."""
    core = new_core(rows=64, max_elements=P, max_pool=8)
    net = Network(2, pool_size=9, aggregators=[core], join=False)
    (reply, _), = net.join(0)
    assert "pool size 9 exceeds this aggregator's maximum of 8 slots per job (intml-aggregator --max-pool)" in \
        error_text(reply)
    assert core.info == {} and not core.counters.row_used.any()
    at_limit = Network(2, pool_size=8, aggregators=[core], job=9, worker_port=6000)  # accepted, and it works
    assert_results_of(at_limit, make_inputs(2, 100, P, "normal", seed=1))


def test_leave_by_all_ranks_tears_down_and_frees_rows():
    net = Network(3, pool_size=4)
    core = net.cores[0]
    xs = make_inputs(3, 500, P, "normal", seed=6)
    net.allreduce(xs)
    rows = core.info[net.job].rows
    assert core.counters.row_used[rows.start:rows.stop].all()
    assert net.to_core(0, [(net.leave(0), net.addr(0)), (net.leave(1), net.addr(1))]) == []
    assert net.job in core.info  # rank 2 has not left
    assert net.to_core(0, [(net.leave(2), STRANGER)]) == []  # not rank 2's address: ignored
    assert net.job in core.info
    assert net.to_core(0, [(net.leave(2), net.addr(2))]) == []
    assert core.info == {} and not core.counters.row_used.any()
    assert str(net.job) not in net.stats()["jobs"]
    # its data is now of an unknown job
    before = net.core_counters()
    stale = wire.pack({"type": MsgType.DATA, "job": net.job, "rank": 0, "codec": 0, "count": 0})
    assert net.to_core(0, [(stale, net.addr(0))]) == []
    assert counter_diff(before, net.core_counters()) == {"packets_in": 1, "drop_unknown_job": 1}
    # a new job (same id, new engines starting at allreduce 0) takes the same rows and starts fresh
    again = Network(3, pool_size=4, aggregators=[core], seed=77)
    assert core.info[net.job].rows == rows
    assert all(v == 0 for v in again.job_counters().values())
    xs2 = make_inputs(3, 500, P, "normal", seed=8)
    again.allreduce(xs2)
    assert_results(again, xs2)


def test_idle_job_is_torn_down_but_active_one_is_not():
    core = new_core(rows=32, max_elements=P, idle_timeout=1.0)
    Network(2, aggregators=[core], job=1)  # joins, then stays idle
    active = Network(2, aggregators=[core], job=2, worker_port=6000)
    assert core.get_timer() == 1.0  # both joined at 0
    active.now = 0.75
    xs = make_inputs(2, 300, P, "normal", seed=9)
    active.allreduce(xs)
    last = active.now
    assert core.get_timer() == 1.0  # job 1 is still due first
    assert core.handle_timer(0.9) == []
    assert core.handle_timer(1.5) == [1]
    assert set(core.info) == {2}
    assert core.get_timer() == pytest.approx(last + 1.0, abs=active.dt)
    assert core.handle_timer(last + 0.5) == []
    assert core.handle_timer(last + 1.0 + 2 * active.dt) == [2]
    assert core.info == {} and core.get_timer() is None and not core.counters.row_used.any()


def test_join_counts_as_activity():
    core = new_core(rows=32, max_elements=P, idle_timeout=1.0)
    net = Network(2, aggregators=[core])
    net.now = 0.8
    net.join(0)  # repeated JOIN at 0.8
    assert core.get_timer() == pytest.approx(1.8)
    assert core.handle_timer(1.5) == []


def test_handle_timer_at_get_timer_does_its_work():
    core = new_core(rows=32, max_elements=P, idle_timeout=1.0)
    Network(2, aggregators=[core])
    deadline = core.get_timer()
    assert core.handle_timer(deadline) == [7]  # "when handle_timer next has something to do"


def test_stats_reply_lists_pending_rounds_and_missing_ranks():
    net = Network(3, pool_size=4)
    xs = make_inputs(3, 20 * P, P, "normal", seed=10)
    net.start(xs)
    for _ in range(5):  # rank 2 falls silent after its first packets
        net.step()
        if _ >= 1:
            net.up = [item for item in net.up if item[1] != net.addr(2)]
    (reply, dst), = net.to_core(0, [(net.stats_request(0), net.addr(0))])
    assert dst == net.addr(0) and msg_type(reply) == MsgType.STATS_REPLY and header(reply)["job"] == net.job
    job = json.loads(reply[HDR:-16])
    assert job["counters"] == {k: v for k, v in net.job_counters().items() if v}
    assert job["missing"] == [2] and job["pending_total"] == 4
    assert sorted(job["silent_s"]) == ["0", "1", "2"] and job["silent_s"]["2"] > job["silent_s"]["0"]
    # the local view (--stats-interval) has the detail
    local = net.stats()["jobs"][str(net.job)]
    assert {p["slot"] for p in local["pending"]} == {0, 1, 2, 3}
    assert all(p["missing_ranks"] == [2] for p in local["pending"])
    # an unknown job: a short ERROR, only if no larger than the request
    (reply, _), = net.to_core(0, [(stats_request(12345), STRANGER)])
    assert error_text(reply) == "job 12345 unknown"
    assert net.to_core(0, [(stats_request(12345, size=HDR + 16), STRANGER)]) == []


def test_two_jobs_interleaved_on_one_core():
    core = new_core(rows=64, max_elements=256)
    a = Network(3, codec="cnat8", packet_elements=64, pool_size=4, aggregators=[core], job=1, seed=5)
    b = Network(2, codec="int32", packet_elements=256, pool_size=3, aggregators=[core], job=2, seed=6,
                worker_port=6000)
    assert not set(core.info[1].rows) & set(core.info[2].rows)
    for seq in range(2):
        xa = make_inputs(3, 700 - 300 * seq, 64, "mixed", seed=seq)
        xb = make_inputs(2, 1500 + 100 * seq, 256, "normal", seed=seq + 10)
        a.start(xa)
        b.start(xb)
        Network.run_together([a, b], shuffle_seed=seq)
        assert_results(a, xa, seq)
        assert_results(b, xb, seq)
    assert not a.stray and not b.stray
    assert all(v == 0 for k, v in a.core_counters().items() if k.startswith("drop_"))
    for net in (a, b):
        counters = net.job_counters()
        assert all(v == 0 for k, v in counters.items() if k.startswith("drop_")), counters


# ---- 7. several data-plane cores ----------------------------------------------------------------------------


def test_core_accepts_only_its_slots():
    cores = 3
    core = new_core(core=1, cores=cores, rows=16, max_elements=P)
    _join_ranks(core, 2, pool=7)
    assert len(core.info[7].rows) == len(range(1, 7, cores)) == 2
    for slot in range(8):
        data = wire.pack({"type": MsgType.DATA, "job": 7, "rank": 0, "slot": slot, "chunk": -1, "codec": 0,
                          "count": 0, "exp": NO_EXP, "next_exp": NO_EXP})
        before = core.stats(0.0)["jobs"]["7"]["counters"]
        assert core_receive(core, [(data, worker_addr(0))], 0.0) == []
        diff = counter_diff(before, core.stats(0.0)["jobs"]["7"]["counters"])
        ok = slot % cores == 1 and slot < 7
        assert diff == {"packets_in": 1, ("contributions" if ok else "drop_slot_out_of_range"): 1}, slot
    pending = core.stats(0.0)["jobs"]["7"]["pending"]
    assert sorted(p["slot"] for p in pending) == [1, 4]  # reported by their global slot number


def test_core_index_validated():
    for core, cores in ((2, 2), (-1, 2), (0, 0)):
        with pytest.raises(ValueError):
            new_core(core=core, cores=cores, rows=4, max_elements=P)


@pytest.mark.parametrize("cores,pool,codec", [(2, 4, "cnat8"), (3, 5, "int32"), (4, 7, "cnat8"), (2, 3, "int32")])
def test_multi_core_network_matches_reference(cores, pool, codec):
    n, size = 3, 17 * P + 9
    net = Network(n, codec=codec, packet_elements=P, pool_size=pool, cores=cores)
    xs = make_inputs(n, size, P, "mixed", seed=cores)
    net.allreduce(xs)
    assert_results(net, xs)
    chunks = -(-size // P)
    window = min(pool, chunks)
    for i in range(cores):
        rounds = sum(1 + len(range(s, chunks, window)) for s in range(window) if s % cores == i)
        counters = net.job_counters(i)
        assert counters["contributions"] == n * rounds and counters["completions"] == rounds, i
    # and lossy
    lossy = Network(n, codec=codec, packet_elements=P, pool_size=pool, cores=cores, drop=0.1, duplicate=0.1,
                    reorder=0.1, fault_seed=cores)
    lossy.allreduce(xs)
    assert_results(lossy, xs)


def test_pool_smaller_than_cores_can_join_every_core():
    net = Network(2, pool_size=1, cores=2, join=False)
    for core in range(2):
        for rank in range(2):
            (reply, _), = net.join(rank, core=core)
            assert msg_type(reply) == MsgType.JOIN_ACK, reply[HDR:]
    xs = make_inputs(2, 3 * P, P, "normal", seed=1)
    net.allreduce(xs)
    assert_results(net, xs)


# ---- robustness of the core's burst interface ---------------------------------------------------------------


def _join_ranks(core: AggregatorCore, world: int, *, pool: int, job: int = 7) -> None:
    """Ranks 0..world-1 of a job join the core (the handshake)."""
    replies = [reply for r in range(world) for reply in handshake(
        core, worker_addr(r), 0.0, job, r, token=TOKEN, world_size=world, packet_elements=P, pool_size=pool, seed=1)]
    assert [msg_type(d) for d, _ in replies] == [MsgType.JOIN_ACK] * world


def _joined(world: int, *, pool: int = 4, job: int = 7) -> AggregatorCore:
    core = new_core(rows=16, max_elements=P)
    _join_ranks(core, world, pool=pool, job=job)
    return core


def _data(rank: int, slot: int, chunk: int, codes: bytes, *, job: int = 7, shadow: int = 0) -> tuple[bytes, int]:
    """A C_nat DATA packet of exponent 0 (codes 0x40 | k, k in [0, s(n)] = 2**(k - s(n)), or 0)."""
    return wire.pack({"type": MsgType.DATA, "job": job, "rank": rank, "slot": slot, "chunk": chunk, "codec": 0,
                      "count": len(codes), "shadow": shadow, "exp": 0, "next_exp": NO_EXP}, codes), worker_addr(rank)


def test_output_holds_a_burst_of_completions_of_the_largest_world():
    """The core's output burst is sized for the worst case: every packet of a burst completes a round of a
    MAX_WORLD-rank job, each sending MAX_WORLD results (unicast)."""
    pool = 8
    core = _joined(MAX_WORLD, pool=pool)
    for rank in range(MAX_WORLD - 1):
        assert core_receive(core, [_data(rank, s, s, bytes([0x58])) for s in range(pool)], 0.0) == []
    out = core_receive(core, [_data(MAX_WORLD - 1, s, s, bytes([0x58])) for s in range(pool)], 0.0)
    assert len(out) == pool * MAX_WORLD
    assert [dst for _, dst in out] == [worker_addr(r) for _ in range(pool) for r in range(MAX_WORLD)]
    assert [header(d)["chunk"] for d, _ in out] == [s for s in range(pool) for _ in range(MAX_WORLD)]


def test_a_burst_larger_than_expected_grows_the_output_and_keeps_stored_results():
    core = new_core(rows=16, max_elements=P, burst=1)
    _join_ranks(core, 2, pool=4)
    assert core_receive(core, [_data(0, 0, 0, bytes([0x57]))], 0.0) == []
    (result, _), (again, _) = core_receive(core, [_data(1, 0, 0, bytes([0x58]))], 0.0)
    assert result == again
    resent = core_receive(core, [_data(0, 0, 0, bytes([0x57])), _data(1, 0, 0, bytes([0x58]))], 0.0)
    assert resent == [(stored(result), worker_addr(0)), (stored(result), worker_addr(1))]


@pytest.mark.parametrize("world", [1, 2])
def test_result_reused_by_a_new_round_in_the_same_burst_is_not_overwritten(world):
    """A set that completes (or re-sends) a round and then, in the same burst, completes a newer one (only a
    misbehaving sender does that) must not change the bytes the earlier outputs point at: the burst's
    datagrams are those of handing the packets over one at a time."""
    burst = []
    for chunk, code in ((0, 0x57), (8, 0x58)):  # chunk 8 is the next use of slot 0, set 0 (pool 4, two sets)
        burst += [_data(r, 0, chunk, bytes([code, 0x50 + r])) for r in range(world)]
        burst.append(_data(0, 0, chunk, bytes([code, 0x50])))  # a retransmission: the result again, to rank 0
    one = _joined(world)
    expected = [out for datagram in burst for out in core_receive(one, [datagram], 0.0)]
    got = core_receive(_joined(world), burst, 0.0)
    assert got == expected
    assert len({d for d, _ in got}) == 4  # two rounds, two different results, each also re-sent marked STORED


@pytest.mark.parametrize("size", [HDR + 17, 100, 512])  # HDR + 16: a keepalive (test_keepalive)
def test_stats_reply_is_at_most_three_times_its_request(size):
    """However short the member's request, the reply is cut to fit (and says so); it is still MAC'd."""
    net = Network(MAX_WORLD, packet_elements=P, pool_size=2)
    xs = make_inputs(MAX_WORLD, 4 * P, P, "normal", seed=3)
    net.start(xs)
    net.step()
    (reply, _), = net.to_core(0, [(net.stats_request(0, size=size), net.addr(0))])
    assert msg_type(reply) == MsgType.STATS_REPLY and len(reply) <= 3 * size
    assert keys.verify(net.sessions[0].sessions[agg_addr(0)], reply, len(reply) - 16)
    body = reply[HDR:-16]
    if size < 512:
        assert b"truncated" in body


def test_control_datagrams_mixed_with_data_in_one_burst():
    net = Network(2, pool_size=2)
    xs = make_inputs(2, 4 * P, P, "normal", seed=12)
    net.start(xs)
    burst = [(d, s) for d, s, _ in net.up]
    net.up = []
    burst.insert(1, (net.stats_request(0), net.addr(0)))
    burst.insert(3, (join_datagram(net.job, 1, **net.join_params()), net.addr(1)))
    out = net.to_core(0, burst)
    types = sorted(msg_type(d) for d, _ in out)
    assert types == sorted([MsgType.RESULT] * 4 + [MsgType.STATS_REPLY, MsgType.CHALLENGE])
    for data, dst in out:
        if msg_type(data) == MsgType.RESULT:
            net.down.append((data, agg_addr(0), dst))
    net.run()
    assert_results(net, xs)


def test_malformed_control_datagram_is_counted_and_answered():
    """A JOIN whose payload is too short (LEAVE and STATS_REQUEST have nothing past the header to get wrong)."""
    datagram = wire.pack({"type": int(MsgType.JOIN), "job": 7}, b"\x00" * 5)
    net = Network(2)
    before = net.core_counters()
    out = net.to_core(0, [(datagram, STRANGER)])
    assert counter_diff(before, net.core_counters()) == {"packets_in": 1, "drop_bad_control": 1}
    assert [msg_type(d) for d, _ in out] == [MsgType.ERROR]
    assert out[0][1] == STRANGER


# ---- 8. a burst is handled as if packet by packet -----------------------------------------------------------


def _recorded_uplink(codec: str, n: int, seed: int) -> tuple[Network, list[tuple[bytes, int]]]:
    """Every datagram the workers of a faulty two-allreduce run sent (retransmissions, duplicates included)."""
    net = Network(n, codec=codec, packet_elements=P, pool_size=4, drop=0.1, duplicate=0.1, reorder=0.1,
                  fault_seed=seed, record=True)
    for seq in range(2):
        net.allreduce(make_inputs(n, 9 * P + 7, P, "normal", seed=seed + seq))
    return net, [(d, s) for d, s, _ in net.sent_up]


def _joined_core(net: Network) -> AggregatorCore:
    core = new_core(rows=16, max_elements=P)
    for r in range(net.n):
        (reply, _), = handshake(core, net.addr(r), 0.0, net.job, r, token=net.token, **net.join_params())
        assert msg_type(reply) == MsgType.JOIN_ACK
    return core


@pytest.mark.slow
@pytest.mark.parametrize("codec", ["cnat8", "int32"])
@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("shuffle", [False, True])
def test_burst_equals_one_packet_at_a_time(codec, seed, shuffle):
    """The two-phase burst kernel (decide in order, then add per set) sends the same datagrams in the same order
    and leaves the same slot table and counters as handing it one packet per call. `shuffle` scrambles the
    stream within windows of 40 packets, past what the protocol allows: new rounds then arrive in sets that
    still have work in the burst, stale rounds and early retransmissions abound."""
    rng = np.random.default_rng(seed)
    net, stream = _recorded_uplink(codec, 3, seed)
    if shuffle:
        stream = [stream[k] for w in range(0, len(stream), 40)
                  for k in (w + rng.permutation(min(40, len(stream) - w)))]
    one, batched = _joined_core(net), _joined_core(net)
    sent_one = [out for datagram in stream for out in core_receive(one, [datagram], 1.0)]
    sent_batched = []
    start = 0
    while start < len(stream):
        size = int(rng.integers(1, 120))
        sent_batched += core_receive(batched, stream[start:start + size], 1.0)
        start += size
    assert sent_batched == sent_one
    assert one.stats(1.0) == batched.stats(1.0)
    assert_table_equal(table_snapshot(one, net.job), table_snapshot(batched, net.job))
    counters = one.stats(1.0)["jobs"][str(net.job)]["counters"]
    assert counters["completions"] > 0 and counters["retransmissions"] > 0
    if shuffle:
        assert counters["drop_stale"] > 0
    assert (batched.datapath.batch[0] == -1).all()  # no set is left marked as part of a burst


# ---- 9. results by multicast --------------------------------------------------------------------------------

GROUP = (0xEFFF0000, 4000)  # 239.255.0.0, port 4000


@pytest.mark.parametrize("codec", ["cnat8", "int32"])
@pytest.mark.parametrize("faults", [0.0, 0.1])
def test_multicast_results_one_datagram_per_completion(codec, faults):
    """With a results group, a completion sends one datagram to the job's group (each worker's copy then lost,
    duplicated or delayed on its own), a retransmitted result goes to its one worker, and the results are
    still the reference's bit for bit. Two jobs on one core get two groups."""
    core = new_core(rows=64, max_elements=P, results_group=GROUP)
    nets = [Network(3, codec=codec, packet_elements=P, pool_size=4, job=job, aggregators=[core], drop=faults,
                    duplicate=faults, reorder=faults, fault_seed=job, record=True, worker_port=5000 + 100 * job)
            for job in (1, 2)]
    assert [net.group for net in nets] == [((GROUP[0] + k) << 16) | GROUP[1] for k in range(2)]
    xs = [make_inputs(3, 9 * P + 5, P, "normal", seed=job) for job in (1, 2)]
    for net, x in zip(nets, xs):
        net.start(x)
    Network.run_together(nets)
    for net, x in zip(nets, xs):
        assert_results(net, x)
        counters = net.job_counters()
        assert counters["packets_out"] == (counters["completions"] + counters["results_resent"]
                                           + counters["drop_duplicate_incomplete"])  # each answered by a PENDING
        to_group = [d for d, _, dst in net.sent_down if dst == net.group]
        assert len(to_group) == counters["completions"]
        assert all(dst == net.group or dst in net.rank_of for _, _, dst in net.sent_down)
        if faults:
            assert counters["results_resent"] > 0


def test_results_group_must_be_multicast():
    with pytest.raises(ValueError, match="multicast"):
        new_core(rows=4, max_elements=P, results_group=(0x7F000001, 4000))
    with pytest.raises(ValueError, match="multicast"):
        new_core(rows=4, max_elements=P, max_jobs=64, results_group=(0xEFFFFFF0, 4000))
