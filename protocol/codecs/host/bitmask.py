"""``bitmask`` (``bitmask<B>``), seed 000's naive bitmask quantization: each float32 masked to its top B bits
(sign, exponent and B - 9 mantissa bits; B = 16 by default, bfloat16's truncation), the rest dropped.

Package: the B-bit tops packed most significant bit first, nothing else. Truncation rounds toward zero: biased.
"""

from __future__ import annotations

import numpy as np

from intml.protocol.codecs.host.base import HostCodec, MalformedPackage
from intml.protocol.codecs.host.packing import integer_suffix, pack_codes, unpack_codes, wire_integer

DEFAULT_BITS = 16
EXPONENT = 0x7F800000


class Bitmask(HostCodec):
    wire_id = 20
    unbiased = False
    switch_reason = "bitmask packs B-bit floats: a switch adds integers, not floats"

    def __init__(self, bits: int = DEFAULT_BITS) -> None:
        self.bits = bits
        self.name = "bitmask" if bits == DEFAULT_BITS else f"bitmask{bits}"

    def wire_param(self) -> int:
        return self.bits

    def encode(self, x: np.ndarray, key: int, offset: int) -> bytes:
        return pack_codes(x.astype(np.float32).view(np.uint32) >> (32 - self.bits), self.bits)

    def decode(self, package: bytes, count: int) -> np.ndarray:
        words = unpack_codes(package, count, self.bits, self.name) << np.uint32(32 - self.bits)
        if np.any(words & EXPONENT == EXPONENT):
            raise MalformedPackage(f"a {self.name} package holds an infinity or a NaN")
        return words.view(np.float32)


FAMILIES = {"bitmask": (Bitmask.wire_id,
                        lambda text: Bitmask(integer_suffix(text, "bitmask", 9, 32) if text else DEFAULT_BITS),
                        lambda param: Bitmask(wire_integer(param, "bitmask", 9, 32)))}
