"""Tests of worker.engine.StreamEngine, alone and end to end with aggregator.core.AggregatorCore through the
in-process harness (tests/support/harness.py):

* results bit for bit equal to protocol.reference.allreduce, at every rank, over world sizes, codecs, sizes around
  the packet size, pools smaller and larger than the chunk count, and awkward inputs (zero chunks, values up to
  float32's largest, values below 2**-50); the saturation and overflow counters against the oracle;
* the same bits under seeded loss, duplication and reordering in both directions;
* consecutive allreduces on the same engines: shadow-set parity over the job's life, delayed duplicates;
* the engine's own checks on results (foreign, stale, malformed) and its retransmission timers.
"""

import numpy as np
import pytest
from support.harness import (
    AGG_IP,
    Network,
    addr_key,
    agg_addr,
    assert_table_equal,
    counter_diff,
    engine_receive,
    engine_start,
    engine_timer,
    header,
    make_inputs,
    msg_type,
    reference_saturation,
    stored,
    table_snapshot,
    with_header,
    with_payload_byte,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from numba.core.registry import CPUDispatcher

from intml.protocol import arith, cnat, reference, wire
from intml.protocol.arith import data_k_max, value_bits
from intml.protocol.codec import Codec
from intml.protocol.packet import HDR
from intml.protocol.siphash import tag_ref
from intml.protocol.wire import NO_EXP, MsgType
from intml.protocol.burst import Burst
from intml.protocol.job import WorkerTimers
from intml.worker import engine as engine_module
from intml.worker import retransmit, state
from intml.worker.engine import IDLE, STAT_NAMES, StreamEngine

CODECS = ["cnat8", "int32"]
SEED = 123
FEW = settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def ref(xs, codec, P, seq=0, seed=SEED):
    return reference.allreduce(xs, codec=codec, seed=seed, allreduce_seq=seq, packet_elements=P)


def assert_all_equal(results, expected):
    for rank, got in enumerate(results):
        assert got.dtype == np.float32 and got.shape == expected.shape
        bad = np.flatnonzero(got.view(np.uint32) != expected.view(np.uint32))
        assert bad.size == 0, f"rank {rank}: {bad.size} elements differ, first {bad[:5]}: {got[bad[:5]]} != " \
                              f"{expected[bad[:5]]}"


def check_saturation(net, xs, P, seq=0):
    """Engine and aggregator saturation counters equal the oracle's (cnat8 only)."""
    worker, switch = reference_saturation(xs, seed=net.seed, allreduce_seq=seq, packet_elements=P)
    assert [e.counters()["saturated_elements"] for e in net.engines] == worker
    assert net.total_job_counters()["saturated_elements"] == switch
    return worker, switch


# ---- 1. bit for bit against the reference -------------------------------------------------------------------

KINDS = ["normal", "zero_chunks", "zeros", "huge", "tiny", "mixed"]
P64 = 64


@pytest.mark.parametrize("codec", CODECS)
@pytest.mark.parametrize("n", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("size", [0, 1, P64 - 1, P64, P64 + 1, 2 * P64 + 37, 5 * P64 + 1])
@pytest.mark.parametrize("pool", [2, 16])
def test_matches_reference(codec, n, size, pool):
    kind = KINDS[(n + size + pool) % len(KINDS)]
    xs = make_inputs(n, size, P64, kind, seed=size * 31 + n)
    net = Network(n, codec=codec, packet_elements=P64, pool_size=pool)
    results = net.allreduce(xs)
    assert_all_equal(results, ref(xs, codec, P64))
    chunks = -(-size // P64)
    assert all(e.progress == (chunks, chunks) for e in net.engines)
    if codec == "cnat8":
        check_saturation(net, xs, P64)


@pytest.mark.slow
@FEW
@given(
    n=st.sampled_from([1, 2, 3, 4, 8]),
    codec=st.sampled_from(CODECS),
    P=st.sampled_from([64, 256, 1024]),
    size_kind=st.sampled_from(["0", "1", "P-1", "P", "P+1", "odd", "any"]),
    extra=st.integers(0, 3 * 1024),
    pool=st.integers(1, 9),
    kind=st.sampled_from(KINDS),
    seed=st.integers(0, 2**64 - 1),
    data_seed=st.integers(0, 2**32),
)
def test_matches_reference_property(n, codec, P, size_kind, extra, pool, kind, seed, data_seed):
    size = {"0": 0, "1": 1, "P-1": P - 1, "P": P, "P+1": P + 1, "odd": 2 * P + (2 * (extra % P) + 1) % P,
            "any": extra}[size_kind]
    xs = make_inputs(n, size, P, kind, data_seed)
    net = Network(n, codec=codec, packet_elements=P, pool_size=pool, seed=seed)
    results = net.allreduce(xs)
    assert_all_equal(results, ref(xs, codec, P, seed=seed))
    if codec == "cnat8":
        check_saturation(net, xs, P)


@pytest.mark.parametrize("n", [2, 4])
def test_cnat_large_values_are_not_clipped_and_overflow_is_counted(n):
    """Values up to float32's largest: no worker encode saturates; a sum whose rounded value reaches 2**128 comes
    back as +-Inf (as a float32 sum overflows), and the aggregator counts exactly those elements."""
    P = 64
    xs = make_inputs(n, 3 * P + 5, P, "huge", seed=n)
    assert max(float(np.abs(x).max()) for x in xs) > 2.0**127
    net = Network(n, codec="cnat8", packet_elements=P, pool_size=3)
    results = net.allreduce(xs)
    expected = ref(xs, "cnat8", P)
    assert_all_equal(results, expected)
    worker, switch = check_saturation(net, xs, P)
    assert worker == [0] * n
    assert switch == int(np.isinf(expected).sum()) > 0
    assert np.abs(expected[np.isfinite(expected)]).max() > 2.0**120  # not clipped at 2**10 any more


@pytest.mark.slow
def test_issue_10_example_is_unbiased_through_engines_and_aggregator():
    """A review's example [3, 100, 1000, 5000, 1e6, 0.1, 123.456, 1e-20] on 2 ranks, 1500 consecutive allreduces (each has
    its own random streams): every result equals the oracle's and is the same at both ranks, none is clipped at
    2**10 or counted, and the mean is the exact sum 2x within 5 standard errors of docs/arithmetic.md's variance
    bound (mu**2 / 8 + 9/64 sum x_i**2 + 9/32 n u**2 per allreduce; u = 2**-9, the unit of a chunk whose largest
    value is 1e6)."""
    x = np.array([3, 100, 1000, 5000, 1e6, 0.1, 123.456, 1e-20], np.float32)
    net = Network(2, codec="cnat8", packet_elements=8, pool_size=1)
    runs = 1500
    total = np.zeros(x.size)
    for seq in range(runs):  # the engines number allreduces from 0
        results = net.allreduce([x, x])
        if seq < 3:
            want = reference.allreduce([x, x], codec="cnat8", seed=net.seed, allreduce_seq=seq, packet_elements=8)
            assert_all_equal(results, want)
        total += results[0].astype(np.float64)
    assert net.job_counters()["saturated_elements"] == 0
    x64 = x.astype(np.float64)
    bound = (2 * x64) ** 2 / 8 + 9 / 64 * 2 * x64**2 + 9 / 32 * 2 * 2.0**-18
    np.testing.assert_array_less(np.abs(total / runs - 2 * x64), 5 * np.sqrt(bound / runs))


def test_tiny_values_below_cnat_range():
    P, n = 64, 3
    xs = make_inputs(n, 2 * P + 3, P, "tiny", seed=5)
    assert max(float(np.abs(x).max()) for x in xs) < 2**-50
    net = Network(n, codec="cnat8", packet_elements=P, pool_size=2)
    results = net.allreduce(xs)
    expected = ref(xs, "cnat8", P)
    assert_all_equal(results, expected)
    # every result is 0 or a power of two at or above its chunk's unit (2**(E - 29), from E = -126: denormals
    # included), and not everything rounded to zero
    exps = [max(reference.chunk_exponent(x[lo:lo + P], reference.EXP_MIN, reference.EXP_MAX) for x in xs)
            for lo in range(0, expected.size, P)]
    units = np.repeat([2.0 ** reference.cnat_floor(e, n) for e in exps], P)[:expected.size]
    assert np.all((expected == 0) | (np.abs(expected) >= units))
    assert np.count_nonzero(expected) > 0


# ---- 2. loss, duplication, reordering -----------------------------------------------------------------------


@pytest.mark.parametrize(
    "codec,n,drop,duplicate,reorder,fault_seed",
    [
        ("cnat8", 2, 0.1, 0.1, 0.1, 1),
        ("cnat8", 4, 0.1, 0.1, 0.1, 2),
        ("cnat8", 3, 0.1, 0.0, 0.0, 3),
        ("cnat8", 4, 0.0, 0.1, 0.1, 4),
        ("int32", 2, 0.1, 0.1, 0.1, 5),
        ("int32", 4, 0.1, 0.05, 0.1, 6),
    ],
)
def test_faults_do_not_change_results(codec, n, drop, duplicate, reorder, fault_seed):
    P, pool, size = 64, 4, 40 * 64 + 13
    xs = make_inputs(n, size, P, "mixed" if codec == "cnat8" else "normal", seed=fault_seed)
    clean = Network(n, codec=codec, packet_elements=P, pool_size=pool).allreduce(xs)
    assert_all_equal(clean, ref(xs, codec, P))
    net = Network(n, codec=codec, packet_elements=P, pool_size=pool, drop=drop, duplicate=duplicate,
                  reorder=reorder, fault_seed=fault_seed)
    assert_all_equal(net.allreduce(xs), clean[0])
    for link in (net.uplink, net.downlink):
        assert link.counts["dropped"] > 0 if drop else link.counts["dropped"] == 0
        assert link.counts["duplicated"] > 0 if duplicate else True
        assert link.counts["reordered"] > 0 if reorder else True
    agg = net.total_job_counters()
    assert agg["retransmissions"] > 0 and agg["results_resent"] > 0
    if drop:
        assert sum(e.counters()["retransmissions"] for e in net.engines) > 0
    assert sum(e.counters()["drop_stale"] for e in net.engines) > 0  # duplicate results were seen and dropped
    if codec == "cnat8":
        check_saturation(net, xs, P)  # retransmissions are not re-encoded, so not counted twice


@pytest.mark.slow
@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    n=st.sampled_from([2, 3, 4]),
    codec=st.sampled_from(CODECS),
    drop=st.floats(0, 0.1),
    duplicate=st.floats(0, 0.1),
    reorder=st.floats(0, 0.1),
    fault_seed=st.integers(0, 10**6),
    pool=st.integers(1, 6),
)
def test_faults_property(n, codec, drop, duplicate, reorder, fault_seed, pool):
    P = 64
    xs = make_inputs(n, 12 * P + 7, P, "mixed", seed=fault_seed)
    net = Network(n, codec=codec, packet_elements=P, pool_size=pool, drop=drop, duplicate=duplicate,
                  reorder=reorder, fault_seed=fault_seed)
    assert_all_equal(net.allreduce(xs), ref(xs, codec, P))


# ---- 3. consecutive allreduces ------------------------------------------------------------------------------


def expected_parity(pool, sizes, P):
    """Uses of each slot over the job's life mod 2: one bootstrap round plus one round per chunk."""
    uses = np.zeros(pool, np.int64)
    for size in sizes:
        chunks = -(-size // P)
        window = min(pool, chunks)
        for s in range(window):
            uses[s] += 1 + len(range(s, chunks, window))
    return uses % 2


@pytest.mark.parametrize("codec", CODECS)
@pytest.mark.parametrize("faults", [0.0, 0.08])
def test_consecutive_allreduces(codec, faults):
    P, pool, n = 64, 4, 3
    sizes = [1000, 300, 5, 0, 700, 64]  # windows 4, 4, 1, 0, 4, 1
    net = Network(n, codec=codec, packet_elements=P, pool_size=pool, drop=faults, duplicate=faults,
                  reorder=faults, fault_seed=11, record=True)
    for seq, size in enumerate(sizes):
        xs = make_inputs(n, size, P, "normal", seed=100 + seq)
        assert_all_equal(net.allreduce(xs), ref(xs, codec, P, seq=seq))
        for e in net.engines:
            assert e.allreduce_seq == seq
            assert np.array_equal(e.parity, expected_parity(pool, sizes[:seq + 1], P))
    # on the wire: each rank's successive rounds in a slot alternate shadow sets 0, 1, 0, 1, ... over the job
    for rank in range(n):
        for slot in range(pool):
            rounds = {}
            for data, src, _ in net.sent_up:
                h = header(data)
                if src == net.addr(rank) and h["slot"] == slot:
                    rounds.setdefault((int(h["allreduce"]), int(h["chunk"])), int(h["shadow"]))
            assert list(rounds) == sorted(rounds)
            assert list(rounds.values()) == [i % 2 for i in range(len(rounds))]


@pytest.mark.parametrize("codec", CODECS)
@pytest.mark.parametrize("faults", [0.0, 0.1])
def test_result_into_out_and_in_place(codec, faults):
    """out= receives the same bits as a fresh result; out=x (in place) too, under loss, duplication and reordering:
    a chunk's input is never read again after its datagram was built, so results overwriting x are harmless."""
    P, pool, n = 64, 4, 3
    xs = make_inputs(n, 1000, P, "normal", seed=5)
    expected = ref(xs, codec, P)
    outs = [np.full(1000, np.nan, np.float32) for _ in range(n)]
    net = Network(n, codec=codec, packet_elements=P, pool_size=pool, drop=faults, duplicate=faults, reorder=faults,
                  fault_seed=3)
    net.start(xs, outs)
    net.run()
    assert_all_equal(outs, expected)
    assert all(np.shares_memory(e.result, o) for e, o in zip(net.engines, outs))
    in_place = [x.copy() for x in xs]
    net = Network(n, codec=codec, packet_elements=P, pool_size=pool, drop=faults, duplicate=faults, reorder=faults,
                  fault_seed=3)
    net.start(in_place, in_place)
    net.run()
    assert_all_equal(in_place, expected)


@pytest.mark.parametrize("out", [np.zeros(10, np.float32), np.zeros(12, np.float32), np.zeros(11, np.float64),
                                 np.zeros((11, 2), np.float32)[:, 0]])
def test_engine_rejects_bad_out(out):
    engine = Network(1, join=False).engines[0]
    with pytest.raises(ValueError, match="out must be a C-contiguous float32 array of 11 elements"):
        engine.start(np.ones(11, np.float32), 0.0, out)


@pytest.mark.parametrize("codec", CODECS)
@pytest.mark.parametrize("cores", [1, 2])
@pytest.mark.parametrize("faults", [0.0, 0.2])
def test_non_finite_values_pass_through(codec, cores, faults):
    """NaN, +Inf and -Inf at chosen positions of chosen ranks (in the first window, past it, in the last chunk, and
    a chunk with no finite value) go through the engines and the aggregator cores, even with loss, duplication and
    reordering: every rank gets the same bits, the reference's (+Inf where only +Inf met, -Inf where only -Inf,
    NaN elsewhere), the finite lanes exact as without them; each rank counts the non-finite values it sent, the
    aggregator the lanes it sent back non-finite; and the job's next allreduce is right."""
    n, pool, chunks = 3, 4, 12
    xs = make_inputs(n, chunks * P64, P64, "normal", seed=9)
    plan = [(0, 0, np.nan), (0, 1, np.inf), (1, 1, -np.inf), (2, 2, np.inf), (0, 5 * P64 + 3, -np.inf),
            (2, 5 * P64 + 3, -np.inf), (1, 11 * P64 + 63, np.nan), (2, 7 * P64 + 9, np.inf), (0, 7 * P64 + 9, 1e30)]
    plan += [(1, lane, np.inf) for lane in range(3 * P64, 4 * P64)]  # a chunk with no finite value at rank 1
    for r, lane, v in plan:
        xs[r][lane] = v
    net = Network(n, codec=codec, packet_elements=P64, pool_size=pool, cores=cores, drop=faults, duplicate=faults,
                  reorder=faults, fault_seed=5)
    got = net.allreduce(xs)
    want = ref(xs, codec, P64)
    assert_all_equal(got, want)
    lanes = {lane for _, lane, v in plan if not np.isfinite(v)}
    assert {int(i) for i in np.flatnonzero(~np.isfinite(got[0]))} == lanes
    assert got[0][2] == got[0][7 * P64 + 9] == got[0][3 * P64] == np.inf and got[0][5 * P64 + 3] == -np.inf
    assert {int(got[0].view(np.uint32)[lane]) for lane in (0, 1, 11 * P64 + 63)} == {0x7FC00000}  # +Inf met -Inf
    for r, e in enumerate(net.engines):
        assert e.counters()["nonfinite_elements"] == sum(1 for q, _, v in plan if q == r and not np.isfinite(v))
    assert net.total_job_counters()["nonfinite_elements"] == len(lanes)
    ys = make_inputs(n, chunks * P64 + 7, P64, "normal", seed=10)
    assert_all_equal(net.allreduce(ys), ref(ys, codec, P64, seq=1))


@pytest.mark.parametrize("cores", [1, 2])
def test_nearest_rounding_through_engines_and_cores(cores):
    """A job joined with rounding "nearest" (the JOIN's flag): the workers' encode and the cores' re-encode are
    deterministic, so the result is the reference's nearest allreduce bit for bit, under loss, whatever the seed,
    and differs from the stochastic one."""
    n = 3
    xs = make_inputs(n, 9 * P64 + 5, P64, "normal", seed=4)
    want = reference.allreduce(xs, codec="cnat8", seed=0, allreduce_seq=0, packet_elements=P64, rounding="nearest")
    for seed in (1, 77):
        net = Network(n, packet_elements=P64, cores=cores, seed=seed, nearest=True, drop=0.1, reorder=0.1,
                      fault_seed=seed)
        assert_all_equal(net.allreduce(xs), want)
    assert want.tobytes() != ref(xs, "cnat8", P64).tobytes()


def test_a_rank_with_the_other_rounding_is_refused():
    """The rounding is a job parameter (the JOIN's flags): a rank asking for stochastic rounding cannot join a
    nearest job, and an unknown flag is refused."""
    net = Network(2, nearest=True)
    (reply, _), = net.join(1, flags=0)
    assert msg_type(reply) == MsgType.ERROR and b"flags=0 (job has 2)" in reply
    (reply, _), = net.join(1, job=net.job + 1, flags=4)
    assert msg_type(reply) == MsgType.ERROR and b"unknown JOIN flags 0x04" in reply


@pytest.mark.parametrize("own_result_too", [False, True])
def test_fast_retransmit_after_three_overtaking_results(own_result_too):
    """Chunk 0 goes out at t=1, chunks 1-3 at t=2; their three results arriving first resend chunk 0 at once, byte
    for byte, at the end of the burst; unless chunk 0's own result is in the same burst."""
    net = Network(1, packet_elements=P64, pool_size=4)
    e, src = net.engines[0], agg_addr(0)
    x = make_inputs(1, 12 * P64, P64, "normal", seed=3)[0]

    def results(datagrams):
        return {int(header(d)["slot"]): d for d, _ in net.to_core(0, [(d, net.addr(0)) for d, _ in datagrams])}

    boot = results(engine_start(e, x, 0.0))
    chunk0 = engine_receive(e, [(boot[0], src)], 1.0)
    later = engine_receive(e, [(boot[s], src) for s in (1, 2, 3)], 2.0)
    res = results(chunk0 + later)
    burst = [(res[s], src) for s in ((1, 2, 3, 0) if own_result_too else (1, 2, 3))]
    out = engine_receive(e, burst, 3.0)
    resent = [d for d, _ in out if header(d)["chunk"] == 0]
    if own_result_too:
        assert resent == [] and e.counters()["fast_retransmissions"] == 0
    else:
        assert resent == [chunk0[0][0]] and e.counters()["fast_retransmissions"] == 1
    assert sorted(int(header(d)["chunk"]) for d, _ in out if header(d)["chunk"] != 0) == (
        [4, 5, 6, 7] if own_result_too else [5, 6, 7])


@pytest.mark.parametrize("overtaking, resent", [((1, 3, 5, 7), False), ((2, 4, 6), True)])
def test_fast_retransmit_counts_only_results_of_the_same_core(overtaking, resent):
    """Two aggregator cores run at their own pace: four results of core 1's slots overtaking slot 0 (core 0)
    prove nothing, three of core 0's slots do."""
    net = Network(1, packet_elements=P64, pool_size=8, cores=2)
    e = net.engines[0]
    x = make_inputs(1, 24 * P64, P64, "normal", seed=4)[0]

    def results(datagrams):
        out = {}
        for core in range(2):
            sent = [(d, net.addr(0)) for d, dst in datagrams if dst == agg_addr(core)]
            out.update({int(header(d)["slot"]): (d, agg_addr(core)) for d, _ in net.to_core(core, sent)})
        return out

    boot = results(engine_start(e, x, 0.0))
    chunk0 = engine_receive(e, [boot[0]], 1.0)
    later = engine_receive(e, [boot[s] for s in range(1, 8)], 2.0)
    res = results(chunk0 + later)
    out = engine_receive(e, [res[s] for s in overtaking], 3.0)
    assert [d for d, _ in out if header(d)["chunk"] == 0] == ([chunk0[0][0]] if resent else [])
    assert e.counters()["fast_retransmissions"] == int(resent)


def test_delayed_duplicate_from_earlier_allreduce_is_stale():
    P, pool, n, codec = 64, 4, 2, "cnat8"
    net = Network(n, codec=codec, packet_elements=P, pool_size=pool, record=True)
    for seq, size in enumerate([600, 200]):
        xs = make_inputs(n, size, P, "normal", seed=seq)
        assert_all_equal(net.allreduce(xs), ref(xs, codec, P, seq=seq))
    old = next(d for d, src, _ in net.sent_up
               if src == net.addr(0) and header(d)["allreduce"] == 0 and header(d)["chunk"] == 0)
    h = header(old)
    assert h["type"] == MsgType.DATA and h["slot"] == 0 and h["count"] == P
    xs = make_inputs(n, 900, P, "normal", seed=7)
    net.start(xs)
    net.step()
    net.step()
    core = net.cores[0]
    row = core.info[net.job].rows.start
    old_key = (0 << 32) | (0 + 2**31)
    assert core.datapath.table.round_key[row, h["shadow"]] > old_key  # the set was used again since
    before, snap = net.job_counters(), table_snapshot(core, net.job)
    assert net.to_core(0, [(old, net.addr(0))]) == []
    assert counter_diff(before, net.job_counters()) == {"packets_in": 1, "drop_stale": 1}
    assert_table_equal(snap, table_snapshot(core, net.job))
    net.run()
    assert_all_equal([e.result for e in net.engines], ref(xs, codec, P, seq=2))


# ---- 8. the engine alone ------------------------------------------------------------------------------------

AGG = agg_addr(0)
JOB, RANK, N, P8, POOL, ESEED = 7, 1, 2, 8, 2, 5


def lone_engine(codec=Codec.CNAT8, size=20, agg_addrs=(AGG,), rto=0.02, min_rto=0.005, max_rto=1.0, pool=POOL,
                data_mac_keys=None):
    engine = StreamEngine(job=JOB, rank=RANK, world_size=N, codec=codec, packet_elements=P8, pool_size=pool,
                          seed=ESEED, agg_addrs=list(agg_addrs), rto=rto, min_rto=min_rto, max_rto=max_rto,
                          data_mac_keys=data_mac_keys)
    x = ((np.arange(size) % 8 - 3.5) * 1.5).astype(np.float32)  # |x| <= 5.25: every chunk has E = 3
    sent = engine_start(engine, x, 0.0)
    return engine, x, sent


def result_for(data: bytes, *, next_exp: int, payload: bytes | None = None, **fields) -> bytes:
    """The RESULT answering DATA datagram ``data`` (same round), with a given payload."""
    h = header(data)
    count = int(h["count"])
    codec = Codec(int(h["codec"]))
    if payload is None:
        if codec == Codec.CNAT8:
            payload = bytes([0x40 | data_k_max(int(h["exp"]), value_bits(N))] * count)  # every element 2**E
        else:
            payload = np.full(count, 3, ">i4").tobytes()
    fields = {"type": MsgType.RESULT, "job": int(h["job"]), "allreduce": int(h["allreduce"]),
              "chunk": int(h["chunk"]), "rank": 0, "slot": int(h["slot"]), "count": count, "codec": int(codec),
              "shadow": int(h["shadow"]), "exp": int(h["exp"]), "next_exp": next_exp, **fields}
    return wire.pack(fields, payload)


def engine_state(engine):
    return engine.state.cur_chunk.copy(), engine.parity.copy(), engine.result.copy(), engine.state.agreed_exp.copy()


def test_engine_start_sends_bootstrap_chunks():
    engine, x, sent = lone_engine()
    assert len(sent) == POOL
    for s, (data, dst) in enumerate(sent):
        assert dst == AGG
        h, payload = wire.unpack(data)
        assert (h["type"], h["job"], h["rank"], h["slot"], h["allreduce"]) == (MsgType.DATA, JOB, RANK, s, 0)
        assert (h["chunk"], h["count"], h["shadow"], h["exp"]) == (s - POOL, 0, 0, NO_EXP)
        assert h["next_exp"] == reference.chunk_exponent(x[s * P8:(s + 1) * P8], -126, 127) == 3
        assert payload.size == 0
    assert engine.counters()["packets_out"] == POOL


def test_engine_accepts_results_and_decodes():
    engine, x, sent = lone_engine()
    out = engine_receive(engine, [(result_for(sent[0][0], next_exp=4), AGG)], 0.001)
    assert len(out) == 1
    h, payload = wire.unpack(out[0][0])
    assert (h["chunk"], h["slot"], h["shadow"], h["exp"], h["count"]) == (0, 0, 1, 4, P8)
    # chunk 0 was encoded against the agreed exponent 4, keyed by (seed, worker stream of rank 1, index)
    codes, _ = reference.encode(x[:P8], seed=ESEED, stream=(0 << 24) | (1 << 16) | RANK, offset=0, floor=4 - 29)
    assert np.array_equal(payload, codes)
    assert h["next_exp"] == 3  # its exponent for chunk 2 (the next in slot 0)
    engine_receive(engine, [(result_for(sent[1][0], next_exp=3), AGG)], 0.001)
    chunk0 = out[0][0]
    out = engine_receive(engine, [(result_for(chunk0, next_exp=5), AGG)], 0.002)
    assert np.all(engine.result[:P8] == 2.0**4)
    assert header(out[0][0])["chunk"] == 2 and header(out[0][0])["exp"] == 5
    assert engine.counters()["results"] == 3 and engine.progress == (1, 3)


def _drop_cases(boot: bytes, data0: bytes):
    """(name, datagram, source, counter) for results the engine must drop while slot 0 waits for chunk 0."""
    good = result_for(data0, next_exp=3)
    other_agg = addr_key(AGG_IP, 40000)
    cases = [
        ("wrong job", result_for(data0, next_exp=3, job=JOB + 1), AGG, "drop_foreign"),
        ("wrong source", good, other_agg, "drop_foreign"),
        ("wrong source (worker)", good, addr_key(0x7F000002, 5000), "drop_foreign"),
        ("slot beyond window", result_for(data0, next_exp=3, slot=POOL), AGG, "drop_foreign"),
        ("wrong allreduce", result_for(data0, next_exp=3, allreduce=1), AGG, "drop_stale"),
        ("wrong chunk", result_for(data0, next_exp=3, chunk=2), AGG, "drop_stale"),
        ("old round (duplicate bootstrap result)", result_for(boot, next_exp=3), AGG, "drop_stale"),
        ("wrong shadow", result_for(data0, next_exp=3, shadow=0), AGG, "drop_stale"),
        ("short", good[:HDR - 1], AGG, "drop_malformed"),
        ("empty", b"", AGG, "drop_malformed"),
        ("bad magic", with_header(good, magic=0x4E49), AGG, "drop_malformed"),
        ("bad version", with_header(good, version=2), AGG, "drop_malformed"),
        ("DATA type", with_header(good, type=MsgType.DATA), AGG, "drop_malformed"),
        ("ERROR type", with_header(good, type=MsgType.ERROR), AGG, "drop_malformed"),
        ("wrong codec", with_header(good, codec=1), AGG, "drop_malformed"),
        ("count too small", with_header(good, count=P8 - 1)[:-1], AGG, "drop_malformed"),
        ("count too large", result_for(data0, next_exp=3, count=P8 + 1, payload=b"\x40" * (P8 + 1)), AGG,
         "drop_malformed"),
        ("length > count", good + b"\x00", AGG, "drop_malformed"),
        ("length < count", good[:-1], AGG, "drop_malformed"),
        ("wrong exponent", with_header(good, exp=int(header(good)["exp"]) - 1), AGG, "drop_malformed"),
        ("next_exp below range", with_header(good, next_exp=-127), AGG, "drop_malformed"),  # int8: none above
        ("invalid code 0x80", with_payload_byte(good, 3, 0x80), AGG, "drop_malformed"),
        ("invalid code 0x3F", with_payload_byte(good, 0, 0x3F), AGG, "drop_malformed"),
        ("invalid code k=32", with_payload_byte(good, P8 - 1, 0x40 | 32), AGG, "drop_malformed"),
        ("invalid code 0xFF", with_payload_byte(good, 2, 0xFF), AGG, "drop_malformed"),
    ]
    return good, cases


def test_engine_drops_bad_results_and_counts_them():
    engine, _, sent = lone_engine()
    boot = result_for(sent[0][0], next_exp=3)
    (data0, _), = engine_receive(engine, [(boot, AGG)], 0.001)
    good, cases = _drop_cases(boot, data0)
    for name, datagram, src, counter in cases:
        before, state = engine.counters(), engine_state(engine)
        assert engine_receive(engine, [(datagram, src)], 0.002) == [], name
        assert counter_diff(before, engine.counters()) == {"packets_in": 1, counter: 1}, name
        for a, b in zip(state, engine_state(engine)):
            assert np.array_equal(a, b), name
    # all of them in one burst, then the good one: only the good one counts
    before = engine.counters()
    burst = [(d, s) for _, d, s, _ in cases] + [(good, AGG)]
    out = engine_receive(engine, burst, 0.003)
    assert len(out) == 1 and header(out[0][0])["chunk"] == 2
    diff = counter_diff(before, engine.counters())
    assert diff.pop("results") == 1 and diff.pop("packets_out") == 1 and diff.pop("packets_in") == len(burst)
    expect = {}
    for _, _, _, counter in cases:
        expect[counter] = expect.get(counter, 0) + 1
    assert diff == expect
    assert np.all(engine.result[:P8] == 2.0**3)
    # and a duplicate of the accepted result is now stale
    before = engine.counters()
    assert engine_receive(engine, [(good, AGG)], 0.004) == []
    assert counter_diff(before, engine.counters()) == {"packets_in": 1, "drop_stale": 1}


def test_engine_int32_result_checks():
    engine, _, sent = lone_engine(codec=Codec.INT32)
    (data0, _), = engine_receive(engine, [(result_for(sent[0][0], next_exp=3), AGG)], 0.001)
    h = header(data0)
    assert h["codec"] == Codec.INT32 and h["exp"] == 3 and len(data0) == HDR + 4 * P8
    good = result_for(data0, next_exp=3)
    for bad in (with_header(good, next_exp=-127), with_header(good, codec=0), good[:-2], good + b"\0\0\0\0",
                with_header(good, exp=4)):
        before = engine.counters()
        assert engine_receive(engine, [(bad, AGG)], 0.002) == []
        assert counter_diff(before, engine.counters()) == {"packets_in": 1, "drop_malformed": 1}
    assert len(engine_receive(engine, [(good, AGG)], 0.003)) == 1
    s = 31 - N.bit_length()
    assert np.all(engine.result[:P8] == np.float32(3 * 2.0 ** (3 - s)))


def test_engine_multi_core_source_check():
    cores = [agg_addr(0), agg_addr(1)]
    engine, _, sent = lone_engine(agg_addrs=cores)
    assert [dst for _, dst in sent] == cores  # slot s goes to core s % 2
    before = engine.counters()
    r1 = result_for(sent[1][0], next_exp=3)
    assert engine_receive(engine, [(r1, cores[0])], 0.001) == []  # slot 1's result from core 0: foreign
    assert counter_diff(before, engine.counters()) == {"packets_in": 1, "drop_foreign": 1}
    (out, dst), = engine_receive(engine, [(r1, cores[1])], 0.001)
    assert dst == cores[1] and header(out)["chunk"] == 1


def test_engine_late_result_of_earlier_allreduce_is_stale_not_foreign():
    # allreduce 0 uses slots 0 and 1, allreduce 1 (one chunk) only slot 0; a delayed duplicate of allreduce 0's
    # result for slot 1 arrives from the right aggregator, for the right job: it is of "another allreduce",
    # which the engine docstring calls stale; "foreign" is reserved for another job or source.
    engine, _, sent = lone_engine(size=2 * P8)
    boot = [result_for(d, next_exp=3) for d, _ in sent]
    data = [d for d, _ in engine_receive(engine, [(b, AGG) for b in boot], 0.001)]
    late = result_for(data[1], next_exp=NO_EXP)
    assert engine_receive(engine, [(result_for(data[0], next_exp=NO_EXP), AGG), (late, AGG)], 0.002) == []
    assert engine.done
    engine_start(engine, np.ones(3, np.float32), 0.01)  # one chunk: window 1
    before = engine.counters()
    assert engine_receive(engine, [(late, AGG)], 0.02) == []
    assert counter_diff(before, engine.counters()) == {"packets_in": 1, "drop_stale": 1}


def test_engine_timer_probes_a_silent_core_one_slot_at_a_time_with_backoff():
    """Both slots wait on a silent core: each timeout retransmits only the least recently sent slot (byte for
    byte) and restarts the core's silence; the core's backoff doubles, up to max_rto, once every slot in flight
    there was probed."""
    engine, _, sent = lone_engine(rto=1.0, min_rto=0.25, max_rto=5.0)
    assert engine.get_timer() == 1.0
    assert engine_timer(engine, 0.999) == []
    # due at max(sent at, the core's last probe) + min(max_rto, RTO x backoff): the slots take turns, and a round
    # of probes doubles the backoff
    probes = [(1.0, 0), (2.0, 1), (4.0, 0), (6.0, 1), (10.0, 0), (14.0, 1), (19.0, 0), (24.0, 1)]
    for t, slot in probes:
        assert engine.get_timer() == t
        assert engine_timer(engine, t) == [sent[slot]]  # the stored datagram, to the same address
    assert engine.counters()["retransmissions"] == len(probes)
    assert engine.counters()["packets_out"] == POOL + len(probes)
    assert engine.rto == 1.0  # no round-trip sample yet: the initial RTO


def tail_wait(engine: StreamEngine) -> float:
    """The tail probe's wait into a silence: 2 SRTT, or SRTT + 4 RTTVAR (the RTO without its floor) if longer."""
    srtt, rttvar = engine.timing[0], engine.timing[1]
    return max(2 * srtt, srtt + 4 * rttvar)


def test_engine_timer_probes_take_turns_whatever_rto_each_slot_was_armed_with():
    """Slot 1 was armed with the initial RTO (1.0), slot 0 after a fast round trip with a shorter one (0.3): when
    the core falls silent, slot 1 is probed first (least recently sent; the tail probe, SRTT + 4 RTTVAR = 0.3 into
    the silence after one sample), and then they alternate. Probing the slot due first instead would probe slot 0 again and again, never slot 1,
    whose datagram may be the lost one."""
    engine, _, sent = lone_engine(rto=1.0, min_rto=0.25, max_rto=8.0)
    (data0, _), = engine_receive(engine, [(result_for(sent[0][0], next_exp=3), AGG)], 0.1)
    assert engine.rto == pytest.approx(0.3)
    for t, probe in [(0.4, sent[1][0]), (0.7, data0), (1.3, sent[1][0])]:  # a round of two probes, then backoff 2
        assert engine.get_timer() == pytest.approx(t)
        assert engine_timer(engine, engine.get_timer()) == [(probe, AGG)]


def test_engine_timer_probes_a_tail_two_round_trips_into_a_silence():
    """A core that falls silent after a result gets its first probe max(2 SRTT, SRTT + 4 RTTVAR) (0.3 after one
    sample) into the silence, not an RTO (1.0, the floor) later: TCP's tail loss probe; and its second as long
    after the first (TAIL_PROBES). The next probe waits the RTO; the next result re-arms the tail probes.
    64 workers under 1% loss spent most of their stalls waiting the RTO (min_rto) for that first probe."""
    engine, _, sent = lone_engine(rto=1.0, min_rto=1.0, max_rto=8.0, pool=4, size=64)
    (data0, _), = engine_receive(engine, [(result_for(sent[0][0], next_exp=3), AGG)], 0.1)
    assert (engine.timing[0], engine.rto) == (pytest.approx(0.1), 1.0)  # SRTT, RTO
    for t, probe in [(0.4, sent[1]), (0.7, sent[2])]:
        assert engine.get_timer() == pytest.approx(t)
        assert engine_timer(engine, engine.get_timer()) == [probe]
    assert engine.get_timer() == pytest.approx(1.7)  # the RTO after the second
    engine_receive(engine, [(result_for(sent[3][0], next_exp=3), AGG)], 1.5)
    # the silence restarts: the tail probe, or the slot's RTO (1.0) if sooner, as here after the late sample
    assert engine.get_timer() == pytest.approx(1.5 + min(1.0, tail_wait(engine)))
    assert engine.counters()["retransmissions"] == 2


def test_engine_no_tail_probe_before_a_cores_first_result_of_an_allreduce():
    """At an allreduce's start the silence is the peers' start, or a queue the round trips have yet to show: the
    first probe waits the RTO (1.0), not 2 SRTT (0.2), until the core has answered in this allreduce."""
    engine, _, sent = lone_engine(size=2 * P8, rto=1.0, min_rto=1.0, max_rto=8.0)
    data = [d for d, _ in engine_receive(engine, [(result_for(d, next_exp=3), AGG) for d, _ in sent], 0.1)]
    assert engine_receive(engine, [(result_for(d, next_exp=NO_EXP), AGG) for d in data], 0.2) == []
    assert engine.done and engine.timing[0] == pytest.approx(0.1)  # SRTT
    engine_start(engine, np.ones(3, np.float32), 1.0)
    assert engine.get_timer() == pytest.approx(1.0 + engine.rto)


def test_engine_first_probe_of_an_allreduce_waits_two_round_trips_where_the_rto_is_shorter():
    """A queue-bound round trip with little variance (the overload test's: SRTT 0.4, RTO 0.74 here) puts the RTO
    under 2 SRTT; an allreduce's first result waits on every rank's window in the aggregator's queue and on the last
    rank's start, so the first probe waits 2 SRTT."""
    engine, _, sent = lone_engine(size=2 * P8, rto=1.0, min_rto=0.25, max_rto=8.0)
    data = [d for d, _ in engine_receive(engine, [(result_for(d, next_exp=3), AGG) for d, _ in sent], 0.4)]
    engine_receive(engine, [(result_for(d, next_exp=NO_EXP), AGG) for d in data], 0.8)
    srtt = engine.timing[0]
    assert engine.done and srtt == pytest.approx(0.4) and engine.rto < 2 * srtt
    engine_start(engine, np.ones(3, np.float32), 1.0)
    assert engine.get_timer() == pytest.approx(1.0 + 2 * srtt)


def test_engine_round_trip_of_an_overtaken_slot_is_not_sampled():
    """Slot 1's result comes after the result of slot 0's chunk 0, sent later: slot 1's round waited for something
    else (a peer's recovery), and its round trip is not an RTT sample."""
    model = Rfc6298(1.0, 0.25, 8.0)
    engine, _, sent = lone_engine(rto=1.0, min_rto=0.25, max_rto=8.0)
    (data0, _), = engine_receive(engine, [(result_for(sent[0][0], next_exp=3), AGG)], 0.1)
    engine_receive(engine, [(result_for(data0, next_exp=3), AGG)], 0.2)
    model.sample(0.1)
    model.sample(0.1)
    engine_receive(engine, [(result_for(sent[1][0], next_exp=3), AGG)], 3.0)
    assert engine.counters()["results"] == 3
    assert engine.rto == pytest.approx(model.rto)


def test_engine_timer_probes_each_silent_core_and_a_result_restarts_its_core():
    """Slots 0 and 2 live on core 0, 1 and 3 on core 1: each core has its own silence and backoff. Core 1 answers
    slot 1 at 0.5: its slot 3 is due an RTO after that, not after its sending, while silent core 0's earliest
    slot is probed at 1.0."""
    agg1 = agg_addr(1)
    engine, _, sent = lone_engine(rto=1.0, min_rto=0.25, max_rto=8.0, agg_addrs=(AGG, agg1), pool=4, size=64)
    engine_receive(engine, [(result_for(sent[1][0], next_exp=3), agg1)], 0.5)
    assert engine_timer(engine, 1.0) == [sent[0]]
    assert engine.get_timer() == 1.5  # slot 3: core 1 was heard at 0.5, and is not backed off
    assert engine_timer(engine, 1.5) == [sent[3]]
    assert engine.get_timer() == 2.0  # slot 2: an RTO after core 0's probe at 1.0 (not backed off: slot 2's turn)
    assert engine_timer(engine, 2.0) == [sent[2]]
    assert engine.get_timer() == 2.5  # slot 1: core 1's probe at 1.5, its other slot already answered
    assert engine.counters()["retransmissions"] == 3


class Rfc6298:
    """The RTO estimator of RFC 6298 (alpha 1/8, beta 1/4, K 4), bounded to [lo, hi]."""

    def __init__(self, rto, lo, hi):
        self.srtt = None
        self.rttvar = 0.0
        self.rto, self.lo, self.hi = rto, lo, hi

    def sample(self, r):
        if self.srtt is None:
            self.srtt, self.rttvar = r, r / 2
        else:
            self.rttvar = 0.75 * self.rttvar + 0.25 * abs(self.srtt - r)
            self.srtt = 0.875 * self.srtt + 0.125 * r
        self.rto = min(self.hi, max(self.lo, self.srtt + 4 * self.rttvar))


@pytest.mark.parametrize("answer", ["fresh", "stored", "late_peer"])
def test_engine_timer_resends_the_rest_soon_once_a_silent_core_answers_a_probe(answer):
    """Slot 3 samples the round trip (0.1) and finishes; slots 0-2 wait on a silent core. Slot 0's probe (at
    1.2) is answered at 1.25, fresh or (its first result lost on the way back) re-sent marked STORED: the core is
    alive, so slots 1 and 2, sent before that answer, are lost and go out together SRTT (0.1) later, not one at a
    time an RTO (1.0) apart. Unless a result of a slot that was not retransmitted follows (a late peer: its slots'
    results come together), which makes them be probed one at a time again (the first a tail probe, into the
    silence)."""
    engine, _, sent = lone_engine(rto=1.0, min_rto=0.25, max_rto=8.0, pool=4, size=32)
    (chunk3, _), = engine_receive(engine, [(result_for(sent[3][0], next_exp=3), AGG)], 0.1)
    assert engine_receive(engine, [(result_for(chunk3, next_exp=NO_EXP), AGG)], 0.2) == []
    assert engine.timing[0] == pytest.approx(0.1)  # SRTT
    assert engine_timer(engine, 1.2) == [sent[0]]
    result = result_for(sent[0][0], next_exp=3)
    (chunk0, _), = engine_receive(engine, [(stored(result) if answer == "stored" else result, AGG)], 1.25)
    if answer == "late_peer":
        engine_receive(engine, [(result_for(chunk0, next_exp=NO_EXP), AGG)], 1.3)
        assert engine.get_timer() == pytest.approx(1.3 + tail_wait(engine))
        assert engine_timer(engine, engine.get_timer()) == [sent[1]]
    else:
        assert engine.get_timer() == pytest.approx(1.25 + 0.1)
        assert engine_timer(engine, 1.35) == [sent[1], sent[2]]
        assert engine.get_timer() == pytest.approx(1.35 + 2 * 0.25)  # chunk 0: its own RTO, after the resend
    assert engine.counters()["spurious_retransmissions"] == 0


@pytest.mark.parametrize("mac", [False, True])
def test_a_stored_duplicate_proves_a_retransmission_spurious(mac):
    """A result the slot already took, again marked STORED (the aggregator had the round complete when the
    retransmission came), is a stale duplicate that counts as a spurious retransmission; one of another allreduce,
    unmarked, or (with the MAC) with a bad tag is only stale."""
    keys = np.array([[0x0706050403020100, 0x0F0E0D0C0B0A0908]], np.uint64) if mac else None
    engine, _, sent = lone_engine(rto=1.0, min_rto=0.25, max_rto=8.0, pool=4, size=32, data_mac_keys=keys)
    assert engine_timer(engine, 1.0) == [sent[0]]
    result = result_for(sent[0][0], next_exp=3)
    if mac:  # the tag of what precedes it, as the aggregator appends it
        result += tag_ref(int(keys[0, 0]), int(keys[0, 1]), result)
    engine_receive(engine, [(result, AGG)], 1.1)
    forged = bytearray(stored(result))
    forged[-1] ^= 1
    others = [(result, AGG), (with_header(stored(result), allreduce=9), AGG)] + ([(bytes(forged), AGG)] if mac else [])
    assert engine_receive(engine, others, 1.2) == []
    assert engine.counters()["spurious_retransmissions"] == 0
    assert engine_receive(engine, [(stored(result), AGG)], 1.3) == []
    assert engine.counters()["spurious_retransmissions"] == 1
    assert engine.counters()["drop_stale"] == len(others) + 1


def test_answered_probes_do_not_fast_retransmit_the_slots_they_seem_to_overtake():
    """A late peer: slots 0-2 are probed at 1, 3 and 7 while the core waits for it; then the results of all four
    come. Those of the probed slots may answer their first sending (Karn), so they overtake nothing: slot 3 is
    not fast retransmitted, though three of them came before its own."""
    engine, _, sent = lone_engine(rto=1.0, min_rto=0.25, max_rto=8.0, pool=4, size=64)
    for t, slot in ((1.0, 0), (3.0, 1), (7.0, 2)):
        assert engine_timer(engine, t) == [sent[slot]]
    out = engine_receive(engine, [(result_for(sent[s][0], next_exp=3), AGG) for s in (0, 1, 2)], 7.5)
    assert [int(header(d)["chunk"]) for d, _ in out] == [0, 1, 2]
    assert engine.counters()["fast_retransmissions"] == 0


def test_engine_timer_earliest_deadline_and_adaptive_rto():
    model = Rfc6298(1.0, 0.25, 8.0)
    engine, _, sent = lone_engine(rto=1.0, min_rto=0.25, max_rto=8.0)
    # slot 0's bootstrap result after 0.5: first sample; its next chunk is sent with the new RTO
    (data0, _), = engine_receive(engine, [(result_for(sent[0][0], next_exp=3), AGG)], 0.5)
    model.sample(0.5)
    assert engine.rto == model.rto == 1.5
    assert engine.get_timer() == 1.5  # slot 1's RTO counts from the core's result at 0.5; slot 0 is due at 2.0
    assert engine_timer(engine, 1.5) == [sent[1]]  # only the expired slot
    assert engine.get_timer() == 2.5  # not backed off before slot 0's turn: slot 1 at 1.5 + 1.0, slot 0 at 1.5 + 1.5
    # slot 1's result 0.25 after its retransmission: no sample (Karn); its next chunk gets the current RTO
    (data1, _), = engine_receive(engine, [(result_for(sent[1][0], next_exp=3), AGG)], 1.75)
    assert engine.rto == model.rto
    # the backoff ended; slot 0, sent before this answer to a retransmission, is due SRTT after it
    assert engine.get_timer() == 1.75 + 0.5
    # slot 0's chunk 0 result, 1.5 after it was sent: a second sample; chunk 2 goes out with the new RTO
    (data2, _), = engine_receive(engine, [(result_for(data0, next_exp=3), AGG)], 2.0)
    model.sample(1.5)
    assert engine.rto == model.rto == 2.375
    assert header(data2)["chunk"] == 2
    # the tail probe, max(2 SRTT, SRTT + 4 RTTVAR) = 2.375 into the core's silence, is not sooner than slot 1's
    # RTO (1.5)
    assert engine.get_timer() == 2.0 + 1.5
    assert engine.counters()["retransmissions"] == 1
    assert engine_timer(engine, 3.5) == [(data1, AGG)]
    assert engine.get_timer() == 3.5 + 1.5  # slot 1 again, before slot 0 (3.5 + 2.375): slot 0 had no turn yet
    # slot 1's result after its retransmission, then again marked STORED: that retransmission was spurious
    result = result_for(data1, next_exp=3)
    engine_receive(engine, [(result, AGG)], 4.2)
    assert engine.counters()["spurious_retransmissions"] == 0
    engine_receive(engine, [(stored(result), AGG)], 4.3)
    assert engine.counters()["spurious_retransmissions"] == 1


def test_engine_rto_bounded_by_min_and_max():
    for sample, expect in ((0.001, 0.25), (4.0, 5.0)):
        engine, _, sent = lone_engine(rto=1.0, min_rto=0.25, max_rto=5.0)
        engine_receive(engine, [(result_for(sent[0][0], next_exp=3), AGG)], sample)
        assert engine.rto == expect
        model = Rfc6298(1.0, 0.25, 5.0)
        model.sample(sample)
        assert model.rto == expect


def test_engine_rejects_inconsistent_rto_bounds():
    for rto, lo, hi in ((0.5, 1.0, 2.0), (3.0, 1.0, 2.0), (0.1, 0.0, 1.0)):
        with pytest.raises(ValueError):
            lone_engine(rto=rto, min_rto=lo, max_rto=hi)


def test_engine_done_and_timer_with_nothing_in_flight():
    engine, _, sent = lone_engine(size=0)
    assert sent == [] and engine.done and engine.get_timer() is None
    assert engine_timer(engine, 100.0) == []
    assert engine.result.size == 0


def test_engine_counters_names():
    engine, _, _ = lone_engine()
    assert set(engine.counters()) == set(STAT_NAMES)


def test_engine_hands_out_bursts_over_its_own_datagram_buffers():
    """Zero copy: the rows of the Burst a call returns point into the engine's stored datagrams, and the engine
    takes a receive Burst as BurstSocket.rx is (rows of its own, count set)."""
    engine = StreamEngine(job=JOB, rank=RANK, world_size=N, codec=Codec.CNAT8, packet_elements=P8, pool_size=POOL,
                          seed=ESEED, agg_addrs=[AGG])
    assert engine.get_timer() is None  # nothing started
    assert engine.timing[3] == WorkerTimers.min_rto  # the same floor as the Worker's
    x = ((np.arange(20) % 8 - 3.5) * 1.5).astype(np.float32)
    tx = engine.start(x, 0.0)
    assert tx is engine.tx and tx.count == POOL
    base, end = engine.packet.ctypes.data, engine.packet.ctypes.data + engine.packet.nbytes
    assert all(base <= int(p) and int(p) + int(n) <= end for p, n in zip(tx.ptr[:tx.count], tx.length[:tx.count]))
    boot = tx.datagrams()
    rx = Burst.rows_of(8, engine.max_datagram)
    rx.fill([(result_for(boot[0][0], next_exp=3), AGG)])
    out = engine.receive(rx, 0.001)
    assert out is engine.tx and out.count == 1
    assert int(out.ptr[0]) == engine.packet[0, engine.parity[0]].ctypes.data  # slot 0's next chunk, in place
    assert engine.handle_timer(0.002).count == 0
    # the other slots: a tail probe SRTT + 4 RTTVAR (3 round trips after one sample) after the result, before the
    # default RTO
    assert engine.get_timer() == pytest.approx(0.001 + 3 * 0.001)


def test_the_engine_kernels_run_without_numbas_runtime() -> None:
    """Every kernel of the engine and its retransmission policy, and the encode it calls, allocates nothing, so none
    needs Numba's runtime and its atomic reference counts (about 40% of the engine's time: docs/benchmarks.md);
    the inline ones compile into them."""
    kernels = [f for m in (engine_module, state, retransmit) for f in vars(m).values()
               if isinstance(f, CPUDispatcher) and f.py_func.__module__ == m.__name__
               and f.targetoptions.get("inline") != "always"] + [arith.precode_chunk, cnat.encode_into]
    assert len(kernels) >= 19 and all(f.targetoptions["_nrt"] is False for f in kernels), \
        [f.__name__ for f in kernels if f.targetoptions.get("_nrt") is not False]
