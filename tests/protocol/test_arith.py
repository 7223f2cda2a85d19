"""Tests of protocol.arith: fixed-point sizing, exponent agreement, code -> fixed point, the stochastic
re-encode of integer sums (against the numpy oracle, unbiasedness, chunking, threads, out=), and the int32 mode's
quantize/dequantize kernels."""

import math
import re

import numpy as np
import pytest
from support.concurrency import run_halves_concurrently
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from intml.protocol import arith, cnat, reference
from intml.protocol.arith import (
    CNAT_RANGE,
    INT32_RANGE,
    NO_EXP,
    chunk_exponents,
    cnat_floor,
    code_in_range,
    data_k_max,
    int32_scale_exponent,
    sum_to_codes,
    switch_stream,
    to_fixed,
    value_bits,
    window_top,
    worker_stream,
)
from intml.protocol.rng import BLOCK

M64 = (1 << 64) - 1
I32_MIN, I32_MAX = -(2**31), 2**31 - 1
SETTINGS = settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
FEW = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])

SEEDS = st.integers(0, M64)
FLOORS = st.one_of(st.integers(cnat.F_MIN, cnat.F_MAX), st.sampled_from([-149, -50, 0, 96, 97, 98, 127]))
OFFSETS = st.one_of(
    st.sampled_from([0, 1, 4095, 2**32 - 3, 2**32 - 4096, 2**32 - 1, 2**32, 2**63 - 1, 2**64 - 20000]),
    st.integers(2**32 - 5000, 2**32 + 10),
    st.integers(0, 2**64 - 20000),
)


def code_of(negative: bool, k: int) -> int:
    """bit 7 sign, bit 6 nonzero, bits 5..0 = k"""
    return (0x80 if negative else 0) | 0x40 | k


def bad_index(excinfo) -> int:
    m = re.search(r"\bindex (\d+)\b", str(excinfo.value))
    assert m, f"message does not name the index: {excinfo.value!r}"
    return int(m.group(1))


def random_f32(rng: np.random.Generator, n: int) -> np.ndarray:
    """Finite float32: uniform bit patterns (all exponents, denormals, huge), log-uniform, zeros; random signs."""
    kind = rng.integers(0, 3, n)
    pattern = rng.integers(0, 0x7F800000, n, dtype=np.uint32).view(np.float32).astype(np.float64)
    logu = 2.0 ** rng.uniform(-60, 12, n)
    x = np.select([kind == 0, kind == 1], [pattern, logu], 0.0)
    return np.where(rng.random(n) < 0.5, -x, x).astype(np.float32)


@st.composite
def f32_arrays(draw, max_size=3000):
    n = draw(st.integers(0, max_size))
    x = random_f32(np.random.default_rng(draw(st.integers(0, 2**32 - 1))), n)
    # a few zero runs (whole zero chunks) and hand-picked values
    for _ in range(draw(st.integers(0, 3))):
        if n:
            a = draw(st.integers(0, n - 1))
            x[a : a + draw(st.integers(1, 300))] = draw(st.sampled_from([0.0, -0.0]))
    specials = draw(st.lists(st.sampled_from([2.0**-149, 1e-40, 2.0**-126, 2.0**-50, 2.0**-51, 1.0, 1.5, 2.0**10,
                                              1025.0, 2.0**126, 2.0**127, 3e38, -3e38, 0.75]), max_size=8))
    if specials and n:
        at = draw(st.lists(st.integers(0, n - 1), min_size=len(specials), max_size=len(specials)))
        x[at] = np.array(specials, np.float32)
    return x


SUM_SPECIALS = [0, 1, -1, 2, -2, 3, -3, 2**30, -(2**30), 2**30 - 1, 2**30 + 1, I32_MAX, -I32_MAX, I32_MIN,
                2**31 - 2, 5, 7, -1000003]


@st.composite
def int32_sums(draw, max_size=3000):
    n = draw(st.integers(0, max_size))
    g = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    bits = g.integers(0, 32, n)  # log-uniform magnitude: every bit length
    s = (g.integers(0, 2**31, n) >> (31 - bits)) * np.where(g.random(n) < 0.5, -1, 1)
    s = s.astype(np.int32)
    specials = draw(st.lists(st.one_of(st.sampled_from(SUM_SPECIALS), st.integers(I32_MIN, I32_MAX)), max_size=20))
    if specials and n:
        at = draw(st.lists(st.integers(0, n - 1), min_size=len(specials), max_size=len(specials)))
        s[at] = np.array(specials, np.int32)
    return s


# --- fixed-point sizing ----------------------------------------------------------------------------------------


def test_value_bits_is_maximal_and_safe():
    for n in range(1, 1001):
        s = value_bits(n)
        assert n * 2**s < 2**31, n  # n contributions of magnitude <= 2**s fit a signed 32-bit register
        assert n * 2 ** (s + 1) >= 2**31, n  # and one more bit would not
    for n in (1, 2, 3, 4, 1023, 1024, 1025, 32767, 32768):
        s = value_bits(n)
        assert n * 2**s < 2**31 <= n * 2 ** (s + 1)
    assert value_bits(1) == 30 and value_bits(2) == 29 and value_bits(3) == 29 and value_bits(4) == 28


@pytest.mark.parametrize("n", [0, -1, 32769])
def test_value_bits_rejects_bad_world_size(n):
    with pytest.raises(ValueError, match="world size"):
        value_bits(n)


def _safe_bits(n: int) -> int:
    """The largest s with n * 2**s < 2**31, by search (independent of value_bits' bit_length formula)."""
    s = 0
    while n * 2 ** (s + 1) < 2**31:
        s += 1
    return s


@pytest.mark.parametrize("n", [1, 2, 3, 8, 100, 1000, 32768])
def test_cnat_floor_and_int32_scale(n):
    s = _safe_bits(n)
    assert value_bits(n) == s
    assert cnat_floor(NO_EXP, s) == -149 and data_k_max(NO_EXP, s) == -1  # an all-zero chunk: only code 0
    assert int32_scale_exponent(NO_EXP, s) == s + 126  # an all-zero chunk scales as the smallest exponent
    for e in range(-126, 128):
        top = 128 if e == 127 else e  # E = 127 also stands for max |x| in [2**127, 2**128)
        assert window_top(e) == top
        f = cnat_floor(e, s)
        assert f == max(-149, top - s)
        # every value below 2**top is a code k <= top - f <= s(n): n of the largest fit int32, nothing saturates
        assert data_k_max(e, s) == top - f <= s
        assert n * 2 ** (top - f) < 2**31
        # and every code of the window decodes to a float32: 2**f is at least the smallest denormal
        assert f >= -149 and f + data_k_max(e, s) <= 128
    for e in range(-126, 128):
        assert int32_scale_exponent(e, s) == s - e


def test_streams_are_distinct():
    streams = [worker_stream(a, r) for a in range(4) for r in range(300)] + [switch_stream(a) for a in range(4)]
    assert len(set(streams)) == len(streams)


# --- chunk exponents -------------------------------------------------------------------------------------------


def expected_exponents(x: np.ndarray, chunk: int, lo: int, hi: int) -> list[int]:
    out = []
    for c in range(0, x.size, chunk):
        m = float(np.abs(x[c : c + chunk].astype(np.float64)).max())
        out.append(NO_EXP if m == 0 else min(hi, max(lo, math.frexp(m)[1])))  # frexp: m = f 2**E, f in [.5, 1)
    return out


@SETTINGS
@given(x=f32_arrays(), chunk=st.integers(1, 700), codec=st.sampled_from([CNAT_RANGE, INT32_RANGE]))
def test_chunk_exponents(x, chunk, codec):
    lo, hi = codec
    got = chunk_exponents(x, chunk, codec)
    assert got.dtype == np.int8 and got.size == -(-x.size // chunk)
    assert got.tolist() == expected_exponents(x, chunk, lo, hi)
    assert got.tolist() == [reference.chunk_exponent(x[c : c + chunk], lo, hi) for c in range(0, x.size, chunk)]
    for c, e in enumerate(got.tolist()):
        m = float(np.abs(x[c * chunk : (c + 1) * chunk].astype(np.float64)).max())
        if m == 0:
            assert e == NO_EXP
            continue
        assert lo <= e <= hi
        if e < hi:
            assert m < 2.0**e  # every |x| < 2**E unless clipped at the ceiling
        if e > lo:
            assert 2.0 ** (e - 1) <= m  # E - 1 <= log2 max|x| unless clipped at the floor


def test_chunk_exponents_hand_cases():
    x = np.array([0, 0, -0.0, 0,  1.0, 0.5, 0, 0,  -3.0, 1, 1, 1,  1e-40, 0, 0, 0,  3e38, 0, 0, 0,  0.75], np.float32)
    assert chunk_exponents(x, 4, INT32_RANGE).tolist() == [NO_EXP, 1, 2, -126, 127, 0]
    assert chunk_exponents(x, 4, CNAT_RANGE).tolist() == [NO_EXP, 1, 2, -126, 127, 0]
    assert chunk_exponents(np.zeros(0, np.float32), 4, CNAT_RANGE).size == 0


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("at", [0, 5, 99, 100, 250])
def test_chunk_exponents_ignore_non_finite_values(bad, at):
    """A NaN or an infinity travels as flags: a chunk's exponent is its finite values' (NO_EXP if it has none),
    and the kernel counts the non-finite values."""
    x = np.ones(251, np.float32)
    x[3] = 1000.0
    x[at] = bad
    x[at + 1 :: 7] = np.nan
    want = [reference.chunk_exponent(x[lo:lo + 100], *CNAT_RANGE) for lo in range(0, 251, 100)]
    assert chunk_exponents(x, 100, CNAT_RANGE).tolist() == want
    assert want[1] == want[2] == 1 and want[0] == (1 if at == 3 else 10)
    out = np.empty(3, np.int8)
    assert arith.chunk_exponents_kernel(x, 100, *CNAT_RANGE, out) == np.count_nonzero(~np.isfinite(x))
    assert chunk_exponents(np.full(5, np.inf, np.float32), 4, CNAT_RANGE).tolist() == [NO_EXP, NO_EXP]


# --- codes -> fixed point --------------------------------------------------------------------------------------


def in_range(c: int, k_max: int) -> bool:
    return c == 0 or (reference.is_valid(c) and reference.k_of(c) <= k_max)


K_MAXES = st.integers(-1, 30)


@SETTINGS
@given(k_max=K_MAXES, n=st.integers(0, 3000), seed=st.integers(0, 2**32 - 1), bad=st.booleans())
def test_to_fixed_matches_reference(k_max, n, seed, bad):
    g = np.random.default_rng(seed)
    k = g.integers(0, k_max + 1, n) if k_max >= 0 else np.zeros(n, np.int64)
    codes = np.where((g.random(n) < 0.1) | (k_max < 0), 0, (g.integers(0, 2, n) << 7) | 0x40 | k).astype(np.uint8)
    if bad and n:
        codes[g.integers(0, n, 3)] = g.integers(0, 256, 3)  # may or may not be in range
    ok = [in_range(c, k_max) for c in codes.tolist()]
    if all(ok):
        got = to_fixed(codes, k_max)
        assert got.dtype == np.int32
        np.testing.assert_array_equal(got, reference.to_fixed(codes))
    else:
        with pytest.raises(ValueError, match="not a C_nat code with") as excinfo:
            to_fixed(codes, k_max)
        assert bad_index(excinfo) == ok.index(False)


@pytest.mark.parametrize("k_max", [-1, 0, 5, 29, 30, 31, 63])
def test_code_in_range_every_code(k_max):
    for c in range(256):
        assert bool(code_in_range(np.uint8(c), k_max)) == in_range(c, k_max), hex(c)


@pytest.mark.slow
@SETTINGS
@given(x=f32_arrays(), chunk=st.integers(1, 700), seed=st.integers(0, 2**64 - 1), stream=st.integers(0, 2**40),
       floors=st.lists(FLOORS, min_size=1, max_size=4), vbits=st.sampled_from([30, 29, 24]))
def test_precode_gives_the_wire_codes_unless_a_value_is_below_the_floor(x, chunk, seed, stream, floors, vbits):
    """precode_chunk, chunk by chunk as the worker calls it: its exponents are chunk_exponents', nothing saturates,
    it counts the non-finite values, its codes are encode's at the chunk's own floor, and
    for any floor f at or above that the agreed exponent may set, the codes lowered by the floors' difference are
    exactly encode's at f unless has_underflow says a nonzero value lies below 2**f; and has_underflow is exact
    (it says so iff one does), with or without the PRECODED tag."""
    key = np.uint64(cnat.stream_key(seed, stream))
    codes = np.empty(x.size, np.uint8)
    exponents, low, saturated = [], [], 0
    for lo in range(0, x.size, chunk):
        sat, bad, exponent, smallest = arith.precode_chunk(x[lo:lo + chunk], codes[lo:lo + chunk], key, lo, vbits,
                                                           True, np.empty(BLOCK, np.uint32))
        assert bad == np.count_nonzero(~np.isfinite(x[lo:lo + chunk]))
        exponents.append(exponent)
        low.append(smallest)
        saturated += sat
    assert exponents == chunk_exponents(x, chunk, CNAT_RANGE).tolist()
    assert saturated == 0
    for c in range(len(exponents)):
        part = x[c * chunk:(c + 1) * chunk]
        own = cnat_floor(exponents[c], vbits)
        precoded = codes[c * chunk:(c + 1) * chunk]
        assert np.array_equal(precoded, cnat.encode(part, seed=seed, stream=stream, offset=c * chunk, floor=own).codes)
        assert low[c] & arith.PRECODED
        magnitudes = np.abs(part.astype(np.float64))
        for floor in floors:
            below = bool(((magnitudes > 0) & (magnitudes < 2.0**floor)).any())
            assert bool(cnat.has_underflow(low[c], floor)) == below
            assert bool(cnat.has_underflow(low[c] & ~arith.PRECODED, floor)) == below
            if not below and floor >= own:
                lowered = precoded.copy()
                arith.lower_codes(lowered, floor - own)
                want = cnat.encode(part, seed=seed, stream=stream, offset=c * chunk, floor=floor).codes
                assert np.array_equal(lowered, want), (c, floor)


@pytest.mark.parametrize("k_max", [-1, 0, 1, 5, 29, 30, 31, 62, 63])
def test_codes_in_range_every_code_at_every_lane(k_max):
    """The 8-bit vector check agrees with the definition for every code, alone among valid codes, at every
    position of a vector-width block and of the scalar tail; k_max = -1 admits only zeros."""
    n = 32 * 3 + 7
    for c in range(256):
        for pos in list(range(32)) + list(range(n - 7, n)):
            codes = np.zeros(n, np.uint8)
            codes[pos] = c
            assert bool(cnat.codes_in_range(codes, k_max)) == in_range(c, k_max), (hex(c), pos)
    assert cnat.codes_in_range(np.zeros(0, np.uint8), k_max)


@settings(deadline=None)  # the first example compiles the kernels
@given(k_max=st.integers(0, 30), k=st.integers(0, 9), n=st.integers(0, 300), first=st.booleans(),
       seed=st.integers(0, 2**32 - 1))
def test_add_fixed_rows_equals_adding_rows_one_by_one(k_max, k, n, first, seed):
    """The fused 4-row and 2-row passes give the sums of the reference's row-by-row int32 additions (mod 2**32),
    reading only the rows listed and only their columns [col, col + n)."""
    g = np.random.default_rng(seed)
    col, height = 5, 12
    e = g.integers(0, k_max + 1, (height, col + n))
    data = np.where(g.random(e.shape) < 0.1, 0, (g.integers(0, 2, e.shape) << 7) | 0x40 | e).astype(np.uint8)
    data[:, :col] = 0xFF  # invalid codes: reading them would show
    rows = g.permutation(height)[:max(k, 1)].astype(np.int64)
    acc = g.integers(-(2**31), 2**31, n, dtype=np.int64).astype(np.int32)
    want = np.zeros(n, np.int64) if first else acc.astype(np.int64)
    for t in range(k):
        want += reference.to_fixed(data[rows[t], col:])
    if k == 0:
        want = acc.astype(np.int64)
    arith.add_fixed_rows(data, rows, k, col, acc, first)
    np.testing.assert_array_equal(acc, want.astype(np.uint32).view(np.int32))


def test_to_fixed_hand_cases():
    codes = np.array([0x00, 0x40, 0xC0, 0x5E, 0x54, 0xD4], np.uint8)  # 0, 1, -1, 2**30, 2**20, -2**20 units
    assert to_fixed(codes).tolist() == [0, 1, -1, 2**30, 2**20, -(2**20)]
    with pytest.raises(ValueError) as excinfo:
        to_fixed(codes, 29)  # 2**30 units is above k_max
    assert bad_index(excinfo) == 3
    with pytest.raises(ValueError) as excinfo:
        to_fixed(codes, -1)  # an all-zero chunk admits only 0
    assert bad_index(excinfo) == 1
    with pytest.raises(ValueError, match="k_max"):
        to_fixed(codes, 31)  # 2**31 units cannot fit int32
    for invalid in (0x80, 0x5F, 0x7F, 0x01):
        with pytest.raises(ValueError) as excinfo:
            to_fixed(np.array([0x40, invalid], np.uint8))
        assert bad_index(excinfo) == 1


@FEW
@given(x=f32_arrays(), n=st.integers(1, 1000), seed=SEEDS)
def test_encode_at_agreed_exponent_fits_the_slot(x, n, seed):
    """End to end: with E = chunk exponent and f = cnat_floor(E, n), nothing saturates, every code of
    encode(x, floor=f) is accepted by to_fixed(codes, data_k_max(E, s(n))), and n of the largest possible
    contribution fit int32 -- for every finite float32 input, 3e38 and denormals included."""
    (e,) = chunk_exponents(x, max(1, x.size), CNAT_RANGE) if x.size else [NO_EXP]
    if e == NO_EXP:
        return
    s = value_bits(n)
    f = cnat_floor(int(e), s)
    got = cnat.encode(x, seed=seed, stream=worker_stream(1, 0), floor=f)
    assert got.saturated == 0
    fixed = to_fixed(got.codes, data_k_max(int(e), s)).astype(np.int64)
    assert np.abs(fixed).max(initial=0) <= 2 ** data_k_max(int(e), s)
    assert n * 2 ** data_k_max(int(e), s) < 2**31


# --- sum_to_codes ----------------------------------------------------------------------------------------------


@SETTINGS
@given(sums=int32_sums(), floor=FLOORS, seed=SEEDS, stream=SEEDS, offset=OFFSETS)
@example(sums=np.array(SUM_SPECIALS, np.int32), floor=-50, seed=0, stream=0, offset=2**32 - 3)
@example(sums=np.array(SUM_SPECIALS, np.int32), floor=97, seed=M64, stream=1, offset=0)
@example(sums=np.array(SUM_SPECIALS, np.int32), floor=-149, seed=5, stream=1, offset=0)
def test_sum_to_codes_matches_reference(sums, floor, seed, stream, offset):
    codes, saturated = sum_to_codes(sums, floor, seed=seed, stream=stream, offset=offset)
    want, want_saturated = reference.sum_to_codes(sums, floor, seed=seed, stream=stream, offset=offset)
    assert codes.dtype == np.uint8 and codes.shape == sums.shape
    np.testing.assert_array_equal(codes, want)
    assert saturated == want_saturated


def test_sum_to_codes_hand_cases():
    # exact powers of two and zero are deterministic; magnitude 2**b units is the code k = b, whatever the floor
    sums = np.array([0, 1, -1, 2, 2**20, -(2**30), I32_MIN], np.int32)
    for seed in range(5):
        for floor in (-149, -40, 0, 96):
            codes, overflowed = sum_to_codes(sums, floor, seed=seed, stream=3)
            assert codes.tolist() == [0, code_of(False, 0), code_of(True, 0), code_of(False, 1),
                                      code_of(False, 20), code_of(True, 30), code_of(True, 31)]
            assert overflowed == 0
    # at floor 98, 2**30 units is 2**128, beyond float32: the code is kept (it decodes to Inf) and counted
    codes, overflowed = sum_to_codes(np.array([2**30, -(2**30), 2**29], np.int32), 98, seed=1, stream=1)
    assert codes.tolist() == [0x5E, 0xDE, 0x5D] and overflowed == 2
    assert cnat.decode(codes, floor=98).tolist() == [np.inf, -np.inf, 2.0**127]


@pytest.mark.parametrize("offset", [0, 4090, 2**32 - 3])
def test_sum_to_codes_overflow_edge(offset):
    """In units of 2**100: 2**27 units = 2**127 is the largest finite value (not counted); 2**28 = 2**128 is the
    smallest overflow, alone in its block or not; powers of two are deterministic."""
    cases = [([2**27, -(2**27)], 0), ([2**28], 1), ([-(2**28)], 1), ([2**27, 2**28, -(2**28), 2**29, 0], 3)]
    for sums, count in cases:
        codes, overflowed = sum_to_codes(np.array(sums, np.int32), 100, seed=3, stream=4, offset=offset)
        assert overflowed == count, sums
        assert codes.tolist() == [0 if s == 0 else (0x80 if s < 0 else 0) | 0x40 | (abs(s).bit_length() - 1)
                                  for s in sums]


@pytest.mark.parametrize("s", [3, -5, 7, 1000003, -(2**20 + 12345), 2**30 - 1, 2**30 + 2**29 + 1, I32_MAX, -I32_MAX])
def test_sum_to_codes_is_unbiased(s):
    """The mean of N = 2**20 re-encodings of one sum S (one stream, many indices) is S within 5 standard errors.
    With b = floor(log2 |S|), R = |S| - 2**b: C = 2**(b+1) with probability p = R / 2**b, else 2**b, so
    Var = 4**b p (1 - p) (units of 2**floor) and the standard error is sqrt(Var / N)."""
    n = 1 << 20
    floor = -45
    codes, overflowed = sum_to_codes(np.full(n, s, np.int32), floor, seed=9, stream=switch_stream(4),
                                     offset=2**32 - n // 2)
    assert overflowed == 0
    units = cnat.decode(codes, floor=floor).astype(np.float64) / 2.0**floor  # exact: powers of two
    b = abs(s).bit_length() - 1
    p = (abs(s) - 2**b) / 2**b
    assert set(np.abs(units).tolist()) <= {2.0**b, 2.0 ** (b + 1)} and np.all(np.sign(units) == np.sign(s))
    se = math.sqrt(4.0**b * p * (1 - p) / n)
    assert abs(units.mean() - s) <= 5 * se, (units.mean(), s, se)


@FEW
@given(sums=int32_sums(max_size=12000), floor=FLOORS, seed=SEEDS, stream=SEEDS, offset=OFFSETS, data=st.data())
def test_sum_to_codes_chunking_invariance(sums, floor, seed, stream, offset, data):
    whole, whole_saturated = sum_to_codes(sums, floor, seed=seed, stream=stream, offset=offset)
    n = sums.size
    cuts = sorted(set(data.draw(st.lists(st.integers(0, n), max_size=12))))
    bounds = list(zip([0, *cuts], [*cuts, n]))
    out = np.full(n, 0xAA, np.uint8)
    saturated = 0
    for i in np.random.default_rng(len(cuts)).permutation(len(bounds)):
        a, b = bounds[i]
        sl = out[a:b]
        codes, sat = sum_to_codes(sums[a:b], floor, seed=seed, stream=stream, offset=offset + a, out=sl)
        assert codes is sl
        saturated += sat
    np.testing.assert_array_equal(out, whole)
    assert saturated == whole_saturated


def test_sum_to_codes_two_threads_concurrently():
    n = 1 << 22
    g = np.random.default_rng(3)
    sums = (g.integers(-(2**30), 2**30, n) >> g.integers(0, 31, n)).astype(np.int32)
    floor, seed, stream, offset = 100, 5, switch_stream(2), 2**32 - n // 2  # up to 2**131: some overflow
    whole, whole_saturated = sum_to_codes(sums, floor, seed=seed, stream=stream, offset=offset)
    assert whole_saturated > 0
    out = np.zeros(n, np.uint8)
    saturated = run_halves_concurrently(
        n, lambda a, b: sum_to_codes(sums[a:b], floor, seed=seed, stream=stream, offset=offset + a, out=out[a:b])[1])
    assert saturated == whole_saturated
    np.testing.assert_array_equal(out, whole)


def test_sum_to_codes_out_is_used_in_place():
    sums = np.arange(-500, 500, dtype=np.int32)
    want, _ = sum_to_codes(sums, -30, seed=1, stream=2)
    out = np.zeros(1000, np.uint8)
    codes, _ = sum_to_codes(sums, -30, seed=1, stream=2, out=out)
    assert codes is out
    np.testing.assert_array_equal(out, want)
    # sums are the switch's int32 registers: other dtypes are refused rather than silently wrapped
    with pytest.raises(TypeError, match="int32"):
        sum_to_codes(sums.astype(np.int64), -30, seed=1, stream=2)


@pytest.mark.parametrize("dtype", [np.int8, np.float32, np.int32])
def test_sum_to_codes_out_wrong_dtype(dtype):
    sums = np.arange(100, dtype=np.int32)
    with pytest.raises(TypeError, match="uint8"):
        sum_to_codes(sums, -30, seed=1, stream=2, out=np.zeros(100, dtype))


@pytest.mark.parametrize("size", [92, 108])
def test_sum_to_codes_out_wrong_size(size):
    """A wrong-sized out must raise ValueError. The out array is a view into a larger buffer so that a kernel which
    writes past its end (boundscheck=False) only scribbles on our own guard bytes instead of the heap."""
    n = 100
    sums = np.arange(1, n + 1, dtype=np.int32)
    guard = np.full(n + 64, 0xAA, np.uint8)
    out = guard[:size]
    with pytest.raises(ValueError, match=str(n)):
        sum_to_codes(sums, -30, seed=1, stream=2, out=out)
    assert np.all(guard[size:] == 0xAA), "the kernel wrote past the end of out"


def test_sum_to_codes_out_non_contiguous_is_written_or_rejected():
    """A non-contiguous 2-D out (a transpose, which reshape(-1) can only copy) must either be rejected
    (ValueError, as cnat.encode does) or really receive the codes; returning it untouched (the codes went into a
    temporary copy) loses the result silently."""
    sums = np.arange(1, 41, dtype=np.int32).reshape(4, 10)
    want, _ = sum_to_codes(sums, -30, seed=1, stream=2)
    out = np.zeros((10, 4), np.uint8).T
    try:
        codes, _ = sum_to_codes(sums, -30, seed=1, stream=2, out=out)
    except ValueError:
        return
    assert codes is out
    np.testing.assert_array_equal(out, want)


def test_sum_to_codes_checks_floor():
    for floor in (-150, 128):
        with pytest.raises(ValueError, match="floor"):
            sum_to_codes(np.zeros(3, np.int32), floor, seed=1, stream=1)


# --- int32 mode ------------------------------------------------------------------------------------------------


def np_quantize(x, scale_exponent, limit):
    return np.clip(np.rint(x.astype(np.float64) * 2.0**scale_exponent), -limit, limit).astype(np.int32)


def np_dequantize(sums, scale_exponent):
    with np.errstate(over="ignore"):  # large negative scale exponents overflow float32 to +-inf, like the kernel
        out = (sums.astype(np.float64) * 2.0**-scale_exponent).astype(np.float32)
    for word, value in ((I32_MIN + 1, np.inf), (I32_MIN + 2, -np.inf), (I32_MIN + 3, np.nan)):  # reserved words
        out[sums == word] = value
    return out


@SETTINGS
@given(x=f32_arrays(), scale=st.integers(-160, 160), limit=st.one_of(st.integers(0, I32_MAX),
                                                                      st.sampled_from([I32_MAX, 2**30, 1])))
@example(x=np.array([0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 3e38, -3e38, 2.0**-149], np.float32), scale=0, limit=I32_MAX)
def test_quantize_matches_numpy(x, scale, limit):
    out = np.full(x.size, 7, np.int32)
    arith.quantize_int32_kernel(x, scale, limit, out)
    np.testing.assert_array_equal(out, np_quantize(x, scale, limit))


def test_quantize_gives_non_finite_values_reserved_words():
    x = np.array([np.inf, -np.inf, np.nan, -np.nan, 1.0, 3e38], np.float32)
    out = np.empty(x.size, np.int32)
    arith.quantize_int32_kernel(x, 0, 2**30, out)
    assert out.tolist() == [I32_MIN + 1, I32_MIN + 2, I32_MIN + 3, I32_MIN + 3, 1, 2**30]


def test_quantize_rounds_half_to_even():
    x = np.array([0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 0.49999997, 3.5], np.float32)
    out = np.empty(x.size, np.int32)
    arith.quantize_int32_kernel(x, 0, I32_MAX, out)
    assert out.tolist() == [0, 2, 2, 0, -2, -2, 0, 4]


@SETTINGS
@given(seed=st.integers(0, 2**32 - 1), n=st.integers(0, 3000), scale=st.integers(-160, 160))
@example(seed=0, n=10, scale=156)
def test_dequantize_matches_numpy(seed, n, scale):
    g = np.random.default_rng(seed)
    sums = (g.integers(I32_MIN, I32_MAX, n, endpoint=True) >> g.integers(0, 32, n)).astype(np.int32)
    if n:
        sums[: min(n, 7)] = [I32_MIN, I32_MAX, 0, -1, I32_MIN + 1, I32_MIN + 2, I32_MIN + 3][: min(n, 7)]
    out = np.full(n, np.nan, np.float32)
    arith.dequantize_int32_kernel(sums, scale, out)
    np.testing.assert_array_equal(out.view(np.uint32), np_dequantize(sums, scale).view(np.uint32))


@SETTINGS
@given(x=f32_arrays(), n=st.integers(1, 1000))
def test_int32_round_trip_within_half_a_unit(x, n):
    """q = rint(x 2**S) with S = int32_scale_exponent(E, n) and E the chunk exponent; q 2**-S is within half a unit
    (2**-S / 2) of x, and |q| <= 2**value_bits(n) so n of them cannot overflow int32."""
    x = x[np.abs(x) < 2.0**127]  # the int8 exponent can hold E only for |x| < 2**127 (the clamp's domain)
    (e,) = chunk_exponents(x, max(1, x.size), INT32_RANGE) if x.size else [NO_EXP]
    scale = int32_scale_exponent(int(e), value_bits(n))
    q = np.empty(x.size, np.int32)
    arith.quantize_int32_kernel(x, scale, I32_MAX, q)
    assert np.abs(q.astype(np.int64)).max(initial=0) <= 2 ** value_bits(n)
    back = np.empty(x.size, np.float32)
    arith.dequantize_int32_kernel(q, scale, back)
    err = np.abs(back.astype(np.float64) - x.astype(np.float64))
    assert np.all(err <= 0.5 * 2.0**-scale), err.max()
