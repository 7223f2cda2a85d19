"""``terngrad`` (Wen et al., in seed 003's survey): each value as 0 or sign * max|x|, the latter with probability
|x| / max|x|, so that the expectation is the value.

Package: max|x| (float32), then 2-bit codes (0: zero, 1: +max, 2: -max) packed most significant bit first. The
draws are keyed as C_nat's: element i's random word / 2**32 against |x| / max|x|.
"""

from __future__ import annotations

import numpy as np

from intml.protocol.codecs.host.base import HostCodec, MalformedPackage
from intml.protocol.codecs.host.packing import Reader, pack_codes, parameterless, uniforms, unpack_codes

ZERO, PLUS, MINUS = 0, 1, 2


class TernGrad(HostCodec):
    wire_id = 22
    unbiased = True
    switch_reason = "terngrad scales by each package's own max|x|: a switch cannot add ternaries of different scales"
    name = "terngrad"

    def wire_param(self) -> int:
        return 0

    def encode(self, x: np.ndarray, key: int, offset: int) -> bytes:
        scale = np.abs(x).max() if x.size else np.float32(0)
        if scale == 0:
            codes = np.zeros(x.size, np.uint32)
        else:
            kept = uniforms(key, offset, x.size) < np.abs(x.astype(np.float64)) / float(scale)
            codes = np.where(kept, np.where(x < 0, MINUS, PLUS), ZERO).astype(np.uint32)
        return np.array(scale, ">f4").tobytes() + pack_codes(codes, 2)

    def decode(self, package: bytes, count: int) -> np.ndarray:
        reader = Reader(package, self.name)
        (scale,) = reader.take("f")
        if not (np.isfinite(scale) and scale >= 0):
            raise MalformedPackage(f"a terngrad package's scale {scale} is not one an encoder sends")
        codes = unpack_codes(reader.rest(), count, 2, self.name)
        if np.any(codes > MINUS):
            raise MalformedPackage("a terngrad package holds the unused code 3")
        signs = np.array([0.0, 1.0, -1.0], np.float32)
        return (signs[codes] * np.float32(scale)).astype(np.float32)


FAMILIES = {"terngrad": (TernGrad.wire_id, *parameterless(TernGrad, "terngrad"))}
