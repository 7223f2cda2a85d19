"""``randomk<ratio>`` (in seed 003's survey): each element kept with probability ratio, chosen by its keyed random
word (below T = floor(ratio * 2**32)), and scaled on receipt by 2**32 / T, the inverse of that probability, so that
the expectation is the value.

Being unbiased, it needs no error feedback, and must not have it: a kept element decodes to 1 / ratio times
itself, so base.Memory would keep 1 - 1 / ratio times it, and the residual would grow without bound. (GRACE's
random-k sends values unscaled, biased, for use with memory; top-k is this package's codec for error feedback.)

Package: topk's (index, value) pairs of the kept elements, values unscaled.
"""

from __future__ import annotations

import numpy as np

from intml.protocol.codecs.host.packing import random_words, saturated
from intml.protocol.codecs.host.topk import Sparse, sparse_package, sparse_pairs


def threshold(ratio: float) -> int:
    """Elements whose random word is below this are kept (at least 1, at most 2**32: all)."""
    return max(1, int(ratio * 2 ** 32))


class RandomK(Sparse):
    wire_id = 25
    unbiased = True
    family = "randomk"

    def encode(self, x: np.ndarray, key: int, offset: int) -> bytes:
        return sparse_package(x, np.flatnonzero(random_words(key, offset, x.size) < threshold(self.ratio)))

    def decode(self, package: bytes, count: int) -> np.ndarray:
        indices, values = sparse_pairs(package, count, self.name)
        out = np.zeros(count, np.float32)
        out[indices] = saturated(values.astype(np.float64) * (2 ** 32 / threshold(self.ratio)))
        return out


FAMILIES = RandomK.entry()
