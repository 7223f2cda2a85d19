"""``lloyd<N>``, seed 000's Lloyd quantizer: 2**N levels fitted to each package by Lloyd-Max iterations (each
level the mean of the values nearest it), a value sent as the index of its nearest level.

Package: N (uint8), the 2**N levels (float32, ascending), the N-bit codes packed most significant bit first.
ROUNDS iterations from uniform<N>'s bin centres; a level no value is nearest keeps its place. The levels are
rounded to float32 before the final assignment, so the codes index the levels as sent.
"""

from __future__ import annotations

import numpy as np

from intml.protocol.codecs.host.base import MalformedPackage
from intml.protocol.codecs.host.packing import (IntegerCodec, Reader, pack_codes, unpack_codes,
                                                wire_integer)
from intml.protocol.codecs.host.uniform import range_of

MAX_BITS = 8  # 256 levels already cost 1 KiB of header per package
ROUNDS = 8


def nearest(x: np.ndarray, levels: np.ndarray) -> np.ndarray:
    """The index of each value's nearest level (ascending levels; a value on a midpoint goes up)."""
    return np.searchsorted((levels[:-1] + levels[1:]) / 2, x.astype(np.float64), side="right").astype(np.uint32)


def fit(x: np.ndarray, bits: int) -> tuple[np.ndarray, np.ndarray]:
    """(levels as float32, codes) after ROUNDS Lloyd-Max iterations."""
    lo, hi = range_of(x)
    count = 2 ** bits
    levels = lo + (hi - lo) * ((np.arange(count) + 0.5) / count)
    x64 = x.astype(np.float64)
    for _ in range(ROUNDS):
        codes = nearest(x64, levels)
        members = np.bincount(codes, minlength=count)
        # bincount adds the weights in input order, as the reference's loop does.
        sums = np.bincount(codes, weights=x64, minlength=count)
        levels = np.where(members > 0, sums / np.maximum(members, 1), levels)
    levels32 = levels.astype(np.float32)
    return levels32, nearest(x64, levels32.astype(np.float64))


class Lloyd(IntegerCodec):
    wire_id = 19
    unbiased = False
    switch_reason = "lloyd<N> sends indices into each package's own codebook of levels: a switch cannot add them"
    family, low, high = "lloyd", 1, MAX_BITS

    def __init__(self, bits: int) -> None:
        super().__init__(bits)
        self.bits = bits

    def encode(self, x: np.ndarray, key: int, offset: int) -> bytes:
        levels, codes = fit(x, self.bits)
        return bytes([self.bits]) + levels.astype(">f4").tobytes() + pack_codes(codes, self.bits)

    def decode(self, package: bytes, count: int) -> np.ndarray:
        reader = Reader(package, self.name)
        (bits,) = reader.take("B")
        if bits != self.bits:
            raise MalformedPackage(f"a {self.name} package says N = {bits}")
        levels = np.array(reader.take(f"{2 ** bits}f"), np.float32)
        if not np.all(np.isfinite(levels)):
            raise MalformedPackage(f"a {self.name} package's levels are not finite")
        return levels[unpack_codes(reader.rest(), count, bits, self.name)]


FAMILIES = Lloyd.entry()
