"""``INTML_CODEC=powersgd<rank>`` in the DDP hook: PowerSGD (Vogels et al., seed 003) over host mode.

A per-package codec cannot do low rank: it needs each gradient's matrix shape and two sums per step, with a step
between them that only a host takes (``protocol.codecs.host.powersgd``). The hook has both: DDP's bucket names its
gradients, each shaped as its parameter. So a bucket goes in two allreduces through the powersgd job (its packages
are float32 factors, summed exactly in rank order by the aggregator's host mode):

1. every matrix's M Q (``LowRank.first``, M viewed as shape[0] x the rest), and the bucket's vectors (biases,
   norms) as they are, whose sum is then exact;
2. every matrix's M^T P (``LowRank.second``), P the orthonormalised first sum.

Each matrix's update P Q^T (``LowRank.finish``) is the rank-r approximation of the gradients' sum; the bucket
comes back as the average. Error feedback is LowRank's own (what P Q_i^T left out of this rank's M), so the hook's
``INTML_ERROR_FEEDBACK`` is refused with powersgd (config). Every rank computes the same P and update from the same
sums (fsum-based, docs/codecs.md), so the ranks' gradients stay bit-identical.

A matrix's state is made the first time its parameter is seen, with Q's first draw keyed by the powersgd job's id
and the parameter's place in its bucket (DDP lays out the buckets alike at every rank), and kept by the parameter
across DDP's rebuild of the buckets after the first step.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist

from intml.protocol.codecs.host.powersgd import LowRank

CPU = torch.device("cpu")


def as_matrix(shape: torch.Size) -> tuple[int, int] | None:
    """The matrix a gradient of ``shape`` is compressed as (shape[0] x the rest), or None for one sent as it is:
    a vector, or a matrix whose factors would be no smaller than it."""
    if len(shape) < 2:
        return None
    n = shape[0]
    m = int(np.prod(shape[1:]))
    return (n, m) if min(n, m) > 1 else None


class LowRankBuckets:
    """One rank's PowerSGD states, a LowRank per gradient matrix, and the two-round average of a DDP bucket."""

    def __init__(self, low_rank: int, job: int) -> None:
        self.low_rank = low_rank  # the factors' rank r
        self.job = job
        self.states: dict[int, LowRank] = {}  # id(parameter) -> its state

    def _state(self, bucket_index: int, position: int, parameter: torch.Tensor, shape: tuple[int, int]) -> LowRank:
        state = self.states.get(id(parameter))
        if state is None:
            key = (self.job << 24) ^ (bucket_index << 12) ^ position  # the same at every rank
            state = self.states[id(parameter)] = LowRank(shape, self.low_rank, key)
        return state

    def average(self, bucket: dist.GradBucket, world_size: int, allreduce_sum) -> torch.Tensor:
        """The bucket's buffer holding the average of every rank's gradients, matrices at rank r;
        ``allreduce_sum(float32 CPU tensor)`` sums a flat tensor in place over the ranks (through the powersgd job)."""
        gradients, parameters = bucket.gradients(), bucket.parameters()
        plain = [g.detach().to(CPU, torch.float32).numpy().reshape(-1) for g in gradients]
        matrices = [(i, self._state(bucket.index(), i, p, shape))
                    for i, (g, p) in enumerate(zip(gradients, parameters)) if (shape := as_matrix(g.shape))]
        vectors = [i for i in range(len(gradients)) if as_matrix(gradients[i].shape) is None]
        first = self._sum([state.first(plain[i]) for i, state in matrices] + [plain[i] for i in vectors],
                          allreduce_sum)
        second = self._sum([state.second(p) for (_, state), p in zip(matrices, first)], allreduce_sum)
        sums = {i: state.finish(q) for (i, state), q in zip(matrices, second)}
        sums.update(zip(vectors, first[len(matrices):]))
        buf, scale, lo = bucket.buffer(), np.float32(world_size), 0
        for i, g in enumerate(gradients):  # the buffer holds the gradients in this order, back to back
            buf[lo:lo + g.numel()].copy_(torch.from_numpy(sums[i] / scale))  # into its dtype: rounded once
            lo += g.numel()
        return buf

    @staticmethod
    def _sum(parts: list[np.ndarray], allreduce_sum) -> list[np.ndarray]:
        """``parts`` summed over the ranks as one allreduce, split back."""
        if not parts:
            return []
        flat = torch.from_numpy(np.concatenate(parts).astype(np.float32))
        allreduce_sum(flat)
        return np.split(flat.numpy(), np.cumsum([p.size for p in parts])[:-1])
