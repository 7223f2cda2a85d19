"""bfloat16 and float16 tensors in C_nat and int32 allreduces, bit for bit (docs/arithmetic.md, "16-bit inputs").

A 16-bit value travels as its bits (uint16; numpy has no bfloat16) and a format id. Both formats widen to float32
exactly (bfloat16 is float32's upper half; every float16 is a float32), so a 16-bit element encodes to the code
the float32 encode gives its widened value, with the same stochastic or nearest rounding and the same non-finite
flags, and a summed code decodes to its float32 value rounded to the format: to nearest, ties to even, +-Inf
beyond the format's range, its subnormals below it, and any NaN to the format's quiet NaN (sign kept).

The kernels widen one block of elements at a time into a scratch array of float32 (``SCRATCH`` elements, or a
caller's) and run the float32 kernels on it: memory traffic is the 16-bit tensor's, and no float32 copy of a
whole tensor is ever made (worker.engine does the same per packet).
"""

from __future__ import annotations

import numpy as np
from numba import njit

from intml.protocol.cnat import Encoded, _flat, _out, check_floor, decode_kernel, encode_kernel
from intml.protocol.lanes import clz32
from intml.protocol.rng import stream_key

FLOAT32 = 0  # not a 16-bit format: the float32 path, for callers that take either
BFLOAT16 = 1
FLOAT16 = 2
FORMATS = {"float32": FLOAT32, "bfloat16": BFLOAT16, "float16": FLOAT16}
BF16_NAN = 0x7FC0  # the quiet NaNs any NaN narrows to (its sign kept)
F16_NAN = 0x7E00
SCRATCH = 4096  # elements widened at a time by encode and decode here

_U32 = np.uint32
_U64 = np.uint64
_F16_REBIAS = (127 - 15) << 23  # float32's exponent bias minus float16's, in float32's exponent field
_F16_INF_FROM = 0x477FF000  # float32 bits of 65520 = 65504 + half an ulp: from here float16 rounds to Inf
_F16_NORMAL_FROM = 0x38800000  # float32 bits of 2**-14, float16's smallest normal


def format_of(name: str) -> int:
    """The format id of a dtype name ("float32", "bfloat16" or "float16")."""
    if name not in FORMATS:
        raise ValueError(f"dtype must be one of {', '.join(FORMATS)}, got {name!r}")
    return FORMATS[name]


@njit(inline="always")
def widen_bits(h, fmt):
    """float32 bits of 16-bit value bits h: exact, NaN payloads kept."""
    w = _U32(h) & _U32(0xFFFF)
    if fmt == BFLOAT16:
        return _U32(w << _U32(16))
    sign = _U32(_U32(w & _U32(0x8000)) << _U32(16))
    e = _U32(_U32(w >> _U32(10)) & _U32(0x1F))
    m = _U32(w & _U32(0x3FF))
    if e == _U32(0x1F):  # Inf, NaN
        return _U32(sign | _U32(0x7F800000) | _U32(m << _U32(13)))
    if e != _U32(0):
        return _U32(sign | _U32(_U32(_U32(w & _U32(0x7FFF)) << _U32(13)) + _U32(_F16_REBIAS)))
    if m == _U32(0):
        return sign
    width = _U32(_U32(32) - clz32(m))  # a subnormal m * 2**-24: normal in float32, leading one at width - 1
    mant = _U32(_U32(m << _U32(_U32(24) - width)) & _U32(0x7FFFFF))
    return _U32(sign | _U32(_U32(width + _U32(102)) << _U32(23)) | mant)


@njit(inline="always")
def word_bits(w, fmt):
    """float32 bits of an input word: a float32's own bits (fmt FLOAT32), or a 16-bit value's widened. For kernels
    that take either (worker.gpu)."""
    return _U32(w) if fmt == FLOAT32 else widen_bits(w, fmt)


@njit(inline="always")
def _round_shift(v, shift):
    """v >> shift rounded to nearest, ties to even (shift in [1, 31])."""
    q = _U32(v >> _U32(shift))
    rest = _U32(v & _U32(_U32(_U32(1) << _U32(shift)) - _U32(1)))
    half = _U32(_U32(1) << _U32(shift - 1))
    return _U32(q + _U32(rest > half or (rest == half and (q & _U32(1)) != _U32(0))))


@njit(inline="always")
def narrow_bits(b, fmt):
    """16-bit bits of float32 bits b rounded to nearest, ties to even: +-Inf beyond the format's largest finite
    value plus half an ulp, the format's subnormals (then zero) below its smallest normal, a NaN as the format's
    quiet NaN with b's sign."""
    ab = _U32(b & _U32(0x7FFFFFFF))
    sign = _U32(_U32(b >> _U32(16)) & _U32(0x8000))
    if ab > _U32(0x7F800000):
        return np.uint16(sign | _U32(BF16_NAN if fmt == BFLOAT16 else F16_NAN))
    if fmt == BFLOAT16:  # a carry out of the mantissa raises the exponent, up to Inf: still the nearest
        return np.uint16(sign | _round_shift(ab, 16))
    if ab >= _U32(_F16_INF_FROM):
        return np.uint16(sign | _U32(0x7C00))
    if ab >= _U32(_F16_NORMAL_FROM):
        return np.uint16(sign | _round_shift(_U32(ab - _U32(_F16_REBIAS)), 13))
    e = _U32(ab >> _U32(23))  # below 2**-14: units of float16's subnormal 2**-24
    shift = _U32(126) - e  # >= 14; |x| = mant * 2**(e - 150) = (mant >> shift) units
    if e == _U32(0) or shift > _U32(25):
        return np.uint16(sign)  # below 2**-25 (half the smallest subnormal, a tie that goes to even 0)
    mant = _U32(_U32(ab & _U32(0x7FFFFF)) | _U32(0x800000))
    return np.uint16(sign | _round_shift(mant, shift))


@njit(cache=True, nogil=True, boundscheck=False)
def widen_kernel(h, out, fmt):
    """out (uint32 view of float32) = the float32 bits of each 16-bit value of h (uint16)."""
    if fmt == BFLOAT16:  # a loop per format, so that bfloat16's shift vectorises
        for j in range(h.size):
            out[j] = widen_bits(h[j], BFLOAT16)
    else:
        for j in range(h.size):
            out[j] = widen_bits(h[j], FLOAT16)


@njit(cache=True, nogil=True, boundscheck=False)
def narrow_kernel(bits, out, fmt):
    """out (uint16) = each float32 (given as its uint32 bits) rounded to the format."""
    for j in range(bits.size):
        out[j] = narrow_bits(bits[j], fmt)


@njit(cache=True, nogil=True, boundscheck=False)
def encode16_kernel(h, out, key, offset, floor, stochastic, fmt, scratch):
    """encode_kernel of the widened 16-bit values h, a scratch-sized block at a time; returns its saturated and
    non-finite counts summed."""
    saturated = 0
    nonfinite = 0
    step = scratch.size
    for start in range(0, h.size, step):
        end = min(h.size, start + step)
        block = scratch[:end - start]
        widen_kernel(h[start:end], block.view(np.uint32), fmt)
        sat, bad, _, _ = encode_kernel(block, out[start:end], key, _U64(offset + start), floor, stochastic)
        saturated += sat
        nonfinite += bad
    return saturated, nonfinite


@njit(cache=True, nogil=True, boundscheck=False)
def decode16_kernel(codes, out, floor, fmt, scratch):
    """out (uint16) = the values of codes at floor rounded to the format, a scratch-sized block at a time."""
    step = scratch.size
    for start in range(0, codes.size, step):
        end = min(codes.size, start + step)
        block = scratch[:end - start].view(np.uint32)
        decode_kernel(codes[start:end], block, floor)
        narrow_kernel(block, out[start:end], fmt)


def _bits16(h: np.ndarray) -> np.ndarray:
    if not isinstance(h, np.ndarray) or h.dtype.itemsize != 2 or h.dtype.kind not in "uif":
        raise TypeError(f"16-bit values must be a numpy array of uint16, int16 or float16 bits, got "
                        f"{getattr(h, 'dtype', type(h).__name__)}")
    return _flat(h.view(np.uint16), np.uint16, "bits")


def _format16(fmt: int) -> int:
    if fmt not in (BFLOAT16, FLOAT16):
        raise ValueError(f"fmt must be BFLOAT16 or FLOAT16, got {fmt}")
    return fmt


def to_float32(h: np.ndarray, fmt: int) -> np.ndarray:
    """The float32 values of 16-bit values h (their bits as uint16 or int16, or a float16 array), exactly."""
    flat = _bits16(h)
    out = np.empty(flat.size, np.float32)
    widen_kernel(flat, out.view(np.uint32), _format16(fmt))
    return out.reshape(h.shape)


def from_float32(x: np.ndarray, fmt: int) -> np.ndarray:
    """The 16-bit bits (uint16) of float32 x rounded to the format (narrow_bits)."""
    flat = _flat(x, np.float32, "x")
    out = np.empty(flat.size, np.uint16)
    narrow_kernel(flat.view(np.uint32), out, _format16(fmt))
    return out.reshape(x.shape)


def encode(h: np.ndarray, fmt: int, *, floor: int, seed: int | None, stream: int = 0, offset: int = 0) -> Encoded:
    """C_nat codes of 16-bit values h at floor: cnat.encode's (seed None: encode_nearest's) of their float32
    values, random words keyed by (seed, stream, offset + i)."""
    flat = _bits16(h)
    if offset < 0:
        raise ValueError(f"offset must be >= 0, got {offset}")
    codes = _out(None, flat.size, np.uint8)
    key = _U64(0 if seed is None else stream_key(seed, stream))
    saturated, _ = encode16_kernel(flat, codes, key, _U64(offset), check_floor(floor), seed is not None,
                                   _format16(fmt), np.empty(SCRATCH, np.float32))
    return Encoded(codes.reshape(h.shape), int(saturated))


def decode(codes: np.ndarray, fmt: int, *, floor: int) -> np.ndarray:
    """16-bit bits (uint16) of the values of codes at floor, rounded to the format."""
    flat = _flat(codes, np.uint8, "codes")
    out = np.empty(flat.size, np.uint16)
    decode16_kernel(flat, out, check_floor(floor), _format16(fmt), np.empty(SCRATCH, np.float32))
    return out.reshape(codes.shape)
