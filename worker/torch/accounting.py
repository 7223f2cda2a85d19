"""Traffic accounting of a hook state or process group: how many allreduces went where, and their bytes (from
``protocol.traffic``'s formulas, per worker and each way; retransmitted datagrams counted apart), and why each
allreduce that went to Gloo did (``routing``'s reasons)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch

from intml.protocol.traffic import ring_bytes


@dataclasses.dataclass
class Traffic:
    """Counters of one hook state or process group (per worker, each way)."""

    intml_allreduces: int = 0
    intml_elements: int = 0
    intml_bytes: int = 0
    gloo_allreduces: int = 0
    gloo_elements: int = 0
    gloo_bytes: float = 0.0
    packets_out: int = 0
    retransmissions: int = 0
    gloo_reasons: dict[str, int] = dataclasses.field(default_factory=dict)  # routing reason: Gloo allreduces

    def add_intml(self, elements: int, wire_bytes: int, before: dict[str, int], after: dict[str, int]) -> None:
        """One allreduce through the aggregator; `before` and `after` are the worker's counters around it."""
        self.intml_allreduces += 1
        self.intml_elements += elements
        self.intml_bytes += wire_bytes
        self.packets_out += after["packets_out"] - before["packets_out"]
        self.retransmissions += after["retransmissions"] - before["retransmissions"]

    def add_gloo(self, tensors: Sequence[torch.Tensor], world_size: int, reason: str) -> None:
        """One allreduce of `tensors` through Gloo's ring (its bytes from the ring model), for `reason`."""
        self.gloo_allreduces += 1
        self.gloo_reasons[reason] = self.gloo_reasons.get(reason, 0) + 1
        self.gloo_elements += sum(t.numel() for t in tensors)
        self.gloo_bytes += sum(ring_bytes(t.numel(), world_size, t.element_size()) for t in tensors)
