"""The link to the aggregator: one rank's ``Worker`` on a job, joined at start-up by every rank together, with
the errors of that path. Shared by the DDP hook (``hook``) and the process-group backend (``backend``)."""

from __future__ import annotations

import atexit
import dataclasses
import hashlib
import queue
import secrets
import threading
import warnings
import weakref
from collections.abc import Callable, Sequence

import numpy as np
import torch
import torch.distributed as dist
from torch.futures import Future

from intml.worker.api import AllreduceTimeout, JoinError, Worker
from intml.worker.torch import gpu, routing
from intml.worker.torch.accounting import Traffic
from intml.worker.torch.config import IntmlConfig
from intml.worker.traffic import host_bytes, intml_bytes


CPU = torch.device("cpu")


class IntmlError(RuntimeError):
    """An intml allreduce cannot run (an earlier one of the same group failed)."""


class AggregatorUnavailable(IntmlError):
    """At start-up some rank could not join the aggregator, and INTML_FALLBACK is 'error'."""


class IntmlFallbackWarning(RuntimeWarning):
    """At start-up some rank could not join the aggregator; the group uses Gloo instead (INTML_FALLBACK=gloo)."""


class Link:
    """One rank's Worker on a job. Without ``threaded`` each allreduce runs in the caller and the returned Future
    is already complete; with it, the allreduce runs on a dedicated thread fed by a queue and the Future completes
    later, so the caller goes on meanwhile: autograd computes the next buckets' gradients (DDP's overlap), and
    ``dist.all_reduce(..., async_op=True)`` returns at once. The backend always uses the thread (async_op needs
    it); the hook only with INTML_THREAD=1.

    Why the hook runs in the caller by default: measured with `intml-testbed train` (digits MLP, 4 ranks under torchrun on this
    2-core machine, cnat8, thread and no thread interleaved in one invocation, median step time over seeds), the
    thread never helped: thread vs caller 9.13 vs 8.71, 7.84 vs 6.79 and 7.98 vs 7.45 ms per step with one DDP
    bucket per step (5, 3 and 5 seeds), 8.54 vs 8.18 and 9.41 vs 8.46 ms with five buckets per step (3 seeds
    each). Per-seed figures overlap (the machine is shared), but the direction never changed. With 4 ranks and
    the aggregator on 2 cores there is no idle core for the overlap to use, and the hand-off adds GIL switches
    and wake-ups. The thread stays an option for hosts with spare cores, where communication can overlap
    backward compute. Either way allreduces are served strictly in submission order, which is the order every
    rank must issue them in.
    """

    def __init__(self, w: Worker, config: IntmlConfig, traffic: Traffic, threaded: bool) -> None:
        self.worker = w
        self.config = config
        self.traffic = traffic
        self.failed: BaseException | None = None
        self.cuda = gpu.PATH  # how CUDA tensors reach intml.worker.gpu
        self._device = None  # its DeviceAllreducer on this worker, made on the first CUDA allreduce
        self._closed = False
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = None
        w.start_keepalive()  # training pauses (evaluation, checkpoints) must not cost the job
        if threaded:
            self._thread = threading.Thread(target=self._serve, name=f"intml-job{w.job}-rank{w.rank}", daemon=True)
            self._thread.start()

    def submit(self, tensor: torch.Tensor, op: str, *, inplace: bool, residual: torch.Tensor | None = None) -> Future:
        """Allreduce the contiguous float32, bfloat16 or float16 `tensor` (sum or mean), a CPU tensor or one of the
        CUDA path's; the Future holds [tensor] (inplace) or a new tensor of its dtype. With `residual` (error
        feedback, float32 on the tensor's device), send tensor + residual and keep the new residual in it. A 16-bit
        tensor is encoded from its own words into its own dtype (docs/mixed-precision.md), except with a residual:
        tensor + residual is float32, rounded back. A host codec encodes float32 on the CPU: any other tensor is
        converted (exactly) to a float32 CPU copy, and its float32 result rounded back once, into its dtype and
        device."""
        host = self.worker.host_codec is not None
        if (tensor.dtype != torch.float32 and (residual is not None or host)) or (host and tensor.device != CPU):
            # here, in the caller: on the CUDA path, its stream produced the tensor
            wide = tensor.detach().to(CPU if host else tensor.device, torch.float32)
            staged = residual if residual is None else residual.to(wide.device)  # a CUDA residual: a CPU copy
            fut = self.submit(wide, op, inplace=True, residual=staged)
            return fut.then(lambda f: narrow(f, wide, tensor, inplace, residual, staged))
        if self.cuda.owns(tensor) and self.cuda.problem() is None:
            marker = self.cuda.ready_marker(tensor)  # here, in the caller: its stream produced the tensor
            return self._submit(lambda: self._allreduce_cuda(tensor, op, inplace, residual, marker))
        return self._submit(lambda: self._allreduce(tensor, op, inplace, residual))

    def submit_reduce_scatter(self, input: torch.Tensor, output: torch.Tensor, op: str) -> Future:  # noqa: A002
        """Reduce-scatter the contiguous float32, bfloat16 or float16 `input` (sum or mean), a CPU tensor or one of
        the CUDA path's, into `output` (of its dtype and device), this rank's shard (its input.numel() / world size
        elements from rank * that); the Future holds [output]. A host codec's CUDA input is staged through a
        float32 CPU copy."""
        host = self.worker.host_codec is not None
        if not host and self.cuda.owns(input) and self.cuda.problem() is None:
            marker = self.cuda.ready_marker(input)  # here, in the caller: its stream produced the tensor
            return self._submit(lambda: self._reduce_scatter_cuda(input, output, op, marker))
        # a host codec's CUDA input: staged here, in the caller, as submit stages it
        staged = input if input.device == CPU else input.detach().to(CPU, torch.float32)
        return self._submit(lambda: self._reduce_scatter(staged, output, op))

    def _submit(self, collective: Callable[[], object]) -> Future:
        """Run `collective` (in the caller, or queued for the thread); its value or exception goes to the Future."""
        fut: Future = Future()
        item = (collective, fut)
        if self.failed is not None or self._closed:
            self._fail(fut, self._failure())
        elif self._thread is None:
            self._run(item)
        else:
            self._queue.put(item)
        return fut

    def _failure(self) -> IntmlError:
        w = self.worker
        if self.failed is None:
            return IntmlError(f"intml: job {w.job} rank {w.rank} cannot allreduce: its link to the aggregator was "
                              f"closed (the process group was destroyed or the hook state closed)")
        return IntmlError(f"intml: job {w.job} rank {w.rank} cannot allreduce any more because an earlier "
                          f"allreduce through the aggregator {w.host}:{w.port} failed ({self.failed}); destroy the "
                          f"process group and initialise a new one to go on")

    @staticmethod
    def _fail(fut: Future, exc: BaseException) -> None:
        if not fut.done():
            fut.set_exception(exc)

    def _serve(self) -> None:
        while (item := self._queue.get()) is not None:
            if self.failed is not None:
                self._fail(item[-1], self._failure())
            else:
                self._run(item)

    def _run(self, item) -> None:
        collective, fut = item
        try:
            value = collective()
        except BaseException as exc:  # noqa: BLE001 -- every failure goes to the waiting Future
            self.failed = exc
            self._fail(fut, exc)
            return
        fut.set_result(value)

    def _allreduce(self, tensor, op, inplace, residual):
        w = self.worker
        flat, dtype = words(tensor)
        # error feedback: send input + residual, and let the engine write what it sent into the residual's buffer
        # (x is a new array, so nothing reads the old residual any more)
        sent = None if residual is None else residual.numpy()
        x = flat if sent is None else flat + sent
        before = w.counters()
        out = w.allreduce(x, op, out=flat if inplace else None, sent=sent, dtype=dtype)  # in place: no allocation
        if sent is not None:
            np.subtract(x, sent, out=sent)  # the new residual: input - what was sent
            residual.nan_to_num_(0.0, 0.0, 0.0)  # a non-finite element's is reset: it went on as itself
        self._count(x.size, before)
        if inplace:
            return [tensor]
        return torch.from_numpy(out).view(tensor.dtype).view(tensor.shape)

    def _allreducer(self):
        """The DeviceAllreducer on this link's worker, made on the first CUDA collective."""
        if self._device is None:
            self._device = self.cuda.allreducer(self.worker)
        return self._device

    def _allreduce_cuda(self, tensor, op, inplace, residual, marker):
        """_allreduce of a CUDA path tensor: the same steps on its device (intml.worker.gpu), bit for bit."""
        w, path = self.worker, self.cuda
        device = self._allreducer()
        before = w.counters()
        with path.stream(tensor, marker) as stream:
            flat = tensor.detach().reshape(-1)
            x = flat if residual is None else flat + residual
            out = flat if inplace else torch.empty_like(flat)
            sent = None if residual is None else path.view(residual)
            device.allreduce(path.view(device_words(x)), path.view(device_words(out)), op, sent=sent, stream=stream,
                             dtype=WORD_DTYPES.get(x.dtype))
            if residual is not None:
                torch.sub(x, residual, out=residual)  # the new residual: input - what was sent
                residual.nan_to_num_(0.0, 0.0, 0.0)  # a non-finite element's is reset: it went on as itself
        self._count(x.numel(), before, cuda=True)
        if inplace:
            return [tensor]
        return out.view(tensor.shape)

    def _count(self, elements: int, before: dict[str, int], *, reduce_scatter: bool = False,
               cuda: bool = False) -> None:
        c, after = self.config, self.worker.counters()
        if self.worker.host_codec is None:
            self.traffic.add_intml(elements, intml_bytes(elements, c.codec, c.packet_elements, c.pool_size), before,
                                   after, reduce_scatter, cuda)
            return
        sent, received = (host_bytes(after[k] - before[k], elements, c.packet_elements)
                          for k in ("package_bytes", "result_bytes"))
        self.traffic.add_intml(elements, sent, before, after, reduce_scatter, cuda, host_received=received)

    def _reduce_scatter(self, input, output, op):  # noqa: A002
        w = self.worker
        before = w.counters()
        if w.host_codec is not None:
            # host mode has no reduce-scatter: the whole allreduce of the float32 values, this rank's shard kept
            # and rounded once into the output's dtype (Traffic.host_reduce_scatters counts it)
            size = output.numel()
            total = w.allreduce(input.detach().reshape(-1).to(torch.float32).numpy(), op)
            output.view(-1).copy_(torch.from_numpy(total[w.rank * size:(w.rank + 1) * size]))
            self._count(input.numel(), before, reduce_scatter=True)
            return [output]
        x, dtype = words(input)
        w.reduce_scatter(x, op, out=words(output)[0], dtype=dtype)
        self._count(x.size, before, reduce_scatter=True)
        return [output]

    def _reduce_scatter_cuda(self, input, output, op, marker):  # noqa: A002
        """_reduce_scatter of CUDA path tensors: the shard decoded on their device (intml.worker.gpu), bit for
        bit."""
        w, path = self.worker, self.cuda
        device = self._allreducer()
        before = w.counters()
        with path.stream(input, marker) as stream:
            device.reduce_scatter(path.view(device_words(input)), path.view(device_words(output)), op, stream=stream,
                                  dtype=WORD_DTYPES.get(input.dtype))
        self._count(input.numel(), before, reduce_scatter=True, cuda=True)
        return [output]

    def close(self, wait: float | None = None) -> None:
        """Stop the thread once the queued allreduces are done (waiting at most `wait` seconds, default the
        allreduce timeout) and leave the job. A thread still busy after that keeps its Worker open."""
        if self._closed:
            return
        self._closed = True
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join(timeout=self.config.timeout + 5 if wait is None else wait)
            if self._thread.is_alive():
                return
        self.worker.close()


WORD_DTYPES = {torch.bfloat16: "bfloat16", torch.float16: "float16"}


def device_words(tensor: torch.Tensor) -> torch.Tensor:
    """What the CUDA path's kernels take of a tensor: a float32 one itself, a 16-bit one as its int16 words (which
    numba can view)."""
    return tensor if tensor.dtype == torch.float32 else tensor.view(torch.int16)


def words(tensor: torch.Tensor) -> tuple[np.ndarray, str | None]:
    """A flat numpy view of a contiguous CPU tensor, and the ``dtype`` Worker.allreduce takes it with: a float32
    tensor's values (None), a 16-bit float tensor's int16 words and its format's name."""
    flat = tensor.detach().reshape(-1)
    if tensor.dtype == torch.float32:
        return flat.numpy(), None
    return flat.view(torch.int16).numpy(), WORD_DTYPES[tensor.dtype]


def narrow(fut: Future, wide: torch.Tensor, tensor: torch.Tensor, inplace: bool, residual: torch.Tensor | None,
           staged: torch.Tensor | None):
    """A widened (or host-staged) allreduce's completion: its float32 result `wide` rounded to `tensor`'s dtype (to
    nearest, ties to even, as torch converts; beyond float16's range, +-Inf) on its device: into `tensor` ([tensor],
    inplace) or new. The new residual `staged`, if it is a copy, goes back into `residual`."""
    fut.value()  # raises the collective's exception
    if staged is not residual:
        residual.copy_(staged)
    if inplace:
        tensor.copy_(wide.view_as(tensor))
        return [tensor]
    return wide.to(tensor.device, tensor.dtype).view(tensor.shape)


def connect(config: IntmlConfig, rank: int, world_size: int, control_allreduce: Callable[[torch.Tensor], None],
            traffic: Traffic, threaded: bool) -> Link | None:
    """Join the aggregator at every rank and agree on the outcome. Returns the link (its allreduces on a thread if
    `threaded`), or None when the group falls back to Gloo. `control_allreduce(t)` sums an int64 CPU tensor over the group through Gloo, blocking."""
    # Job id and seed: rank 0's (from the config, else drawn at random; the seed from torch's), shared as a Gloo
    # sum of zeros elsewhere.
    ids = torch.zeros(2, dtype=torch.int64)
    if rank == 0:
        ids[0] = config.job if config.job is not None else 1 + secrets.randbelow(0xFFFFFFFE - 1)
        ids[1] = config.seed if config.seed is not None else rounding_seed()
    control_allreduce(ids)
    job, seed = int(ids[0]), int(ids[1])

    # Each rank's outcome, summed over the group so that every rank takes the same path.
    w = None
    reason = ""
    status = torch.zeros(world_size, dtype=torch.int64)
    if not config.aggregator:
        status[rank] = NO_ADDRESS
    else:
        try:
            w = Worker(config.aggregator, job=job, rank=rank, world_size=world_size, token=config.token,
                       codec=config.codec, packet_elements=config.packet_elements, pool_size=config.pool_size,
                       seed=seed, timeout=config.timeout, connect_timeout=config.connect_timeout,
                       rounding=config.rounding)
        except (AllreduceTimeout, OSError) as exc:
            status[rank], reason = UNREACHABLE, f"{type(exc).__name__}: {exc}"
        except JoinError as exc:
            status[rank], reason = REFUSED, str(exc)
        except ValueError as exc:
            status[rank], reason = MISCONFIGURED, str(exc)
    control_allreduce(status)
    if not status.any():
        return Link(w, config, traffic, threaded)
    if w is not None:
        w.close()
    message = startup_failure(status.tolist(), job, config.aggregator, reason)
    if status.max() >= REFUSED:  # a configuration error: falling back would hide it
        raise AggregatorUnavailable(message)
    if config.fallback == "gloo":
        warnings.warn(f"{message}; falling back to Gloo's ring allreduce (INTML_FALLBACK=gloo)",
                      IntmlFallbackWarning, stacklevel=3)
        return None
    raise AggregatorUnavailable(f"{message}; start `intml-aggregator --host HOST --port PORT` and set "
                                f"INTML_AGGREGATOR=HOST:PORT at every rank, or set INTML_FALLBACK=gloo to train with "
                                f"Gloo instead")


def rounding_seed() -> int:
    """The job's default rounding seed: derived from torch's initial seed, so that a run the user seeded
    (``torch.manual_seed``) rounds alike every time, as it would train alike under Gloo, while an unseeded one
    (torch then seeds itself at random) varies. It reads the seed without drawing from the generator, so the
    user's own random numbers stay those of a Gloo run. ``INTML_SEED`` overrides it."""
    digest = hashlib.blake2b(torch.initial_seed().to_bytes(8, "little"), digest_size=8, person=b"intml-seed")
    return int.from_bytes(digest.digest(), "little") >> 2  # 62 bits: positive in the int64 the ranks share


# A rank's start-up outcome (connect), worst last: the group goes by the worst.
JOINED, NO_ADDRESS, UNREACHABLE, REFUSED, MISCONFIGURED = range(5)


def startup_failure(status: list[int], job: int, address: str | None, reason: str) -> str:
    """The start of the one-sentence error every rank raises (or warns) when some rank could not join: what went
    wrong at which ranks, with this rank's own reason, and for a configuration error what to check."""
    def ranks(outcome: int) -> list[int]:
        return [r for r, s in enumerate(status) if s == outcome]

    n = len(status)
    mine = f" (this rank: {reason})" if reason else ""
    at = f"the aggregator at {address}" if address else "the aggregator"
    if ranks(MISCONFIGURED):
        return (f"intml: ranks {ranks(MISCONFIGURED)} of {n} have an invalid intml setting{mine}; correct it "
                f"(INTML_AGGREGATOR is host:port; INTML_JOB, INTML_PACKET_ELEMENTS and INTML_POOL have limits) there")
    if ranks(REFUSED):
        return (f"intml: {at} refused ranks {ranks(REFUSED)} of {n} for job {job}{mine}; check that INTML_TOKEN is "
                f"one the aggregator was started with and that INTML_CODEC, INTML_PACKET_ELEMENTS, INTML_POOL and "
                f"INTML_JOB are the same at every rank and free on the aggregator")
    problems = []
    if ranks(NO_ADDRESS):
        problems.append(f"INTML_AGGREGATOR is not set at ranks {ranks(NO_ADDRESS)} of {n}")
    if ranks(UNREACHABLE):
        problems.append(f"{at} is unreachable from ranks {ranks(UNREACHABLE)} of {n} at start-up{mine}")
    return "intml: " + " and ".join(problems)


_LINKS: weakref.WeakSet = weakref.WeakSet()


@atexit.register
def _close_links() -> None:  # leave the jobs, so the aggregator frees their slots now, not after its idle timeout
    for link in list(_LINKS):
        link.close(wait=1.0)


def sum_op() -> dist.AllreduceOptions:
    opts = dist.AllreduceOptions()
    opts.reduceOp = dist.ReduceOp.SUM
    return opts


def value(fut: Future):
    """A `then` callback passing the value on. A Future failed from Python (set_exception) holds the exception as
    its value, which C++ consumers such as DDP's reducer would try to cast to a tensor ("Unable to cast ...");
    a callback that raises fails the chained Future properly, so DDP raises "AllreduceTimeout: ..." instead."""
    return fut.value()


class AggregatorLinked:
    """What the hook state and the backend share: a Gloo group for control messages, fallback and the allreduces
    that stay exact; the link to the aggregator (None when start-up fell back to Gloo); the traffic counters."""

    gloo: dist.ProcessGroup

    def _attach(self, config: IntmlConfig, rank: int, size: int, threaded: bool, codec: str | None = None) -> None:
        """Join the aggregator with ``config`` (its codec, or ``codec`` where given) as ``self.link``."""
        self.config = config
        self.traffic = Traffic()
        self._warned: set[str] = set()
        self._summarised = False
        self.link = self._join(config if codec is None else dataclasses.replace(config, codec=codec), rank, size,
                               threaded)

    def _join(self, config: IntmlConfig, rank: int, size: int, threaded: bool) -> Link | None:
        """A link to a job of ``config`` (a collective over the group; None where start-up fell back to Gloo),
        counted in ``self.traffic`` and left at interpreter exit."""
        link = connect(config, rank, size, self._control_allreduce, self.traffic, threaded)
        if link is not None:
            _LINKS.add(link)
        return link

    def _to_gloo(self, tensors: Sequence[torch.Tensor], reason: str, reduce_scatter: bool = False) -> None:
        """Count an allreduce (or reduce-scatter) that goes to Gloo for `reason`, warning the first time for a
        reason the user did not choose (``routing``)."""
        self.traffic.add_gloo(tensors, self.gloo.size(), reason, reduce_scatter)
        if reason in self._warned or (reason in routing.CHOSEN and reason != routing.SMALL):
            return
        self._warned.add(reason)
        elements = sum(t.numel() for t in tensors)
        if reason == routing.SMALL:  # chosen by the threshold, but a user who swapped in intml should know
            warnings.warn(routing.small_text(elements, self.config.min_elements, reduce_scatter),
                          routing.IntmlRoutingWarning, stacklevel=routing.user_stacklevel())
        else:
            warnings.warn(routing.warning_text(reason, elements, reduce_scatter), routing.IntmlUncompressedWarning,
                          stacklevel=routing.user_stacklevel())

    def _cuda_problem(self) -> str | None:
        """Why CUDA tensors cannot take intml's CUDA path here (routing's question), or None. A host codec needs no
        CUDA path: its CUDA tensors are staged through host memory (Link.submit), as Gloo stages them."""
        return None if self.link.worker.host_codec is not None else self.link.cuda.problem()

    def _control_allreduce(self, t: torch.Tensor) -> None:
        self.gloo.allreduce([t], sum_op()).wait()

    @property
    def using_intml(self) -> bool:
        return self.link is not None

    def _leave(self) -> None:
        """Leave the job; once, if any collective went to Gloo, say how this group's collectives went."""
        t = self.traffic
        if t.gloo_allreduces + t.gloo_reduce_scatters and not self._summarised:
            self._summarised = True
            warnings.warn(routing.totals_text(t.intml_allreduces + t.intml_reduce_scatters, t.intml_elements,
                                              t.gloo_allreduces + t.gloo_reduce_scatters, t.gloo_elements,
                                              t.gloo_reasons),
                          routing.IntmlRoutingWarning, stacklevel=routing.user_stacklevel())
        if self.link is not None:
            self.link.close()
