"""The interface of a host-aggregated codec: one a switch cannot sum (variable-length codes, per-package
codebooks, sparse indices), so the aggregator's host mode decodes each contribution, combines them and encodes
the result (docs/codecs.md).

In GRACE's split, a ``HostCodec`` is the compressor: stateless between calls, keyed like C_nat so that a
stochastic one is reproducible. The worker-side state of error feedback is a ``Memory``, kept per tensor by the
caller, never by the codec.

A package is the payload of one DATA or RESULT datagram: ``count`` consecutive elements of a tensor, starting at
element ``offset``, self-describing (its own header: a scale, a codebook, N), its length varying per package.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence

import numpy as np
from numba import njit


class MalformedPackage(ValueError):
    """A package that cannot be what its codec sends (a short header, an N out of range, an oversized or
    inconsistent codebook, an index past the tensor): the receiver counts it and drops it."""


class HostCodec(ABC):
    """A host-aggregated codec with its parameters (``uniform8``, ``topk0.01``: see protocol.codecs.host.parse).

    Contract held by every codec's tests:
      * ``decode(encode(x))`` equals the slow reference's bit for bit, and is unbiased where ``unbiased`` says so;
      * ``decode`` of any bytes returns ``count`` float32 values or raises ``MalformedPackage``, never anything
        else;
      * ``combine`` sums in rank order, so the result is independent of arrival order and loss.
    """

    name: str  # what users and command lines call it, parameters included
    wire_id: int  # the JOIN's codec field (protocol.codec.Codec values are the switch codecs'; host ids start at 16)
    unbiased: bool  # E[decode(encode(x))] = x
    switch_reason: str  # one line: why a switch cannot run it (the P4 engine's refusal at JOIN)

    @abstractmethod
    def wire_param(self) -> int:
        """The codec's parameters as the JOIN's 32-bit codec parameter (N, s, the rank; a ratio as float32 bits)."""

    @abstractmethod
    def encode(self, x: np.ndarray, key: int, offset: int) -> bytes:
        """A worker's package of float32 ``x`` (elements ``offset``.. of the tensor; random words keyed by
        ``key`` and the element index, as C_nat's are)."""

    @abstractmethod
    def decode(self, package: bytes, count: int) -> np.ndarray:
        """The ``count`` float32 values a contribution's package stands for."""

    def combine(self, decoded: np.ndarray | Sequence[np.ndarray]) -> np.ndarray:
        """The aggregate of the contributions, given in rank order (one float32 row each): their sum, in float64
        and in that order."""
        return sum_rows(np.asarray(decoded, np.float32))

    def encode_result(self, total: np.ndarray) -> bytes:
        """The aggregator's RESULT package of ``combine``'s output: by default its float32 values, big-endian (what
        the workers receive is exact to float32; a codec may send less)."""
        return total.astype(">f4").tobytes()

    def decode_result(self, package: bytes, count: int) -> np.ndarray:
        """The float32 values a RESULT package stands for."""
        if len(package) != 4 * count:
            raise MalformedPackage(f"a {self.name} result of {count} elements is {4 * count} bytes, got {len(package)}")
        return np.frombuffer(package, ">f4").astype(np.float32)


@njit(cache=True)
def sum_rows(rows):
    """The float64 sum of a 2-D float32 array's rows, added in row order."""
    total = np.zeros(rows.shape[1], np.float64)
    for r in range(rows.shape[0]):
        for i in range(rows.shape[1]):
            total[i] += rows[r, i]
    return total


class Memory:
    """Error feedback (GRACE's memory): what compression left out of a tensor is added to its next gradient."""

    def __init__(self, size: int) -> None:
        self.residual = np.zeros(size, np.float32)

    def compensate(self, x: np.ndarray) -> np.ndarray:
        """The gradient plus what earlier rounds left out: what the codec encodes."""
        return x + self.residual

    def update(self, compensated: np.ndarray, sent: np.ndarray) -> None:
        """Keep what this round left out (``sent``: the decoded values of the package sent)."""
        self.residual = compensated - sent
