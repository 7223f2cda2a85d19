"""Arithmetic shared by the switch and the workers: exponent agreement and 32-bit fixed point.

The switch adds integers in 32-bit registers, never floats, so sums are exact and independent of arrival order.

Exponent agreement (per chunk, SwitchML style)
    A worker's exponent for a chunk is E = floor(log2(max |x|)) + 1, so every |x| < 2**E, clipped to float32's
    exponents [-126, 127] (both codecs); an all-zero chunk has NO_EXP (-128). Each packet carries the sender's
    exponent for the next chunk it will send into the same slot; the switch keeps the maximum and returns it
    with the result, so every worker encodes that chunk against the same E. E = 127, the int8 field's largest,
    also stands for a chunk whose largest |x| lies in [2**127, 2**128) (E would be 128): C_nat's window then
    reaches 2**128 (``window_top``).

Fixed point
    With n workers a slot holds values of magnitude <= 2**s(n), s(n) = 31 - bit_length(n), so that
    n * 2**s(n) < 2**31: a sum of n contributions never overflows a signed 32-bit register.

C_nat mode (``cnat8``)
    The unit of the slot is 2**f, f = max(-149, T - s(n)), T = window_top(E). Workers encode with that floor
    (values below the unit round randomly to 0 or one unit: ``protocol.cnat``), and a code holds k = e - f, so
    every code is +-2**(f + k) with 0 <= k <= T - f <= s(n): nothing saturates. The switch adds +-2**k units,
    whatever the floor. The sum S (an integer number of units) goes back re-encoded with C_nat: with
    b = floor(log2 |S|) and remainder R = |S| - 2**b, it rounds up to 2**(b+1) iff the top b bits of a random
    word are < R (probability R / 2**b exactly): unbiased. The code holds k = b [+1] <= 31. A result worth
    2**128 or more (f + k > 127) decodes to +-Inf, as a float32 sum overflows; the switch counts those
    elements (the job's ``saturated_elements``).

int32 mode (SwitchML's baseline)
    Workers send q = rint(x * 2**(s - E)) (round half to even, deterministic) as int32; the switch adds; the
    worker turns the sum back with sum * 2**(E - s).

Random words are keyed by (job seed, stream, element index), element index = chunk * packet_elements + i, with
stream = worker_stream(allreduce, rank) for a worker's encode and switch_stream(allreduce) for the switch's
re-encode (protocol.rng).
"""

from __future__ import annotations

import numpy as np
from numba import njit

from intml.protocol.cnat import (
    F32_LARGEST,
    F_MAX,
    F_MIN,
    K_MASK,
    NAN_FLAGS,
    NEG_INF,
    NONZERO,
    POS_INF,
    _flat,
    _out,
    check_floor,
    code_in_range,
    codes_in_range,
    encode_into,
    encode_word,
    nonfinite_flags,
)
from intml.protocol.lanes import clz32, shl32
from intml.protocol.rng import BLOCK, block_key, stream_key
from intml.protocol.wire import NO_EXP

EXP_MIN = -126  # float32's exponents: a denormal-only chunk has E = -126
EXP_MAX = 127  # the int8 field's largest; also E = 128 (|x| in [2**127, 2**128)), see window_top
RESULT_K_MAX = 31  # a re-encoded sum's k = b + up, b = floor(log2 |S|) <= 30
PRECODED = 0x80000000  # tag bit of precode_chunk's low word (a magnitude's bits never have bit 31 set)
STAGE_WORKER = 1
STAGE_SWITCH = 2

_U32 = np.uint32
_U64 = np.uint64


def value_bits(world_size: int) -> int:
    """s(n): contributions are bounded by 2**s(n) so that n of them fit a signed 32-bit register."""
    if not 1 <= world_size <= 1 << 15:
        raise ValueError(f"world size must be in [1, 32768], got {world_size}")
    return 31 - world_size.bit_length()


@njit(cache=True)
def window_top(exponent: int) -> int:
    """T: every |x| of a chunk with agreed exponent E (not NO_EXP) is below 2**T. T = E, except at the int8
    field's top: E = 127 also stands for max |x| in [2**127, 2**128), so T = 128 there."""
    return exponent + (exponent == EXP_MAX)


@njit(cache=True)
def cnat_floor(exponent: int, value_bits: int) -> int:
    """The exponent f of the slot's unit for an agreed exponent E and s(n) = value_bits: T - s(n), and no lower
    than float32's smallest denormal (F_MIN = -149)."""
    return F_MIN if exponent == NO_EXP else max(F_MIN, window_top(exponent) - value_bits)


@njit(cache=True)
def data_k_max(exponent: int, value_bits: int) -> int:
    """The largest k a DATA code of the chunk may hold: T - f (<= s(n)); -1 for an all-zero chunk (NO_EXP), which
    admits only the code 0."""
    return -1 if exponent == NO_EXP else window_top(exponent) - cnat_floor(exponent, value_bits)


@njit(cache=True)
def int32_scale_exponent(exponent: int, value_bits: int) -> int:
    """int32 mode sends x * 2**this (an all-zero chunk, NO_EXP, scales as the smallest exponent)."""
    return value_bits - (EXP_MIN if exponent == NO_EXP else exponent)


@njit(cache=True)
def worker_stream(allreduce: int, rank: int) -> int:
    return (np.int64(allreduce) << 24) | (STAGE_WORKER << 16) | rank


@njit(cache=True)
def switch_stream(allreduce: int) -> int:
    return (np.int64(allreduce) << 24) | (STAGE_SWITCH << 16)


@njit(inline="always")
def chunk_exponent(top, lo, hi):
    """E of a chunk whose largest magnitude has float32 bits `top` (finite), clipped to [lo, hi]."""
    return NO_EXP if top == _U32(0) else min(hi, max(lo, int(top >> _U32(23)) - 126))


@njit(inline="always")
def _largest(bits, start, end):
    """(The float32 bits of the largest finite magnitude among bits[start:end], the count of non-finite ones): a
    NaN or an infinity travels as flags and must not raise the chunk's exponent, which would coarsen its finite
    values."""
    top = _U32(0)
    nonfinite = 0
    for j in range(start, end):
        ab = _U32(bits[j] & _U32(0x7FFFFFFF))
        finite = ab <= _U32(F32_LARGEST)
        top = max(top, ab if finite else _U32(0))
        nonfinite += not finite
    return top, nonfinite


@njit(cache=True, nogil=True, boundscheck=False)
def chunk_exponents_kernel(x, chunk_elements, lo, hi, out):
    """out[c] = agreed-exponent proposal of chunk c of x (over its finite values); returns the count of non-finite
    values."""
    bits = x.view(np.uint32)
    nonfinite = 0
    for c in range(out.size):
        top, bad = _largest(bits, c * chunk_elements, min(bits.size, (c + 1) * chunk_elements))
        out[c] = chunk_exponent(top, lo, hi)
        nonfinite += bad
    return nonfinite


def chunk_exponents(x: np.ndarray, chunk_elements: int, codec_range: tuple[int, int]) -> np.ndarray:
    """Per-chunk exponents E (int8) of a flat float32 array, over its finite values."""
    flat = x.reshape(-1)
    out = np.empty(-(-flat.size // chunk_elements), np.int8)
    chunk_exponents_kernel(flat, chunk_elements, codec_range[0], codec_range[1], out)
    return out


@njit(cache=True, nogil=True, boundscheck=False, _nrt=False)
def precode_chunk(x, codes, key, offset, value_bits, stochastic, heads):
    """The worker's read of a chunk x (elements offset, offset + 1, ... of its tensor) in cnat8 mode, a window
    ahead: find its exponent proposal E_r, then encode it into codes at its own floor f_r = cnat_floor(E_r, s(n))
    (the chunk is in cache for the second pass). Returns (saturated (0: the window holds every value), the count
    of non-finite values, E_r, low | PRECODED), low being the smallest nonzero magnitude minus one
    (encode_kernel's). Not stochastic: encode_nearest's codes. heads: the encode's scratch (encode_into).

    Once the agreed exponent E >= E_r is known (floor f >= f_r), which power of two a value rounds to changes only
    for values below 2**f, ``has_underflow(low, f)``; otherwise the wire codes are these with k lowered by
    f - f_r (codecs.cnat8.encode_chunk)."""
    exponent = chunk_exponent(_largest(x.view(np.uint32), 0, x.size)[0], EXP_MIN, EXP_MAX)
    saturated, nonfinite, _, low = encode_into(x, codes, key, _U64(offset), cnat_floor(exponent, value_bits),
                                               stochastic, heads)
    return saturated, nonfinite, exponent, _U32(low | _U32(PRECODED))


@njit(cache=True, nogil=True, boundscheck=False)
def lower_codes(codes, shift):
    """k -= shift in every code with the nonzero bit: the same values at a floor ``shift`` higher (every
    k >= shift); zero and the non-finite codes stay."""
    d = np.uint8(shift)
    for j in range(codes.size):
        c = codes[j]
        codes[j] = np.uint8(c - d) if c >= np.uint8(NONZERO) else c


CNAT_RANGE = (EXP_MIN, EXP_MAX)
INT32_RANGE = (EXP_MIN, EXP_MAX)


@njit(inline="always")
def _fixed_value(code):
    """+-2**k as a 32-bit two's complement word (0 for code 0)."""
    c = _U32(code)
    v = shl32(_U32(c != _U32(0)), _U32(c & _U32(K_MASK)))
    neg = _U32(c >> _U32(7))
    return _U32(_U32(v ^ _U32(_U32(0) - neg)) + neg)


@njit(cache=True, nogil=True, boundscheck=False)
def add_fixed(codes, acc, first):
    """acc = (first) or += (later) the int32 values of codes in units of the slot's 2**floor: +-2**k, the
    switch's integer add, the same whatever the floor. Codes must have passed codes_in_range(codes, k_max <= 30)."""
    if first:  # two loops, not a select inside one, so each vectorises
        for j in range(codes.size):
            acc[j] = np.int32(_fixed_value(codes[j]))
    else:
        for j in range(codes.size):
            acc[j] = np.int32(_U32(_U32(acc[j]) + _fixed_value(codes[j])))


@njit(cache=True, nogil=True, boundscheck=False)
def _add_fixed_pair(a, b, acc, first):
    if first:
        for j in range(acc.size):
            acc[j] = np.int32(_U32(_fixed_value(a[j]) + _fixed_value(b[j])))
    else:
        for j in range(acc.size):
            acc[j] = np.int32(_U32(_U32(acc[j]) + _U32(_fixed_value(a[j]) + _fixed_value(b[j]))))


@njit(cache=True, nogil=True, boundscheck=False)
def _add_fixed_quad(a, b, c, d, acc, first):
    if first:
        for j in range(acc.size):
            acc[j] = np.int32(_U32(_U32(_fixed_value(a[j]) + _fixed_value(b[j]))
                                   + _U32(_fixed_value(c[j]) + _fixed_value(d[j]))))
    else:
        for j in range(acc.size):
            acc[j] = np.int32(_U32(_U32(acc[j]) + _U32(_U32(_fixed_value(a[j]) + _fixed_value(b[j]))
                                                       + _U32(_fixed_value(c[j]) + _fixed_value(d[j])))))


@njit(cache=True, nogil=True, boundscheck=False)
def add_fixed_rows(data, rows, k, col, acc, first):
    """add_fixed of the codes data[rows[t], col:col + acc.size] for t < k, four rows per pass over acc: several
    contributions to one slot then cost one read and one write of the accumulators, not one each. Integer
    addition mod 2**32 is associative, so the sum is the one of adding the rows one by one."""
    n = acc.size
    t = 0
    while t < k:
        left = k - t
        if left >= 4:
            _add_fixed_quad(data[rows[t], col:col + n], data[rows[t + 1], col:col + n], data[rows[t + 2], col:col + n],
                            data[rows[t + 3], col:col + n], acc, first)
            t += 4
        elif left >= 2:
            _add_fixed_pair(data[rows[t], col:col + n], data[rows[t + 1], col:col + n], acc, first)
            t += 2
        else:
            add_fixed(data[rows[t], col:col + n], acc, first)
            t += 1
        first = False


def to_fixed(codes: np.ndarray, k_max: int = 30) -> np.ndarray:
    """int32 values +-2**k of codes in units of the slot's floor; ValueError if a code is invalid or k > k_max."""
    if not -1 <= k_max <= 30:
        raise ValueError(f"k_max must be in [-1, 30] (int32), got {k_max}")
    flat = _flat(codes, np.uint8, "codes")
    if not codes_in_range(flat, k_max):
        bad = next(j for j in range(flat.size) if not code_in_range(flat[j], k_max))
        raise ValueError(f"code 0x{int(flat[bad]):02x} at index {bad} is not a C_nat code with k <= {k_max}")
    out = np.empty(flat.size, np.int32)
    add_fixed(flat, out, True)
    return out.reshape(codes.shape)


@njit(inline="always")
def _sum_code(s, r):
    """(negative, |s|, k) of int32 sum s rounded with random word r.

    32-bit and branch-free so it vectorises: b = 31 - clz(|s|) is the leading one, and the remainder below it,
    left-aligned, is compared with the top b bits of r (probability remainder / 2**b of rounding up).
    """
    u = _U32(s)
    neg = _U32(u >> _U32(31))
    a = _U32(_U32(u ^ _U32(_U32(0) - neg)) + neg)
    lz = clz32(a)
    remainder = shl32(shl32(a, _U32(lz & _U32(31))), _U32(1))  # & 31: a == 0 (lz 32) must not shift by 32
    keep = shl32(_U32(0xFFFFFFFF), _U32(lz + _U32(1))) if lz < _U32(31) else _U32(0)
    return neg, a, _U32(_U32(_U32(31) - lz) + _U32(_U32(r & keep) < remainder))


@njit(cache=True, nogil=True, boundscheck=False)
def _sum_block(sums, out, lo0, k, stochastic):
    """Re-encode one block; returns the largest k so the caller can tell if any value left float32."""
    top = _U32(0)
    for j in range(sums.size):
        neg, a, kk = _sum_code(sums[j], encode_word(stochastic, _U32(lo0 + _U32(j)), k))
        kk = kk if a != _U32(0) else _U32(0)
        top = max(top, kk)
        code = _U32(_U32(neg << _U32(7)) | _U32(NONZERO) | kk)
        out[j] = np.uint8(0) if a == _U32(0) else np.uint8(code)
    return top


@njit(cache=True, nogil=True, boundscheck=False)
def _count_overflowed(sums, lo0, k, k_finite, stochastic):
    count = 0
    for j in range(sums.size):
        neg, a, kk = _sum_code(sums[j], encode_word(stochastic, _U32(lo0 + _U32(j)), k))
        count += (a != _U32(0)) & (kk > _U32(k_finite))
    return count


@njit(cache=True, nogil=True, boundscheck=False)
def sum_to_codes_kernel(sums, out, key, offset, floor, stochastic):
    """C_nat codes of integer sums in units of 2**floor, random words keyed by (key, offset + j) (not
    stochastic: the fixed word of encode_nearest, which rounds |S| to the nearer power of two, ties away from
    zero); returns the number of elements whose rounded value, 2**(floor + k), exceeds float32 (decodes to
    +-Inf). Only a floor above 127 - RESULT_K_MAX = 96 can have any."""
    k_finite = F_MAX - floor  # the largest k that decodes to a finite float32
    overflowed = 0
    start = 0
    n = sums.size
    while start < n:
        idx = _U64(offset + start)
        end = min(n, start + BLOCK - int(idx % _U64(BLOCK)))
        k = block_key(key, idx >> _U64(32))
        lo0 = _U32(idx & _U64(0xFFFFFFFF))
        if np.int64(_sum_block(sums[start:end], out[start:end], lo0, k, stochastic)) > k_finite:
            overflowed += _count_overflowed(sums[start:end], lo0, k, k_finite, stochastic)  # rare: a second pass
        start = end
    return overflowed


def sum_to_codes(
    sums: np.ndarray, floor: int, *, seed: int | None, stream: int = 0, offset: int = 0,
    out: np.ndarray | None = None
) -> tuple[np.ndarray, int]:
    """Stochastic C_nat re-encode of int32 sums in units of 2**floor (seed None: the deterministic, nearest one);
    returns (codes, elements beyond float32)."""
    check_floor(floor)
    if offset < 0:
        raise ValueError(f"offset must be >= 0, got {offset}")
    flat = _flat(sums, np.int32, "sums")
    codes = _out(out, flat.size, np.uint8)
    key = _U64(0 if seed is None else stream_key(seed, stream))
    overflowed = sum_to_codes_kernel(flat, codes, key, _U64(offset), floor, seed is not None)
    return (codes.reshape(sums.shape) if out is None else out), int(overflowed)


@njit(inline="always")
def quantize(x, scale, limit):
    """rint(x * scale) clamped to [-limit, limit]; the clamp only bites for |x| >= 2**127, where the exponent
    field (int8) cannot hold floor(log2 |x|) + 1."""
    return np.int32(min(limit, max(-limit, np.rint(np.float64(x) * scale))))


INT32_NONFINITE = -(1 << 31)  # int32 mode's reserved words are this + flags: no sum of n values reaches them


@njit(inline="always")
def quantize_lane(x, b, scale, limit):
    """int32 mode's word of float32 x, whose bits are b: quantize's, or INT32_NONFINITE + flags for a NaN or an
    infinity."""
    flags = nonfinite_flags(b)
    return np.int32(INT32_NONFINITE + np.int64(flags)) if flags else quantize(x, scale, limit)


@njit(inline="always")
def nonfinite_float(flags):
    """The float32 a lane with nonzero flags decodes to (flags_bits' value)."""
    if flags == POS_INF:
        return np.float32(np.inf)
    return np.float32(-np.inf) if flags == NEG_INF else np.float32(np.nan)


@njit(inline="always")
def dequantize(v, unit):
    """The float32 of an int32 sum, or the non-finite value of a reserved word."""
    if np.int32(INT32_NONFINITE) < v <= np.int32(INT32_NONFINITE + NAN_FLAGS):
        return nonfinite_float(np.int64(v) - INT32_NONFINITE)
    return np.float32(np.float64(v) * unit)


@njit(cache=True, nogil=True, boundscheck=False)
def quantize_int32_kernel(x, scale_exponent, limit, out):
    scale = 2.0**scale_exponent
    bits = x.view(np.uint32)
    for j in range(x.size):
        out[j] = quantize_lane(x[j], bits[j], scale, limit)


@njit(cache=True, nogil=True, boundscheck=False)
def dequantize_int32_kernel(sums, scale_exponent, out):
    unit = 2.0**-scale_exponent
    for j in range(sums.size):
        out[j] = dequantize(sums[j], unit)
