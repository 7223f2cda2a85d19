"""``topk<ratio>`` (in seed 003's survey, with error feedback): the floor(ratio * count) values of largest
magnitude in each package (ties to the lower index), the rest dropped; meant for use with base.Memory.

Package: the kept elements as (index uint32, value float32) pairs, indices ascending and relative to the
package, no header (the length says how many). The same sparse layout serves randomk.
"""

from __future__ import annotations

import math

import numpy as np

from intml.protocol.codecs.host.base import HostCodec, MalformedPackage
from intml.protocol.codecs.host.packing import float32_ratio, ratio_bits, ratio_name, ratio_of_bits

PAIR = np.dtype([("index", ">u4"), ("value", ">f4")])


def sparse_package(x: np.ndarray, indices: np.ndarray) -> bytes:
    """The (index, value) pairs of ``x`` at ascending ``indices``."""
    pairs = np.zeros(indices.size, PAIR)
    pairs["index"], pairs["value"] = indices, x[indices]
    return pairs.tobytes()


def sparse_pairs(package: bytes, count: int, codec: str) -> tuple[np.ndarray, np.ndarray]:
    """(indices, values) of a sparse package: whole pairs, indices strictly ascending and below ``count``, values
    finite; MalformedPackage otherwise."""
    if len(package) % PAIR.itemsize:
        raise MalformedPackage(f"a {codec} package of {len(package)} bytes is not whole (index, value) pairs")
    pairs = np.frombuffer(package, PAIR)
    indices, values = pairs["index"].astype(np.int64), pairs["value"].astype(np.float32)
    if indices.size and (indices[-1] >= count or np.any(np.diff(indices) <= 0)):
        raise MalformedPackage(f"a {codec} package's indices are not ascending below {count}")
    if not np.all(np.isfinite(values)):
        raise MalformedPackage(f"a {codec} package holds a non-finite value")
    return indices, values


def kept(ratio: float, count: int) -> int:
    """How many elements top-k keeps of ``count``: floor(ratio * count), at least one of a non-empty package
    (floor, as GRACE's: the float32 ratio 0.1 is a little over 0.1, and 10% of 50 should be 5)."""
    return max(1, math.floor(ratio * count)) if count else 0


def largest(magnitudes: np.ndarray, k: int) -> np.ndarray:
    """The ascending indices of the ``k`` largest ``magnitudes``, ties to the lower index: those above the k-th
    largest, then the first ones equal to it (a partition, linear, where a stable sort is n log n)."""
    if k == 0:
        return np.zeros(0, np.int64)
    kth = np.partition(magnitudes, magnitudes.size - k)[magnitudes.size - k]
    above = np.flatnonzero(magnitudes > kth)
    return np.sort(np.concatenate((above, np.flatnonzero(magnitudes == kth)[:k - above.size])))


class Sparse(HostCodec):
    """What top-k and random-k share: a ratio in the name and the JOIN's parameter, and the sparse package."""

    family: str

    def __init__(self, ratio: float) -> None:
        self.ratio = ratio
        self.name = ratio_name(self.family, ratio)
        self.switch_reason = (f"{self.family} sends (index, value) pairs that differ per worker: "
                              "a switch sums aligned slots only")

    def wire_param(self) -> int:
        return ratio_bits(self.ratio)

    @classmethod
    def entry(cls) -> dict:
        """The family's FAMILIES entry."""
        return {cls.family: (cls.wire_id, lambda text: cls(float32_ratio(text, cls.family)),
                             lambda param: cls(ratio_of_bits(param, cls.family)))}


class TopK(Sparse):
    wire_id = 24
    unbiased = False
    family = "topk"

    def encode(self, x: np.ndarray, key: int, offset: int) -> bytes:
        return sparse_package(x, largest(np.abs(x), kept(self.ratio, x.size)))

    def decode(self, package: bytes, count: int) -> np.ndarray:
        indices, values = sparse_pairs(package, count, self.name)
        if indices.size != kept(self.ratio, count):
            raise MalformedPackage(f"a {self.name} package of {count} elements keeps {kept(self.ratio, count)}, "
                                   f"not {indices.size}")
        out = np.zeros(count, np.float32)
        out[indices] = values
        return out


FAMILIES = TopK.entry()
