"""The engine's precoded entry point (StreamEngine.start_precoded, the one worker.gpu drives): given each chunk's
codes at its own floor, it sends the datagrams ``start`` sends from the floats, byte for byte, and its result codes
decode to ``start``'s result, bit for bit; also when an agreed floor forces a chunk to be encoded again, and when
the codes arrive piece by piece (slots wait, parked, for them).

The codes come from a CPU stand-in for the device (``HostCodes``: protocol.arith.precode_chunk per chunk, and
protocol.cnat's encode at the agreed floor for a re-encode); tests/gpu/test_gpu_driver.py checks the device's.
"""

from __future__ import annotations

import numpy as np
import pytest
from support.harness import Network, engine_start, make_inputs
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from intml.protocol import cnat
from intml.protocol.arith import NO_EXP, cnat_floor, precode_chunk
from intml.worker.engine import P_READY, P_VBITS, PARKED, StreamEngine

PKT = 64


class HostCodes:
    """What a device gives the engine for rank ``engine``'s next allreduce of x, computed on the CPU: per chunk the
    codes at its own floor, its exponent proposal and low word; and a chunk's codes at a given floor."""

    def __init__(self, engine: StreamEngine, x: np.ndarray) -> None:
        self.engine, self.x = engine, x
        self.key = np.uint64(engine.stream_key(engine.next_allreduce))
        self.pkt = engine.packet_elements
        chunks = -(-x.size // self.pkt)
        self.codes = np.zeros(x.size, np.uint8)
        self.local = np.empty(chunks, np.int64)
        self.low = np.empty(chunks, np.uint32)
        for c in range(chunks):
            lo, hi = self._range(c)
            _, bad, self.local[c], self.low[c] = precode_chunk(x[lo:hi], self.codes[lo:hi], self.key, lo,
                                                               int(engine.params[P_VBITS]), True, engine.heads)
            assert bad == np.count_nonzero(~np.isfinite(x[lo:hi]))  # counted, coded as their flags
        self.reencodes = 0

    def _range(self, c: int) -> tuple[int, int]:
        return c * self.pkt, min(self.x.size, (c + 1) * self.pkt)

    def serve(self, send) -> None:
        """The driver's turn: encode every chunk the engine asks for again, and hand their datagrams to send."""
        requests = self.engine.reencode_requests()
        for c, floor in requests:
            lo, hi = self._range(c)
            cnat.encode_kernel(self.x[lo:hi], self.codes[lo:hi], self.key, np.uint64(lo), floor, True)
        if requests:
            self.reencodes += len(requests)
            send(self.engine.reencoded([c for c, _ in requests], 0.0).datagrams())

    def decoded(self) -> np.ndarray:
        """The result codes (in the codes array once the allreduce is done) decoded at the agreed floors."""
        out = np.empty(self.x.size, np.float32)
        vbits = int(self.engine.params[P_VBITS])
        for c, exp in enumerate(self.engine.agreed_exp.tolist()):
            lo, hi = self._range(c)
            out[lo:hi] = cnat.decode(self.codes[lo:hi], floor=cnat_floor(exp, vbits))
        return out


def run(xs, precoded: set[int], *, n: int, pool: int, piece: int | None = None, seed: int = 5, scatter: bool = False,
        **net_options) -> tuple[Network, list[np.ndarray], dict[int, HostCodes]]:
    """One allreduce (a reduce-scatter with ``scatter``) over the harness, ranks in ``precoded`` through
    start_precoded (their codes made ready ``piece`` elements per step if given), the others through start. Returns
    the network (its record), every rank's result (its shard with ``scatter``) and the precoded ranks' code
    sources."""
    net = Network(n, packet_elements=PKT, pool_size=pool, seed=seed, record=True, **net_options)
    sources: dict[int, HostCodes] = {}
    for r, engine in enumerate(net.engines):
        if r in precoded:
            src = sources[r] = HostCodes(engine, xs[r])
            ready = None if piece is None else 0
            net._from_worker(r, engine.start_precoded(src.codes, src.local, src.low, net.now, ready=ready,
                                                      scatter=scatter).datagrams())
        else:
            net._from_worker(r, engine_start(engine, xs[r], net.now, scatter=scatter))
    size = xs[0].size
    for _ in range(50_000):
        if net.done:
            break
        net.step()
        for r, src in sources.items():
            engine = net.engines[r]
            if piece is not None and engine.params[P_READY] < size:
                ready = min(size, int(engine.params[P_READY]) + piece)
                net._from_worker(r, engine.codes_ready(ready, net.now).datagrams())
            src.serve(lambda datagrams, r=r: net._from_worker(r, datagrams))
    assert net.done, [e.progress for e in net.engines]
    shard = size // n if scatter else size
    results = [sources[r].decoded()[r * shard:(r + 1) * shard] if scatter and r in sources
               else sources[r].decoded() if r in sources else e.result.copy() for r, e in enumerate(net.engines)]
    return net, results, sources


def sent_by(net: Network, rank: int) -> list[bytes]:
    return [data for data, src, _ in net.sent_up if src == net.addr(rank)]


def assert_same_bits(got: np.ndarray, want: np.ndarray) -> None:
    bad = np.flatnonzero(got.view(np.uint32) != want.view(np.uint32))
    assert bad.size == 0, f"{bad.size} elements differ, first {bad[:5]}: {got[bad[:5]]} != {want[bad[:5]]}"


def forced_reencode_inputs(n: int, chunks: int) -> list[np.ndarray]:
    """Rank 0 holds in every chunk values near 1 and one tiny value; the other ranks' values are 2**20 times larger,
    so each chunk's agreed floor lies far above rank 0's own and its tiny value below it: rank 0 must encode every
    chunk again."""
    rng = np.random.default_rng(n)
    xs = [rng.standard_normal(chunks * PKT - 5).astype(np.float32) * (1.0 if r == 0 else 2.0**20) for r in range(n)]
    xs[0][::PKT] = np.float32(2.0**-30)
    return xs


@pytest.mark.parametrize("pool, mac", [(1, False), (3, False), (16, False), (3, True)])
def test_same_datagrams_and_result_as_start(pool, mac):
    """Every rank precoded, then every rank from floats: each rank sends the same datagrams in the same order, and
    gets the same result bits (with the DATA/RESULT MAC too)."""
    xs = make_inputs(3, 9 * PKT + 17, PKT, "mixed", seed=pool)
    options = {"data_mac_key": (0x0123456789ABCDEF, 0x0FEDCBA987654321)} if mac else {}
    floats, want, _ = run(xs, set(), n=3, pool=pool, **options)
    coded, got, _ = run(xs, {0, 1, 2}, n=3, pool=pool, **options)
    for r in range(3):
        assert sent_by(coded, r) == sent_by(floats, r)
        assert_same_bits(got[r], want[r])


def test_non_finite_values_precoded_as_from_floats():
    """NaN and infinities in the precoded codes (as the device encodes them): the same datagrams and result bits
    as the float path, which is the reference's."""
    xs = make_inputs(3, 9 * PKT + 17, PKT, "mixed", seed=8)
    for r, lane, v in [(0, 5, np.inf), (1, 5, -np.inf), (2, 3 * PKT + 1, np.nan), (1, 9 * PKT + 16, np.inf)]:
        xs[r][lane] = v
    floats, want, _ = run(xs, set(), n=3, pool=3)
    coded, got, _ = run(xs, {0, 1, 2}, n=3, pool=3)
    for r in range(3):
        assert sent_by(coded, r) == sent_by(floats, r)
        assert_same_bits(got[r], want[r])
    assert np.isnan(want[0][5]) and np.isnan(want[0][3 * PKT + 1]) and want[0][9 * PKT + 16] == np.inf


@pytest.mark.parametrize("piece", [None, 1, PKT, 5 * PKT])
def test_forced_reencode_gives_the_cpu_codes(piece):
    """A chunk whose agreed floor lies above its own, with a value below that floor, is encoded again, exactly as
    start encodes it: the same datagrams (as sets: parked slots go later, and slow codes make the other ranks
    retransmit) and results, precoded rank next to float
    ones; with the codes arriving piece by piece too."""
    xs = forced_reencode_inputs(3, 6)
    floats, want, _ = run(xs, set(), n=3, pool=4)
    coded, got, sources = run(xs, {0}, n=3, pool=4, piece=piece)
    assert sources[0].reencodes == 6  # every chunk of rank 0
    assert set(sent_by(coded, 0)) == set(sent_by(floats, 0))
    for r in range(3):
        assert_same_bits(got[r], want[r])


@pytest.mark.parametrize("n, pool", [(3, 4), (5, 2)])
def test_precoded_reduce_scatter_equals_start(n, pool):
    """scatter=True: each precoded rank sends its float self's datagrams (each chunk's owners in them), and the
    result codes of the chunks its shard overlaps decode to its float self's shard, bit for bit (shards not on chunk
    boundaries; rank 0's chunks all encoded again)."""
    xs = forced_reencode_inputs(n, 7)
    xs = [x[:x.size - x.size % n] for x in xs]
    assert (xs[0].size // n) % PKT
    floats, want, _ = run(xs, set(), n=n, pool=pool, scatter=True)
    coded, got, sources = run(xs, set(range(n)), n=n, pool=pool, scatter=True)
    assert sources[0].reencodes == 7
    for r in range(n):
        assert set(sent_by(coded, r)) == set(sent_by(floats, r))
        assert got[r].size == xs[0].size // n
        assert_same_bits(got[r], want[r])


FEW = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@FEW
@given(n=st.sampled_from([1, 2, 3, 5]), size=st.integers(0, 12 * PKT), pool=st.integers(1, 9),
       kind=st.sampled_from(["normal", "zero_chunks", "zeros", "huge", "tiny", "mixed"]),
       piece=st.sampled_from([None, 1, 37, PKT, 1000]), data=st.data(), seed=st.integers(0, 2**64 - 1))
def test_precoded_equals_start_property(n, size, pool, kind, piece, data, seed):
    """Any mix of precoded and float ranks, codes arriving in any piece size: the same result bits as every rank
    from floats, and each precoded rank sends the datagrams its float self sends."""
    xs = make_inputs(n, size, PKT, kind, seed=n * 1000 + size)
    precoded = set(data.draw(st.lists(st.integers(0, n - 1), unique=True)))
    floats, want, _ = run(xs, set(), n=n, pool=pool, seed=seed)
    coded, got, _ = run(xs, precoded, n=n, pool=pool, piece=piece, seed=seed)
    for r in range(n):
        assert_same_bits(got[r], want[r])
    for r in precoded:
        assert set(sent_by(coded, r)) == set(sent_by(floats, r))


def test_slots_wait_for_their_codes():
    """ready=0: only the bootstrap datagrams go; codes of one chunk release exactly that chunk's slot, a parked slot
    has no timer, and results before the codes cannot complete it."""
    n, chunks = 2, 5
    xs = make_inputs(n, chunks * PKT, PKT, "normal", seed=3)
    net = Network(n, packet_elements=PKT, pool_size=chunks, seed=5)
    src = HostCodes(net.engines[0], xs[0])
    engine = net.engines[0]
    boot = engine.start_precoded(src.codes, src.local, src.low, net.now, ready=0).datagrams()
    assert len(boot) == chunks  # bootstrap rounds carry only exponents
    net._from_worker(0, boot)
    net._from_worker(1, engine_start(net.engines[1], xs[1], net.now))
    for _ in range(20):
        net.step()
    assert (engine.state.cur_chunk == PARKED).all()
    assert engine.get_timer() is None and engine.handle_timer(1e9).count == 0
    assert engine.completed() == 0 and engine.reencode_requests() == []
    assert len(engine.codes_ready(PKT - 1, net.now).datagrams()) == 0  # chunk 0 not whole yet
    sent = engine.codes_ready(PKT + 1, net.now).datagrams()
    assert len(sent) == 1 and engine.state.cur_chunk.tolist()[0] == 0
    net._from_worker(0, sent)
    net._from_worker(0, engine.codes_ready(xs[0].size, net.now).datagrams())
    net.run()
    assert engine.completed() == chunks
    vbits = int(engine.params[P_VBITS])
    floats, want, _ = run(xs, set(), n=n, pool=chunks)
    got = np.concatenate([cnat.decode(src.codes[c * PKT:(c + 1) * PKT], floor=cnat_floor(e, vbits))
                          for c, e in enumerate(engine.agreed_exp.tolist())])
    assert_same_bits(got, want[0])
    assert NO_EXP not in engine.agreed_exp.tolist()


def test_precoded_rejects_what_it_cannot_take():
    engine = Network(1, codec="int32", packet_elements=PKT, pool_size=2).engines[0]
    with pytest.raises(ValueError, match="cnat8 only"):
        engine.start_precoded(np.zeros(PKT, np.uint8), np.zeros(1), np.zeros(1, np.uint32), 0.0)
    engine = Network(1, packet_elements=PKT, pool_size=2).engines[0]
    with pytest.raises(ValueError, match="need 2 exponents"):
        engine.start_precoded(np.zeros(PKT + 1, np.uint8), np.zeros(1), np.zeros(1, np.uint32), 0.0)
    with pytest.raises(ValueError, match="uint8"):
        engine.start_precoded(np.zeros(PKT, np.float32), np.zeros(1), np.zeros(1, np.uint32), 0.0)
    engine = Network(2, packet_elements=PKT, pool_size=2).engines[0]
    with pytest.raises(ValueError, match="multiple of the world size 2"):
        engine.start_precoded(np.zeros(PKT + 1, np.uint8), np.zeros(2), np.zeros(2, np.uint32), 0.0, scatter=True)
