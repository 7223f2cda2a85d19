"""Tests of protocol.half: the 16-bit kernels against the plain-numpy reference (protocol.reference) bit for bit,
over all 65,536 bit patterns where a 16-bit value goes in, and the stochastic encode's mean."""

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from intml.protocol import cnat, half, reference

FORMATS = [half.BFLOAT16, half.FLOAT16]
ALL16 = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def same_bits(a: np.ndarray, b: np.ndarray) -> None:
    np.testing.assert_array_equal(a.view(np.uint32 if a.dtype.itemsize == 4 else np.uint16),
                                  b.view(np.uint32 if b.dtype.itemsize == 4 else np.uint16))


@pytest.mark.parametrize("fmt", FORMATS)
def test_widening_is_exact_for_every_pattern(fmt):
    same_bits(half.to_float32(ALL16, fmt), reference.half_to_float32(ALL16, fmt))


@pytest.mark.parametrize("fmt", FORMATS)
def test_narrowing_a_widened_value_gives_it_back(fmt):
    """Every non-NaN pattern round-trips; every NaN comes back as the format's quiet NaN with its sign."""
    back = half.from_float32(half.to_float32(ALL16, fmt), fmt)
    nan = np.isnan(reference.half_to_float32(ALL16, fmt))
    np.testing.assert_array_equal(back[~nan], ALL16[~nan])
    np.testing.assert_array_equal(back[nan], (ALL16[nan] & 0x8000) | reference.HALF_NAN[fmt])


def neighbours(fmt: int) -> np.ndarray:
    """float32 values at and around every 16-bit value: each value, the midpoints to its neighbours (the ties),
    and one float32 ulp either side of those."""
    wide = reference.half_to_float32(ALL16, fmt)
    wide = np.sort(wide[np.isfinite(wide)].astype(np.float64))
    mids = ((wide[1:] + wide[:-1]) / 2).astype(np.float32)  # exact in float32: one bit more than 16-bit holds
    points = np.concatenate([wide.astype(np.float32), mids])
    return np.concatenate([points, np.nextafter(points, np.float32(np.inf)),
                           np.nextafter(points, np.float32(-np.inf)),
                           np.float32([np.inf, -np.inf, np.nan, 3.4e38, -3.4e38, 65520, 65519.998, 1e-45])])


@pytest.mark.parametrize("fmt", FORMATS)
def test_narrowing_rounds_to_nearest_even_at_every_tie(fmt):
    x = neighbours(fmt)
    same_bits(half.from_float32(x, fmt), reference.float32_to_half(x, fmt))


def test_float16_narrowing_is_numpys():
    """numpy's float32 -> float16 cast is IEEE round to nearest even: a second oracle for float16."""
    x = neighbours(half.FLOAT16)
    x = x[~np.isnan(x)]
    with np.errstate(over="ignore"):  # numpy warns where it rounds to Inf, as it must
        same_bits(half.from_float32(x, half.FLOAT16), x.astype(np.float16))


@SETTINGS
@given(bits=st.lists(st.integers(0, 2**32 - 1), min_size=1, max_size=64), fmt=st.sampled_from(FORMATS))
def test_narrowing_of_any_float32(bits, fmt):
    x = np.array(bits, np.uint32).view(np.float32)
    same_bits(half.from_float32(x, fmt), reference.float32_to_half(x, fmt))


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("floor", [-149, -140, -133, -40, -24, -10, 0, 5, 99, 127])
def test_nearest_encode_of_every_pattern_is_the_float32_encode(fmt, floor):
    codes, saturated = half.encode(ALL16, fmt, floor=floor, seed=None)
    want, want_saturated = reference.encode(reference.half_to_float32(ALL16, fmt), seed=None, floor=floor)
    np.testing.assert_array_equal(codes, want)
    assert saturated == want_saturated


@pytest.mark.parametrize("fmt", FORMATS)
def test_stochastic_encode_of_every_pattern_is_the_float32_encode(fmt):
    """Same words, same codes: the 16-bit encode draws the float32 encode's word for each element index."""
    codes, _ = half.encode(ALL16, fmt, floor=-30, seed=7, stream=5, offset=2**32 - 1000)
    want, _ = reference.encode(reference.half_to_float32(ALL16, fmt), seed=7, floor=-30, stream=5,
                               offset=2**32 - 1000)
    np.testing.assert_array_equal(codes, want)


@pytest.mark.parametrize("fmt", FORMATS)
def test_stochastic_encode_is_unbiased(fmt):
    """2**18 copies of 1.25 * 2**-3 (exact in both formats) round to 2**-3 or 2**-2, up with probability 1/4:
    the mean is within 5 standard deviations (sd = 2**-3 * sqrt(3/16) / 2**9) of the value."""
    x = half.from_float32(np.full(1 << 18, 0.15625, np.float32), fmt)
    codes, _ = half.encode(x, fmt, floor=-20, seed=3)
    mean = cnat.decode(codes, floor=-20).astype(np.float64).mean()
    assert abs(mean - 0.15625) < 5 * 0.125 * np.sqrt(3 / 16) / 2**9


@pytest.mark.parametrize("fmt", FORMATS)
def test_nonfinite_16bit_values_get_their_flags(fmt):
    inf, nan = (0x7F80, 0x7FC1) if fmt == half.BFLOAT16 else (0x7C00, 0x7D01)
    codes, _ = half.encode(np.array([inf, inf | 0x8000, nan, nan | 0x8000, 0], np.uint16), fmt, floor=0,
                           seed=1)
    np.testing.assert_array_equal(codes, [1, 2, 3, 3, 0])


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("floor", [-149, -134, -60, -26, 0, 96, 127])
def test_decode_of_every_code_rounds_the_float32_value(fmt, floor):
    codes = np.arange(256, dtype=np.uint8)
    want = reference.float32_to_half(reference.decode(codes, floor), fmt)
    np.testing.assert_array_equal(half.decode(codes, fmt, floor=floor), want)


def test_decode_of_a_sum_at_the_formats_edges():
    """A summed code is a power of two: bfloat16 holds 2**-133 .. 2**127 exactly (below, 2**-134 is a tie that
    goes to 0); float16 holds 2**-24 .. 2**15, and 2**16 is +Inf. Non-finite codes give +-Inf and the NaN."""
    codes = np.array([0x40, 0x41, 0xC2, 0x01, 0x02, 0x03], np.uint8)
    np.testing.assert_array_equal(half.decode(codes, half.BFLOAT16, floor=-134), [0x0000, 0x0001, 0x8002, 0x7F80,
                                                                                   0xFF80, 0x7FC0])
    np.testing.assert_array_equal(half.decode(codes, half.FLOAT16, floor=15), [0x7800, 0x7C00, 0xFC00, 0x7C00,
                                                                                0xFC00, 0x7E00])
    np.testing.assert_array_equal(half.decode(codes[:2], half.FLOAT16, floor=-25), [0x0000, 0x0001])


def test_arrays_of_any_16bit_dtype_and_errors():
    x = np.float16([1.5, -2.0])
    np.testing.assert_array_equal(half.to_float32(x, half.FLOAT16), [1.5, -2.0])
    np.testing.assert_array_equal(half.to_float32(x.view(np.int16), half.FLOAT16), [1.5, -2.0])
    with pytest.raises(TypeError, match="16-bit"):
        half.to_float32(np.float32([1.0]), half.FLOAT16)
    with pytest.raises(ValueError, match="BFLOAT16 or FLOAT16"):
        half.to_float32(x, half.FLOAT32)
    with pytest.raises(ValueError, match="dtype must be one of"):
        half.format_of("float8")
    assert half.format_of("bfloat16") == half.BFLOAT16
