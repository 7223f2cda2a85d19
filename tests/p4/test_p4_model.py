"""The P4 pipeline model (intml.p4.model) against the aggregator core, bit for bit: the same datagrams out in the
same order, the same counters per drop reason, the same slot state and sums, as protocol.slot_reference and the
Numba kernel. Streams: (a) hypothesis's random streams of tests/protocol/test_slot_reference.py (malformed packets of every
drop reason, rounds that complete, go stale and are retransmitted; both codecs, several jobs, multicast); (b) the
in-process harness with loss, duplication and reordering, 2 to 32 workers, packets of several passes; (c) a
stream recorded from a real loopback run (real UDP sockets, workers in their own processes), replayed with its
control datagrams into a kernel core and a model core.

The switch tells every drop reason of the core apart. Two never arise on it: ``drop_bad_mac`` (the p4model
engine refuses a JOIN with data_mac: a switch cannot SipHash a payload at line rate) and, on a switch,
``drop_truncated`` (a switch receives whole frames; the model counts it for a datagram its driver cut, as the
core does). The per-received-burst cap of the control admission belongs to the driver (a switch sees no bursts).
"""

from __future__ import annotations

import math
import socket
import threading
import time

import numpy as np
import pytest
from support.cluster import HOST, run_ok
from support.harness import TOKEN, Network, core_receive, handshake, make_inputs, msg_type, stored, worker_addr
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from intml.aggregator.core import AggregatorCore
from intml.p4 import layout
from intml.p4.controller import controller_entries
from intml.p4.engine import engine_problem, p4model_core
from intml.p4.entries import cli_commands, static_entries
from intml.p4.extern import ExternRandom, KeyedRandom
from intml.p4.model import PipelineModel
from intml.protocol import reference, wire
from intml.protocol.address import addr_key_of
from intml.protocol.burst import Burst
from intml.protocol.codec import Codec
from intml.protocol.job import ControlLimits
from intml.protocol.slot_reference import COMPLETE, TRANSITIONS, Job, SlotReference
from intml.protocol.wire import NO_EXP, MsgType
from support.slot_streams import GROUP, JOBS, Item, joined_pair, nonzero, packets
from support.allreduce import SMALL_PLAN, allreduce_worker, assert_bits_equal, check_results, new_job

PLAIN_JOBS = [spec for spec in JOBS if "mac_key" not in spec]  # the switch refuses data_mac; its packets: unknown job


def model_of(core: AggregatorCore, random=None) -> PipelineModel:
    """A pipeline model with the static entries and the controller's entries of ``core``'s jobs."""
    model = PipelineModel(random or KeyedRandom())
    model.install(static_entries())
    model.replace_job_entries(controller_entries(core))
    return model


def joined(world: int, packet_elements: int, codec: Codec = Codec.CNAT8, random=None, flags: int = 0
           ) -> tuple[AggregatorCore, SlotReference, PipelineModel]:
    """Job 7 of ``world`` ranks (one slot) joined on a kernel core with JOIN ``flags``, the reference and a model of
    that core."""
    core = AggregatorCore(rows=4, max_elements=packet_elements, tokens=[TOKEN])
    for rank in range(world):
        handshake(core, worker_addr(rank), 0.0, 7, rank, token=TOKEN, world_size=world,
                  packet_elements=packet_elements, pool_size=1, codec=int(codec), flags=flags)
    ref = SlotReference()
    ref.join(Job(7, world, packet_elements, 1, int(codec), 0, {r: worker_addr(r) for r in range(world)}))
    return core, ref, model_of(core, random)


def data(rank: int, allreduce: int, codes: np.ndarray, exp: int = 0) -> bytes:
    """A DATA packet of job 7, slot 0, chunk 0 of ``allreduce`` (shadow set = its parity)."""
    return wire.pack({"type": int(MsgType.DATA), "job": 7, "allreduce": allreduce, "rank": rank,
                      "count": codes.size, "codec": 0, "shadow": allreduce % 2, "exp": exp, "next_exp": NO_EXP},
                     codes)


def lanes_of(model: PipelineModel, register: str, slot_index: int, elements: int) -> np.ndarray:
    """A per-lane register's cells of a (row, set), gathered over the passes in element order."""
    cells = model.registers.cells[register]
    return np.array([cells[i % layout.LANES_PER_PASS, layout.lane_index(slot_index, i // layout.LANES_PER_PASS)]
                     for i in range(elements)], cells.dtype)


def assert_model_state(model: PipelineModel, core: AggregatorCore, ref: SlotReference) -> None:
    """The model's registers hold the reference's sets: round key, bitmap, count, sums, and a complete set's
    result (C_nat: the stored codes; int32: the sums)."""
    cells = model.registers.cells
    for (job_id, slot, x), s in ref.sets.items():
        info = core.info[job_id]
        stride = info.slots.stride
        index = 2 * (info.rows.start + slot // stride) + x
        if s.key < 0:
            assert cells["worker_bitmap"][layout.lane_index(index, 0)] == 0
            continue
        for p in range(layout.passes(s.elements)):  # every pass keeps the round's state
            cell = layout.lane_index(index, p)
            assert int(cells["round_key"][cell]) == s.key
            assert int(cells["worker_bitmap"][cell]) == sum(1 << r for r in s.ranks)
            assert int(cells["worker_count"][cell]) == len(s.ranks)
            assert int(cells["round_owners"][cell]) == s.owners
        assert lanes_of(model, "lane_sum", index, s.elements).view(np.int32).tolist() == s.sums
        if s.state(ref.jobs[job_id].world) == COMPLETE:
            stored = lanes_of(model, "lane_code", index, s.elements) if ref.jobs[job_id].codec == Codec.CNAT8 \
                else lanes_of(model, "lane_sum", index, s.elements).astype(">u4")
            assert stored.tobytes() == s.result[wire.HEADER_SIZE:]


def assert_model_counters(model: PipelineModel, core: AggregatorCore, ref: SlotReference, joins: dict) -> None:
    assert nonzero(model.counters()) == nonzero(ref.core_stats - joins)
    for job in ref.jobs.values():
        assert nonzero(model.counters(core.info[job.job_id].index)) == nonzero(job.stats), job.job_id


# ---- (a) hypothesis's random streams -----------------------------------------------------------------------


@pytest.mark.slow
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(stream=st.lists(packets(), min_size=1, max_size=80),
       sizes=st.lists(st.integers(1, 40), min_size=1, max_size=5), group=st.sampled_from([None, GROUP]))
def test_random_stream_matches_reference_and_kernel(stream: list[Item], sizes: list[int], group) -> None:
    agg, ref = joined_pair(PLAIN_JOBS, group=group)
    joins = ref.core_stats.copy()
    model = model_of(agg)
    expected = [out for datagram, src in stream for out in ref.receive(datagram, src)]
    got = [out for datagram, src in stream for out in model.receive(datagram, src, 1.0)]
    assert got == expected
    kernel, start, k = [], 0, 0
    while start < len(stream):
        part = stream[start:start + sizes[k % len(sizes)]]
        kernel += core_receive(agg, [(d or b"", src) for d, src in part], 1.0, [-1 if d is None else len(d)
                                                                                 for d, _ in part])
        start, k = start + len(part), k + 1
    assert got == kernel
    assert_model_counters(model, agg, ref, joins)
    assert_model_state(model, agg, ref)


# ---- (b) the in-process harness: loss, duplication, reordering, 2 to 32 workers, several passes -------------


class Recording:
    """Wraps a model core's pipeline: every datagram it took and what it sent for each."""

    def __init__(self, core: AggregatorCore) -> None:
        self.taken: list[tuple[bytes | None, int, list]] = []
        receive = core.datapath.model.receive

        def recording(datagram, addr, now):
            out = receive(datagram, addr, now)
            self.taken.append((datagram, addr, out))
            return out

        core.datapath.model.receive = recording


def run_network(core: AggregatorCore, n: int, codec: str, packet_elements: int, seed: int) -> tuple[Network, list]:
    """An allreduce, then a reduce-scatter (shards of packet_elements / 2 + 3: chunks with one owner, with two,
    and with none of a rank's), through ``core`` with 10% loss and duplication, 20% reordering; (network,
    results)."""
    net = Network(n, codec=codec, packet_elements=packet_elements, pool_size=4, drop=0.1, duplicate=0.1,
                  reorder=0.2, fault_seed=seed, aggregators=[core], record=True)
    results = [net.allreduce(make_inputs(n, 7 * packet_elements + 3, packet_elements, "normal", seed))]
    net.start(make_inputs(n, n * (packet_elements // 2 + 3), packet_elements, "normal", seed + 1), scatter=True)
    net.run()
    return net, results + [[engine.result for engine in net.engines]]


FAULTY_RUNS = [(n, codec, elements) for n in (2, 5, 17, 32) for codec, elements in (("cnat8", 200), ("int32", 150))] \
    + [(2, "cnat8", 1024), (17, "cnat8", 1024), (3, "int32", 256)]  # 16 and 4 passes a packet


@pytest.mark.slow
@pytest.mark.parametrize("n, codec, packet_elements", FAULTY_RUNS)
def test_faulty_runs_match_kernel_and_reference(n: int, codec: str, packet_elements: int) -> None:
    """The same faulty run (an allreduce and a reduce-scatter) with the kernel and with the model as the
    aggregator: the same datagrams to the workers (header-only completions included), the same results and
    counters; and every DATA packet the model took gives the reference's output."""
    kernel, kernel_results = run_network(AggregatorCore(rows=64, max_elements=packet_elements, tokens=[TOKEN]), n,
                                         codec, packet_elements, seed=n)
    core = p4model_core(rows=64, max_elements=packet_elements, tokens=[TOKEN])
    recording = Recording(core)
    model, model_results = run_network(core, n, codec, packet_elements, seed=n)
    assert model.sent_down == kernel.sent_down
    for a, b in zip(kernel_results, model_results):
        for x, y in zip(a, b):
            assert_bits_equal(y, x, f"n={n} {codec}")
    assert model.job_counters() == kernel.job_counters()
    assert model.job_counters()["retransmissions"] > 0 and model.job_counters()["completions"] > 0
    assert any(len(d) == wire.HEADER_SIZE and msg_type(d) == MsgType.RESULT for d, _, _ in model.sent_down)
    ref = SlotReference()
    ref.join(Job(model.job, n, packet_elements, 4, int(model.codec), model.seed,
                 {r: model.addr(r) for r in range(n)}))
    for datagram, addr, out in recording.taken:
        if datagram is not None and datagram[3] == MsgType.DATA:
            assert out == ref.receive(datagram, addr)
    assert nonzero(ref.jobs[model.job].stats) == nonzero(model.job_counters())


@pytest.mark.slow
@pytest.mark.parametrize("codec", ["cnat8", "int32"])
def test_non_finite_lanes_match_kernel_and_reference(codec: str) -> None:
    """NaN, +Inf and -Inf at chosen lanes of chosen ranks, with loss, duplication and reordering, through the model
    (its lane_flags rule) and through the kernel: the same datagrams, the reference's results (a packet of 4
    passes, flags in several), the same counters, nonfinite_elements included, and each DATA packet the model
    took gives the slot reference's output."""
    n, elements = 3, 256
    xs = make_inputs(n, 5 * elements + 3, elements, "normal", 7)
    plan = [(0, 3, np.inf), (1, 3, np.inf), (0, 70, -np.inf), (2, 70, np.inf), (1, 200, np.nan), (2, 511, -np.inf),
            (0, 4 * elements + 1, np.inf), (1, 5 * elements + 2, np.nan)]
    for r, lane, v in plan:
        xs[r][lane] = v

    def run(core):
        net = Network(n, codec=codec, packet_elements=elements, pool_size=4, drop=0.1, duplicate=0.1, reorder=0.2,
                      fault_seed=3, aggregators=[core], record=True)
        return net, net.allreduce(xs)

    kernel, kernel_results = run(AggregatorCore(rows=64, max_elements=elements, tokens=[TOKEN]))
    core = p4model_core(rows=64, max_elements=elements, tokens=[TOKEN])
    recording = Recording(core)
    model, model_results = run(core)
    assert model.sent_down == kernel.sent_down
    want = reference.allreduce(xs, codec=codec, seed=model.seed, allreduce_seq=0, packet_elements=elements)
    for got in model_results + kernel_results:
        assert_bits_equal(got, want, codec)
    assert model.job_counters() == kernel.job_counters()
    assert model.job_counters()["nonfinite_elements"] == len({lane for _, lane, _ in plan})
    ref = SlotReference()
    ref.join(Job(model.job, n, elements, 4, int(model.codec), model.seed, {r: model.addr(r) for r in range(n)}))
    for datagram, addr, out in recording.taken:
        if datagram is not None and datagram[3] == MsgType.DATA:
            assert out == ref.receive(datagram, addr)
    assert nonzero(ref.jobs[model.job].stats) == nonzero(model.job_counters())


@pytest.mark.parametrize("codec", ["cnat8", "int32"])
def test_nearest_jobs_match_kernel_and_reference(codec: str) -> None:
    """A job joined with nearest rounding (the JOIN flag, the job table's ``nearest``), with loss and duplication,
    a packet of 3 passes: the model sends the kernel's datagrams and counters, and every rank gets the reference's
    deterministic result; the same stream with stochastic rounding gives other C_nat results."""
    n, elements = 3, 150
    xs = make_inputs(n, 2 * elements + 7, elements, "normal", 5)

    def run(core, nearest=True):
        net = Network(n, codec=codec, packet_elements=elements, pool_size=4, drop=0.1, duplicate=0.1, fault_seed=2,
                      aggregators=[core], record=True, nearest=nearest)
        return net, net.allreduce(xs)

    kernel, kernel_results = run(AggregatorCore(rows=64, max_elements=elements, tokens=[TOKEN]))
    model, model_results = run(p4model_core(rows=64, max_elements=elements, tokens=[TOKEN]))
    assert model.sent_down == kernel.sent_down
    assert model.job_counters() == kernel.job_counters()
    want = reference.allreduce(xs, codec=codec, seed=model.seed, allreduce_seq=0, packet_elements=elements,
                               rounding="nearest")
    for got in model_results + kernel_results:
        assert_bits_equal(got, want, codec)
    if codec == "cnat8":
        _, stochastic = run(p4model_core(rows=64, max_elements=elements, tokens=[TOKEN]), nearest=False)
        assert not np.array_equal(stochastic[0], want)


@pytest.mark.slow
def test_two_jobs_on_two_cores_with_multicast_match_kernel() -> None:
    """Two jobs of different codecs on one aggregator of two cores, results multicast: the model cores' output
    equals the kernel cores', for an allreduce and a reduce-scatter."""
    runs = []
    for core_class in (AggregatorCore, p4model_core):
        cores = [core_class(core=i, cores=2, rows=64, max_elements=100, tokens=[TOKEN], results_group=GROUP)
                 for i in range(2)]
        nets = [Network(n, codec=codec, packet_elements=100, pool_size=6, job=job, worker_port=5000 + 100 * job,
                        drop=0.05, duplicate=0.05, reorder=0.1, fault_seed=job, aggregators=cores, record=True)
                for job, n, codec in ((1, 3, "cnat8"), (2, 4, "int32"))]
        for k in range(2):  # an allreduce (to the group), then a reduce-scatter (by unicast, through the rank group)
            for net in nets:
                net.start(make_inputs(net.n, net.n * 251 if k else 1003, 100, "normal", seed=k), scatter=k == 1)
            Network.run_together(nets, shuffle_seed=k)
        runs.append([(net.sent_down, [e.result.tobytes() for e in net.engines], net.total_job_counters())
                     for net in nets])
    assert runs[0] == runs[1]


# ---- (c) a stream recorded from a real loopback run -------------------------------------------------------------


class LoopbackAggregator:
    """A kernel aggregator core on a real UDP socket in a thread, recording every burst it received (datagrams,
    the receive time) so that the run can be replayed into other cores."""

    def __init__(self, core: AggregatorCore) -> None:
        self.core = core
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.bind((HOST, 0))
        self.sock.settimeout(0.05)
        self.port = self.sock.getsockname()[1]
        self.bursts: list[tuple[float, list[tuple[bytes, int]]]] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)

    def _serve(self) -> None:
        width = wire.HEADER_SIZE + 4 * self.core.max_elements + wire.TAG_SIZE
        while not self.stop.is_set():
            try:
                burst = [self.sock.recvfrom(width)]
                self.sock.setblocking(False)
                try:
                    while len(burst) < 32:
                        burst.append(self.sock.recvfrom(width))
                except BlockingIOError:
                    pass
                self.sock.settimeout(0.05)
            except TimeoutError:
                continue
            now = time.monotonic()
            received = [(data, addr_key_of(*src)) for data, src in burst]
            self.bursts.append((now, received))
            for data, dest in replay_burst(self.core, received, now):
                self.sock.sendto(data, (socket.inet_ntoa(int(dest >> 16).to_bytes(4, "big")), dest & 0xFFFF))

    def __enter__(self) -> LoopbackAggregator:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join(timeout=5)
        self.sock.close()


def replay_burst(core: AggregatorCore, received: list[tuple[bytes, int]], now: float) -> list[tuple[bytes, int]]:
    rx = Burst.rows_of(len(received), max(len(d) for d, _ in received))
    rx.fill(received)
    return core.receive(rx, now).datagrams() + core.take_replies()


def strip_silence(stats: dict) -> dict:
    for job in stats["jobs"].values():
        job.pop("silent_s")
    return stats


def fixed_bytes(n: int) -> bytes:
    return bytes(range(n))  # the cores' cookie secret: the same in the live run and the replays


@pytest.mark.process
@pytest.mark.parametrize("codec", ["cnat8", "int32"])
def test_recorded_loopback_stream_matches_kernel(codec: str) -> None:
    """Three workers (processes, real sockets, 10% loss, duplication and reordering) allreduce through a kernel
    core on 127.0.0.1; the recorded bursts, JOINs and LEAVEs included, replayed at their receive times into a
    fresh kernel core and a model core give the same datagrams, burst by burst, and the same statistics."""
    n, seed, job = 3, 41, new_job()
    options = {"rows": 64, "max_elements": 256, "tokens": ["t"], "random_bytes": fixed_bytes}
    with LoopbackAggregator(AggregatorCore(**options)) as live:
        results = run_ok(allreduce_worker, [(live.port, job, r, n, codec, seed, SMALL_PLAN) for r in range(n)],
                         timeout=90, faults=0.1)
    check_results(results, n, codec, seed, SMALL_PLAN, f"loopback {codec}")
    kernel, model = AggregatorCore(**options), p4model_core(**options)
    datagrams = 0
    for now, received in live.bursts:
        assert replay_burst(model, received, now) == replay_burst(kernel, received, now)
        datagrams += len(received)
    end = live.bursts[-1][0]
    # silent_s aside: the switch keeps last-seen times in microseconds (v1model's timestamp), the kernel in floats
    assert strip_silence(model.stats(end)) == strip_silence(kernel.stats(end))
    assert datagrams > 100 and kernel.stats(end)["core_counters"]["packets_in"] == datagrams


# ---- passes, unbiasedness, entries, refusals, the control meter ---------------------------------------------


@pytest.mark.parametrize("count", [0, 1, 63, 64, 65, 256, 1000, 1024])
def test_a_packet_takes_one_pass_per_lanes_per_pass_elements(count: int) -> None:
    _, _, model = joined(2, 1024)
    assert layout.passes(count) == max(1, math.ceil(count / layout.LANES_PER_PASS))
    for rank in range(2):
        out = model.receive(data(rank, 0, np.full(count, 0x41, np.uint8)), worker_addr(rank), 0.0)
        assert model.last_passes == layout.passes(count)
    assert len(out) == 2 and len(out[0][0]) == wire.HEADER_SIZE + count
    model.receive(data(0, 0, np.zeros(count, np.uint8)), worker_addr(9), 0.0)  # dropped in pass 0
    assert model.last_passes == 1
    assert (layout.passes(256), layout.passes(1024)) == (4, 16)


@pytest.mark.slow
def test_reencode_with_the_extern_random_is_unbiased_and_loss_invariant() -> None:
    """Rounds of two ranks whose codes sum to fixed S per lane, re-encoded with ExternRandom (seeded): the mean
    of the results' values per lane lies within 4 standard errors of S (the value is 2**b or 2**(b+1) with
    probability R / 2**b of the latter, R = S - 2**b); a re-send carries the stored codes, not a new draw."""
    rounds, lanes = 1500, 96  # two passes
    _, _, model = joined(2, lanes, random=ExternRandom(2024))
    rng = np.random.default_rng(5)
    ks = rng.integers(0, 12, (2, lanes))
    codes = (0x40 | ks).astype(np.uint8)
    codes[1, ::3] |= 0x80  # some lanes subtract
    sums = reference.to_fixed(codes[0]) + reference.to_fixed(codes[1])
    total = np.zeros(lanes)
    for k in range(rounds):
        packets = [data(r, k, codes[r]) for r in range(2)]
        model.receive(packets[0], worker_addr(0), 0.0)
        (result, _), _ = model.receive(packets[1], worker_addr(1), 0.0)
        [(resent, _)] = model.receive(packets[1], worker_addr(1), 0.0)
        assert resent == stored(result)  # the stored codes again, not re-encoded: loss-invariant
        total += reference.to_fixed(np.frombuffer(result, np.uint8, offset=wire.HEADER_SIZE))
    a = np.abs(sums).astype(np.float64)
    b = np.floor(np.log2(np.maximum(a, 1)))
    p = np.where(a > 0, (a - 2**b) / 2**b, 0)
    standard_error = np.sqrt(4.0**b * p * (1 - p) / rounds)
    exact = standard_error == 0
    assert np.all(total[exact] / rounds == sums[exact])
    assert np.all(np.abs(total[~exact] / rounds - sums[~exact]) <= 4 * standard_error[~exact])
    assert (~exact).sum() > lanes // 2


def test_small_sums_round_as_the_kernel() -> None:
    """Sums of a few units (leading one b = 0..4, where the comparison of b random bits with the remainder is
    often an equality) re-encode to the kernel's and the reference's codes, over rounds of three ranks."""
    core, ref, model = joined(3, 80)
    rng = np.random.default_rng(8)
    for k in range(60):
        codes = (0x40 | rng.integers(0, 3, (3, 80)) | 0x80 * rng.integers(0, 2, (3, 80))).astype(np.uint8)
        stream = [(data(r, k, codes[r]), worker_addr(r)) for r in range(3)]
        expected = [out for d, src in stream for out in ref.receive(d, src)]
        assert [out for d, src in stream for out in model.receive(d, src, 0.0)] == expected
        assert core_receive(core, stream, 0.0) == expected


def test_static_entries_are_the_arithmetic() -> None:
    """next_step is TRANSITIONS; every code the decode table holds is its value in the slot's unit, and with
    data_bound's k_limit the pass-0 check is reference.data_code_ok; leading_one finds the leading one."""
    entries = static_entries()
    model = PipelineModel(KeyedRandom())
    model.install(entries)
    tables = model.tables
    assert len(tables.exact["next_step"]) == len(TRANSITIONS)
    for (state, event), action in TRANSITIONS.items():
        assert tables.lookup("next_step", (layout.STATE_CODES[state], layout.EVENT_CODES[event]))[0] == action
    codes = np.arange(256, dtype=np.uint8)
    hit, value = tables.decode(codes)
    for c in range(256):
        if hit[c]:
            assert int(value[c:c + 1].view(np.int32)[0]) == int(reference.to_fixed(np.array([c]))[0])
    for n in (1, 2, 3, 17, 64):
        for exp in (NO_EXP, -126, -100, 0, 20, 126, 127):
            _, (k_limit, _) = tables.lookup("data_bound", (reference.value_bits(n), exp & 0xFF))
            for c in range(256):
                ok = layout.lane_ok(c, k_limit)
                assert ok == reference.data_code_ok(c, exp, n), (n, exp, c)
                assert not ok or hit[c]
    magnitudes = np.array([1, 2, 3, 255, 256, 2**30 + 5, 2**31, 0xFFFFFFFF], np.uint32)
    assert tables.leading_one(magnitudes) == [f"encode_b{int(m).bit_length() - 1}" for m in magnitudes]
    assert tables.leading_one(np.zeros(1, np.uint32)) == ["encode_zero"]
    assert len(tables.exact["data_bound"]) == layout.DATA_BOUND_ENTRIES
    for t in layout.TABLES:
        assert len(tables.exact[t.name]) <= t.size, t.name


def test_cli_commands_load_every_entry() -> None:
    core = AggregatorCore(rows=8, max_elements=64, tokens=[TOKEN], results_group=GROUP)
    for rank in range(3):
        handshake(core, worker_addr(rank), 0.0, 7, rank, token=TOKEN, world_size=3, packet_elements=64,
                  pool_size=4, codec=int(Codec.INT32))
    commands = cli_commands(controller_entries(core))
    assert "table_add job_table set_job_int32 7 => 0 3 29 4 64 536870912 " in commands[0]
    assert sum(c.startswith("table_add membership set_worker 0 ") for c in commands) == 3
    assert sum(c.startswith("table_add slot_table ") for c in commands) == 4
    assert commands.count("mc_mgrp_create 1") == 1
    lanes = cli_commands(static_entries())
    assert sum(c.startswith("table_add leading_one_") for c in lanes) == 32 * layout.LANES_PER_PASS


@pytest.mark.parametrize("params, says", [({"flags": wire.FLAG_DATA_MAC}, "data_mac"),
                                          ({"packet_elements": 1025}, "1024 cnat8 elements"),
                                          ({"packet_elements": 257, "codec": int(Codec.INT32)}, "256 int32")])
def test_the_model_engine_refuses_what_the_switch_cannot_do(params: dict, says: str) -> None:
    core = p4model_core(rows=8, max_elements=2048, tokens=[TOKEN])
    [(reply, _)] = handshake(core, worker_addr(0), 0.0, 7, 0, token=TOKEN,
                             **{"world_size": 2, "packet_elements": 64, "pool_size": 2, "codec": 0, **params})
    header, payload = wire.unpack(reply)
    assert header["type"] == MsgType.ERROR
    text = payload.tobytes().decode()
    assert says in text and "\n" not in text
    assert core.stats(0.0)["core_counters"]["drop_refused_join"] == 1
    assert engine_problem(layout.ROWS + 1, 1) and engine_problem(1, layout.MAX_JOBS + 1)
    assert engine_problem(layout.ROWS, layout.MAX_JOBS) is None


def test_control_meter_admits_as_the_core() -> None:
    """JOINs from a few sources, in bursts, at times on a 1/64 s grid (exact in floats and in nanoseconds):
    the model's meter admits the reference's datagrams and counts the same drops."""
    limits = ControlLimits(source_rate=16, source_burst=3, global_rate=8, global_burst=5, per_burst=4)
    ref, model = SlotReference(control_limits=limits), PipelineModel(KeyedRandom(), limits)
    model.install(static_entries())
    rng = np.random.default_rng(3)
    join = wire.pack_join({"type": int(MsgType.JOIN), "job": 1}, {"pool_size": 1})
    for step in range(300):
        now = int(rng.integers(0, 4)) / 64 + step / 16
        ref.new_burst()
        model.new_burst()
        for _ in range(int(rng.integers(1, 7))):
            src = worker_addr(int(rng.integers(0, 5)))
            ref.receive(join, src, now)
            model.receive(join, src, now)
    assert model.control == ref.control
    assert model.counters()["drop_control_rate"] == ref.core_stats["drop_control_rate"] > 0
    assert len(ref.control) > 50


@pytest.mark.parametrize("codec", [Codec.CNAT8, Codec.INT32])
def test_results_behind_a_deep_egress_queue_carry_the_congestion_mark(codec: Codec) -> None:
    """Each result copy that finds MARK_DEPTH or more packets ahead of it in its egress queue leaves with the
    CONGESTED bit in its shadow byte and is otherwise the unmarked copy byte for byte (a completion's multicast, a
    re-send); shallower, or by default, nothing is marked; DATA with that bit is still malformed."""
    rng = np.random.default_rng(5)
    payload = ((0x40 | rng.integers(0, 5, 150)).astype(np.uint8) if codec == Codec.CNAT8  # equal codes: exact sums
               else rng.integers(-99, 99, 150).astype(">i4"))
    packets_ = [wire.pack({"type": int(MsgType.DATA), "job": 7, "allreduce": 1, "rank": rank, "count": 150,
                           "codec": int(codec), "shadow": 1, "exp": 0, "next_exp": NO_EXP}, payload)
                for rank in (0, 1, 0)]  # a completion (both copies), then rank 0's re-send
    outputs = {}
    for depth in (None, 0, layout.MARK_DEPTH - 1, layout.MARK_DEPTH, 10 * layout.MARK_DEPTH):
        model = joined(2, 150, codec)[2]
        outputs[depth] = [model.receive(p, worker_addr(r), 0.0, *(() if depth is None else (depth,)))
                          for p, r in zip(packets_, (0, 1, 0))]
    plain = outputs[None]
    assert [len(sent) for sent in plain] == [0, 2, 1]
    assert outputs[0] == outputs[layout.MARK_DEPTH - 1] == plain
    shadow = wire.HEADER.fields["shadow"][1]
    assert [u[shadow] for sent in plain for u, _ in sent] == [1, 1, 1 | wire.STORED]  # the re-send: STORED
    for depth in (layout.MARK_DEPTH, 10 * layout.MARK_DEPTH):
        for marked, unmarked in zip(outputs[depth], plain):
            for (m, m_dest), (u, u_dest) in zip(marked, unmarked):
                assert m_dest == u_dest and m[shadow] == u[shadow] | wire.CONGESTED
                assert m[:shadow] + m[shadow + 1:] == u[:shadow] + u[shadow + 1:]
    model = joined(2, 150, codec)[2]
    bad = bytearray(packets_[0])
    bad[shadow] |= wire.CONGESTED
    assert model.receive(bytes(bad), worker_addr(0), 0.0, layout.MARK_DEPTH) == []
    assert model.counters(0)["drop_bad_shadow"] == 1
