"""``qsgd<s>`` (Alistarh et al., in seed 003's survey): each value as ||x|| * sign * l / s, l in 0..s rounded at
random between the two levels around |x| / ||x|| * s so that the expectation is the value.

Package: the package's L2 norm (float64: float32 values' norm may overflow float32), then each element's sign bit
and level (bit_length(s) bits) packed most significant bit first. The rounding draws are keyed as C_nat's: element
i's random word / 2**32 against the fraction (unbiased to within 2**-32 of a level).
"""

from __future__ import annotations

import math

import numpy as np

from intml.protocol.codecs.host.base import MalformedPackage
from intml.protocol.codecs.host.packing import (IntegerCodec, Reader, pack_codes, saturated, uniforms,
                                                unpack_codes)

MAX_LEVELS = 2 ** 15


def norm_of(x: np.ndarray) -> float:
    """The L2 norm. The squares of float32 values are exact in float64 and fsum rounds their sum once, so every
    encoder gets the same norm whatever order it adds in, and no |x| exceeds it (each square is at most the sum,
    and sqrt is correctly rounded)."""
    return math.sqrt(math.fsum((x.astype(np.float64) ** 2).tolist()))


class QSGD(IntegerCodec):
    wire_id = 21
    unbiased = True
    switch_reason = "qsgd<s> scales by each package's own norm: a switch cannot add levels of different scales"
    family, low, high = "qsgd", 1, MAX_LEVELS

    def __init__(self, levels: int) -> None:
        super().__init__(levels)
        self.levels = levels
        self.width = levels.bit_length() + 1

    def encode(self, x: np.ndarray, key: int, offset: int) -> bytes:
        norm = norm_of(x)
        if norm == 0:
            level = np.zeros(x.size, np.uint32)
        else:
            r = np.abs(x.astype(np.float64)) / norm * self.levels
            floor = np.floor(r)
            level = (floor + (uniforms(key, offset, x.size) < r - floor)).astype(np.uint32)
        sign = (x < 0).astype(np.uint32) << (self.width - 1)
        return np.array(norm, ">f8").tobytes() + pack_codes(sign | level, self.width)

    def decode(self, package: bytes, count: int) -> np.ndarray:
        reader = Reader(package, self.name)
        (norm,) = reader.take("d")
        if not (np.isfinite(norm) and norm >= 0):
            raise MalformedPackage(f"a {self.name} package's norm {norm} is not one an encoder sends")
        codes = unpack_codes(reader.rest(), count, self.width, self.name)
        level = codes & ((1 << (self.width - 1)) - 1)
        if np.any(level > self.levels):
            raise MalformedPackage(f"a {self.name} package's level is past {self.levels}")
        magnitude = norm * (level / self.levels)
        return saturated(np.where(codes >> (self.width - 1) == 1, -magnitude, magnitude))


FAMILIES = QSGD.entry()
