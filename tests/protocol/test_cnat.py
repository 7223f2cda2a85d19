"""Tests of protocol.cnat: the kernels against the numpy oracle (protocol.reference) bit for bit, the code
layout relative to the floor, exactness on powers of two, unbiasedness and variance of the stochastic rounding,
the 6-bit window's top, underflow, denormals, non-finite input, chunking/thread invariance and out= buffers.

F0 = -50 is the floor of most hand cases: there k = e + 50."""

import math
import re

import numpy as np
import pytest
from support.concurrency import run_halves_concurrently
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from numba import njit

from intml.protocol import cnat, reference
from intml.protocol.cnat import (
    decode,
    decode_accumulate,
    encode,
    encode_nearest,
    find_invalid,
    validate,
)

M64 = (1 << 64) - 1
SETTINGS = settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
FEW = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])

F32_MAX = float(np.finfo(np.float32).max)
TINY = 2.0**-149  # smallest float32 denormal
F0 = -50  # the hand cases' floor: k = e + 50

# --- strategies ------------------------------------------------------------------------------------------------

SEEDS = st.integers(0, M64)
FLOORS = st.one_of(st.integers(cnat.F_MIN, cnat.F_MAX), st.sampled_from([-149, -127, -126, -125, -50, 0, 64, 65, 127]))
OFFSETS = st.one_of(
    st.sampled_from([0, 1, 4095, 4096, 2**32 - 3, 2**32 - 4096, 2**32 - 1, 2**32, 2**63 - 1, 2**64 - 20000]),
    st.integers(2**32 - 5000, 2**32 + 10),  # straddles the 2**32 block-key boundary
    st.integers(0, 2**64 - 20000),
)
FACTORS = [1.0, 1.5, 4 / 3, 1.25, 1.75, 1 + 2**-23, 2 - 2**-23, 1.5 - 2**-23, 1.5 + 2**-23, 1.5 - 2**-22]
SPECIAL_MAGNITUDES = [
    0.0, TINY, 2 * TINY, 1e-40, 2.0**-126, 2.0**-126 - TINY, 2.0**-50, 2.0**-51, 2.0**-50 * 0.75, 2.0**-50 * 1.5,
    2.0**-52 * 3, 1e-20, 2.0**-21, 2.0**9, 2.0**9.5, 768.0, 1023.9, 2.0**10, 1024.0001, 2000.0, 3e38, F32_MAX,
]


def _f32(v: float) -> float:
    return float(np.float32(v))


MAGNITUDES = st.one_of(
    st.floats(min_value=0, width=32, allow_nan=False, allow_infinity=False),  # subnormals up to 3.4e38
    st.builds(lambda a, f: _f32(f * 2.0**a), st.integers(-60, 12), st.sampled_from(FACTORS)),  # ties, 4/3, powers
    st.sampled_from(SPECIAL_MAGNITUDES),
)
SPECIALS = st.builds(lambda m, neg: -m if neg else m, MAGNITUDES, st.booleans())


def bulk_f32(rng: np.random.Generator, n: int) -> np.ndarray:
    """A mix of: uniform finite float32 bit patterns (every exponent, denormals, huge), log-uniform magnitudes over
    [2**-60, 2**12], powers of two times tie/worst-case factors, and zeros; random signs."""
    kind = rng.integers(0, 4, n)
    pattern = rng.integers(0, 0x7F800000, n, dtype=np.uint32).view(np.float32).astype(np.float64)
    logu = 2.0 ** rng.uniform(-60, 12, n)
    ties = 2.0 ** rng.integers(-55, 12, n) * np.array(FACTORS)[rng.integers(0, len(FACTORS), n)]
    x = np.select([kind == 0, kind == 1, kind == 2], [pattern, logu, ties], 0.0)
    x = np.where(rng.random(n) < 0.5, -x, x)
    return x.astype(np.float32)


@st.composite
def f32_arrays(draw, max_size=3000, min_size=0):
    n = draw(st.integers(min_size, max_size))
    x = bulk_f32(np.random.default_rng(draw(st.integers(0, 2**32 - 1))), n)
    specials = draw(st.lists(SPECIALS, max_size=min(n, 24)))
    if specials:
        at = draw(st.lists(st.integers(0, n - 1), min_size=len(specials), max_size=len(specials)))
        x[at] = np.array(specials, dtype=np.float32)
    return x


def code_of(negative: bool, e: int, floor: int = F0) -> int:
    """bit 7 sign, bit 6 nonzero, bits 5..0 = k = e - floor"""
    return (0x80 if negative else 0) | 0x40 | (e - floor)


def code_values(codes: np.ndarray, floor: int) -> np.ndarray:
    """float64 values +-2**(floor + k) of valid codes, by hand from the layout (beyond float32's range too)."""
    c = codes.astype(np.int64)
    sign = np.where(c & 0x80, -1.0, 1.0)
    return np.where(c == 0, 0.0, sign * np.ldexp(1.0, floor + (c & 0x3F)))


def saturating(x: np.ndarray, floor: int) -> int:
    """Elements beyond the 6-bit window: |x| > 2**(floor + 63)."""
    return int((np.abs(x.astype(np.float64)) > 2.0 ** (floor + 63)).sum())


def same_floats(a: np.ndarray, b: np.ndarray) -> None:
    """Bit-for-bit equality, except that any NaN matches any NaN (payloads are not specified)."""
    assert a.dtype == b.dtype and a.shape == b.shape
    nan_a, nan_b = np.isnan(a), np.isnan(b)
    np.testing.assert_array_equal(nan_a, nan_b)
    ints = np.uint32 if a.dtype == np.float32 else np.uint64
    np.testing.assert_array_equal(a[~nan_a].view(ints), b[~nan_b].view(ints))


def bad_index(excinfo) -> int:
    m = re.search(r"\bindex (\d+)\b", str(excinfo.value))
    assert m, f"message does not name the index: {excinfo.value!r}"
    return int(m.group(1))


# --- encode / decode against the oracle ------------------------------------------------------------------------


@SETTINGS
@given(x=f32_arrays(), seed=SEEDS, stream=SEEDS, offset=OFFSETS, floor=FLOORS)
@example(x=np.array([TINY, -1e-40, 2.0**-50, 1.5 * 2.0**-50, -0.0, 0.0, 3e38], np.float32), seed=0, stream=0,
         offset=2**32 - 3, floor=-50)
@example(x=np.array([TINY, -3 * TINY, 1e-40, 2.0**-126 - TINY, 2.0**-126, 3e38, -F32_MAX], np.float32), seed=1,
         stream=2, offset=0, floor=-149)
@example(x=np.array([TINY, 1e-40, 2.0**-126 - TINY, 2.0**-126, 1.5 * 2.0**-127], np.float32), seed=1, stream=2,
         offset=5, floor=-127)
@example(x=np.array([3e38, -F32_MAX, 2.0**127, 1e38, 1.0], np.float32), seed=3, stream=4, offset=0, floor=98)
def test_encode_matches_reference(x, seed, stream, offset, floor):
    got = encode(x, seed=seed, stream=stream, offset=offset, floor=floor)
    codes, saturated = reference.encode(x, seed=seed, stream=stream, offset=offset, floor=floor)
    np.testing.assert_array_equal(got.codes, codes)
    assert got.codes.dtype == np.uint8 and got.codes.shape == x.shape
    assert got.saturated == saturated == saturating(x, floor)



@pytest.mark.parametrize("offset", [2**16 - 5000, 2**32 - 70000])
def test_long_encode_matches_reference_as_head_tables_change(offset):
    """A call long enough that the encoder's table of word heads (protocol.rng.block_heads) serves several whole
    blocks, is refilled where the key's top half changes (every 2**16 elements) and where the block key changes
    (2**32), after a partial first block: the codes equal the oracle's."""
    x = bulk_f32(np.random.default_rng(offset), 140_000)
    got = encode(x, seed=9, stream=10, offset=offset, floor=-40)
    np.testing.assert_array_equal(got.codes, reference.encode(x, seed=9, stream=10, offset=offset, floor=-40)[0])


@pytest.mark.parametrize("n", [4 * 4096, 4 * 4096 + 13, 70_007])
@pytest.mark.parametrize("floor", [-40, -149, 98])
def test_long_encode_of_every_kind_of_value(n, floor):
    """A long stochastic encode (codes and extremes in one lanes-wide pass per block, the last n % 8 elements
    scalar) of finite values of every exponent, zeros, values below the floor, saturating and non-finite values
    at every lane position: the codes and the saturated count are the oracle's, and the extremes encode_kernel
    returns are the largest magnitude and the smallest nonzero magnitude minus one."""
    rng = np.random.default_rng(n + floor)
    x = bulk_f32(rng, n)
    at = rng.choice(n - 16, 64, replace=False)
    x[at] = rng.choice(np.array([np.inf, -np.inf, np.nan, 3e38, -1e-42, 1e-30, 0.0], np.float32), at.size)
    x[-16:] = np.array([np.inf, 1e-30, 0.0, -np.nan, -3e38, 2.0**-130, 1.0, -0.0] * 2, np.float32)
    codes, saturated = reference.encode(x, seed=5, stream=6, offset=3, floor=floor)
    got = encode(x, seed=5, stream=6, offset=3, floor=floor)
    np.testing.assert_array_equal(got.codes, codes)
    assert got.saturated == saturated
    out = np.empty(n, np.uint8)
    _, nonfinite, top, low = cnat.encode_kernel(x, out, np.uint64(cnat.stream_key(5, 6)), np.uint64(3), floor, True)
    magnitudes = x.view(np.uint32) & np.uint32(0x7FFFFFFF)
    assert nonfinite == np.count_nonzero(~np.isfinite(x))
    assert top == magnitudes.max() and low == magnitudes[magnitudes != 0].min() - 1


def test_stochastic_loop_fetches_its_input_ahead_within_reach():
    """The lanes-wide stochastic loop hints its input a fixed distance ahead (without it, on AMD Zen 4, the stream's
    memory time adds to the loop's: docs/benchmarks.md), clamped to the last element it may read: its IR calls
    llvm.prefetch on an address bounded by reach - 1 (the select, optimised to a signed minimum)."""
    loop = njit(lambda bits, out, heads, reach: cnat._stochastic_lanes(bits, out, heads, np.uint32(0), np.uint32(100),
                                                                        np.uint32(100), reach))
    bits, heads = np.zeros(64, np.uint32), np.zeros(64, np.uint32)
    loop(bits, np.zeros(64, np.uint8), heads, np.int64(64))
    ir = next(iter(loop.inspect_llvm().values()))
    assert re.search(r"call void @llvm\.prefetch", ir)
    assert re.search(r"= tail call i64 @llvm\.smin\.i64\(i64 %[\w.]+, i64 %[\w.]+\)\n.*getelementptr i32, ptr %arg\.bits"
                     r"[\w.]*, i64 %[\w.]+\n.*call void @llvm\.prefetch", ir)


@pytest.mark.parametrize("n", [1000, 20_000])
def test_encode_into_a_used_scratch_matches_reference(n):
    """encode_into, the encode with its heads table passed in (the worker's engine allocates nothing), gives the
    oracle's codes whatever the scratch held, whether the call uses the table (n >= 4 BLOCK) or not."""
    x = bulk_f32(np.random.default_rng(n), n)
    heads = np.random.default_rng(1).integers(0, 2**32, cnat.BLOCK, dtype=np.uint32)
    codes = np.empty(n, np.uint8)
    key = np.uint64(cnat.stream_key(9, 10))
    saturated, nonfinite, _, _ = cnat.encode_into(x, codes, key, np.uint64(70_000), -40, True, heads)
    want, want_saturated = reference.encode(x, seed=9, stream=10, offset=70_000, floor=-40)
    np.testing.assert_array_equal(codes, want)
    assert (saturated, nonfinite) == (want_saturated, 0)


def test_encode_into_a_kept_table_matches_reference():
    """encode_into with a kept table (kept_heads: the worker's engine, a chunk at a time) gives the oracle's codes
    call after call: chunks of 1000 across the 2**16-element spans a mask serves, a chunk that straddles a BLOCK, a
    second key (the next allreduce), a nearest encode between, and a table refilled for an earlier span."""
    x = bulk_f32(np.random.default_rng(3), 140_000)
    heads = cnat.kept_heads()
    for seed, stream, starts in ((9, 10, range(0, 139_000, 1000)), (9, 11, (4090, 70_000, 500, 131_000))):
        key = np.uint64(cnat.stream_key(seed, stream))
        for lo in starts:
            part, codes = x[lo:lo + 1000], np.empty(1000, np.uint8)
            cnat.encode_into(part, codes, key, np.uint64(lo), -40, True, heads)
            np.testing.assert_array_equal(codes, reference.encode(part, seed=seed, stream=stream, offset=lo,
                                                                  floor=-40)[0], err_msg=f"chunk at {lo}")
            cnat.encode_into(part, codes, key, np.uint64(lo), -40, False, heads)
            np.testing.assert_array_equal(codes, reference.encode(part, seed=None, floor=-40)[0])


@SETTINGS
@given(x=f32_arrays(), floor=FLOORS)
@example(x=np.array([1.5, -1.5, 1.49, 1.5 - 2**-23, 768.0, 2.0**-51, 0.49 * 2.0**-50], np.float32), floor=-50)
def test_encode_nearest_matches_reference(x, floor):
    got = encode_nearest(x, floor=floor)
    codes, saturated = reference.encode(x, seed=None, floor=floor)
    np.testing.assert_array_equal(got.codes, codes)
    assert got.saturated == saturated == saturating(x, floor)


@pytest.mark.parametrize("floor", [-149, -140, -127, -126, -50, 0, 64, 65, 100, 127])
def test_decode_all_256_codes(floor):
    codes = np.arange(256, dtype=np.uint8)
    got = decode(codes, floor=floor)
    want = reference.decode(codes, floor)
    assert got.dtype == np.float32
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))  # NaNs too: both are the quiet NaN
    assert np.isnan(got).sum() == 256 - 1 - 2 * 64 - 2  # zero, the 64 k of each sign and +-Inf's codes are not NaN
    assert got[1] == np.inf and got[2] == -np.inf and got.view(np.uint32)[3] == 0x7FC00000  # the non-finite codes
    np.testing.assert_array_equal(np.isnan(got), ~np.array([reference.is_valid(c) or c in (1, 2) for c in range(256)]))
    valid = ~np.isnan(got)
    valid[1:3] = False  # the infinities' codes, checked above
    finite = np.abs(code_values(codes[valid], floor)) < 2.0**128
    np.testing.assert_array_equal(got[valid][finite].astype(np.float64), code_values(codes[valid], floor)[finite])
    assert np.all(np.isinf(got[valid][~finite]))  # 2**128 and up: +-Inf, as a float32 overflows
    assert cnat.decode_table(floor).view(np.uint32).tolist() == want.view(np.uint32).tolist()


def test_decode_range_ends():
    """The lowest floor decodes k = 0 to the smallest denormal; 2**127 is the largest finite code value."""
    assert decode(np.array([0x40, 0xC0, 0x40 | 23], np.uint8), floor=-149).tolist() == [TINY, -TINY, 2.0**-126]
    assert decode(np.array([0x7F, 0xFF], np.uint8), floor=64).tolist() == [2.0**127, -(2.0**127)]
    assert decode(np.array([0x7F, 0xFF, 0x40], np.uint8), floor=65).tolist() == [np.inf, -np.inf, 2.0**65]


@SETTINGS
@given(codes=st.lists(st.integers(0, 255), max_size=3000), shape2=st.booleans(), floor=FLOORS)
def test_decode_matches_reference(codes, shape2, floor):
    c = np.array(codes, dtype=np.uint8)
    if shape2 and c.size % 2 == 0:
        c = c.reshape(2, -1)
    got = decode(c, floor=floor)
    assert got.shape == c.shape
    same_floats(got.reshape(-1), reference.decode(c, floor))


@SETTINGS
@given(codes=st.lists(st.integers(0, 255), max_size=3000), acc_seed=st.integers(0, 2**32 - 1),
       dtype=st.sampled_from([np.float32, np.float64]), floor=st.integers(-149, 60))
def test_decode_accumulate_matches_reference(codes, acc_seed, dtype, floor):
    c = np.array(codes, dtype=np.uint8)
    acc = bulk_f32(np.random.default_rng(acc_seed), c.size).astype(dtype)
    acc[np.abs(acc) > 1e30] = 0  # keep clear of inf + (-inf)
    want = acc + reference.decode(c, floor).astype(dtype)  # the sum in the accumulator's dtype
    got = decode_accumulate(c, acc, floor=floor)
    assert got is acc
    same_floats(acc, want)


def test_decode_accumulate_exact_small_case():
    acc32 = np.array([1.0, 1.0, 0.5, -3.0], np.float32)
    acc64 = acc32.astype(np.float64) + 2.0**-40  # not representable in float32
    codes = np.array([0x72, 0xF2, 0x00, 0x40], np.uint8)  # +1, -1, 0, 2**-50 at F0
    decode_accumulate(codes, acc32, floor=F0)
    decode_accumulate(codes, acc64, floor=F0)
    assert acc32.tolist() == [2.0, 0.0, 0.5, np.float32(-3.0 + 2.0**-50)]
    assert acc64.tolist() == [2.0 + 2.0**-40, 2.0**-40, 0.5 + 2.0**-40, -3.0 + 2.0**-40 + 2.0**-50]


def test_find_invalid_and_validate_on_every_code():
    for c in range(256):
        a = np.array([0, 0x72, c, 0x40, c], np.uint8)
        expected = -1 if reference.is_valid(c) else 2
        assert find_invalid(a) == expected, hex(c)
        if expected < 0:
            validate(a)
        else:
            with pytest.raises(ValueError, match=f"0x{c:02x}") as excinfo:
                validate(a)
            assert bad_index(excinfo) == 2


@SETTINGS
@given(codes=st.lists(st.integers(0, 255), max_size=3000),
       valid=st.lists(st.sampled_from([0] + [code_of(s, e) for s in (0, 1) for e in range(-50, 14)]), max_size=3000))
def test_find_invalid_is_the_first_invalid_index(codes, valid):
    c = np.array(valid + codes, dtype=np.uint8)
    invalid = [i for i, v in enumerate(c.tolist()) if not reference.is_valid(v)]
    assert find_invalid(c) == (invalid[0] if invalid else -1)
    if invalid:
        with pytest.raises(ValueError) as excinfo:
            validate(c)
        assert bad_index(excinfo) == invalid[0]
    else:
        validate(c)


def test_find_invalid_2d_and_empty():
    assert find_invalid(np.zeros((0,), np.uint8)) == -1
    c = np.full((3, 4), 0x72, np.uint8)
    c[2, 1] = 0x80
    c[2, 3] = 0x3F
    assert find_invalid(c) == 9


# --- code layout and exactness ---------------------------------------------------------------------------------

# (value, code) at F0 written out by hand from the layout: bit7 sign, bit6 nonzero, bits5..0 = e - F0 = e + 50.
HAND_CODES = [
    (0.0, 0x00),
    (1.0, 0x72),  # e=0: 0x40 | 50 = 0x40 | 0x32
    (-1.0, 0xF2),
    (2.0, 0x73),
    (0.5, 0x71),
    (-0.125, 0xEF),  # e=-3: 0x80 | 0x40 | 47
    (2.0**10, 0x7C),  # e=10: k=60
    (-(2.0**10), 0xFC),
    (2.0**-50, 0x40),  # e=-50: k=0
    (-(2.0**-50), 0xC0),
    (2.0**-20, 0x5E),  # k=30
    (2.0**13, 0x7F),  # k=63, the window's top
    (-(2.0**13), 0xFF),
]
# (value, floor, code) at other floors: the code says k = e - floor whatever the floor
HAND_CODES_FLOORS = [
    (TINY, -149, 0x40),  # the smallest denormal, k = 0
    (-(2.0**-126), -149, 0xD7),  # k = 23
    (2.0**-140, -149, 0x49),  # a denormal power of two, k = 9
    (1.0, 0, 0x40),
    (4096.0, 0, 0x4C),  # 2**12, k = 12
    (2.0**127, 98, 0x5D),  # k = 29
    (2.0**127, 64, 0x7F),  # k = 63
]


@pytest.mark.parametrize("value, code", HAND_CODES)
def test_hand_computed_codes(value, code):
    x = np.array([value] * 5, np.float32)
    assert encode(x, seed=3, stream=4, floor=F0).codes.tolist() == [code] * 5
    assert encode_nearest(x, floor=F0).codes.tolist() == [code] * 5
    assert decode(np.array([code], np.uint8), floor=F0).tolist() == [value]


@pytest.mark.parametrize("value, floor, code", HAND_CODES_FLOORS)
def test_hand_computed_codes_at_other_floors(value, floor, code):
    x = np.array([value] * 5, np.float32)
    assert encode(x, seed=3, stream=4, floor=floor).codes.tolist() == [code] * 5
    assert encode_nearest(x, floor=floor).codes.tolist() == [code] * 5
    assert decode(np.array([code], np.uint8), floor=floor).tolist() == [value]


@pytest.mark.parametrize("code", [0x80, 0x04, 0x3F, 0xBD, 0xBF, 0x3C, 0x81])
def test_hand_invalid_codes(code):
    # 0x80 is "negative zero"; the others have the nonzero flag clear and another bit set
    assert np.isnan(decode(np.array([code], np.uint8), floor=F0)[0])
    assert find_invalid(np.array([0x72, code], np.uint8)) == 1


@pytest.mark.parametrize("floor", [-149, -130, F0, 0, 64])
def test_powers_of_two_round_trip_exactly(floor):
    exps = range(floor, floor + 64)
    powers = np.array([2.0**e for e in exps], np.float32)
    x = np.concatenate([powers, -powers])
    want = np.array([code_of(False, e, floor) for e in exps] + [code_of(True, e, floor) for e in exps], np.uint8)
    for seed, stream, offset in [(0, 0, 0), (1, 2, 2**32 - 5), (M64, M64, 12345)]:
        np.testing.assert_array_equal(encode(x, seed=seed, stream=stream, offset=offset, floor=floor).codes, want)
    enc = encode_nearest(x, floor=floor)
    np.testing.assert_array_equal(enc.codes, want)
    assert enc.saturated == 0
    np.testing.assert_array_equal(decode(want, floor=floor), x)


def test_nearest_rounding_hand_cases():
    x = np.array([1.49, 1.5, -1.5, np.float32(1.5) - np.float32(2**-23), 3.0, 0.75, 1.5 * 2.0**-50, 6144.0,
                  2.0**12.5], np.float32)
    got = encode_nearest(x, floor=F0)
    want = [code_of(False, 0), code_of(False, 1), code_of(True, 1), code_of(False, 0), code_of(False, 2),
            code_of(False, 0), code_of(False, -49), code_of(False, 13), code_of(False, 12)]
    assert got.codes.tolist() == want
    assert got.saturated == 0  # 6144 rounds to 2**13 exactly: the window's top, not saturated


# --- unbiasedness ----------------------------------------------------------------------------------------------


def bernoulli_pair(x: float, floor: int) -> tuple[float, float, float, bool]:
    """(lo, hi, p, underflow): C_nat at x is hi with probability p, else lo (magnitudes; signs follow x)."""
    ax = abs(x)
    if ax < 2.0**floor:
        return 0.0, 2.0**floor, ax / 2.0**floor, True
    a = math.frexp(ax)[1] - 1  # 2**a <= ax < 2**(a+1)
    return 2.0**a, 2.0 ** (a + 1), ax / 2.0**a - 1, False


UNBIASED_CASES = [
    # generic values
    (0.3, -50), (-0.7, -50), (1.1, -50), (3.0, -50), (4 / 3, -50), (-1000.0, -50), (1e-3, -50), (5.5e-12, -50),
    (1.25 * 2.0**-49, -50), (600.0, -50), (-2.0**9.5, -50),
    # below 2**-50 (underflow of plain C_nat)
    (2.0**-52, -50), (-3 * 2.0**-53, -50), (0.999 * 2.0**-50, -50), (1e-20, -50),
    # below a raised floor
    (2.0**-21, -20), (-0.3 * 2.0**-20, -20), (7e-7, -20), (0.3, 0), (-0.01, 3), (100.0, 10),
    # above a raised floor
    (0.3, -20), (-5.0, 0),
    # denormals: P(up) is exact only to 2**-32, so the mean is x to within 2**(floor - 32)
    (1e-40, -50), (-TINY, -50), (1e-39, -20),
    # denormals at or above the lowest floors: rounded between powers of two like any value
    (1e-40, -149), (-3 * TINY, -149), (2.0**-126 - TINY, -149), (1e-39, -130), (1e-40, -127),
    # the magnitudes the old absolute window clipped at 2**10 or flushed below 2**-50, at the floors an
    # allreduce gives them (cnat_floor(E, s(2)) = E - 29): 5000, 1e6, AMP's x65536 scaled values, 1e-20, 3e38
    (5000.0, 13 - 29), (-1e6, 20 - 29), (65536 * 0.37, 15 - 29), (-65536 * 3e-5, 1 - 29), (1e-20, -66 - 29),
    (123.456, 7 - 29), (3e38, 128 - 29), (-1.7e38, 128 - 29),
    # and at the top of a window: 2**(floor + 62) < |x| < 2**(floor + 63)
    (1.3 * 2.0**62, 0),
]


@pytest.mark.slow
@pytest.mark.parametrize("x, floor", UNBIASED_CASES)
def test_encode_is_unbiased(x, floor):
    """Mean of N = 2**20 encodings of one x (one stream, many indices) is x within 5 standard errors.

    C_nat at x is a two-point variable: hi with probability p, lo otherwise, so Var = (hi - lo)**2 p (1 - p).
    For 2**a <= |x| < 2**(a+1), x = 2**a (1 + t): lo = 2**a, hi = 2**(a+1), p = t, Var = 4**a t (1 - t).
    For |x| < 2**floor: lo = 0, hi = 2**floor, p = |x| / 2**floor, Var = 4**floor p (1 - p).
    The standard error of the mean is sqrt(Var / N). Below the floor the kernel's probability is exact only to
    within 2**-32 (cnat docstring), so there the mean is allowed an extra 2**(floor - 32)."""
    x = _f32(x)
    n = 1 << 20
    got = encode(np.full(n, x, np.float32), seed=77, stream=floor + 1000, offset=2**32 - n // 3, floor=floor)
    assert got.saturated == 0
    values = code_values(got.codes, floor)  # in float64: 2**128 (3e38 rounded up) is beyond float32
    lo, hi, p, underflow = bernoulli_pair(x, floor)
    assert set(np.abs(values).tolist()) <= {lo, hi}
    assert np.all((values == 0) | (np.sign(values) == np.sign(x)))
    se = math.sqrt((hi - lo) ** 2 * p * (1 - p) / n)
    tol = 5 * se + (2.0 ** (floor - 32) if underflow else 0.0)
    assert abs(values.mean() - x) <= tol, (values.mean(), x, tol)


@pytest.mark.parametrize("x", [0.3, -2.5, 3 * 2.0**-52, 1e-40])
def test_encode_is_unbiased_across_streams(x):
    """Mean over 1024 streams x 1024 indices (the same element index in different ranks' streams); same bound."""
    x = _f32(x)
    v = np.full(1024, x, np.float32)
    codes = np.concatenate([encode(v, seed=5, stream=s, offset=2**32 - 512, floor=F0).codes for s in range(1024)])
    values = decode(codes, floor=F0).astype(np.float64)
    lo, hi, p, underflow = bernoulli_pair(x, F0)
    se = math.sqrt((hi - lo) ** 2 * p * (1 - p) / values.size)
    assert abs(values.mean() - x) <= 5 * se + (2.0**-82 if underflow else 0.0)


def test_underflow_probability_resolution_matches_docstring():
    """For a denormal, |x| * 2**(32 - floor) < 1, so it rounds up only where the word r == 0: P = 2**-32 exactly,
    and |2**floor * 2**-32 - x| <= 2**(floor - 32) as documented. Check the codes follow r == 0 exactly."""
    from intml.protocol.rng import random_bits

    n = 1 << 16
    x = np.full(n, 1e-40, np.float32)
    r = random_bits(1, 2, 0, n)
    codes = encode(x, seed=1, stream=2, floor=-50).codes
    np.testing.assert_array_equal(codes, np.where(r == 0, 0x40, 0).astype(np.uint8))


# --- variance --------------------------------------------------------------------------------------------------


def second_moment_ratio(t):
    """E[C(x)**2] / x**2 for x = 2**a (1 + t): (4**a (1 - t) + 4**(a+1) t) / (4**a (1 + t)**2) = (1+3t)/(1+t)**2."""
    return (1 + 3 * t) / (1 + t) ** 2


def test_second_moment_formula_bounded_by_9_8():
    t = np.linspace(0, 1, 100001)
    r = second_moment_ratio(t)
    assert r.max() <= 9 / 8 + 1e-15
    assert abs(r.max() - 9 / 8) < 1e-9 and abs(t[r.argmax()] - 1 / 3) < 1e-4
    assert second_moment_ratio(1 / 3) == pytest.approx(9 / 8, rel=1e-15)
    assert second_moment_ratio(0.0) == 1.0 and second_moment_ratio(1.0) == 1.0


@pytest.mark.parametrize("a", [-49, -3, 0, 7])
def test_worst_case_second_moment(a):
    """x = 4/3 * 2**a (t = 1/3 up to float32 rounding). C**2/x**2 is 9/16 * 4**(C==hi) ... a two-point variable
    with values 1/(1+t)**2 and 4/(1+t)**2, so its standard deviation is 3/(1+t)**2 sqrt(t(1-t)) ~ 0.80; the mean
    over N = 2**20 encodings must be the exact ratio within 5 standard errors, hence also <= 9/8 + 5 se."""
    x = _f32(4 / 3 * 2.0**a)
    n = 1 << 20
    c = decode(encode(np.full(n, x, np.float32), seed=a + 100, stream=9, floor=F0).codes, floor=F0).astype(np.float64)
    t = x / 2.0**a - 1
    measured = float((c * c).mean() / (x * x))
    se = 3 / (1 + t) ** 2 * math.sqrt(t * (1 - t)) / math.sqrt(n)
    assert abs(measured - second_moment_ratio(t)) <= 5 * se, (measured, second_moment_ratio(t), se)
    assert measured <= 9 / 8 + 5 * se


def test_gaussian_vector_second_moment():
    """sum C(x_i)**2 / sum x_i**2 over a 2**20-element Gaussian vector equals its exact expectation
    sum x_i**2 (1+3t_i)/(1+t_i)**2 / sum x_i**2 within 5 standard deviations of the estimator. C(x_i)**2 takes the
    values 4**a_i and 4**(a_i+1) with probability 1-t_i, t_i, so Var(C(x_i)**2) = 9 * 16**a_i t_i (1 - t_i) and the
    estimator's sd is sqrt(sum 9 * 16**a_i t_i (1 - t_i)) / sum x_i**2 (about 0.05% here)."""
    g = np.random.default_rng(2024)
    x = (g.standard_normal(1 << 20) * 0.01).astype(np.float32)
    c = decode(encode(x, seed=8, stream=8, floor=F0).codes, floor=F0).astype(np.float64)
    xd = x.astype(np.float64)
    assert np.abs(xd).min() > 2.0**-50 and np.abs(xd).max() < 2.0**13  # no underflow or saturation here
    a = np.frexp(np.abs(xd))[1] - 1
    lo = np.ldexp(1.0, a)
    t = np.abs(xd) / lo - 1
    sx2 = (xd * xd).sum()
    expected = (xd * xd * second_moment_ratio(t)).sum() / sx2
    sd = math.sqrt((9 * lo**4 * t * (1 - t)).sum()) / sx2
    measured = (c * c).sum() / sx2
    assert abs(measured - expected) <= 5 * sd, (measured, expected, sd)
    assert expected <= 9 / 8 and measured <= 9 / 8 + 5 * sd
    assert measured > 1.0  # the variance is not zero: it really is stochastic


# --- saturation, underflow, zeros, non-finite ------------------------------------------------------------------


def test_saturation_is_counted_only_above_the_window():
    """At F0 the 6-bit window tops out at 2**13: only |x| > 2**13 is clamped, and counted."""
    above = [float(np.nextafter(np.float32(8192), np.float32(np.inf))), 10000.0, -3e38, F32_MAX, -8193.0]
    not_above = [8192.0, -8192.0, 8191.9, 2.0**12.5, 6144.0, -8000.0, 0.0]
    x = np.array(above + not_above, np.float32)
    for seed in range(20):
        got = encode(x, seed=seed, stream=1, floor=F0)
        assert got.saturated == len(above)
        assert got.codes[: len(above)].tolist() == [0x7F, 0x7F, 0xFF, 0x7F, 0xFF]
        assert got.codes[len(above) : len(above) + 2].tolist() == [0x7F, 0xFF]
    got = encode_nearest(x, floor=F0)
    assert got.saturated == len(above)
    assert got.codes[: len(above) + 2].tolist() == [0x7F, 0x7F, 0xFF, 0x7F, 0xFF, 0x7F, 0xFF]


def test_nothing_saturates_from_floor_65():
    """From floor 65 up the window reaches 2**128, beyond every float32: the largest values round to 2**127 or
    2**128 (k = 128 - floor), unbiased, and nothing is counted."""
    x = np.full(4096, 1.5 * 2.0**127, np.float32)
    for floor in (65, 98, 127):
        got = encode(x, seed=1, stream=1, floor=floor)
        assert got.saturated == 0 and encode(x * 0 + F32_MAX, seed=1, stream=1, floor=floor).saturated == 0
        assert set(got.codes.tolist()) == {0x40 | (127 - floor), 0x40 | (128 - floor)}


def test_top_of_window_may_round_up_without_counting():
    x = np.full(4096, 2.0**12.5, np.float32)
    got = encode(x, seed=1, stream=1, floor=F0)
    assert got.saturated == 0
    assert set(got.codes.tolist()) == {code_of(False, 12), code_of(False, 13)}  # both occur: p(up) ~ 0.41
    big = np.full(5000, 3e38, np.float32)  # a whole block of saturated values, counted across blocks
    assert encode(big, seed=1, stream=1, offset=100, floor=F0).saturated == 5000


@SETTINGS
@given(floor=FLOORS, seed=SEEDS, data=st.data())
def test_underflow_gives_zero_or_the_floor(floor, seed, data):
    fractions = data.draw(st.lists(st.floats(0, 1, exclude_max=True), min_size=1, max_size=200))
    mags = np.array([f * 2.0**floor for f in fractions] + [TINY, 1e-40, 2.0**-126], np.float32)
    mags = mags[np.abs(mags) < 2.0**floor]
    x = np.concatenate([mags, -mags])
    got = encode(x, seed=seed, stream=0, floor=floor)
    allowed_pos, allowed_neg = {0, code_of(False, floor, floor)}, {0, code_of(True, floor, floor)}
    assert set(got.codes[: mags.size].tolist()) <= allowed_pos
    assert set(got.codes[mags.size :].tolist()) <= allowed_neg
    assert got.saturated == 0
    near = encode_nearest(x, floor=floor).codes
    want = np.where(np.abs(x.astype(np.float64)) >= 2.0 ** (floor - 1), np.where(x < 0, 0xC0, 0x40), 0)
    np.testing.assert_array_equal(near, want.astype(np.uint8))


@pytest.mark.parametrize("floor", [-149, -50, -20, 0, 10, 127])
def test_zeros_encode_to_0x00(floor):
    x = np.array([0.0, -0.0] * 3000, np.float32)
    for seed in (0, 1, M64):
        got = encode(x, seed=seed, stream=seed, offset=2**32 - 100, floor=floor)
        assert not got.codes.any() and got.saturated == 0
    assert not encode_nearest(x, floor=floor).codes.any()


def test_denormals_are_encoded():
    x = np.array([TINY, -TINY, 1e-40, -1e-39, 2.0**-126 - TINY], np.float32)
    assert np.all(np.abs(x) < 2.0**-126) and np.all(x != 0)
    # deterministic: all below 2**-51, so 0 under floor -50
    assert encode_nearest(x, floor=F0).codes.tolist() == [0] * 5
    got = encode(np.tile(x, 1000), seed=1, stream=1, floor=F0)
    assert set(got.codes.tolist()) <= {0, 0x40, 0xC0}
    # at the lowest floor every denormal is a multiple of the unit: a power of two encodes exactly, k = e + 149
    assert encode_nearest(x[:2], floor=-149).codes.tolist() == [0x40, 0xC0]
    near = encode_nearest(x, floor=-149).codes
    assert near.tolist() == reference.encode(x, seed=None, floor=-149)[0].tolist() and np.all(near & 0x40)


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf, -np.nan, "snan"])
@pytest.mark.parametrize("n, at", [(1, 0), (10, 7), (10000, 4095), (10000, 4096), (10000, 9999)])
@pytest.mark.parametrize("stochastic", [True, False])
def test_non_finite_values_get_their_codes(bad, n, at, stochastic):
    """A NaN (quiet, negative or signalling) encodes to 0x03, +Inf to 0x01, -Inf to 0x02, which decode to the one
    NaN, +Inf and -Inf; every other code is the reference's, and the count of saturated values is unchanged."""
    x = np.linspace(-2000, 2000, n).astype(np.float32)  # includes saturating values, before and after
    x[: min(n, 3)] = 1e-30  # and underflowing ones
    xb = x.view(np.uint32)
    if bad == "snan":
        xb[at] = 0x7F800001
    else:
        x[at] = bad
    if at + 5 < n:
        x[at + 5] = np.nan
    got = encode(x, seed=1, stream=2, offset=123, floor=F0) if stochastic else encode_nearest(x, floor=F0)
    want, saturated = reference.encode(x, seed=1 if stochastic else None, stream=2, offset=123, floor=F0)
    np.testing.assert_array_equal(got.codes, want)
    assert got.saturated == saturated
    assert got.codes[at] == (2 if bad == -np.inf else 1 if bad == np.inf else 3)
    values = decode(got.codes, floor=F0)
    assert values.view(np.uint32)[at] == {1: 0x7F800000, 2: 0xFF800000, 3: 0x7FC00000}[int(got.codes[at])]
    assert np.isfinite(np.delete(values, [i for i in (at, at + 5) if i < n])).all()


# --- chunking, threads ------------------------------------------------------------------------------------------


@FEW
@given(seed=SEEDS, stream=SEEDS, offset=OFFSETS, floor=FLOORS, data=st.data())
@example(seed=1, stream=2, offset=2**32 - 3, floor=-50, data=None)
def test_chunking_invariance(seed, stream, offset, floor, data):
    n = 12000 if data is None else data.draw(st.integers(0, 12000))
    x = bulk_f32(np.random.default_rng(seed % 2**32), n)
    whole = encode(x, seed=seed, stream=stream, offset=offset, floor=floor)
    if data is None:
        cuts = [3, 4093, 4099, 5000, 11999]
    else:
        cuts = sorted(set(data.draw(st.lists(st.integers(0, n), max_size=12))))
    bounds = list(zip([0, *cuts], [*cuts, n]))
    order = np.random.default_rng(seed % 7).permutation(len(bounds))
    out = np.full(n, 0xAA, np.uint8)
    saturated = 0
    for i in order:
        a, b = bounds[i]
        sl = out[a:b]
        got = encode(x[a:b], seed=seed, stream=stream, offset=offset + a, floor=floor, out=sl)
        assert got.codes is sl
        saturated += got.saturated
    np.testing.assert_array_equal(out, whole.codes)
    assert saturated == whole.saturated
    # separate calls without out= too
    pieces = {i: encode(x[a:b], seed=seed, stream=stream, offset=offset + a, floor=floor).codes
              for i, (a, b) in enumerate(bounds)}
    np.testing.assert_array_equal(np.concatenate([pieces[i] for i in range(len(bounds))] or [out[:0]]), whole.codes)
    # nearest is offset-free: chunks equal the whole
    near = encode_nearest(x, floor=floor).codes
    np.testing.assert_array_equal(np.concatenate([encode_nearest(x[a:b], floor=floor).codes for a, b in bounds]),
                                  near)


@pytest.mark.slow
def test_two_threads_concurrently():
    """Two threads (the kernels release the GIL) each encode half of a 4M vector in uneven chunks into slices of
    one out buffer, starting together; the result equals one call."""
    n = 1 << 22
    x = bulk_f32(np.random.default_rng(5), n)
    seed, stream, offset = 123, 456, 2**32 - n // 2
    whole = encode(x, seed=seed, stream=stream, offset=offset, floor=F0)
    out = np.zeros(n, np.uint8)
    saturated = run_halves_concurrently(
        n, lambda a, b: encode(x[a:b], seed=seed, stream=stream, offset=offset + a, floor=F0, out=out[a:b]).saturated)
    assert saturated == whole.saturated > 0
    np.testing.assert_array_equal(out, whole.codes)



# --- out= buffers and argument checks ------------------------------------------------------------------------------


def test_encode_out_is_used_in_place():
    x = bulk_f32(np.random.default_rng(1), 1000)
    want = encode(x, seed=1, stream=2, floor=F0).codes
    out = np.zeros(1000, np.uint8)
    got = encode(x, seed=1, stream=2, floor=F0, out=out)
    assert got.codes is out and np.shares_memory(got.codes, out)
    np.testing.assert_array_equal(out, want)
    out2 = np.zeros(1000, np.uint8)
    assert encode_nearest(x, floor=F0, out=out2).codes is out2
    np.testing.assert_array_equal(out2, encode_nearest(x, floor=F0).codes)


@pytest.mark.parametrize("dtype", [np.int8, np.float32, np.uint16])
def test_encode_out_wrong_dtype(dtype):
    x = np.ones(10, np.float32)
    with pytest.raises(TypeError, match="out.*uint8"):
        encode(x, seed=1, stream=1, floor=F0, out=np.zeros(10, dtype))
    with pytest.raises(TypeError, match="out.*uint8"):
        encode_nearest(x, floor=F0, out=np.zeros(10, dtype))


@pytest.mark.parametrize("size", [0, 9, 11])
def test_encode_out_wrong_size(size):
    x = np.ones(10, np.float32)
    with pytest.raises(ValueError, match=f"out has {size} elements, needs 10"):
        encode(x, seed=1, stream=1, floor=F0, out=np.zeros(size, np.uint8))


def test_encode_argument_checks():
    x = np.ones(10, np.float32)
    with pytest.raises(ValueError, match="contiguous"):
        encode(x, seed=1, stream=1, floor=F0, out=np.zeros(20, np.uint8)[::2])
    with pytest.raises(ValueError, match="contiguous"):
        encode(np.ones(20, np.float32)[::2], seed=1, stream=1, floor=F0)
    with pytest.raises(TypeError, match="float32"):
        encode(np.ones(10, np.float64), seed=1, stream=1, floor=F0)
    with pytest.raises(TypeError, match="float32"):
        encode_nearest([1.0, 2.0], floor=F0)
    for floor in (-150, 128):
        with pytest.raises(ValueError, match="floor"):
            encode(x, seed=1, stream=1, floor=floor)
        with pytest.raises(ValueError, match="floor"):
            decode(np.zeros(3, np.uint8), floor=floor)
    with pytest.raises(ValueError, match="offset"):
        encode(x, seed=1, stream=1, offset=-1, floor=F0)
    with pytest.raises(ValueError, match="seed"):
        encode(x, seed=-1, stream=1, floor=F0)


def test_encode_keeps_shape():
    x = bulk_f32(np.random.default_rng(2), 24).reshape(2, 3, 4)
    got = encode(x, seed=1, stream=1, floor=F0)
    assert got.codes.shape == (2, 3, 4)
    np.testing.assert_array_equal(got.codes.reshape(-1), encode(x.reshape(-1), seed=1, stream=1, floor=F0).codes)


def test_decode_out_is_used_in_place_and_checked():
    codes = np.arange(256, dtype=np.uint8)
    out = np.zeros(256, np.float32)
    got = decode(codes, floor=F0, out=out)
    assert got is out
    same_floats(out, reference.decode(codes, F0))
    with pytest.raises(TypeError, match="out.*float32"):
        decode(codes, floor=F0, out=np.zeros(256, np.float64))
    with pytest.raises(ValueError, match="out has 255 elements, needs 256"):
        decode(codes, floor=F0, out=np.zeros(255, np.float32))
    with pytest.raises(TypeError, match="codes.*uint8"):
        decode(codes.astype(np.int16), floor=F0)


def test_decode_accumulate_checks():
    codes = np.array([0x72, 0x40], np.uint8)
    with pytest.raises(TypeError, match="float32 or float64"):
        decode_accumulate(codes, np.zeros(2, np.int32), floor=F0)
    with pytest.raises(TypeError, match="float32 or float64"):
        decode_accumulate(codes, [0.0, 0.0], floor=F0)
    with pytest.raises(ValueError, match="acc has 3 elements, needs 2"):
        decode_accumulate(codes, np.zeros(3, np.float32), floor=F0)
    with pytest.raises(TypeError, match="codes.*uint8"):
        decode_accumulate(codes.astype(np.int32), np.zeros(2, np.float32), floor=F0)
    acc = np.zeros((1, 2), np.float64)
    assert decode_accumulate(codes, acc, floor=F0) is acc and acc.tolist() == [[1.0, 2.0**-50]]
