"""Error feedback's memory, as GRACE's ``Memory``: per DDP bucket, the compression residual (the bucket's input
minus what this rank put on the wire, as the engine reports it in ``sent``), added to the bucket's next input."""

from __future__ import annotations

import torch
import torch.distributed as dist


class Residuals:
    """The residual of every bucket, flat like its buffer, kept per parameter as well: DDP rebuilds its buckets
    after the first step (in the order gradients became ready), and each parameter's residual moves into the new
    layout."""

    def __init__(self) -> None:
        self.of_bucket: dict[int, tuple[tuple, torch.Tensor]] = {}  # bucket index: (parameter ids, residual)
        self.of_param: dict[int, torch.Tensor] = {}  # id(parameter): its view into its bucket's residual

    def of(self, bucket: dist.GradBucket) -> torch.Tensor:
        """The residual of `bucket` (zeros the first time, and for a bucket whose parameters do not fill it)."""
        size = bucket.buffer().numel()
        params = bucket.parameters()
        layout = tuple(id(p) for p in params)
        cached = self.of_bucket.get(bucket.index())
        if cached is not None and cached[0] == layout and cached[1].numel() == size:
            return cached[1]
        flat = torch.zeros(size, dtype=torch.float32, device=bucket.buffer().device)  # a CUDA bucket's stays there
        if sum(p.numel() for p in params) == size:
            offset = 0
            for p in params:
                view = flat[offset:offset + p.numel()]
                old = self.of_param.get(id(p))
                if old is not None:
                    view.copy_(old)
                self.of_param[id(p)] = view
                offset += p.numel()
        self.of_bucket[bucket.index()] = (layout, flat)
        return flat
