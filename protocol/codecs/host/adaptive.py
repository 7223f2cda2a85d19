"""``adaptive`` and ``adaptive-huffman``, seed 001's Algorithms 1 and 2: each package quantized like uniform<N>
with N = ceil(H + c), H the entropy (bits) of a keyed F-fraction sample of it quantized to M bits; then, for
adaptive-huffman, the codes Huffman-coded with the codebook in the package.

The paper picks N per layer per epoch; a host codec sees a package at a time, so N is picked per package (a
package is a run of one tensor: with large packages the two agree). The sample is keyed like C_nat's roundings:
element i is in it when its random word is below F * 2**32, and an empty sample is the whole package.

Packages: adaptive's is uniform<N>'s (w_min, w_max, N, codes) with N in 1..16; adaptive-huffman's is the paper's
[E, w_min, w_max, P, N] reordered as w_min, w_max (float32), N (uint8), the codebook (P as code lengths:
protocol.codecs.host.huffman), E.
"""

from __future__ import annotations

import math
import re

import numpy as np

from intml.protocol.codecs.host import huffman
from intml.protocol.codecs.host.base import HostCodec, MalformedPackage
from intml.protocol.codecs.host.packing import Reader, random_words
from intml.protocol.codecs.host.uniform import (MAX_BITS, centres, decode_fixed, encode_fixed, quantize, range_of,
                                                read_range)

DEFAULT_C, DEFAULT_M, DEFAULT_F = 5, 4, 300  # c = 5 bits, M = 4 bits, F = 3% (in basis points)
BASIS = 10000


def entropy_bits(histogram: np.ndarray) -> float:
    """The entropy in bits of a histogram's distribution, summed bin by bin in order (so every encoder agrees)."""
    total = int(histogram.sum())
    h = 0.0
    for count in histogram:
        if count:
            p = int(count) / total
            h -= p * math.log2(p)
    return h


def bits_for(entropy: float, c: int) -> int:
    """N = ceil(H + c), kept in 1..16."""
    return min(MAX_BITS, max(1, math.ceil(entropy + c)))


def sample_threshold(f_bp: int) -> int:
    """An element is in the sample when its random word is below this: F of 2**32."""
    return f_bp * 2 ** 32 // BASIS


class Adaptive(HostCodec):
    wire_id = 17
    unbiased = False
    switch_reason = ("adaptive picks N per package from its entropy and scales by its own range: "
                     "a switch cannot add codes of different widths on different grids")
    family = "adaptive"

    def __init__(self, c: int = DEFAULT_C, m: int = DEFAULT_M, f_bp: int = DEFAULT_F) -> None:
        if not (0 <= c <= MAX_BITS and 1 <= m <= 8 and 1 <= f_bp <= BASIS):
            raise ValueError(f"{self.family} takes c in 0..16, m in 1..8 and f in (0, 1]; got c={c} m={m} "
                             f"f={f_bp / BASIS}")
        self.c, self.m, self.f_bp = c, m, f_bp
        self.name = self.family + "".join(
            f"-{letter}{value}" for letter, value, default in
            (("c", c, DEFAULT_C), ("m", m, DEFAULT_M), ("f", f"{f_bp / BASIS:g}", f"{DEFAULT_F / BASIS:g}"))
            if value != default)

    @classmethod
    def parse(cls, text: str) -> Adaptive:
        """From the text after the family's name: ``-c6``, ``-m4``, ``-f0.03`` in any order, or nothing."""
        fields = {"c": DEFAULT_C, "m": DEFAULT_M, "f": DEFAULT_F}
        for part in text.split("-")[1:] if text.startswith("-") else ([text] if text else []):
            match = re.fullmatch(r"([cm])(\d+)|f(0?\.\d+|1(\.0*)?)", part)
            if not match:
                raise ValueError(f"{cls.family} takes -c<bits>, -m<bits> and -f<fraction>, as in "
                                 f"{cls.family}-c6; got {text!r}")
            if match.group(1):
                fields[match.group(1)] = int(match.group(2))
            else:
                fields["f"] = round(float(match.group(3)) * BASIS)
        return cls(fields["c"], fields["m"], fields["f"])

    @classmethod
    def from_param(cls, param: int) -> Adaptive:
        """c in bits 0-7, M in bits 8-15, F in basis points in bits 16-31."""
        try:
            return cls(param & 0xFF, (param >> 8) & 0xFF, param >> 16)
        except ValueError as error:
            raise MalformedPackage(str(error)) from None

    def wire_param(self) -> int:
        return self.c | self.m << 8 | self.f_bp << 16

    def bits(self, x: np.ndarray, key: int, offset: int, lo: float, hi: float) -> int:
        """N for this package: Algorithm 1's EstimateEntropy on the keyed sample, plus c."""
        sample = x[random_words(key, offset, x.size) < sample_threshold(self.f_bp)]
        if sample.size == 0:
            sample = x
        histogram = np.bincount(quantize(sample, lo, hi, self.m), minlength=2 ** self.m)
        return bits_for(entropy_bits(histogram), self.c)

    def encode(self, x: np.ndarray, key: int, offset: int) -> bytes:
        lo, hi = range_of(x)
        return encode_fixed(x, self.bits(x, key, offset, lo, hi))

    def decode(self, package: bytes, count: int) -> np.ndarray:
        return decode_fixed(package, count, self.name, None)


class AdaptiveHuffman(Adaptive):
    wire_id = 18
    switch_reason = ("adaptive-huffman sends variable-length codes with a per-package codebook: "
                     "a switch cannot find an element's code, let alone add them")
    family = "adaptive-huffman"

    def encode(self, x: np.ndarray, key: int, offset: int) -> bytes:
        lo, hi = range_of(x)
        bits = self.bits(x, key, offset, lo, hi)
        codes = quantize(x, lo, hi, bits)
        symbols, lengths = huffman.code_lengths(np.bincount(codes, minlength=2 ** bits))
        return (np.array((lo, hi), ">f4").tobytes() + bytes([bits]) + huffman.write_codebook(symbols, lengths)
                + huffman.encode(codes, symbols, lengths))

    def decode(self, package: bytes, count: int) -> np.ndarray:
        reader = Reader(package, self.name)
        lo, hi, bits = read_range(reader)
        symbols, lengths = huffman.read_codebook(reader, 2 ** bits)
        return centres(huffman.decode(reader.rest(), symbols, lengths, count, self.name), lo, hi, bits)


FAMILIES = {codec.family: (codec.wire_id, codec.parse, codec.from_param) for codec in (Adaptive, AdaptiveHuffman)}
