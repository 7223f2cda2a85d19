"""Tests of protocol.codecs: every registered codec has the common interface; each dispatcher computes bit for bit
what the codec's own function does; and a whole allreduce built from the dispatchers alone (each rank's encode,
the switch's check, add and result encode, each worker's check and decode) equals protocol.reference's oracle bit
for bit, for several world sizes."""

import inspect
import struct

import numpy as np
import pytest
from support.harness import make_inputs
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from intml.protocol import codecs, reference, wire
from intml.protocol.arith import (
    PRECODED,
    chunk_exponents,
    precode_chunk,
    sum_to_codes,
    switch_stream,
    value_bits,
    worker_stream,
)
from intml.protocol.cnat import decode
from intml.protocol.codec import Codec
from intml.protocol.job import CODEC_NAMES
from intml.protocol.rng import BLOCK, stream_key
from intml.protocol.wire import NO_EXP

SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
FUNCTIONS = {  # name: parameters, the same in every codec
    "encode_chunk": ("x", "payload", "key", "offset", "exp", "vbits", "low", "local_exp", "stochastic", "heads"),
    "check_nonfinite": ("payload", "exp", "vbits"),
    "take_nonfinite": ("payload", "exp", "vbits", "flags"),
    "put_nonfinite": ("payload", "flags"),
    "check_payload": ("payload", "exp", "vbits"),
    "add_payloads": ("data", "rows", "k", "col", "acc", "exp", "vbits", "first"),
    "encode_result": ("acc", "payload", "key", "offset", "exp", "vbits", "stochastic"),
    "check_result": ("payload", "exp", "vbits"),
    "decode_result": ("payload", "exp", "vbits", "out"),
}
HEADS = np.empty(BLOCK, np.uint32)  # the encode's scratch, enough for any chunk
CODEC_MODULES = pytest.mark.parametrize("codec", codecs.CODECS, ids=lambda c: c.NAME)
M64 = (1 << 64) - 1


def test_registry_covers_the_wire_codecs() -> None:
    assert sorted(codecs.BY_ID) == sorted(Codec)
    assert [codecs.BY_ID[c.ID] for c in codecs.CODECS] == list(codecs.CODECS)
    assert [codecs.BY_NAME[c.NAME] for c in codecs.CODECS] == list(codecs.CODECS)
    assert CODEC_NAMES == {"cnat8": Codec.CNAT8, "int32": Codec.INT32}


@CODEC_MODULES
def test_codec_interface(codec) -> None:
    assert isinstance(codec.ID, Codec) and codec.NAME == codec.ID.name.lower()
    assert codec.PAYLOAD_DTYPE.byteorder in ("|", ">")  # network order on the wire
    assert codec.WIDTH == codec.PAYLOAD_DTYPE.itemsize == codec.ID.bytes_per_element
    assert wire.payload_dtype(codec.ID) == codec.PAYLOAD_DTYPE
    lo, hi = codec.EXP_RANGE
    assert NO_EXP < lo <= hi <= 127  # exponents travel as int8, NO_EXP apart
    assert isinstance(codec.PRECODES, bool)
    for name, params in FUNCTIONS.items():
        assert tuple(inspect.signature(getattr(codec, name).py_func).parameters) == params, name
        assert tuple(inspect.signature(getattr(codecs, name).py_func).parameters) == ("codec", *params), name


@CODEC_MODULES
def test_constant_dispatchers(codec) -> None:
    assert codecs.width(codec.ID) == codec.WIDTH
    assert codecs.exp_range(codec.ID) == codec.EXP_RANGE
    assert codecs.precodes(codec.ID) == codec.PRECODES


def chunk_values(seed: int, n: int) -> np.ndarray:
    """Finite float32 of every magnitude the codecs treat apart: below and around the floors, saturating, zero."""
    rng = np.random.default_rng(seed)
    x = np.where(rng.random(n) < 0.5, -1.0, 1.0) * 2.0 ** rng.uniform(-140, 20, n) * (rng.random(n) < 0.9)
    return x.astype(np.float32)


def random_bytes(seed: int, n: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


@st.composite
def chunk_cases(draw):
    """(codec, rng seed, element count, agreed exponent, s(n)) with exponents of the codec's range or NO_EXP."""
    codec = draw(st.sampled_from(codecs.CODECS))
    lo, hi = codec.EXP_RANGE
    return (codec, draw(st.integers(0, 2**32 - 1)), draw(st.integers(0, 700)),
            draw(st.one_of(st.just(NO_EXP), st.integers(lo, hi))), value_bits(draw(st.integers(1, 64))))


@pytest.mark.slow
@SETTINGS
@given(case=chunk_cases(), key=st.integers(0, M64), offset=st.integers(0, 2**40), precoded=st.booleans(),
       local=st.integers(-128, 127), stochastic=st.booleans())
def test_encode_chunk_dispatch(case, key, offset, precoded, local, stochastic) -> None:
    codec, seed, n, exp, vbits = case
    x = chunk_values(seed, n)
    low = np.uint32(0xFFFFFFFF if precoded else 0)  # "already encoded" (nothing below any floor) or "encode"
    got, want = (random_bytes(seed, n * codec.WIDTH) for _ in range(2))
    codecs.encode_chunk(int(codec.ID), x, got, np.uint64(key), offset, exp, vbits, low, local, stochastic, HEADS)
    codec.encode_chunk(x, want, np.uint64(key), offset, exp, vbits, low, local, stochastic, HEADS)
    assert got.tobytes() == want.tobytes()


@pytest.mark.slow
@SETTINGS
@given(case=chunk_cases(), kind=st.sampled_from(["random", "in range", "encoded"]))
def test_check_dispatch(case, kind) -> None:
    codec, seed, n, exp, vbits = case
    payload = random_bytes(seed, n * codec.WIDTH)
    if kind != "random":  # the codec's own encode of values below 2**exp, or of any size
        x = chunk_values(seed, n)
        if kind == "in range":
            x = np.ldexp(x.astype(np.float64), exp - 20).astype(np.float32)
        codec.encode_chunk(x, payload, np.uint64(seed), 0, exp, vbits, np.uint32(0), exp, True, HEADS)
    assert codecs.check_payload(int(codec.ID), payload, exp, vbits) == codec.check_payload(payload, exp, vbits)
    assert codecs.check_result(int(codec.ID), payload, exp, vbits) == codec.check_result(payload, exp, vbits)


@pytest.mark.slow
@SETTINGS
@given(case=chunk_cases(), k=st.integers(0, 9), col=st.integers(0, 30), first=st.booleans())
def test_add_payloads_dispatch(case, k, col, first) -> None:
    codec, seed, n, exp, vbits = case
    rng = np.random.default_rng(seed)
    data = random_bytes(seed, 12 * (col + n * codec.WIDTH)).reshape(12, -1)
    rows = rng.permutation(12)[:k].astype(np.int64)
    got, want = (np.random.default_rng(seed).integers(-2**31, 2**31, n, dtype=np.int32) for _ in range(2))
    codecs.add_payloads(int(codec.ID), data, rows, k, col, got, exp, vbits, first)
    codec.add_payloads(data, rows, k, col, want, exp, vbits, first)
    assert got.tobytes() == want.tobytes()


@pytest.mark.slow
@SETTINGS
@given(case=chunk_cases(), key=st.integers(0, M64), offset=st.integers(0, 2**40), stochastic=st.booleans())
def test_result_dispatch(case, key, offset, stochastic) -> None:
    codec, seed, n, exp, vbits = case
    acc = np.random.default_rng(seed).integers(-2**31, 2**31, n, dtype=np.int32)
    got, want = (np.zeros(n * codec.WIDTH, np.uint8) for _ in range(2))
    saturated = codecs.encode_result(int(codec.ID), acc, got, np.uint64(key), offset, exp, vbits, stochastic)
    assert saturated == codec.encode_result(acc, want, np.uint64(key), offset, exp, vbits, stochastic)
    assert got.tobytes() == want.tobytes()
    payload = random_bytes(seed, n * codec.WIDTH)
    got_values, want_values = np.zeros(n, np.float32), np.ones(n, np.float32)
    codecs.decode_result(int(codec.ID), payload, exp, vbits, got_values)
    codec.decode_result(payload, exp, vbits, want_values)
    assert got_values.tobytes() == want_values.tobytes()


def test_int32_check_payload_bounds() -> None:
    """The switch's int32 contribution check: [-2**s, 2**s] is accepted, one past either end is not."""
    vbits = 28
    limit = 1 << vbits
    for values, ok in (([limit, -limit, 0], True), ([limit + 1], False), ([-limit - 1], False),
                       ([-(2**31)], False), ([2**31 - 1], False), ([], True)):
        payload = np.frombuffer(struct.pack(f">{len(values)}i", *values), np.uint8).copy()
        assert bool(codecs.int32.check_payload(payload, 0, vbits)) == ok, values


def dispatched_allreduce(codec, xs: list[np.ndarray], *, seed: int, allreduce_seq: int,
                         packet_elements: int, stochastic: bool = True) -> np.ndarray:
    """An allreduce from the dispatchers alone, chunk by chunk as the workers and the switch run it."""
    cid, n, size = int(codec.ID), len(xs), xs[0].size
    vbits = value_bits(n)
    exps = [chunk_exponents(x, packet_elements, codecs.exp_range(cid)) for x in xs]
    worker_keys = [np.uint64(stream_key(seed, worker_stream(allreduce_seq, r))) for r in range(n)]
    switch_key = np.uint64(stream_key(seed, switch_stream(allreduce_seq)))
    out = np.empty(size, np.float32)
    for c, lo in enumerate(range(0, size, packet_elements)):
        count = min(packet_elements, size - lo)
        flags = np.zeros(count, np.uint8)
        exp = max(int(e[c]) for e in exps)
        data = np.zeros((n, codecs.width(cid) * count), np.uint8)
        for r, x in enumerate(xs):
            low, local = np.uint32(0), int(exps[r][c])
            if codecs.precodes(cid):  # as the worker does: encoded at its own floor first
                _, _, local, low = precode_chunk(x[lo:lo + count], data[r], worker_keys[r], lo, vbits, stochastic,
                                                 HEADS)
                assert low & PRECODED and local == exps[r][c]
            codecs.encode_chunk(cid, x[lo:lo + count], data[r], worker_keys[r], lo, exp, vbits, low, local,
                                stochastic, HEADS)
            finite = np.isfinite(x[lo:lo + count]).all()
            assert bool(codecs.check_payload(cid, data[r], exp, vbits)) == finite
            if not finite:  # the switch's slow check, which ORs the lanes' flags and zeroes them
                held = data[r].copy()
                assert codecs.check_nonfinite(cid, data[r], exp, vbits)  # the same check, nothing changed
                assert data[r].tobytes() == held.tobytes()
                assert codecs.take_nonfinite(cid, data[r], exp, vbits, flags)
                assert codecs.check_payload(cid, data[r], exp, vbits)
        acc = np.empty(count, np.int32)
        codecs.add_payloads(cid, data, np.arange(n, dtype=np.int64), n, 0, acc, exp, vbits, True)
        result = np.empty(codecs.width(cid) * count, np.uint8)
        codecs.encode_result(cid, acc, result, switch_key, lo, exp, vbits, stochastic)
        assert codecs.put_nonfinite(cid, result, flags) == np.count_nonzero(flags)
        flags[:] = 0
        assert codecs.check_result(cid, result, exp, vbits)
        codecs.decode_result(cid, result, exp, vbits, out[lo:lo + count])
    return out


@pytest.mark.parametrize("n", [1, 2, 3, 7, 16, 64])
@pytest.mark.parametrize("kind", ["mixed", "normal", "zero_chunks", "huge", "tiny"])
@CODEC_MODULES
def test_round_trip_matches_reference(codec, kind, n) -> None:
    packet = 96
    xs = make_inputs(n, 5 * packet + 17, packet, kind, seed=n)
    got = dispatched_allreduce(codec, xs, seed=n * 7919, allreduce_seq=3, packet_elements=packet)
    want = reference.allreduce(xs, codec=codec.NAME, seed=n * 7919, allreduce_seq=3, packet_elements=packet)
    assert got.tobytes() == want.tobytes()


def test_cnat8_checks_against_the_window() -> None:
    """DATA codes may hold k <= T - f (T = E, or 128 for E = 127), RESULT codes k <= 31; an all-zero chunk admits
    only 0; a code without the nonzero bit is never accepted."""
    cnat8 = codecs.cnat8
    for exp, vbits, k_max in ((0, 29, 29), (-126, 29, 23), (-126, 24, 23), (-120, 29, 29), (127, 29, 29),
                              (126, 30, 30), (NO_EXP, 29, -1)):
        for c in range(256):
            k = c & 0x3F
            ok = c == 0 or (bool(c & 0x40) and k <= k_max)
            assert bool(cnat8.check_payload(np.array([0, c], np.uint8), exp, vbits)) == ok, (exp, vbits, hex(c))
            assert bool(cnat8.check_result(np.array([c, 0], np.uint8), exp, vbits)) == (
                c in (0, 1, 2, 3) or (bool(c & 0x40) and k <= 31)), hex(c)  # with the non-finite codes
            flags = np.zeros(2, np.uint8)
            payload = np.array([0, c], np.uint8)
            assert bool(cnat8.check_nonfinite(payload, exp, vbits)) == (ok or c in (1, 2, 3))
            assert payload.tolist() == [0, c] and not flags.any()
            assert bool(cnat8.take_nonfinite(payload, exp, vbits, flags)) == (ok or c in (1, 2, 3))
            if ok or c in (1, 2, 3):
                assert flags.tolist() == [0, c if c in (1, 2, 3) else 0] and payload[1] == (0 if c < 4 else c)


@pytest.mark.parametrize("codec", codecs.CODECS)
@pytest.mark.parametrize("n", [1, 2, 3, 8])
def test_non_finite_lanes_follow_the_reference(codec, n) -> None:
    """NaN, +Inf and -Inf at chosen positions of chosen ranks: each such lane comes back as +Inf if only +Inf met
    it, -Inf if only -Inf, else NaN, whatever the finite values beside it; the finite lanes, and the chunks'
    exponents, are those of the inputs with the non-finite values left out."""
    g = np.random.default_rng(n)
    size, packet = 700, 128
    xs = [(g.standard_normal(size) * 2.0 ** g.integers(-20, 20)).astype(np.float32) for _ in range(n)]
    plan = {3: {0: np.inf}, 5: {0: -np.inf}, 7: {0: np.nan}, 130: {0: np.inf, n - 1: np.inf},
            131: {0: np.inf, n - 1: -np.inf}, 300: {n - 1: -np.inf}, 699: {n // 2: np.nan}}
    plan.update({lane: {0: np.inf} for lane in range(512, 640)})  # a chunk with no finite value
    for lane, ranks in plan.items():
        for r, v in ranks.items():
            xs[r][lane] = v
    got = dispatched_allreduce(codec, xs, seed=11, allreduce_seq=2, packet_elements=packet)
    want = reference.allreduce(xs, codec=codec.NAME, seed=11, allreduce_seq=2, packet_elements=packet)
    assert got.tobytes() == want.tobytes()
    for lane, ranks in plan.items():
        both = {np.sign(v) for v in ranks.values() if not np.isnan(v)}
        if any(np.isnan(v) for v in ranks.values()) or len(both) > 1:
            assert got.view(np.uint32)[lane] == 0x7FC00000, lane
        else:
            assert got[lane] == both.pop() * np.inf, lane
    finite = np.ones(size, bool)
    finite[list(plan)] = False
    clean = [np.where(finite, x, 0).astype(np.float32) for x in xs]
    base = reference.allreduce(clean, codec=codec.NAME, seed=11, allreduce_seq=2, packet_elements=packet)
    np.testing.assert_array_equal(got[finite].view(np.uint32), base[finite].view(np.uint32))


def allreduce_mean(xs: list[np.ndarray], seeds: range) -> tuple[np.ndarray, np.ndarray]:
    """(mean, bound on the standard error) of the cnat8 allreduce of xs over job seeds, by the fast dispatchers;
    each result also equals the oracle's for the first seeds. The bound is docs/arithmetic.md's variance bound,
    mu**2 / 8 + 9/64 sum x_i**2 + 9/32 n u**2, over the number of seeds."""
    results = []
    for seed in seeds:
        got = dispatched_allreduce(codecs.cnat8, xs, seed=seed, allreduce_seq=1, packet_elements=xs[0].size)
        if seed < seeds.start + 5:
            want = reference.allreduce(xs, codec="cnat8", seed=seed, allreduce_seq=1, packet_elements=xs[0].size)
            assert got.tobytes() == want.tobytes()
        results.append(got.astype(np.float64))
    x64 = [x.astype(np.float64) for x in xs]
    mu = sum(x64)
    exp = max(reference.chunk_exponent(x, reference.EXP_MIN, reference.EXP_MAX) for x in xs)
    unit = 2.0 ** reference.cnat_floor(exp, len(xs))
    bound = mu**2 / 8 + 9 / 64 * sum(x * x for x in x64) + 9 / 32 * len(xs) * unit**2
    return np.mean(results, axis=0), np.sqrt(bound / len(seeds))


@pytest.mark.parametrize("values", [
    [3, 100, 1000, 5000, 1e6, 0.1, 123.456, 1e-20],  # a review's example: was [8, 256, 1024, 1024, 1024, ...]
    [65536 * 0.37, -65536 * 0.02, 65536 * 3e-5, 65536 * 1.7],  # AMP's x65536-scaled gradients
], ids=["issue10", "amp"])
def test_allreduce_of_large_and_small_values_is_unbiased(values) -> None:
    """Over 2 ranks holding the same values, the mean of 4000 allreduces (job seeds) is 2x within 5 standard
    errors (by the variance bound): nothing is clipped at 2**10 any more. 1e-20 lies far below the unit of a
    chunk whose largest value is 1e6 (2**-9), so it rounds to 0 or one unit, unbiased."""
    x = np.array(values, np.float32)
    mean, se = allreduce_mean([x, x], range(4000))
    np.testing.assert_array_less(np.abs(mean - 2 * x.astype(np.float64)), 5 * se + 1e-300)


def test_allreduce_near_the_top_of_float32_is_unbiased() -> None:
    """Values up to float32's largest (3e38 > 2**127) encode to 2**127 or 2**128 units, unbiased, and sums that
    stay below 2**128 come back finite: the mean is the exact sum within 5 standard errors."""
    xs = [np.array([3e38, 1.5e38, -1.2e38], np.float32), np.array([-2.9e38, -1.5e38, 0.5e38], np.float32)]
    mean, se = allreduce_mean(xs, range(4000))
    assert np.all(np.isfinite(mean))
    exact = xs[0].astype(np.float64) + xs[1].astype(np.float64)
    np.testing.assert_array_less(np.abs(mean - exact), 5 * se)


def test_sums_beyond_float32_become_inf_and_are_counted() -> None:
    """A sum whose rounded value reaches 2**128 decodes to +-Inf, as a float32 sum overflows, and the switch's
    encode_result counts it."""
    vbits = value_bits(2)
    acc = np.array([2**29, -(2**29), 2**28, 3], np.int32)  # at E = 127 (f = 99): 2**128, -2**128, 2**127, tiny
    payload = np.zeros(4, np.uint8)
    assert codecs.cnat8.encode_result(acc, payload, np.uint64(1), 0, 127, vbits, True) == 2
    out = np.zeros(4, np.float32)
    codecs.cnat8.decode_result(payload, 127, vbits, out)
    assert out[:3].tolist() == [np.inf, -np.inf, 2.0**127] and 0 < out[3] < 2.0**102


@pytest.mark.parametrize("n", [1, 2, 5])
def test_nearest_rounding_is_deterministic_and_the_references(n) -> None:
    """rounding "nearest" (encode_nearest at the workers, the fixed word at the switch): the reference's result
    bit for bit, the same under every job seed and allreduce number, and each sum's code is the nearer power of
    two (ties away from zero)."""
    g = np.random.default_rng(n)
    xs = [(g.standard_normal(900) * 2.0 ** g.integers(-10, 10)).astype(np.float32) for _ in range(n)]
    results = [dispatched_allreduce(codecs.cnat8, xs, seed=seed, allreduce_seq=seed, packet_elements=256,
                                    stochastic=False) for seed in (1, 2, 99)]
    want = reference.allreduce(xs, codec="cnat8", seed=5, allreduce_seq=0, packet_elements=256, rounding="nearest")
    assert all(r.tobytes() == want.tobytes() for r in results)
    assert want.tobytes() != reference.allreduce(xs, codec="cnat8", seed=5, allreduce_seq=0,
                                                 packet_elements=256).tobytes()
    sums = np.arange(-3000, 3000, dtype=np.int32)
    codes, _ = sum_to_codes(sums, 0, seed=None)
    assert codes.tobytes() == reference.sum_to_codes(sums, 0, seed=None)[0].tobytes()
    values = decode(codes, floor=0).astype(np.float64)
    a = np.abs(sums[sums != 0]).astype(np.float64)
    low = 2.0 ** np.floor(np.log2(a))
    nearest = np.where(a - low >= low / 2, 2 * low, low)  # the tie 1.5 * 2**b goes up, away from zero
    assert np.array_equal(np.abs(values[sums != 0]), nearest) and values[sums == 0].tolist() == [0.0]


def test_int32_check_nonfinite_is_take_nonfinite_without_changes() -> None:
    """Words within +-2**s or reserved (non-finite) pass, any other word fails; the check changes nothing."""
    int32, vbits = codecs.int32, 20
    reserved = int32.INT32_NONFINITE + 1
    for words, ok in (([5, -(1 << vbits), reserved], True), ([5, (1 << vbits) + 1], False),
                      ([reserved, -(1 << vbits) - 1], False)):
        payload = np.array(words, ">i4").view(np.uint8)
        held = payload.copy()
        assert bool(int32.check_nonfinite(payload, 0, vbits)) == ok
        assert payload.tobytes() == held.tobytes()
        assert bool(int32.take_nonfinite(payload, 0, vbits, np.zeros(len(words), np.uint8))) == ok
