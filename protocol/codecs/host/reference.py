"""Slow, obvious restatements of the host codecs, one element at a time with Python ints, floats and strings of
'0' and '1', that the fast paths are held to bit for bit (tests/protocol/test_host_codecs.py). They share with
the fast paths only the parameters, the Huffman code lengths (which tree to build is a choice, not a
computation to check) and adaptive's entropy of a 2**M-bin histogram; random words come from protocol.reference's
numpy oracle of protocol.rng. They assume well-formed packages: validation is the fast decoders' job.

REFERENCES maps a family to (encode(codec, x, key, offset) -> package, decode(codec, package, count) -> values).
"""

from __future__ import annotations

import math
import struct
from collections.abc import Callable
from fractions import Fraction

import numpy as np

from intml.protocol import reference as rng_oracle
from intml.protocol.codecs.host import huffman
from intml.protocol.codecs.host.adaptive import bits_for, entropy_bits, sample_threshold
from intml.protocol.codecs.host.base import HostCodec
from intml.protocol.codecs.host.lloyd import ROUNDS
from intml.protocol.codecs.host.packing import FLOAT32_MAX


def words(key: int, offset: int, count: int) -> list[int]:
    return [int(w) for w in rng_oracle.bits32(key, np.arange(offset, offset + count, dtype=np.uint64))]


def field(value: int, width: int) -> str:
    return format(value, f"0{width}b")


def to_bytes(bits: str) -> bytes:
    bits += "0" * (-len(bits) % 8)
    return bytes(int(bits[i:i + 8], 2) for i in range(0, len(bits), 8))


def bit_string(data: bytes) -> str:
    return "".join(format(b, "08b") for b in data)


def fields(data: bytes, count: int, width: int) -> list[int]:
    bits = bit_string(data)
    return [int(bits[i * width:(i + 1) * width], 2) for i in range(count)]


def f32(value: float) -> float:
    return struct.unpack(">f", struct.pack(">f", value))[0]


def values_of(x: np.ndarray) -> list[float]:
    return [float(v) for v in x]


def quantize(value: float, lo: float, hi: float, bits: int) -> int:
    if hi == lo:
        return 0
    return min(math.floor((value - lo) / (hi - lo) * 2 ** bits), 2 ** bits - 1)


def uniform_package(xs: list[float], bits: int) -> bytes:
    lo, hi = (min(xs) + 0.0, max(xs) + 0.0) if xs else (0.0, 0.0)
    codes = "".join(field(quantize(v, lo, hi, bits), bits) for v in xs)
    return struct.pack(">ffB", lo, hi, bits) + to_bytes(codes)


def uniform_values(package: bytes, count: int) -> np.ndarray:
    lo, hi, bits = struct.unpack(">ffB", package[:9])
    return np.array([lo + (hi - lo) * ((q + 0.5) / 2 ** bits) for q in fields(package[9:], count, bits)], np.float32)


def adaptive_bits(codec: HostCodec, xs: list[float], key: int, offset: int) -> int:
    lo, hi = (min(xs) + 0.0, max(xs) + 0.0) if xs else (0.0, 0.0)
    sample = [v for v, w in zip(xs, words(key, offset, len(xs))) if w < sample_threshold(codec.f_bp)] or xs
    histogram = [0] * 2 ** codec.m
    for v in sample:
        histogram[quantize(v, lo, hi, codec.m)] += 1
    return bits_for(entropy_bits(np.array(histogram)), codec.c)


def canonical(symbols: list[int], lengths: list[int]) -> dict[int, str]:
    """symbol -> code string, codes handed out in (length, symbol) order, each the last plus one, shifted left."""
    codes, code, previous = {}, 0, None
    for length, symbol in sorted(zip(lengths, symbols)):
        if previous is not None:
            code = (code + 1) << (length - previous)
        codes[symbol], previous = (field(code, length) if length else ""), length
    return codes


def adaptive_huffman_package(codec: HostCodec, x: np.ndarray, key: int, offset: int) -> bytes:
    xs = values_of(x)
    bits = adaptive_bits(codec, xs, key, offset)
    lo, hi = (min(xs) + 0.0, max(xs) + 0.0) if xs else (0.0, 0.0)
    codes = [quantize(v, lo, hi, bits) for v in xs]
    histogram = np.zeros(2 ** bits, np.int64)
    for q in codes:
        histogram[q] += 1
    symbols, lengths = (list(map(int, a)) for a in huffman.code_lengths(histogram))
    book = canonical(symbols, lengths)
    first = min(symbols) if symbols else 0
    span = max(symbols) - first + 1 if symbols else 0
    table = "".join(field(lengths[symbols.index(s)] + 1 if s in symbols else 0, 5) for s in range(first, first + span))
    return (struct.pack(">ffBHI", lo, hi, bits, first, span) + to_bytes(table)
            + to_bytes("".join(book[q] for q in codes)))


def adaptive_huffman_values(codec: HostCodec, package: bytes, count: int) -> np.ndarray:
    lo, hi, bits, first, span = struct.unpack(">ffBHI", package[:15])
    table_bytes = (span * 5 + 7) // 8
    table = fields(package[15:15 + table_bytes], span, 5)
    present = [(first + i, t - 1) for i, t in enumerate(table) if t]
    book = canonical([s for s, _ in present], [n for _, n in present])
    by_code = {code: symbol for symbol, code in book.items()}
    stream, out, prefix = bit_string(package[15 + table_bytes:]), [], ""
    if len(present) == 1:
        out = [present[0][0]] * count
    for bit in stream:
        if len(out) == count:
            break
        prefix += bit
        if prefix in by_code:
            out.append(by_code[prefix])
            prefix = ""
    return np.array([lo + (hi - lo) * ((q + 0.5) / 2 ** bits) for q in out], np.float32)


def lloyd_package(codec: HostCodec, x: np.ndarray) -> bytes:
    xs, count = values_of(x), 2 ** codec.bits
    lo, hi = (min(xs) + 0.0, max(xs) + 0.0) if xs else (0.0, 0.0)
    levels = [lo + (hi - lo) * ((j + 0.5) / count) for j in range(count)]

    def nearest(v: float, levels: list[float]) -> int:
        return sum(1 for a, b in zip(levels, levels[1:]) if (a + b) / 2 <= v)

    for _ in range(ROUNDS):
        sums, members = [0.0] * count, [0] * count
        for v in xs:
            j = nearest(v, levels)
            sums[j] += v
            members[j] += 1
        levels = [sums[j] / members[j] if members[j] else levels[j] for j in range(count)]
    levels = [f32(level) for level in levels]
    codes = "".join(field(nearest(v, levels), codec.bits) for v in xs)
    return bytes([codec.bits]) + struct.pack(f">{count}f", *levels) + to_bytes(codes)


def lloyd_values(codec: HostCodec, package: bytes, count: int) -> np.ndarray:
    levels = struct.unpack_from(f">{2 ** codec.bits}f", package, 1)
    return np.array([levels[q] for q in fields(package[1 + 4 * len(levels):], count, codec.bits)], np.float32)


def bitmask_package(codec: HostCodec, x: np.ndarray) -> bytes:
    tops = [struct.unpack(">I", struct.pack(">f", v))[0] >> (32 - codec.bits) for v in values_of(x)]
    return to_bytes("".join(field(t, codec.bits) for t in tops))


def bitmask_values(codec: HostCodec, package: bytes, count: int) -> np.ndarray:
    return np.array([struct.unpack(">f", struct.pack(">I", t << (32 - codec.bits)))[0]
                     for t in fields(package, count, codec.bits)], np.float32)


def qsgd_package(codec: HostCodec, x: np.ndarray, key: int, offset: int) -> bytes:
    xs = values_of(x)
    norm = math.sqrt(float(sum(Fraction(v) ** 2 for v in xs)))
    width = codec.levels.bit_length()
    codes = ""
    for v, w in zip(xs, words(key, offset, len(xs))):
        level = 0
        if norm:
            r = abs(v) / norm * codec.levels
            level = math.floor(r) + (w / 2 ** 32 < r - math.floor(r))
        codes += ("1" if v < 0 else "0") + field(level, width)
    return struct.pack(">d", norm) + to_bytes(codes)


def qsgd_values(codec: HostCodec, package: bytes, count: int) -> np.ndarray:
    (norm,) = struct.unpack(">d", package[:8])
    width = codec.levels.bit_length() + 1
    out = []
    for code in fields(package[8:], count, width):
        magnitude = min(norm * ((code & ((1 << (width - 1)) - 1)) / codec.levels), FLOAT32_MAX)
        out.append(-magnitude if code >> (width - 1) else magnitude)
    return np.array(out, np.float32)


def terngrad_package(x: np.ndarray, key: int, offset: int) -> bytes:
    xs = values_of(x)
    scale = max((abs(v) for v in xs), default=0.0)
    codes = ""
    for v, w in zip(xs, words(key, offset, len(xs))):
        kept = scale > 0 and w / 2 ** 32 < abs(v) / scale
        codes += "00" if not kept else ("10" if v < 0 else "01")
    return struct.pack(">f", scale) + to_bytes(codes)


def terngrad_values(package: bytes, count: int) -> np.ndarray:
    (scale,) = struct.unpack(">f", package[:4])
    return np.array([(0.0, scale, -scale)[c] for c in fields(package[4:], count, 2)], np.float32)


def signs_package(x: np.ndarray) -> bytes:
    return to_bytes("".join("1" if v >= 0 else "0" for v in values_of(x)))


def signs_values(package: bytes, count: int) -> np.ndarray:
    return np.array([1.0 if b else -1.0 for b in fields(package, count, 1)], np.float32)


def pairs_package(x: np.ndarray, indices: list[int]) -> bytes:
    return b"".join(struct.pack(">If", i, float(x[i])) for i in sorted(indices))


def pairs_values(package: bytes, count: int, scale: float) -> np.ndarray:
    out = [0.0] * count
    for i in range(0, len(package), 8):
        index, value = struct.unpack(">If", package[i:i + 8])
        out[index] = min(value * scale, FLOAT32_MAX) if value >= 0 else max(value * scale, -FLOAT32_MAX)
    return np.array(out, np.float32)


def topk_package(codec: HostCodec, x: np.ndarray) -> bytes:
    k = max(1, int(codec.ratio * x.size)) if x.size else 0
    return pairs_package(x, sorted(range(x.size), key=lambda i: (-abs(float(x[i])), i))[:k])


def randomk_threshold(codec: HostCodec) -> int:
    return max(1, math.floor(codec.ratio * 2 ** 32))


def randomk_package(codec: HostCodec, x: np.ndarray, key: int, offset: int) -> bytes:
    return pairs_package(x, [i for i, w in enumerate(words(key, offset, x.size)) if w < randomk_threshold(codec)])


def float32_package(x: np.ndarray) -> bytes:
    return b"".join(struct.pack(">f", v) for v in values_of(x))


def float32_values(package: bytes, count: int) -> np.ndarray:
    return np.array(struct.unpack(f">{count}f", package), np.float32)


Encode = Callable[[HostCodec, np.ndarray, int, int], bytes]
Decode = Callable[[HostCodec, bytes, int], np.ndarray]
REFERENCES: dict[str, tuple[Encode, Decode]] = {
    "uniform": (lambda c, x, key, offset: uniform_package(values_of(x), c.bits),
                lambda c, package, count: uniform_values(package, count)),
    "adaptive": (lambda c, x, key, offset: uniform_package(values_of(x), adaptive_bits(c, values_of(x), key, offset)),
                 lambda c, package, count: uniform_values(package, count)),
    "adaptive-huffman": (adaptive_huffman_package, adaptive_huffman_values),
    "lloyd": (lambda c, x, key, offset: lloyd_package(c, x), lloyd_values),
    "bitmask": (lambda c, x, key, offset: bitmask_package(c, x), bitmask_values),
    "qsgd": (qsgd_package, qsgd_values),
    "terngrad": (lambda c, x, key, offset: terngrad_package(x, key, offset),
                 lambda c, package, count: terngrad_values(package, count)),
    "signsgd": (lambda c, x, key, offset: signs_package(x), lambda c, package, count: signs_values(package, count)),
    "topk": (lambda c, x, key, offset: topk_package(c, x), lambda c, package, count: pairs_values(package, count, 1.0)),
    "randomk": (randomk_package,
                lambda c, package, count: pairs_values(package, count, 2 ** 32 / randomk_threshold(c))),
    "powersgd": (lambda c, x, key, offset: float32_package(x),
                 lambda c, package, count: float32_values(package, count)),
}
