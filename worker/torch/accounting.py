"""Traffic accounting of a hook state or process group: how many allreduces went where, and their bytes (from
``worker.traffic``'s formulas, per worker and each way; a host codec's measured, as its packages vary with the data;
retransmitted datagrams counted apart), and why each allreduce that went to Gloo did (``routing``'s reasons)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch

from intml.worker.traffic import ring_bytes


@dataclasses.dataclass
class Traffic:
    """Counters of one hook state or process group (per worker, each way)."""

    intml_allreduces: int = 0
    intml_reduce_scatters: int = 0  # their elements and bytes (the upload's) are in intml_elements and intml_bytes
    intml_elements: int = 0
    intml_bytes: int = 0  # sent; a switch codec's results are as long, a host codec's are in host_result_bytes
    # of intml_allreduces and intml_reduce_scatters: CUDA tensors, encoded and decoded on their device
    intml_cuda_allreduces: int = 0
    intml_cuda_elements: int = 0  # their elements and wire bytes (also in intml_elements and intml_bytes)
    intml_cuda_bytes: int = 0
    gloo_allreduces: int = 0
    gloo_reduce_scatters: int = 0  # their elements and ring bytes are in gloo_elements and gloo_bytes
    gloo_elements: int = 0
    gloo_bytes: float = 0.0
    packets_out: int = 0
    retransmissions: int = 0
    gloo_reasons: dict[str, int] = dataclasses.field(default_factory=dict)  # routing reason: Gloo allreduces
    # a host codec's result packages received (measured, with headers): they differ from what was sent (topk's sum
    # is dense float32, signsgd's vote 1 bit)
    host_result_bytes: int = 0
    # of intml_reduce_scatters: run by a host codec as a whole allreduce, the shard kept (host mode has no
    # reduce-scatter): the rank received the whole sum, in host_result_bytes
    host_reduce_scatters: int = 0

    def add_intml(self, elements: int, wire_bytes: int, before: dict[str, int], after: dict[str, int],
                  reduce_scatter: bool = False, cuda: bool = False, host_received: int | None = None) -> None:
        """One allreduce (or reduce-scatter) through the aggregator, of a CUDA tensor on the CUDA path if `cuda`;
        `before` and `after` are the worker's counters around it. `host_received`: a host codec's result bytes."""
        if host_received is not None:
            self.host_result_bytes += host_received
            self.host_reduce_scatters += reduce_scatter
        if cuda:
            self.intml_cuda_allreduces += 1
            self.intml_cuda_elements += elements
            self.intml_cuda_bytes += wire_bytes
        if reduce_scatter:
            self.intml_reduce_scatters += 1
        else:
            self.intml_allreduces += 1
        self.intml_elements += elements
        self.intml_bytes += wire_bytes
        self.packets_out += after["packets_out"] - before["packets_out"]
        self.retransmissions += after["retransmissions"] - before["retransmissions"]

    def add_gloo(self, tensors: Sequence[torch.Tensor], world_size: int, reason: str,
                 reduce_scatter: bool = False) -> None:
        """One allreduce (or reduce-scatter: half the ring's bytes) of `tensors` through Gloo's ring (its bytes
        from the ring model), for `reason`."""
        if reduce_scatter:
            self.gloo_reduce_scatters += 1
        else:
            self.gloo_allreduces += 1
        self.gloo_reasons[reason] = self.gloo_reasons.get(reason, 0) + 1
        self.gloo_elements += sum(t.numel() for t in tensors)
        share = 0.5 if reduce_scatter else 1.0  # a ring reduce-scatter is the allreduce's first half
        self.gloo_bytes += sum(share * ring_bytes(t.numel(), world_size, t.element_size()) for t in tensors)
