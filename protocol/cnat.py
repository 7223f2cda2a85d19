"""The 8-bit natural-compression (C_nat) code and its Numba kernels.

The code (Horváth et al., "Natural Compression for Distributed Deep Learning"; docs/arithmetic.md, "C_nat code")
is relative to a floor f, the exponent of the slot's unit, known to every rank and the switch from the chunk's
agreed exponent (protocol.arith.cnat_floor):

====  ==========  ===============================================================
bit   name        meaning
====  ==========  ===============================================================
7     sign        1 = negative
6     nonzero     0 = the value is zero, and then every other bit must be 0
5..0  k           the value is (-1)**sign * 2**(f + k), k in [0, 63]
====  ==========  ===============================================================

``0x00`` is zero. ``0x01``, ``0x02`` and ``0x03`` are the non-finite codes (+Inf, -Inf, NaN), which carry no
value a switch adds. Any other code with the nonzero flag clear (so also ``0x80``, "negative zero") is invalid:
``find_invalid``/``validate`` report it, and the non-finite codes too, and ``decode`` turns it into NaN. Which k a
packet may hold is the protocol's business (protocol.codecs.cnat8: k <= E - f in DATA, k <= 31 in RESULT).

The floor lies in [F_MIN, F_MAX] = [-149, 127]: 2**-149 is float32's smallest denormal, so every code decodes to
an exact float32 (denormals included) or, where f + k >= 128, to +-inf, as a float32 overflows.

Stochastic encode (``encode``) of a float32 x at floor f, k = e - f:

* |x| in [2**a, 2**(a+1)) with a >= f (normal or denormal) rounds to 2**(a+1) with probability
  (|x| - 2**a) / 2**a, else to 2**a. For a normal x with mantissa field m (23 bits) and a 32-bit random word r
  this is ``(r >> 9) < m``, an exact Bernoulli(m / 2**23): unbiased.
* |x| < 2**f rounds to 2**f with probability |x| / 2**f, else to 0. This is ``r < |x| * 2**(32 - f)`` in
  float64, exact to within 2**-32 of a probability: the mean is |x| to within 2**(f - 32).
* A value whose code would need k > 63 (|x| > 2**(f + 63)) saturates to k = 63 and is counted; the count is
  returned, never silently dropped. The protocol's floor puts every value a worker sends within k <= 30, so
  there it never happens.
* NaN, +Inf and -Inf encode to the non-finite codes 0x03, 0x01 and 0x02 (their flags; docs/arithmetic.md,
  "Non-finite values"), which decode to NaN, +Inf and -Inf.
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
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

from intml.protocol.lanes import Lanes, byte_outside, clz32, or8, shl32
from intml.protocol.rng import (
    BLOCK,
    block_heads,
    block_key,
    lowbias32,
    lowbias32_tail,
    lowbias32_tail_lanes,
    stream_key,
)

F_MIN = -149  # the lowest floor: 2**-149 is float32's smallest denormal
F_MAX = 127  # the highest floor: 2**127 is float32's largest power of two
K_MAX = 63  # the largest k of the 6-bit field
SIGN = 0x80
NONZERO = 0x40
K_MASK = 0x3F

_U32 = np.uint32
_U64 = np.uint64
_F32_EXP_BIAS = 127
F32_LARGEST = 0x7F7FFFFF  # float32 bits of the largest finite magnitude: above it, Inf and NaN
# Non-finite lanes (docs/arithmetic.md, "Non-finite values"): two flag bits, +Inf seen and -Inf seen, a NaN being
# both. The switch ORs them per lane, so a lane's result is NaN where +Inf meets -Inf or NaN, else the infinity.
# A cnat8 code with the nonzero bit clear and k = flags (0x01-0x03) carries them, as int32 mode's reserved words
# INT32_MIN + flags do.
POS_INF = 1
NEG_INF = 2
NAN_FLAGS = POS_INF | NEG_INF
NAN_BITS = 0x7FC00000  # the one NaN every rank decodes to
_DETERMINISTIC_WORD = 0x7FFFFFFF  # r with (r >> 9) = 2**22 - 1: rounds up iff m >= 2**22, i.e. ties away


class Encoded(NamedTuple):
    codes: np.ndarray
    saturated: int


@njit(inline="always")
def make_code(negative, k):
    """The code of (-1)**negative * 2**(floor + k), k in [0, K_MAX]."""
    return np.uint8((np.int64(negative) << 7) | NONZERO | k)


@njit(inline="always")
def power_bits(p):
    """float32 bits of 2**p, p in [F_MIN, F_MAX] (a denormal below 2**-126)."""
    return _U32(_U32(p + _F32_EXP_BIAS) << _U32(23)) if p >= 1 - _F32_EXP_BIAS else _U32(_U32(1) << _U32(p - F_MIN))


@njit(inline="always")
def has_underflow(low, floor):
    """Whether some nonzero |x| lies below 2**floor, given low = the smallest nonzero |x| minus one as float32
    bits (encode_kernel's fourth result; bit 31, protocol.arith.PRECODED, is ignored): only then does the floor
    change which power of two a value rounds to."""
    return _U32(low & _U32(0x7FFFFFFF)) < _U32(power_bits(floor) - _U32(1))


@njit(cache=True, nogil=True, boundscheck=False)
def small_code(b, r, floor):
    """The code of float32 bits b with 0 < |x| < 2**max(floor, -126), which the vectorised pass leaves at 0: below
    the floor, 2**floor with probability |x| / 2**floor, else 0; at or above it (a denormal, floor < -126), 2**a
    or 2**(a+1) as for any value. Float64 products of integers and powers of two, all exact."""
    e = np.int64((b >> _U32(23)) & _U32(0xFF))
    mant = np.int64(b & _U32(0x7FFFFF))
    if e > 0:
        mant += 1 << 23
    scale = max(e, 1) - 150  # |x| = mant * 2**scale
    width = 32 - np.int64(clz32(_U32(mant)))  # bit length of mant
    a = width - 1 + scale  # floor(log2 |x|)
    negative = np.int64(b >> _U32(31))
    if a < floor:
        if np.float64(r) < math.ldexp(np.float64(mant), scale + 32 - floor):
            return make_code(negative, 0)
        return np.uint8(0)
    remainder = mant - (1 << (width - 1))  # |x| = 2**a (1 + remainder / 2**(width - 1))
    up = np.float64(r) < math.ldexp(np.float64(remainder), 33 - width)
    return make_code(negative, a + int(up) - floor)


@njit(inline="always")
def encode_word(stochastic, lo, k):
    return lowbias32(_U32(lo ^ k)) if stochastic else _U32(_DETERMINISTIC_WORD)


@njit(inline="always")
def fast_code(b, r, kfl, bias):
    """The code of float32 bits b with random word r, for the vectorised pass: 0 if the biased exponent is below
    kfl (zero, or a value small_code must encode), else k = exponent field - bias (= floor + 127, mod 2**32)
    plus the round-up, capped at K_MAX. Shared by the CPU block loop and the device kernels (worker.gpu);
    fast_code_lanes states the same steps lanes-wide.

    The round-up ((r >> 9) < mantissa) is the carry out of the mantissa field when (~r) >> 9 = 2**23 - 1 - (r >> 9)
    is added to the magnitude, so exponent plus round-up is one add and one shift, without a compare."""
    ab = _U32(b & _U32(0x7FFFFFFF))
    kk = _U32(_U32(_U32(ab + _U32(_U32(~r) >> _U32(9))) >> _U32(23)) - bias)
    kk = _U32(K_MAX) if kk > _U32(K_MAX) else kk
    code = _U32(_U32(_U32(b >> 31) << 7) | _U32(NONZERO) | kk)
    return np.uint8(0) if ab < _U32(kfl << _U32(23)) else np.uint8(code)


def fast_code_lanes(lanes: Lanes, b: ir.Value, r: ir.Value, kfl_bits: ir.Value, bias: ir.Value) -> ir.Value:
    """fast_code of each lane (as uint32), in LLVM IR (protocol.lanes.Lanes): the same steps, kfl_bits = kfl << 23
    in every lane, but without the cap at K_MAX. A lane past it holds a saturating or non-finite value, whose block
    takes encode_kernel's scalar pass, and that pass writes its code (one instruction fewer per 8 lanes)."""
    bld = lanes.builder
    ab = bld.and_(b, lanes.const(0x7FFFFFFF))
    carried = bld.add(ab, bld.lshr(bld.xor(r, lanes.const(0xFFFFFFFF)), lanes.const(9)))
    kk = bld.sub(bld.lshr(carried, lanes.const(23)), bias)
    code = bld.or_(bld.or_(bld.shl(bld.lshr(b, lanes.const(31)), lanes.const(7)), lanes.const(NONZERO)), kk)
    return bld.select(bld.icmp_unsigned("<", ab, kfl_bits), lanes.const(0), code)


@njit(inline="always")
def _widen(top, low, ab):
    """The extremes (largest magnitude, smallest nonzero magnitude minus one) with one more magnitude ab."""
    return max(top, ab), min(low, _U32(ab - _U32(1)))  # a zero wraps to the maximum and drops out


def _widen_lanes(lanes: Lanes, top: ir.Value, low: ir.Value, ab: ir.Value) -> tuple[ir.Value, ir.Value]:
    """_widen of each lane, in LLVM IR."""
    return lanes.umax(top, ab), lanes.umin(low, lanes.builder.sub(ab, lanes.const(1)))


@njit(cache=True, nogil=True, boundscheck=False)
def _encode_block(bits, out, lo0, k, kfl, bias, stochastic):
    """The branch-free loop that vectorises; kept in its own function because LLVM will not vectorise it inside
    the block walk. Each code is fast_code's (the scalar pass fixes the values it leaves at 0). Returns the
    largest magnitude and the smallest nonzero magnitude minus one, as float bits."""
    top = _U32(0)
    low = _U32(0xFFFFFFFF)
    for j in range(bits.size):
        b = bits[j]
        ab = _U32(b & _U32(0x7FFFFFFF))
        out[j] = fast_code(b, encode_word(stochastic, _U32(lo0 + _U32(j)), k), kfl, bias)
        top, low = _widen(top, low, ab)
    return top, low


# A stochastic encode of this many elements or more forms its words from protocol.rng.block_heads' table: one
# table serves up to 2**16 elements, and filling it costs the multiply per element it then saves, so a shorter call
# (a packet's chunk) hashes each word whole.
_HEADS_FROM = 4 * BLOCK


_WIDTH = Lanes.WIDTH  # a global int, which Numba freezes into _stochastic_block

# The stochastic loop asks for its input this many elements (4 KiB) ahead. Without it, on AMD Zen 4, the stream's
# memory time adds to the loop's instead of overlapping it (docs/benchmarks.md, "The stochastic loop's input
# fetched ahead").
_PREFETCH_AHEAD = 1024


@intrinsic
def _stochastic_lanes(typingctx, bits, out, heads, head_offset, kfl, bias, reach):
    """_stochastic_block's loop over its first n - n % Lanes.WIDTH elements, written lanes-wide in IR; returns
    (top, low) of those elements. LLVM's vectoriser unrolls the scalar loop 4× for the reductions and packs the
    codes with 512-bit shuffles on AVX-512 machines, which leave Intel cores fewer vector ports for the hash (a
    third slower), so the extremes took a second pass; here the loop stays 256 bits wide in one pass. It fetches
    its input _PREFETCH_AHEAD elements ahead, within the reach elements that may be read from bits[0] on."""
    sig = types.UniTuple(types.uint32, 2)(bits, out, heads, types.uint32, types.uint32, types.uint32, types.int64)

    def codegen(context, builder, signature, args):
        bits_a, out_a, heads_a = (context.make_array(t)(context, builder, a)
                                  for t, a in zip(signature.args[:3], args[:3]))
        lanes = Lanes(builder)
        n = bits_a.nitems
        offset, bias_v = lanes.splat(args[3]), lanes.splat(args[5])
        kfl_bits = lanes.splat(builder.shl(args[4], ir.Constant(args[4].type, 23)))
        top_p = cgutils.alloca_once_value(builder, lanes.const(0))
        low_p = cgutils.alloca_once_value(builder, lanes.const(0xFFFFFFFF))
        stop = builder.and_(n, ir.Constant(n.type, -lanes.WIDTH))
        ahead, last = n.type(_PREFETCH_AHEAD), builder.sub(args[6], n.type(1))
        with cgutils.for_range_slice(builder, n.type(0), stop, n.type(lanes.WIDTH)) as (j, _):
            wanted = builder.add(j, ahead)  # within the input: a packet's chunk fetches nothing past it
            lanes.prefetch(bits_a.data, builder.select(builder.icmp_signed("<", wanted, last), wanted, last))
            b = lanes.load(bits_a.data, j)
            r = lowbias32_tail_lanes(lanes, builder.add(lanes.load(heads_a.data, j), offset))
            lanes.store_bytes(fast_code_lanes(lanes, b, r, kfl_bits, bias_v), out_a.data, j)
            top, low = _widen_lanes(lanes, builder.load(top_p), builder.load(low_p),
                                    builder.and_(b, lanes.const(0x7FFFFFFF)))
            builder.store(top, top_p)
            builder.store(low, low_p)
        top = lanes.reduce(builder.load(top_p), lanes.umax)
        low = lanes.reduce(builder.load(low_p), lanes.umin)
        return context.make_tuple(builder, signature.return_type, (top, low))

    return sig, codegen


@njit(cache=True, nogil=True, boundscheck=False)
def _stochastic_block(bits, out, heads, head_offset, kfl, bias, reach):
    """fast_code of each value with its random word, lowbias32_tail of its head (protocol.rng.block_heads), and the
    extremes as _encode_block returns them: _stochastic_lanes, then the last n % Lanes.WIDTH elements here. reach:
    the elements of the input from bits[0] on (bits.size or more), which the loop may fetch ahead."""
    top, low = _stochastic_lanes(bits, out, heads, head_offset, kfl, bias, reach)
    for j in range(bits.size - bits.size % _WIDTH, bits.size):
        b = bits[j]
        out[j] = fast_code(b, lowbias32_tail(_U32(heads[j] + head_offset)), kfl, bias)
        top, low = _widen(top, low, _U32(b & _U32(0x7FFFFFFF)))
    return top, low


@njit(inline="always")
def encode_params(floor):
    """(fast_floor, kfl, small_bits, bias, sat_bits) of an encode at floor: from 2**fast_floor up fast_code
    encodes (kfl is its biased exponent, small_bits its float32 bits); a nonzero |x| below small_bits takes
    small_code; bias is fast_code's; a magnitude above sat_bits saturates (or, above the largest float32, is
    non-finite)."""
    fast_floor = max(floor, 1 - _F32_EXP_BIAS)
    bias = _U32(np.int64(floor + _F32_EXP_BIAS) & 0xFFFFFFFF)
    sat_bits = power_bits(floor + K_MAX) if floor + K_MAX <= F_MAX else _U32(F32_LARGEST)
    return fast_floor, _U32(fast_floor + _F32_EXP_BIAS), power_bits(fast_floor), bias, sat_bits


@njit(inline="always")
def heads_size(n, stochastic):
    """The words of the heads table an encode of n elements uses: BLOCK, or 0 (each word hashed whole)."""
    return BLOCK if stochastic and n >= _HEADS_FROM else 0


_NO_TABLE = 0xFFFFFFFF  # the mask word of a kept table that holds no mask yet (masks lie below BLOCK)


def kept_heads() -> np.ndarray:
    """A heads table that an encoder keeps between encode_into calls (BLOCK words and the mask they were filled
    for): every stochastic encode then forms its words from it, however short. A mask serves 2**16 consecutive
    elements (protocol.rng.block_heads), so a worker encoding a packet's chunk at a time fills it once per 64
    chunks of 1024 instead of hashing every word whole."""
    return np.full(BLOCK + 1, _NO_TABLE, np.uint32)


@njit(cache=True, nogil=True, boundscheck=False)
def encode_kernel(x, out, key, offset, floor, stochastic):
    """Encode float32 ``x`` into ``out`` at ``floor``; return (saturated, nonfinite, top, low): nonfinite counts
    the NaN and infinities (each coded as its flags), top is the largest |x| and low the smallest nonzero |x| minus
    one, both as float32 bits (low wraps to 2**32 - 1 when x is all zeros).

    Blocks are aligned to BLOCK in the global element index, so each has one 32-bit block key. Only a block
    holding a saturated, non-finite, below-floor or (floor < -126) denormal element takes the scalar pass that
    counts or fixes it.
    """
    heads = np.empty(heads_size(x.size, stochastic), np.uint32)
    return encode_into(x, out, key, offset, floor, stochastic, heads)


@njit(cache=True, nogil=True, boundscheck=False, _nrt=False)
def encode_into(x, out, key, offset, floor, stochastic, heads):
    """encode_kernel with its heads table passed in (uint32, at least heads_size(x.size, stochastic) words; its
    contents are overwritten), so that it allocates nothing: the worker's engine runs without Numba's runtime.
    A kept table (kept_heads: BLOCK + 1 words) is used by every stochastic encode, and refilled only for a new
    mask. The words, and so the codes, are the same either way."""
    bits = x.view(np.uint32)
    n = bits.size
    fast_floor, kfl, small_bits, bias, sat_bits = encode_params(floor)
    saturated = 0
    nonfinite = 0
    top_all = _U32(0)
    low_all = _U32(0xFFFFFFFF)
    kept = heads.size > BLOCK
    table = heads_size(n, stochastic) > 0 or (kept and stochastic)
    filled = np.int64(heads[BLOCK]) if kept else np.int64(-1)
    start = 0
    while start < n:
        idx = _U64(offset + start)
        s0 = int(idx % _U64(BLOCK))
        end = min(n, start + BLOCK - s0)
        lo0 = _U32(idx & _U64(0xFFFFFFFF))
        k = block_key(key, idx >> _U64(32))
        if table:
            if kept:  # the whole table, which the next calls reuse
                head_offset, filled = block_heads(heads, k, _U32(lo0 - _U32(s0)), BLOCK, filled)
                heads[BLOCK] = _U32(filled)
            else:
                head_offset, filled = block_heads(heads, k, lo0, end - start, filled)
            top, low = _stochastic_block(bits[start:end], out[start:end], heads[s0:s0 + end - start], head_offset,
                                         kfl, bias, n - start)
        else:
            top, low = _encode_block(bits[start:end], out[start:end], lo0, k, kfl, bias, stochastic)
        top_all = max(top_all, top)
        low_all = min(low_all, low)
        if top > sat_bits:
            for j in range(start, end):
                flags = nonfinite_flags(bits[j])
                if flags:
                    out[j] = np.uint8(flags)
                    nonfinite += 1
                elif _U32(bits[j] & _U32(0x7FFFFFFF)) > sat_bits:
                    out[j] = make_code(bits[j] >> _U32(31), K_MAX)  # the cap fast_code_lanes leaves out
                    saturated += 1
        if has_underflow(low, fast_floor):
            for j in range(start, end):
                b = bits[j]
                ab = _U32(b & _U32(0x7FFFFFFF))
                if ab != _U32(0) and ab < small_bits:
                    out[j] = small_code(b, encode_word(stochastic, _U32(lo0 + _U32(j - start)), k), floor)
        start = end
    return saturated, nonfinite, top_all, low_all


@njit(inline="always")
def nonfinite_flags(b):
    """The flags of float32 bits b: 0 for a finite value, POS_INF or NEG_INF for an infinity, NAN_FLAGS for a
    NaN."""
    ab = _U32(b & _U32(0x7FFFFFFF))
    inf = _U32(POS_INF) + _U32(b >> _U32(31))
    return _U32(0) if ab <= _U32(F32_LARGEST) else (_U32(NAN_FLAGS) if ab > _U32(0x7F800000) else inf)


@njit(inline="always")
def flags_bits(flags):
    """float32 bits of a lane with nonzero flags: +Inf (POS_INF), -Inf (NEG_INF), else the NaN NAN_BITS (which
    also stands for an invalid code's value)."""
    inf = _U32(0x7F800000) | _U32(_U32(flags == _U32(NEG_INF)) << _U32(31))
    return inf if flags == _U32(POS_INF) or flags == _U32(NEG_INF) else _U32(NAN_BITS)


@njit(inline="always")
def decode_origin(floor):
    """t0 = floor - F_MIN: with t = t0 + k, 2**(f + k) is 2**t denormal units, or normal from t = 23."""
    return _U32(floor - F_MIN)


@njit(inline="always")
def decode_bits(code, t0):
    """float32 bits of one code's value (t0 = decode_origin(floor)): +-Inf or NaN for a non-finite code, NaN for an
    invalid code, +-Inf from f + k = 128. Shared by the CPU loop and the device kernels (worker.gpu)."""
    c = _U32(code)
    t = _U32(_U32(c & _U32(K_MASK)) + t0)
    normal = shl32(min(_U32(t - _U32(22)), _U32(0xFF)), _U32(23))  # exponent field 255: Inf
    magnitude = normal if t > _U32(22) else shl32(_U32(1), _U32(t & _U32(31)))
    value = _U32(_U32(_U32(c & _U32(SIGN)) << 24) | magnitude)
    ok = _U32(c & _U32(NONZERO)) != _U32(0)
    return value if ok else (_U32(0) if c == _U32(0) else flags_bits(c))


@njit(cache=True, nogil=True, boundscheck=False)
def decode_kernel(codes, out, floor):
    """out (uint32 view of float32) = the value of each code at ``floor``; invalid codes give NaN, and values of
    2**128 or more (f + k > 127) +-Inf."""
    t0 = decode_origin(floor)
    for j in range(codes.size):
        out[j] = decode_bits(codes[j], t0)


@njit(cache=True, nogil=True, boundscheck=False)
def decode_accumulate_kernel(codes, acc, table):
    for j in range(codes.size):
        acc[j] += table[codes[j]]


@njit(inline="always")
def code_in_range(c, k_max):
    """A valid code of 0 or +-2**(floor + k) with k <= k_max (k_max = -1 admits only 0).

    Branch-free and 32-bit: loops over it vectorise."""
    c = _U32(c)
    out_of_range = (_U32(c & _U32(NONZERO)) == _U32(0)) | (np.int64(c & _U32(K_MASK)) > k_max)
    return (c == _U32(0)) | ~out_of_range


@njit(cache=True, nogil=True, boundscheck=False)
def codes_in_range(codes, k_max):
    """All codes pass code_in_range (the switch's check before it adds a packet, a worker's of a result).

    The same test in 8-bit lanes, 32 codes per AVX2 instruction: a nonzero code is in range iff its low seven
    bits (nonzero flag and k) lie in [NONZERO, NONZERO + k_max], and subtracting the lower bound with 8-bit
    wrap-around turns that into one unsigned comparison. Admitting only 0 (k_max < 0) uses a lower bound of 0x80,
    which every 7-bit value wraps below."""
    if k_max < 0:
        lo, span = np.uint8(0x80), np.uint8(0x7F)
    else:
        lo, span = np.uint8(NONZERO), np.uint8(min(k_max, K_MAX))
    bad = np.uint8(0)
    for j in range(codes.size):
        bad = or8(bad, byte_outside(codes[j], lo, span))
    return bad == 0


@njit(cache=True, nogil=True, boundscheck=False)
def codes_in_range_or_nonfinite(codes, k_max):
    """Every code passes code_in_range or is a non-finite code (0x01-0x03): the check of a payload that failed
    codes_in_range, which finite payloads pass."""
    for j in range(codes.size):
        c = codes[j]
        if not (code_in_range(c, k_max) or (c >= np.uint8(POS_INF) and c <= np.uint8(NAN_FLAGS))):
            return False
    return True


@njit(cache=True, nogil=True, boundscheck=False)
def take_nonfinite_codes(codes, flags):
    """flags |= the flags of each code, and its non-finite codes become 0, which the switch adds as nothing. The
    codes passed codes_in_range_or_nonfinite: one below NONZERO is 0 or non-finite, its value its flags."""
    for j in range(codes.size):
        c = codes[j]
        nf = c if c < np.uint8(NONZERO) else np.uint8(0)
        flags[j] |= nf
        codes[j] = c ^ nf


@njit(cache=True, nogil=True, boundscheck=False)
def put_nonfinite_codes(codes, flags):
    """The code of every lane with flags becomes its non-finite code; returns the count of such lanes."""
    count = 0
    for j in range(codes.size):
        f = flags[j]
        if f:
            codes[j] = f
            count += 1
    return count


@njit(cache=True, nogil=True, boundscheck=False)
def find_invalid_kernel(codes):
    if codes_in_range(codes, K_MAX):
        return -1
    for j in range(codes.size):
        if not code_in_range(codes[j], K_MAX):
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
    if not F_MIN <= floor <= F_MAX:
        raise ValueError(f"floor must be in [{F_MIN}, {F_MAX}], got {floor}")
    return int(floor)


def _run_encode(x, out, key, offset, floor, stochastic) -> Encoded:
    flat = _flat(x, np.float32, "x")
    codes = _out(out, flat.size, np.uint8)
    if offset < 0:
        raise ValueError(f"offset must be >= 0, got {offset}")
    saturated, _, _, _ = encode_kernel(flat, codes, _U64(key), _U64(offset), check_floor(floor), stochastic)
    return Encoded(codes.reshape(x.shape) if out is None else out, int(saturated))


def encode(
    x: np.ndarray, *, seed: int, stream: int, floor: int, offset: int = 0, out: np.ndarray | None = None
) -> Encoded:
    """Stochastic, unbiased C_nat encode of float32 ``x`` at ``floor``; random words keyed by
    (seed, stream, offset + i)."""
    return _run_encode(x, out, stream_key(seed, stream), offset, floor, True)


def encode_nearest(x: np.ndarray, *, floor: int, out: np.ndarray | None = None) -> Encoded:
    """Deterministic C_nat encode: nearest power of two in linear scale, ties away from zero (biased)."""
    return _run_encode(x, out, 0, 0, floor, False)


def decode(codes: np.ndarray, *, floor: int, out: np.ndarray | None = None) -> np.ndarray:
    """float32 values of ``codes`` at ``floor``; invalid codes decode to NaN."""
    flat = _flat(codes, np.uint8, "codes")
    values = _out(out, flat.size, np.float32)
    decode_kernel(flat, values.view(np.uint32), check_floor(floor))
    return values.reshape(codes.shape) if out is None else out


def decode_table(floor: int) -> np.ndarray:
    """The float32 value of each of the 256 codes at ``floor``."""
    return decode(np.arange(256, dtype=np.uint8), floor=floor)


def decode_accumulate(codes: np.ndarray, acc: np.ndarray, *, floor: int) -> np.ndarray:
    """acc += decode(codes, floor=floor), in place, for a float32 or float64 accumulator; returns acc."""
    flat = _flat(codes, np.uint8, "codes")
    if not isinstance(acc, np.ndarray) or acc.dtype not in (np.float32, np.float64):
        raise TypeError("acc must be a float32 or float64 numpy array")
    decode_accumulate_kernel(flat, _out(acc, flat.size, acc.dtype, "acc"), decode_table(floor))
    return acc


def find_invalid(codes: np.ndarray) -> int:
    """Index of the first invalid code, or -1."""
    return int(find_invalid_kernel(_flat(codes, np.uint8, "codes")))


def validate(codes: np.ndarray) -> None:
    """Raise ValueError naming the first invalid code, if any."""
    bad = find_invalid(codes)
    if bad >= 0:
        raise ValueError(f"invalid C_nat code 0x{int(codes.reshape(-1)[bad]):02x} at index {bad}")
