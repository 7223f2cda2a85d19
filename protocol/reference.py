"""Plain-numpy reference of the whole arithmetic: slow, obvious, and the oracle the fast kernels are tested
against bit for bit. It restates the specs of protocol.rng, protocol.cnat and protocol.arith with float64 and
Python-int arithmetic instead of bit tricks, and shares no code with the kernels beyond the scalar key
derivation (``stream_key``), which is itself checked against a hand-computed value in the tests.
"""

from __future__ import annotations

import math

import numpy as np

from intml.protocol.rng import MASK64, splitmix64_int, stream_key

F_MIN = -149  # the lowest floor: float32's smallest denormal
EXP_MIN, EXP_MAX = -126, 127  # chunk exponents, both codecs: float32's, in an int8 field
K_MAX = 63  # the code's 6-bit k
NO_EXP = -128
POS_INF, NEG_INF, NAN = 1, 2, 3  # a lane's non-finite flags: +Inf seen, -Inf seen, both (NaN)
INT32_NONFINITE = -(2**31)  # int32 mode's reserved words are this + flags


def flags_of(x: np.ndarray) -> np.ndarray:
    """The non-finite flags of each value: 0 if finite, POS_INF, NEG_INF, or NAN (= POS_INF | NEG_INF)."""
    x = np.asarray(x, dtype=np.float32).reshape(-1)
    return np.where(np.isnan(x), NAN, np.where(np.isposinf(x), POS_INF, np.where(np.isneginf(x), NEG_INF, 0)))


def flags_value(flags: int) -> np.float32:
    """What a lane with nonzero flags decodes to."""
    return np.float32({POS_INF: np.inf, NEG_INF: -np.inf}.get(flags, np.nan))


def bits32(key: int, index: np.ndarray) -> np.ndarray:
    """The 32-bit random word of each element index, per protocol.rng."""
    index = np.asarray(index, dtype=np.uint64)
    hi, which = np.unique(index >> np.uint64(32), return_inverse=True)  # one splitmix64 per 2**32 indices
    block = np.array([splitmix64_int((key + int(h)) & MASK64) >> 32 for h in hi], dtype=np.uint64)[which]
    x = ((index & np.uint64(0xFFFFFFFF)) ^ block.reshape(index.shape)).astype(np.uint32)
    with np.errstate(over="ignore"):
        x ^= x >> np.uint32(16)
        x *= np.uint32(0x7FEB352D)
        x ^= x >> np.uint32(15)
        x *= np.uint32(0x846CA68B)
        x ^= x >> np.uint32(16)
    return x


def code_of(negative: bool, k: int) -> int:
    return (0x80 if negative else 0) | 0x40 | k


def encode(x: np.ndarray, *, seed: int | None, floor: int, stream: int = 0, offset: int = 0) -> tuple[np.ndarray, int]:
    """C_nat encode at floor (codes hold k = e - floor); seed=None is the deterministic (nearest, ties away)
    variant. Returns (codes, saturated): |x| above 2**(floor + 63) is clamped to k = 63 and counted. A NaN or an
    infinity's code is its flags."""
    x = np.asarray(x, dtype=np.float32).reshape(-1)
    if seed is None:
        r = np.full(x.size, 2**31 - 1, dtype=np.float64)
    else:
        r = bits32(stream_key(seed, stream), np.arange(offset, offset + x.size, dtype=np.uint64)).astype(np.float64)
    codes = [0] * x.size
    saturated = 0
    with np.errstate(invalid="ignore"):  # a signalling NaN's cast; its code is its flags
        wide = x.astype(np.float64)
    # Python floats and ints (float64 arithmetic, as numpy's): indexing numpy scalars would cost 5x the time
    for i, (v, flags, ri) in enumerate(zip(wide.tolist(), flags_of(x).tolist(), r.tolist())):
        ax = abs(v)
        if flags:
            codes[i] = flags
            continue
        if ax == 0:
            continue
        if ax < 2.0**floor:
            if ri < ax * 2.0 ** (32 - floor):
                codes[i] = code_of(v < 0, 0)
            continue
        mantissa, exponent = math.frexp(ax)  # ax = mantissa * 2**exponent, mantissa in [0.5, 1); float32
        a = exponent - 1  # denormals are normal float64 numbers
        fraction = ax / 2.0**a - 1.0  # in [0, 1), exact
        k = a + int(ri < fraction * 2.0**32) - floor
        saturated += ax > 2.0 ** (floor + K_MAX)  # beyond the window's top: clamped, so counted
        codes[i] = code_of(v < 0, min(k, K_MAX))
    return np.array(codes, np.uint8), saturated


def decode(codes: np.ndarray, floor: int) -> np.ndarray:
    """float32 value of each code at floor: +-2**(floor + k), +-Inf from 2**128 up, NaN for an invalid code."""
    out = np.empty(np.size(codes), np.float32)
    for i, c in enumerate(np.asarray(codes, dtype=np.uint8).reshape(-1).tolist()):
        if c == 0:
            out[i] = 0.0
        elif c in (POS_INF, NEG_INF):
            out[i] = flags_value(c)
        elif not c & 0x40:
            out[i] = np.nan
        else:
            p = floor + (c & 0x3F)
            out[i] = (-1.0 if c & 0x80 else 1.0) * (np.inf if p > 127 else 2.0**p)  # 2**p is exact in float32
    return out


def is_valid(code: int) -> bool:
    return code == 0 or bool(code & 0x40)


def k_of(code: int) -> int:
    return code & 0x3F


def to_fixed(codes: np.ndarray) -> np.ndarray:
    """Integer value of each (valid) code in units of the slot's floor: +-2**k, and 0 for a non-finite code."""
    return np.array([0 if c < 0x40 else (-1 if c & 0x80 else 1) * 2 ** k_of(c) for c in
                     np.asarray(codes, dtype=np.uint8).reshape(-1).tolist()], dtype=np.int64)


def sum_to_codes(sums: np.ndarray, floor: int, *, seed: int | None, stream: int = 0,
                 offset: int = 0) -> tuple[np.ndarray, int]:
    """Stochastic C_nat of integer sums in units of 2**floor (k = b or b + 1, b = floor(log2 |S|)); seed=None is
    the deterministic variant (round up iff the remainder is at least 2**(b-1): nearest, ties away). Returns
    (codes, overflowed): the elements whose rounded value 2**(floor + k) exceeds float32 (they decode to +-Inf)."""
    sums = np.asarray(sums, dtype=np.int64).reshape(-1)
    if seed is None:
        r = np.full(sums.size, 2**31 - 1, dtype=np.uint32)
    else:
        r = bits32(stream_key(seed, stream), np.arange(offset, offset + sums.size, dtype=np.uint64))
    codes = [0] * sums.size
    overflowed = 0
    for i, (s, ri) in enumerate(zip(sums.tolist(), r.tolist())):
        a = abs(s)
        if a == 0:
            continue
        b = a.bit_length() - 1
        remainder = a - (1 << b)
        k = b + int((ri >> (32 - b)) < remainder)
        overflowed += floor + k > 127
        codes[i] = code_of(s < 0, k)
    return np.array(codes, np.uint8), overflowed


def chunk_exponent(x: np.ndarray, lo: int, hi: int) -> int:
    """floor(log2 max|x|) + 1 over the finite values, clipped to [lo, hi]; -128 (no exponent) for a chunk with no
    finite nonzero value."""
    finite = x[np.isfinite(x)]
    top = float(np.max(np.abs(finite.astype(np.float64)))) if finite.size else 0.0
    if top == 0.0:
        return NO_EXP
    _, exponent = np.frexp(top)  # top = m * 2**exponent, m in [0.5, 1): floor(log2 top) + 1 == exponent
    return min(hi, max(lo, int(exponent)))


def window_top(e: int) -> int:
    """T, with every |x| of the chunk below 2**T: E, or 128 for E = 127 (which also stands for E = 128)."""
    return 128 if e == EXP_MAX else e


def cnat_floor(e: int, n: int) -> int:
    """The slot's floor for agreed exponent e and n ranks: T - s(n), at least F_MIN; F_MIN for an all-zero chunk."""
    return F_MIN if e == NO_EXP else max(F_MIN, window_top(e) - value_bits(n))


def value_bits(n: int) -> int:
    return 31 - n.bit_length()


def data_code_ok(code: int, e: int, n: int) -> bool:
    """Whether a DATA code is 0 or valid with floor + k <= T (never for a nonzero code when e is NO_EXP)."""
    if code == 0:
        return True
    return e != NO_EXP and is_valid(code) and k_of(code) <= window_top(e) - cnat_floor(e, n)


def worker_codes(parts: list[np.ndarray], *, seed: int, allreduce_seq: int, offset: int,
                 nearest: bool = False) -> tuple[int, list]:
    """(floor, [(codes, saturated) of each rank]) of one cnat8 chunk whose ranks' inputs are parts."""
    e = max(chunk_exponent(x, EXP_MIN, EXP_MAX) for x in parts)
    floor = cnat_floor(e, len(parts))
    return floor, [encode(x, seed=None if nearest else seed, floor=floor,
                          stream=(allreduce_seq << 24) | (1 << 16) | rank, offset=offset)
                   for rank, x in enumerate(parts)]


def cnat8_chunk_codes(parts: list[np.ndarray], *, seed: int, allreduce_seq: int, offset: int,
                      nearest: bool = False) -> tuple[int, np.ndarray, int]:
    """(floor, result codes, overflowed) of one cnat8 chunk: agree on the max exponent, encode each rank's part
    against its floor, add integers exactly, re-encode the sum; a lane with non-finite flags from any rank (ORed)
    comes back as the code of its flags. nearest: the deterministic variant at the workers and the switch."""
    floor, encoded = worker_codes(parts, seed=seed, allreduce_seq=allreduce_seq, offset=offset, nearest=nearest)
    total = sum(to_fixed(codes) for codes, _ in encoded)
    codes, overflowed = sum_to_codes(total, floor, seed=None if nearest else seed,
                                     stream=(allreduce_seq << 24) | (2 << 16), offset=offset)
    flags = lane_flags(parts)
    codes[flags != 0] = flags[flags != 0]
    return floor, codes, overflowed


def lane_flags(parts: list[np.ndarray]) -> np.ndarray:
    """The OR over ranks of each lane's non-finite flags."""
    return np.bitwise_or.reduce([flags_of(x) for x in parts]).astype(np.uint8)


def cnat8_chunk(parts: list[np.ndarray], *, seed: int, allreduce_seq: int, offset: int,
                nearest: bool = False) -> np.ndarray:
    """The cnat8 result of one chunk whose ranks' inputs are parts (tensor elements offset..)."""
    floor, codes, _ = cnat8_chunk_codes(parts, seed=seed, allreduce_seq=allreduce_seq, offset=offset, nearest=nearest)
    return decode(codes, floor)


def int32_chunk(parts: list[np.ndarray], *, seed: int, allreduce_seq: int, offset: int,
                nearest: bool = False) -> np.ndarray:
    """The int32 result of one chunk: agree on the max exponent E, add rint(x * 2**(s - E)) (clamped to +-2**s)
    exactly, scale the sum back by 2**(E - s); a lane with non-finite flags from any rank (ORed) comes back as
    their value. Deterministic: seed, allreduce_seq, offset and nearest play no part."""
    s = value_bits(len(parts))
    e = max(chunk_exponent(x, EXP_MIN, EXP_MAX) for x in parts)
    scale = s - (EXP_MIN if e == NO_EXP else e)
    limit = 2.0**s
    with np.errstate(invalid="ignore"):  # the non-finite lanes' products, replaced below
        total = sum(np.clip(np.rint(np.where(np.isfinite(x), x, 0).astype(np.float64) * 2.0**scale), -limit, limit)
                    for x in parts)
    with np.errstate(over="ignore"):  # a sum beyond float32 becomes +-Inf, as a float32 sum would
        out = (total * 2.0**-scale).astype(np.float32)
    flags = lane_flags(parts)
    for i in np.flatnonzero(flags):
        out[i] = flags_value(int(flags[i]))
    return out


CHUNK_RESULTS = {"cnat8": cnat8_chunk, "int32": int32_chunk}  # by codec name


def allreduce(inputs: list[np.ndarray], *, codec: str, seed: int, allreduce_seq: int, packet_elements: int,
              rounding: str = "stochastic") -> np.ndarray:
    """The sum every worker receives (docs/arithmetic.md, "One chunk, end to end"): chunk by chunk, the codec's
    result; rounding "nearest": the deterministic C_nat at the workers and the switch (docs/rounding.md)."""
    chunk_result = CHUNK_RESULTS[codec]
    flat = [np.asarray(x, dtype=np.float32).reshape(-1) for x in inputs]
    out = np.zeros(flat[0].size, np.float32)
    for lo in range(0, out.size, packet_elements):
        parts = [x[lo:lo + packet_elements] for x in flat]
        out[lo:lo + packet_elements] = chunk_result(parts, seed=seed, allreduce_seq=allreduce_seq, offset=lo,
                                                    nearest=rounding == "nearest")
    return out


# ---- 16-bit formats (protocol.half): exact widening, and rounding to nearest by comparing distances
BFLOAT16, FLOAT16 = 1, 2
HALF_NAN = {BFLOAT16: 0x7FC0, FLOAT16: 0x7E00}  # the quiet NaN any NaN rounds to, with its sign


def half_to_float32(bits: np.ndarray, fmt: int) -> np.ndarray:
    """The float32 value of each 16-bit value (bits as uint16): bfloat16 is float32's upper half, float16 numpy's."""
    bits = np.asarray(bits, dtype=np.uint16).reshape(-1)
    if fmt == BFLOAT16:
        return (bits.astype(np.uint32) << np.uint32(16)).view(np.float32)
    return bits.view(np.float16).astype(np.float32)


def _finite_halves(fmt: int) -> tuple[np.ndarray, np.ndarray]:
    """(bits, float64 values) of every non-negative finite 16-bit value, ascending, then the infinity as the next
    step of the format's exponent ladder (2**128 or 2**16): what IEEE rounding with an unbounded exponent would
    round to, before overflow makes it Inf."""
    bits = np.arange(0x8000, dtype=np.uint16)
    with np.errstate(invalid="ignore"):  # a signalling NaN's cast; NaNs are left out
        values = half_to_float32(bits, fmt).astype(np.float64)
    finite = np.isfinite(values)
    inf = 0x7F80 if fmt == BFLOAT16 else 0x7C00
    return np.append(bits[finite], inf), np.append(values[finite], 2.0**128 if fmt == BFLOAT16 else 2.0**16)


def float32_to_half(x: np.ndarray, fmt: int) -> np.ndarray:
    """The 16-bit bits (uint16) of each float32 rounded to the nearer 16-bit value, ties to the one with an even
    last bit; the step past the largest finite value is Inf; a NaN is HALF_NAN with its sign."""
    x = np.asarray(x, dtype=np.float32).reshape(-1)
    bits, values = _finite_halves(fmt)
    out = np.empty(x.size, np.uint16)
    with np.errstate(invalid="ignore"):
        wide = x.astype(np.float64)
    for i, v in enumerate(wide):
        sign = 0x8000 if np.signbit(v) else 0
        if np.isnan(v):
            out[i] = sign | HALF_NAN[fmt]
            continue
        a = abs(v)
        if a >= values[-1]:
            out[i] = sign | bits[-1]
            continue
        hi = int(np.searchsorted(values, a))  # values[hi - 1] < a <= values[hi]
        if values[hi] == a:
            out[i] = sign | bits[hi]
            continue
        below, above = a - values[hi - 1], values[hi] - a  # exact: neighbours within a factor 2
        nearer = hi - 1 if below < above or (below == above and bits[hi - 1] % 2 == 0) else hi
        out[i] = sign | bits[nearer]
    return out
