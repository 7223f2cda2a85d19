"""The DDP communication hook: ``ddp.register_comm_hook(IntmlHookState(), intml_hook)`` averages each gradient
bucket through the aggregator, whatever its size, with optional error feedback and Gloo warm-up steps. A CUDA
bucket is encoded and decoded on its device (``gpu``; its residual stays there). A bfloat16 or float16 bucket is
encoded from its own 16-bit words and comes back in its dtype (with error feedback: as float32, its residual's
dtype; docs/mixed-precision.md). A bucket intml cannot encode (not a float32 or
16-bit float, on another device, on CUDA without a usable ``intml[cuda]``) goes exactly through Gloo, with a warning the
first time for each reason. A host codec's buckets (``codec="topk0.01"``) go as float32 CPU copies where they are not
(link.Link.submit); topk wants ``error_feedback=True``, randomk refuses it (config)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.futures import Future

from intml.worker.torch import routing
from intml.worker.torch.backend import IntmlProcessGroup
from intml.worker.torch.config import IntmlConfig
from intml.worker.torch.feedback import Residuals
from intml.worker.torch.link import AggregatorLinked, sum_op, value


class IntmlHookState(AggregatorLinked):
    """State of ``intml_hook``: the link to the aggregator, the step count (warm-up) and the residuals (error
    feedback). Construct it on every rank, after ``init_process_group``, with the process group DDP uses
    (default: the world); it joins the aggregator (a collective over that group). Keyword arguments override the
    ``INTML_*`` environment (fields of ``IntmlConfig``)."""

    def __init__(self, process_group: dist.ProcessGroup | None = None, *, config: IntmlConfig | None = None,
                 **options) -> None:
        pg = process_group if process_group is not None else dist.distributed_c10d._get_default_group()
        self.process_group = pg
        # Gloo for the control messages, warm-up and fallback: the inner group if DDP runs over intml itself
        self.gloo = pg.gloo if isinstance(pg, IntmlProcessGroup) else pg
        self.rank, self.world_size = pg.rank(), pg.size()
        self.step = 0
        self.residuals = Residuals()
        config = config if config is not None else IntmlConfig.from_env(**options)
        self._attach(config, self.rank, self.world_size, config.threaded)

    def close(self) -> None:
        """Leave the aggregator's job (also done at interpreter exit)."""
        self._leave()

    def __getstate__(self):  # DDP pickles nothing of it, but keep a state from being sent across processes
        raise TypeError("IntmlHookState holds a socket and a thread; construct it in each rank")

    def allreduce_bucket(self, bucket: dist.GradBucket) -> Future:
        buf = bucket.buffer()
        step = self.step
        if bucket.is_last():
            self.step += 1
        reason = (routing.FALLBACK if self.link is None else routing.WARMUP if step < self.config.warmup_steps
                  else routing.unsupported(buf, self._cuda_problem))
        if reason is not None:
            return self._gloo_mean(buf, reason)
        residual = self.residuals.of(bucket) if self.config.error_feedback else None
        return self.link.submit(buf, "mean", inplace=False, residual=residual).then(value)

    def _gloo_mean(self, buf: torch.Tensor, reason: str) -> Future:
        """The average through Gloo (warm-up, fallback, other dtypes), as torch's default allreduce hook does."""
        self._to_gloo([buf], reason)
        buf.div_(self.world_size)
        fut = self.gloo.allreduce([buf], sum_op()).get_future()
        return fut.then(lambda f: f.value()[0])


def intml_hook(state: IntmlHookState, bucket: dist.GradBucket) -> Future:
    """DDP communication hook: the bucket's average over the ranks through the aggregator (a Future of a tensor
    shaped like the bucket). Register with ``ddp.register_comm_hook(IntmlHookState(), intml_hook)``."""
    return state.allreduce_bucket(bucket)


# DDP's register_comm_hook compares the annotations with the real types; this module's are strings (PEP 563).
intml_hook.__annotations__ = {"state": IntmlHookState, "bucket": dist.GradBucket,
                              "return": torch.futures.Future[torch.Tensor]}
