"""``signsgd`` with majority vote (Bernstein et al., in seed 003's survey): a worker sends each value's sign,
the aggregator sends back the sign of the votes' sum, so both directions cost 1 bit per element.

Package (either way): one bit per element, 1 for x >= 0 (+1) and 0 for x < 0 (-1), packed most significant bit
first. A tied vote goes to +1. The result is the vote's sign, not a sum: the worker scales it by its step size.
"""

from __future__ import annotations

import numpy as np

from intml.protocol.codecs.host.base import HostCodec
from intml.protocol.codecs.host.packing import pack_codes, parameterless, unpack_codes


def signs_package(positive: np.ndarray) -> bytes:
    """One bit per element, 1 for +1."""
    return pack_codes(positive.astype(np.uint32), 1)


def signs_of(package: bytes, count: int, codec: str) -> np.ndarray:
    """The +1 / -1 values of a package of sign bits."""
    return np.where(unpack_codes(package, count, 1, codec) == 1, np.float32(1), np.float32(-1)).astype(np.float32)


class SignSGD(HostCodec):
    wire_id = 23
    unbiased = False
    switch_reason = "signsgd's result is the sign of the vote, a step no switch pipeline takes after the sum"
    name = "signsgd"

    def wire_param(self) -> int:
        return 0

    def encode(self, x: np.ndarray, key: int, offset: int) -> bytes:
        return signs_package(x >= 0)

    def decode(self, package: bytes, count: int) -> np.ndarray:
        return signs_of(package, count, self.name)

    def encode_result(self, total: np.ndarray) -> bytes:
        """The majority's sign, 1 bit per element."""
        return signs_package(total >= 0)

    def decode_result(self, package: bytes, count: int) -> np.ndarray:
        return signs_of(package, count, self.name)


FAMILIES = {"signsgd": (SignSGD.wire_id, *parameterless(SignSGD, "signsgd"))}
