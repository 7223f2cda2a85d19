"""``powersgd<rank>`` (Vogels et al., in seed 003's survey): a gradient matrix M (n x m) sent as two thin factors,
with error feedback and a warm-started power iteration. It needs the tensor's matrix shape and two sums per step,
which a per-package codec does not see, so it comes in two parts:

* ``PowerSGD``, the HostCodec, carries the factors: a package is float32 values, summed exactly as any dense
  codec's (the factors of all workers add up because M -> M Q and M -> M^T P are linear);
* ``LowRank``, one worker's state for one matrix (its Q and its error-feedback Memory), makes the factors and
  takes the sums back. One step is two allreduces with the powersgd codec, over n x rank then m x rank values:

      p = state.first(gradient)        # this worker's M Q, flattened
      q = state.second(allreduce(p))   # orthonormalise the sum of M Q, then this worker's M^T P
      update = state.finish(allreduce(q))   # P Q^T: the rank-r approximation of the sum of the gradients

What every rank computes from the sums (the orthonormal P, the update) uses only element-wise arithmetic and
fsum's correctly rounded dot products, so it is bit-identical across ranks and machines; each rank's own products
M Q and M^T P need not be. Every rank must construct its LowRank with the same key (Q's first draw).
"""

from __future__ import annotations

import math

import numpy as np

from intml.protocol.codecs.host.base import MalformedPackage, Memory
from intml.protocol.codecs.host.packing import IntegerCodec, uniforms

MAX_RANK = 1024


class PowerSGD(IntegerCodec):
    wire_id = 26
    unbiased = False
    switch_reason = ("powersgd orthonormalises the first sum before the second round: a step between two "
                     "allreduces that a switch cannot take")
    family, low, high = "powersgd", 1, MAX_RANK

    def __init__(self, rank: int) -> None:
        super().__init__(rank)
        self.rank = rank

    def encode(self, x: np.ndarray, key: int, offset: int) -> bytes:
        """A package of factor values, float32 big-endian."""
        return x.astype(">f4").tobytes()

    def decode(self, package: bytes, count: int) -> np.ndarray:
        if len(package) != 4 * count:
            raise MalformedPackage(f"a {self.name} package of {count} factor values is {4 * count} bytes, "
                                   f"got {len(package)}")
        values = np.frombuffer(package, ">f4").astype(np.float32)
        if not np.all(np.isfinite(values)):
            raise MalformedPackage(f"a {self.name} package holds a non-finite value")
        return values


def orthonormal(p: np.ndarray) -> np.ndarray:
    """Gram-Schmidt on the columns of ``p``, in float64 with fsum dot products (a zero column stays zero)."""
    out = p.astype(np.float64)
    for j in range(out.shape[1]):
        column = out[:, j]
        for i in range(j):
            column -= math.fsum((out[:, i] * column).tolist()) * out[:, i]
        norm = math.sqrt(math.fsum((column * column).tolist()))
        out[:, j] = column / norm if norm > 0 else 0.0
    return out


def product(p: np.ndarray, q: np.ndarray) -> np.ndarray:
    """P Q^T as a sum of outer products in column order: element-wise arithmetic only, the same everywhere."""
    out = np.zeros((p.shape[0], q.shape[0]))
    for j in range(p.shape[1]):
        out += np.outer(p[:, j], q[:, j])
    return out


class LowRank:
    """One worker's PowerSGD state for one gradient matrix of ``shape``: see the module's docstring."""

    def __init__(self, shape: tuple[int, int], rank: int, key: int) -> None:
        self.shape = shape
        self.rank = min(rank, *shape)
        self.q = uniforms(key, 0, shape[1] * self.rank).reshape(shape[1], self.rank) - 0.5
        self.memory = Memory(shape[0] * shape[1])
        self.compensated = np.zeros(shape, np.float32)
        self.p = np.zeros((shape[0], self.rank))
        self.mine = np.zeros((shape[1], self.rank), np.float32)

    def first(self, gradient: np.ndarray) -> np.ndarray:
        """This worker's M Q (n x rank, flattened float32), M its gradient plus what earlier steps left out."""
        self.compensated = self.memory.compensate(gradient.reshape(-1)).reshape(self.shape)
        return (self.compensated.astype(np.float64) @ self.q).astype(np.float32).reshape(-1)

    def second(self, p_sum: np.ndarray) -> np.ndarray:
        """This worker's M^T P (m x rank, flattened float32), P the orthonormalised sum of the first round."""
        self.p = orthonormal(p_sum.reshape(self.shape[0], self.rank))
        self.mine = (self.compensated.astype(np.float64).T @ self.p).astype(np.float32)
        return self.mine.reshape(-1)

    def finish(self, q_sum: np.ndarray) -> np.ndarray:
        """The update P Q^T (flattened float32, the same on every rank), Q the sum of the second round; keeps
        what this worker's own P Q_i^T left out, and Q for the next step's warm start."""
        self.memory.update(self.compensated.reshape(-1), product(self.p, self.mine).astype(np.float32).reshape(-1))
        self.q = q_sum.reshape(self.shape[1], self.rank).astype(np.float64)
        return product(self.p, self.q).astype(np.float32).reshape(-1)


FAMILIES = PowerSGD.entry()
