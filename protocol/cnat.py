"""The 8-bit natural-compression (C_nat) code and its Numba kernels.

The code (Horváth et al., "Natural Compression for Distributed Deep Learning"; docs/arithmetic.md, "C_nat code"):

====  ==========  ===============================================================
bit   name        meaning
====  ==========  ===============================================================
7     sign        1 = negative
6     nonzero     0 = the value is zero, and then every other bit must be 0
5..0  k           k = e + 50, e in [-50, 10]; the value is (-1)**sign * 2**e
====  ==========  ===============================================================

``0x00`` is zero. A code with k > 60, or with the nonzero flag clear and any other bit set (so also ``0x80``,
"negative zero"), is invalid: ``find_invalid``/``validate`` report it and ``decode`` turns it into NaN.

Stochastic encode (``encode``) of a float32 x, with a floor f in [-50, 10] (f = -50 for plain C_nat):

* |x| in [2**a, 2**(a+1)) with a >= f rounds to 2**(a+1) with probability (|x| - 2**a) / 2**a, else to 2**a.
  With x's float32 mantissa field m (23 bits) and a 32-bit random word r this is ``(r >> 9) < m``, an exact
  Bernoulli(m / 2**23): unbiased.
* |x| < 2**f (this includes denormals) rounds to 2**f with probability |x| / 2**f, else to 0. This is
  ``r < |x| * 2**(32 - f)`` in float64, exact to within 2**-32 of a probability: the mean is |x| to within
  2**(f - 32). The switch's fixed point uses f > -50 to round values below its unit (protocol.arith).
* |x| > 2**10 saturates to +-2**10 and is counted; the count is returned, never silently dropped.
  (x in [2**9, 2**10) may round up to 2**10 exactly: representable, not a saturation.)
* NaN and +-Inf raise ``ValueError`` naming the first bad index.
* +-0 encode to 0x00.

Random words come from ``protocol.rng`` keyed by (seed, stream, offset + element index), so any chunking gives
the same codes as one call over the whole tensor.

Deterministic encode (``encode_nearest``) is the same kernel with the random word fixed at 2**31 - 1: it rounds
|x| to the nearer of 2**a and 2**(a+1) in linear scale, ties (|x| = 1.5 * 2**a) away from zero, and below the
floor to 2**f when |x| >= 2**(f-1). It is biased: the relative error lies in [-1/3, +1/3] (e.g. 1.49 -> 1 and
1.5 -> 2), and its mean error does not average out. Use it only where bias is acceptable.

Variance: for x = 2**a (1 + t), E[C(x)**2] = x**2 (1 + 3t) / (1 + t)**2 <= 9/8 x**2 (worst at t = 1/3).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np
from numba import njit

from intml.protocol.lanes import byte_outside, or8
from intml.protocol.rng import BLOCK, block_key, lowbias32, stream_key

E_MIN = -50
E_MAX = 10
K_BIAS = 50  # k = e + K_BIAS
SIGN = 0x80
NONZERO = 0x40
K_MASK = 0x3F

_U32 = np.uint32
_U64 = np.uint64
_F32_EXP_BIAS = 127
_SAT_BITS = 0x44800000  # float32 bits of 2**10: |x| above it saturates
_DETERMINISTIC_WORD = 0x7FFFFFFF  # r with (r >> 9) = 2**22 - 1: rounds up iff m >= 2**22, i.e. ties away


class Encoded(NamedTuple):
    codes: np.ndarray
    saturated: int


@njit(inline="always")
def make_code(negative, e):
    """The code of (-1)**negative * 2**e, e in [E_MIN, E_MAX]."""
    return np.uint8((np.int64(negative) << 7) | NONZERO | (e + K_BIAS))


@njit(cache=True, nogil=True, boundscheck=False)
def _underflow_code(b, r, floor):
    """The code of float32 bits b with |x| < 2**floor: 2**floor with probability |x| / 2**floor, else 0."""
    e = int((b >> _U32(23)) & _U32(0xFF))
    mant = int(b & _U32(0x7FFFFF))
    if e > 0:
        mant += 1 << 23
    # |x| = mant * 2**(max(e, 1) - 150), so |x| * 2**(32 - floor) is exact in float64
    if np.float64(r) < math.ldexp(np.float64(mant), max(e, 1) - 150 + 32 - floor):
        return make_code(b >> _U32(31), floor)
    return np.uint8(0)


@njit(inline="always")
def _word(stochastic, lo, k):
    return lowbias32(_U32(lo ^ k)) if stochastic else _U32(_DETERMINISTIC_WORD)


@njit(cache=True, nogil=True, boundscheck=False)
def _encode_block(bits, out, lo0, k, kfl, stochastic):
    """The branch-free loop that vectorises; kept in its own function because LLVM will not vectorise it inside
    the block walk. Returns the largest magnitude and the smallest nonzero magnitude minus one, as float bits."""
    top = _U32(0)
    low = _U32(0xFFFFFFFF)
    for j in range(bits.size):
        b = bits[j]
        r = _word(stochastic, _U32(lo0 + _U32(j)), k)
        ab = _U32(b & _U32(0x7FFFFFFF))
        e = _U32(ab >> 23)
        kk = _U32(e - _U32(_F32_EXP_BIAS - K_BIAS) + _U32(_U32(r >> 9) < _U32(b & _U32(0x7FFFFF))))
        kk = _U32(E_MAX + K_BIAS) if kk > _U32(E_MAX + K_BIAS) else kk
        code = _U32(_U32(_U32(b >> 31) << 7) | _U32(NONZERO) | kk)
        out[j] = np.uint8(0) if e < kfl else np.uint8(code)
        top = max(top, ab)
        low = min(low, _U32(ab - _U32(1)))  # zeros wrap to the maximum and drop out
    return top, low


@njit(inline="always")
def has_underflow(low, floor):
    """Whether some nonzero |x| lies below 2**floor, given low = the smallest nonzero |x| minus one as float32
    bits (encode_kernel's fourth result): only then does the floor change any code."""
    return low < _U32(_U32(_U32(floor + _F32_EXP_BIAS) << _U32(23)) - _U32(1))


@njit(cache=True, nogil=True, boundscheck=False)
def encode_kernel(x, out, key, offset, floor, stochastic):
    """Encode float32 ``x`` into ``out``; return (saturated, first_bad, top, low): first_bad = -1 if all finite,
    top the largest |x| and low the smallest nonzero |x| minus one, both as float32 bits (low wraps to 2**32 - 1
    when x is all zeros).

    Blocks are aligned to BLOCK in the global element index, so each has one 32-bit block key. Only a block
    holding a saturated, non-finite or below-floor element takes the scalar pass that counts or fixes it.
    """
    bits = x.view(np.uint32)
    n = bits.size
    kfl = _U32(floor + _F32_EXP_BIAS)  # biased float32 exponent of 2**floor
    under_bits = _U32(kfl << _U32(23))
    saturated = 0
    top_all = _U32(0)
    low_all = _U32(0xFFFFFFFF)
    start = 0
    while start < n:
        idx = _U64(offset + start)
        end = min(n, start + BLOCK - int(idx % _U64(BLOCK)))
        lo0 = _U32(idx & _U64(0xFFFFFFFF))
        k = block_key(key, idx >> _U64(32))
        top, low = _encode_block(bits[start:end], out[start:end], lo0, k, kfl, stochastic)
        top_all = max(top_all, top)
        low_all = min(low_all, low)
        if top > _U32(_SAT_BITS):
            for j in range(start, end):
                ab = bits[j] & _U32(0x7FFFFFFF)
                if ab >= _U32(0x7F800000):
                    return saturated, j, top_all, low_all
                saturated += ab > _U32(_SAT_BITS)
        if has_underflow(low, floor):
            for j in range(start, end):
                b = bits[j]
                ab = _U32(b & _U32(0x7FFFFFFF))
                if ab != _U32(0) and ab < under_bits:
                    out[j] = _underflow_code(b, _word(stochastic, _U32(lo0 + _U32(j - start)), k), floor)
        start = end
    return saturated, -1, top_all, low_all


@njit(cache=True, nogil=True, boundscheck=False)
def decode_kernel(codes, out):
    """out (uint32 view of float32) = the value of each code; invalid codes give NaN."""
    for j in range(codes.size):
        c = _U32(codes[j])
        k = _U32(c & _U32(K_MASK))
        value = _U32(_U32(_U32(c & _U32(SIGN)) << 24) | _U32(_U32(k + _U32(_F32_EXP_BIAS - K_BIAS)) << 23))
        ok = (_U32(c & _U32(NONZERO)) != _U32(0)) & (k <= _U32(E_MAX + K_BIAS))
        out[j] = value if ok else (_U32(0) if c == _U32(0) else _U32(0x7FC00000))


def _decode_table() -> np.ndarray:
    table = np.empty(256, np.float32)
    decode_kernel(np.arange(256, dtype=np.uint8), table.view(np.uint32))
    return table


DECODE_TABLE = _decode_table()


@njit(cache=True, nogil=True, boundscheck=False)
def decode_accumulate_kernel(codes, acc, table):
    for j in range(codes.size):
        acc[j] += table[codes[j]]


@njit(inline="always")
def code_in_range(c, floor, ceiling):
    """A valid code of 0 or +-2**e with floor <= e <= ceiling (ceiling = floor - 1 admits only 0).

    Branch-free, 32-bit and biased by one so that every bound is non-negative: loops over it vectorise."""
    c = _U32(c)
    kb = _U32(_U32(c & _U32(K_MASK)) + _U32(1))
    out_of_range = (_U32(c & _U32(NONZERO)) == _U32(0)) | (kb < _U32(floor + K_BIAS + 1)) | (kb > _U32(ceiling + K_BIAS + 1))
    return (c == _U32(0)) | ~out_of_range


@njit(cache=True, nogil=True, boundscheck=False)
def codes_in_range(codes, floor, ceiling):
    """All codes pass code_in_range (the switch's check before it adds a packet).

    The same test in 8-bit lanes, 32 codes per AVX2 instruction: a nonzero code is in range iff its low seven
    bits (nonzero flag and k) lie in [NONZERO + floor + K_BIAS, NONZERO + ceiling + K_BIAS], and subtracting the
    lower bound with 8-bit wrap-around turns that into one unsigned comparison. Admitting only 0 (ceiling below
    floor) uses a lower bound of 0x80, which every 7-bit value wraps below."""
    if ceiling < floor:
        lo, span = np.uint8(0x80), np.uint8(0x7F)
    else:
        lo, span = np.uint8(NONZERO + floor + K_BIAS), np.uint8(ceiling - floor)
    bad = np.uint8(0)
    for j in range(codes.size):
        bad = or8(bad, byte_outside(codes[j], lo, span))
    return bad == 0


@njit(cache=True, nogil=True, boundscheck=False)
def find_invalid_kernel(codes):
    if codes_in_range(codes, E_MIN, E_MAX):
        return -1
    for j in range(codes.size):
        if not code_in_range(codes[j], E_MIN, E_MAX):
            return j
    return -1


def _flat(a: np.ndarray, dtype: type, name: str) -> np.ndarray:
    if not isinstance(a, np.ndarray) or a.dtype != dtype:
        got = a.dtype if isinstance(a, np.ndarray) else type(a).__name__
        raise TypeError(f"{name} must be a numpy array of {np.dtype(dtype).name}, got {got}")
    if not a.flags.c_contiguous:
        raise ValueError(f"{name} must be C-contiguous (use np.ascontiguousarray)")
    return a.reshape(-1)


def _out(out: np.ndarray | None, n: int, dtype: type, name: str = "out") -> np.ndarray:
    if out is None:
        return np.empty(n, dtype)
    flat = _flat(out, dtype, name)
    if flat.size != n:
        raise ValueError(f"{name} has {flat.size} elements, needs {n}")
    return flat


def check_floor(floor: int) -> int:
    if not E_MIN <= floor <= E_MAX:
        raise ValueError(f"floor must be in [{E_MIN}, {E_MAX}], got {floor}")
    return int(floor)


def _run_encode(x, out, key, offset, floor, stochastic) -> Encoded:
    flat = _flat(x, np.float32, "x")
    codes = _out(out, flat.size, np.uint8)
    if offset < 0:
        raise ValueError(f"offset must be >= 0, got {offset}")
    saturated, bad, _, _ = encode_kernel(flat, codes, _U64(key), _U64(offset), check_floor(floor), stochastic)
    if bad >= 0:
        raise ValueError(f"cannot encode non-finite value {flat[bad]} at index {bad}")
    return Encoded(codes.reshape(x.shape) if out is None else out, int(saturated))


def encode(
    x: np.ndarray, *, seed: int, stream: int, offset: int = 0, floor: int = E_MIN, out: np.ndarray | None = None
) -> Encoded:
    """Stochastic, unbiased C_nat encode of float32 ``x``; random words keyed by (seed, stream, offset + i)."""
    return _run_encode(x, out, stream_key(seed, stream), offset, floor, True)


def encode_nearest(x: np.ndarray, *, floor: int = E_MIN, out: np.ndarray | None = None) -> Encoded:
    """Deterministic C_nat encode: nearest power of two in linear scale, ties away from zero (biased)."""
    return _run_encode(x, out, 0, 0, floor, False)


def decode(codes: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """float32 values of ``codes``; invalid codes decode to NaN."""
    flat = _flat(codes, np.uint8, "codes")
    values = _out(out, flat.size, np.float32)
    decode_kernel(flat, values.view(np.uint32))
    return values.reshape(codes.shape) if out is None else out


def decode_accumulate(codes: np.ndarray, acc: np.ndarray) -> np.ndarray:
    """acc += decode(codes), in place, for a float32 or float64 accumulator; returns acc."""
    flat = _flat(codes, np.uint8, "codes")
    if not isinstance(acc, np.ndarray) or acc.dtype not in (np.float32, np.float64):
        raise TypeError("acc must be a float32 or float64 numpy array")
    decode_accumulate_kernel(flat, _out(acc, flat.size, acc.dtype, "acc"), DECODE_TABLE)
    return acc


def find_invalid(codes: np.ndarray) -> int:
    """Index of the first invalid code, or -1."""
    return int(find_invalid_kernel(_flat(codes, np.uint8, "codes")))


def validate(codes: np.ndarray) -> None:
    """Raise ValueError naming the first invalid code, if any."""
    bad = find_invalid(codes)
    if bad >= 0:
        raise ValueError(f"invalid C_nat code 0x{int(codes.reshape(-1)[bad]):02x} at index {bad}")
