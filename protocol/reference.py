"""Plain-numpy reference of the whole arithmetic: slow, obvious, and the oracle the fast kernels are tested
against bit for bit. It restates the specs of protocol.rng, protocol.cnat and protocol.arith with float64 and
Python-int arithmetic instead of bit tricks, and shares no code with the kernels beyond the scalar key
derivation (``stream_key``), which is itself checked against a hand-computed value in the tests.
"""

from __future__ import annotations

import numpy as np

from intml.protocol.rng import MASK64, splitmix64_int, stream_key

E_MIN, E_MAX = -50, 10  # C_nat exponents
INT32_E_MIN, INT32_E_MAX = -126, 127  # int32 mode's exponent range: float32's normal exponents


def bits32(key: int, index: np.ndarray) -> np.ndarray:
    """The 32-bit random word of each element index, per protocol.rng."""
    index = np.asarray(index, dtype=np.uint64)
    hi = (index >> np.uint64(32)).astype(object)
    block = np.array([splitmix64_int((key + int(h)) & MASK64) >> 32 for h in hi], dtype=np.uint64)
    x = ((index & np.uint64(0xFFFFFFFF)) ^ block).astype(np.uint32)
    with np.errstate(over="ignore"):
        x ^= x >> np.uint32(16)
        x *= np.uint32(0x7FEB352D)
        x ^= x >> np.uint32(15)
        x *= np.uint32(0x846CA68B)
        x ^= x >> np.uint32(16)
    return x


def code_of(negative: bool, e: int) -> int:
    return (0x80 if negative else 0) | 0x40 | (e + 50)


def encode(
    x: np.ndarray, *, seed: int | None, stream: int = 0, offset: int = 0, floor: int = E_MIN
) -> tuple[np.ndarray, int]:
    """C_nat encode; seed=None is the deterministic (nearest, ties away) variant. Returns (codes, saturated)."""
    x = np.asarray(x, dtype=np.float32).reshape(-1)
    if not np.all(np.isfinite(x)):
        raise ValueError(f"non-finite value at index {int(np.argmin(np.isfinite(x)))}")
    if seed is None:
        r = np.full(x.size, 2**31 - 1, dtype=np.float64)
    else:
        r = bits32(stream_key(seed, stream), np.arange(offset, offset + x.size, dtype=np.uint64)).astype(np.float64)
    codes = np.zeros(x.size, np.uint8)
    saturated = 0
    for i, v in enumerate(x.astype(np.float64)):
        ax = abs(v)
        if ax == 0:
            continue
        if ax < 2.0**floor:
            if r[i] < ax * 2.0 ** (32 - floor):
                codes[i] = code_of(v < 0, floor)
            continue
        mantissa, exponent = np.frexp(ax)  # ax = mantissa * 2**exponent, mantissa in [0.5, 1)
        a = int(exponent) - 1
        fraction = ax / 2.0**a - 1.0  # in [0, 1), exact
        e = a + int(r[i] < fraction * 2.0**32)
        if ax > 2.0**E_MAX:
            saturated += 1
        codes[i] = code_of(v < 0, min(e, E_MAX))
    return codes, saturated


def decode(codes: np.ndarray) -> np.ndarray:
    out = np.empty(np.size(codes), np.float32)
    for i, c in enumerate(np.asarray(codes, dtype=np.uint8).reshape(-1)):
        c = int(c)
        k = c & 0x3F
        if c == 0:
            out[i] = 0.0
        elif not c & 0x40 or k > 60:
            out[i] = np.nan
        else:
            out[i] = (-1.0 if c & 0x80 else 1.0) * 2.0 ** (k - 50)
    return out


def is_valid(code: int) -> bool:
    return code == 0 or (bool(code & 0x40) and (code & 0x3F) <= 60)


def to_fixed(codes: np.ndarray, floor: int) -> np.ndarray:
    """Integer value of each code in units of 2**floor (codes assumed valid and >= 2**floor)."""
    values = decode(codes).astype(np.float64)
    return (values / 2.0**floor).astype(np.int64)


def sum_to_codes(sums: np.ndarray, floor: int, *, seed: int, stream: int, offset: int = 0) -> tuple[np.ndarray, int]:
    """Stochastic C_nat of integer sums in units of 2**floor. Returns (codes, saturated)."""
    sums = np.asarray(sums, dtype=np.int64).reshape(-1)
    r = bits32(stream_key(seed, stream), np.arange(offset, offset + sums.size, dtype=np.uint64))
    codes = np.zeros(sums.size, np.uint8)
    saturated = 0
    for i, s in enumerate(sums):
        a = abs(int(s))
        if a == 0:
            continue
        b = a.bit_length() - 1
        remainder = a - (1 << b)
        e = b + floor + int((int(r[i]) >> (32 - b)) < remainder)
        if e > E_MAX:
            saturated += 1
            e = E_MAX
        codes[i] = code_of(s < 0, e)
    return codes, saturated


def chunk_exponent(x: np.ndarray, lo: int, hi: int) -> int:
    """floor(log2 max|x|) + 1 clipped to [lo, hi]; -128 (no exponent) for an all-zero chunk."""
    top = float(np.max(np.abs(x.astype(np.float64)))) if x.size else 0.0
    if top == 0.0:
        return -128
    _, exponent = np.frexp(top)  # top = m * 2**exponent, m in [0.5, 1): floor(log2 top) + 1 == exponent
    return min(hi, max(lo, int(exponent)))


def cnat8_chunk(parts: list[np.ndarray], *, seed: int, allreduce_seq: int, offset: int) -> np.ndarray:
    """The cnat8 result of one chunk whose ranks' inputs are parts (tensor elements offset..): agree on the max
    exponent, encode each rank's part against its floor, add integers exactly, re-encode the sum, decode."""
    s = 31 - len(parts).bit_length()
    e = max(chunk_exponent(x, E_MIN, E_MAX) for x in parts)
    floor = E_MIN if e == -128 else max(E_MIN, e - s)
    total = np.zeros(parts[0].size, np.int64)
    for rank, x in enumerate(parts):
        worker_stream = (allreduce_seq << 24) | (1 << 16) | rank
        codes, _ = encode(x, seed=seed, stream=worker_stream, offset=offset, floor=floor)
        total += to_fixed(codes, floor)
    codes, _ = sum_to_codes(total, floor, seed=seed, stream=(allreduce_seq << 24) | (2 << 16), offset=offset)
    return decode(codes)


def int32_chunk(parts: list[np.ndarray], *, seed: int, allreduce_seq: int, offset: int) -> np.ndarray:
    """The int32 result of one chunk: agree on the max exponent E, add rint(x * 2**(s - E)) (clamped to +-2**s)
    exactly, scale the sum back by 2**(E - s). Deterministic: seed, allreduce_seq and offset play no part."""
    s = 31 - len(parts).bit_length()
    e = max(chunk_exponent(x, INT32_E_MIN, INT32_E_MAX) for x in parts)
    scale = s - (INT32_E_MIN if e == -128 else e)
    limit = 2.0**s
    total = sum(np.clip(np.rint(x.astype(np.float64) * 2.0**scale), -limit, limit) for x in parts)
    return (total * 2.0**-scale).astype(np.float32)


CHUNK_RESULTS = {"cnat8": cnat8_chunk, "int32": int32_chunk}  # by codec name


def allreduce(inputs: list[np.ndarray], *, codec: str, seed: int, allreduce_seq: int, packet_elements: int) -> np.ndarray:
    """The sum every worker receives (docs/arithmetic.md, "One chunk, end to end"): chunk by chunk, the codec's
    result."""
    chunk_result = CHUNK_RESULTS[codec]
    flat = [np.asarray(x, dtype=np.float32).reshape(-1) for x in inputs]
    out = np.zeros(flat[0].size, np.float32)
    for lo in range(0, out.size, packet_elements):
        parts = [x[lo:lo + packet_elements] for x in flat]
        out[lo:lo + packet_elements] = chunk_result(parts, seed=seed, allreduce_seq=allreduce_seq, offset=lo)
    return out
