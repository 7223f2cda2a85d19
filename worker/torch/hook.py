"""The DDP communication hook: ``ddp.register_comm_hook(IntmlHookState(), intml_hook)`` averages each gradient
bucket through the aggregator, whatever its size, with optional error feedback and Gloo warm-up steps. A CUDA
bucket is encoded and decoded on its device (``gpu``; its residual stays there). A bfloat16 or float16 bucket is
encoded from its own 16-bit words and comes back in its dtype (with error feedback: as float32, its residual's
dtype; docs/mixed-precision.md). A bucket intml cannot encode (not a float32 or
16-bit float, on another device, on CUDA without a usable ``intml[cuda]``) goes exactly through Gloo, with a warning the
first time for each reason. A host codec's buckets (``codec="topk0.01"``) go as float32 CPU copies where they are not
(link.Link.submit); topk wants ``error_feedback=True``, randomk refuses it (config). ``codec="powersgd<r>"`` takes
each bucket in two rounds of low-rank factors (worker.torch.lowrank)."""

from __future__ import annotations

import dataclasses
import time

import torch
import torch.distributed as dist
from torch.futures import Future

from intml.protocol.codecs.host.powersgd import PowerSGD
from intml.worker.torch import routing
from intml.worker.torch.auto import AUTO, AutoCodec
from intml.worker.torch.backend import IntmlProcessGroup
from intml.worker.torch.config import IntmlConfig
from intml.worker.torch.feedback import Residuals
from intml.worker.torch.link import AggregatorLinked, Link, sum_op, value
from intml.worker.torch.lowrank import LowRankBuckets
from intml.worker.traffic import ring_bytes
from intml.worker.tuner import GLOO, SWITCH_CODECS


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
        # auto: start-up joins with a switch codec, so that an unreachable aggregator shows (and falls back) at
        # once; the tuner's other codecs join when a bucket first uses them
        self._attach(config, self.rank, self.world_size, config.threaded,
                     codec=SWITCH_CODECS[0] if config.codec == AUTO else None)
        self.auto: AutoCodec | None = None  # the tuner's side at this rank (INTML_CODEC=auto)
        self.links: dict[str, Link | None] = {}  # auto: a link per codec
        self.tuned: list[Future] = []  # auto: this step's allreduces so far
        if config.codec == AUTO and self.link is not None:
            # the statistics' sample key: the start-up job's id, the same at every rank
            self.auto = AutoCodec(self.rank, self.world_size, self.link.worker.job, config.pins(),
                                  config.error_feedback, self._shared_sum, config.tuner_every, config.pool_size)
            self.links[SWITCH_CODECS[0]] = self.link
        self.metrics = None  # auto with INTML_METRICS_PORT: the tuner's Prometheus endpoint (worker.torch.metrics)
        if self.auto is not None and config.metrics_port is not None:
            from intml.worker.torch import metrics

            self.metrics = metrics.serve(self.auto, config.metrics_address,
                                         config.metrics_port + self.rank if config.metrics_port else 0)
        codec = config.host_codec() if config.codec != AUTO else None
        # powersgd<r>: two allreduces of factors per bucket (worker.torch.lowrank), keyed by the job id
        self.low_rank = (LowRankBuckets(codec.rank, self.link.worker.job)
                         if isinstance(codec, PowerSGD) and self.link is not None else None)

    def close(self) -> None:
        """Leave the aggregator's jobs (also done at interpreter exit), and stop serving metrics."""
        if self.metrics is not None:
            self.metrics.shutdown()
            self.metrics.server_close()
        for link in self.links.values():
            if link is not None and link is not self.link:
                link.close()
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
        residual = self.residuals.of(bucket) if self.config.error_feedback and reason is None else None
        if reason is not None:
            fut = self._gloo_mean(buf, reason)
        elif self.auto is not None:
            fut = self._tuned(bucket.index(), buf, residual)
        elif self.low_rank is not None:
            fut = self._low_rank(bucket)
        else:
            fut = self.link.submit(buf, "mean", inplace=False, residual=residual).then(value)
        if self.auto is not None and reason is None:
            self.tuned.append(fut)
        if self.auto is not None and bucket.is_last() and self.auto.layout:
            for pending in self.tuned if self.auto.measuring else ():  # the step's means (DDP waits for them at
                pending.wait()  # the end of backward anyway)
            self.tuned = []
            self.auto.end_step()  # the statistics of the step's buckets, shared; the next codecs decided
        return fut

    def _tuned(self, index: int, buf: torch.Tensor, residual: torch.Tensor | None) -> Future:
        """Bucket ``index`` through the codec the tuner chose for it (``auto``), measured and timed for it."""
        auto = self.auto
        codec = auto.codec(index)
        auto.observe(index, buf, residual)
        if codec != GLOO and codec not in self.links:  # the same bucket at every rank: a collective join
            self.links[codec] = self._join(dataclasses.replace(self.config, codec=codec, job=None), self.rank,
                                           self.world_size, self.config.threaded)
        link = None if codec == GLOO else self.links[codec]
        started, sent = time.perf_counter(), self.traffic.intml_bytes
        if link is None:  # Gloo's ring (chosen, or its codec fell back at its join): exact, so the residual goes too
            if residual is not None:
                buf.add_(residual)
                residual.zero_()
            fut = self._gloo_mean(buf, routing.TUNED)
        else:
            fut = link.submit(buf, "mean", inplace=False, residual=residual).then(value)

        def timed(f: Future) -> torch.Tensor:
            result = f.value()
            bits = 8 * (ring_bytes(buf.numel(), self.world_size, buf.element_size()) if link is None
                        else self.traffic.intml_bytes - sent)
            auto.done(index, result, bits, time.perf_counter() - started, aggregated=link is not None)
            return result

        return fut.then(timed)

    def _low_rank(self, bucket: dist.GradBucket) -> Future:
        """The bucket's average through PowerSGD's two rounds (worker.torch.lowrank), in the caller."""
        fut: Future = Future()
        try:
            fut.set_result(self.low_rank.average(bucket, self.world_size, self._intml_sum))
        except Exception as exc:  # DDP raises it from the Future, as it does any allreduce's
            fut.set_exception(exc)
        return fut

    def _intml_sum(self, t: torch.Tensor) -> None:
        """``t`` (float32, CPU) summed over the group in place, through the aggregator."""
        self.link.submit(t, "sum", inplace=True).wait()

    def _shared_sum(self, t: torch.Tensor) -> torch.Tensor:
        """The tuner's statistics summed over the group through Gloo (auto's module docstring says why)."""
        self._control_allreduce(t)
        return t

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
