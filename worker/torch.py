"""PyTorch integration: intml as a drop-in for Gloo's ring allreduce in ``torch.distributed``.

Two ways in, both configured from ``INTML_*`` environment variables (or keyword arguments, which win):

* **DDP communication hook** (keeps Gloo as the process group, options for error feedback and warm-up)::

      import intml.worker.torch as intml
      ddp.register_comm_hook(intml.IntmlHookState(), intml.intml_hook)

* **Process-group backend** (``import intml.worker.torch`` registers it)::

      import intml.worker.torch  # noqa: F401
      dist.init_process_group("intml")          # instead of "gloo"

  Its ``allreduce`` of float32 CPU tensors with SUM or AVG goes through the aggregator; every other collective,
  op and dtype goes to an inner Gloo group built on the same store (SwitchML's PyTorch patch falls back to Gloo
  the same way). DDP with no hook then sends its buckets through intml.

Environment (see ``IntmlConfig``): ``INTML_AGGREGATOR=host:port`` (required unless falling back),
``INTML_TOKEN``, ``INTML_CODEC`` (cnat8 | int32), ``INTML_JOB``, ``INTML_SEED``, ``INTML_PACKET_ELEMENTS``,
``INTML_POOL``, ``INTML_TIMEOUT``, ``INTML_CONNECT_TIMEOUT``, ``INTML_FALLBACK`` (error | gloo),
``INTML_ERROR_FEEDBACK`` (0 | 1, hook only), ``INTML_WARMUP_STEPS`` (hook only), ``INTML_THREAD`` (0 | 1).

Start-up: every rank joins the aggregator, then the ranks agree over Gloo on the outcome, so they all take
the same path: all use intml, all fall back to Gloo with an ``IntmlFallbackWarning`` (``INTML_FALLBACK=gloo``),
or all raise ``AggregatorUnavailable`` naming the ranks that could not join and why. An aggregator that
*refuses* the join (``JoinError``: wrong token, job id taken, mismatched parameters) is a configuration
error and always raises. Mid-training, an allreduce that makes no progress for ``INTML_TIMEOUT`` seconds
raises ``intml.AllreduceTimeout`` (naming the ranks the aggregator waits for) through the returned Future,
so ``loss.backward()`` / ``dist.all_reduce`` raise instead of hanging; later intml allreduces of the same
group fail at once with ``IntmlError``.
"""

from __future__ import annotations

import atexit
import dataclasses
import os
import queue
import secrets
import threading
import warnings
import weakref
from collections.abc import Callable, Mapping
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist
from numba import njit
from torch.futures import Future

from intml.protocol.arith import cnat_floor, dequantize, int32_scale_exponent, quantize, value_bits, worker_stream
from intml.protocol.cnat import decode_kernel, encode_kernel
from intml.protocol.packet import HDR
from intml.protocol.rng import derive_key
from intml.worker.api import CODECS, AllreduceTimeout, JoinError, Worker

__all__ = [
    "AggregatorUnavailable",
    "IntmlConfig",
    "IntmlError",
    "IntmlFallbackWarning",
    "IntmlHookState",
    "IntmlProcessGroup",
    "intml_hook",
]

BACKEND = "intml"


class IntmlError(RuntimeError):
    """An intml allreduce cannot run (an earlier one of the same group failed)."""


class AggregatorUnavailable(IntmlError):
    """At start-up some rank could not join the aggregator, and INTML_FALLBACK is 'error'."""


class IntmlFallbackWarning(RuntimeWarning):
    """At start-up some rank could not join the aggregator; the group uses Gloo instead (INTML_FALLBACK=gloo)."""


# ---- configuration ------------------------------------------------------------------------------------------
_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}


def _parse_bool(text: str, name: str) -> bool:
    value = text.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ValueError(f"{name} must be 0 or 1 (or true/false), got {text!r}")


@dataclasses.dataclass
class IntmlConfig:
    """Where the aggregator is and how to use it. ``from_env`` reads ``INTML_<FIELD>`` (upper case; ``pool_size``
    is ``INTML_POOL``, ``threaded`` is ``INTML_THREAD``); keyword arguments override the environment."""

    aggregator: str | None = None  # host:port of intml-aggregator
    token: str = ""  # the job's shared secret (only a hash goes on the wire)
    codec: str = "cnat8"  # cnat8 (8-bit C_nat) or int32 (SwitchML's fixed point)
    job: int | None = None  # job id on the aggregator; None: rank 0 draws one at random and shares it
    seed: int | None = None  # job seed of the stochastic rounding; None: rank 0 draws one
    packet_elements: int = 1024  # elements per packet (1024 fits a 1500-byte MTU)
    pool_size: int = 64  # slots, i.e. packets in flight per worker
    timeout: float = 30.0  # an allreduce with no progress for this long raises AllreduceTimeout
    connect_timeout: float = 5.0  # start-up: seconds to wait for the aggregator's JOIN_ACK
    fallback: str = "error"  # aggregator unreachable at start-up: "error" raises, "gloo" warns and uses Gloo
    error_feedback: bool = False  # hook: keep each bucket's compression residual and add it next step
    warmup_steps: int = 0  # hook: the first K steps go uncompressed through Gloo
    threaded: bool = False  # run allreduces on a background thread instead of in the caller (see _Link)

    _ENV = {"pool_size": "INTML_POOL", "threaded": "INTML_THREAD"}

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, **overrides) -> IntmlConfig:
        env = os.environ if env is None else env
        values: dict = {}
        for f in dataclasses.fields(cls):
            name = cls._ENV.get(f.name, f"INTML_{f.name.upper()}")
            if name not in env:
                continue
            text = env[name]
            kind = str(f.type)
            if f.name == "aggregator" or kind == "str":
                values[f.name] = text
            elif kind == "bool":
                values[f.name] = _parse_bool(text, name)
            else:
                try:
                    values[f.name] = float(text) if "float" in kind else int(text, 0)
                except ValueError:
                    raise ValueError(f"{name} must be a number, got {text!r}") from None
        unknown = set(overrides) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            raise TypeError(f"unknown intml option(s): {sorted(unknown)}")
        values.update(overrides)
        return cls(**values).validated()

    def validated(self) -> IntmlConfig:
        if self.codec not in CODECS:
            raise ValueError(f"INTML_CODEC must be one of {sorted(CODECS)}, got {self.codec!r}")
        if self.fallback not in ("error", "gloo"):
            raise ValueError(f"INTML_FALLBACK must be 'error' or 'gloo', got {self.fallback!r}")
        if self.warmup_steps < 0:
            raise ValueError(f"INTML_WARMUP_STEPS must be >= 0, got {self.warmup_steps}")
        if not (self.timeout > 0 and self.connect_timeout > 0):
            raise ValueError("INTML_TIMEOUT and INTML_CONNECT_TIMEOUT must be > 0")
        return self


# ---- the worker's own encoding, for error feedback -----------------------------------------------------------
@njit(cache=True, nogil=True, boundscheck=False)
def _own_cnat_kernel(x, out_bits, codes, key, pkt, agreed, vbits):
    """What this worker sent for x, decoded: each chunk encoded as the engine does (same key, element offsets
    and agreed-exponent floor), so the codes are bit for bit the ones that went on the wire."""
    for c in range(agreed.size):
        lo = c * pkt
        hi = min(x.size, lo + pkt)
        encode_kernel(x[lo:hi], codes[lo:hi], key, np.uint64(lo), cnat_floor(agreed[c], vbits), True)
    decode_kernel(codes, out_bits)


@njit(cache=True, nogil=True, boundscheck=False)
def _own_int32_kernel(x, out, pkt, agreed, vbits):
    limit = np.int64(1) << vbits
    for c in range(agreed.size):
        se = int32_scale_exponent(agreed[c], vbits)
        scale, unit = 2.0**se, 2.0**-se
        for i in range(c * pkt, min(x.size, (c + 1) * pkt)):
            out[i] = dequantize(quantize(x[i], scale, limit), unit)


def sent_values(w: Worker, x: np.ndarray, seed: int) -> np.ndarray:
    """The values worker `w` put on the wire in its last allreduce, whose input was the flat float32 `x`.

    Reads the chunk exponents the switch agreed on from the engine's state; call it right after the allreduce.
    """
    eng = w.engine
    agreed = eng.state.agreed_exp
    vbits = value_bits(w.world_size)
    out = np.empty(x.size, np.float32)
    if w.codec == CODECS["cnat8"]:
        key = np.uint64(derive_key(np.uint64(seed), worker_stream(eng.allreduce_seq, w.rank)))
        _own_cnat_kernel(x, out.view(np.uint32), np.empty(x.size, np.uint8), key, eng.packet_elements, agreed,
                         vbits)
    else:
        _own_int32_kernel(x, out, eng.packet_elements, agreed, vbits)
    return out


# ---- traffic accounting -------------------------------------------------------------------------------------
def intml_bytes(elements: int, codec: str, packet_elements: int, pool_size: int) -> int:
    """Bytes one worker sends (and receives) for one allreduce without loss: the payload, plus a header on each
    of the ceil(N/P) data packets and the min(pool, chunks) empty bootstrap packets that open the slots."""
    chunks = -(-elements // packet_elements)
    return elements * CODECS[codec].bytes_per_element + (chunks + min(pool_size, chunks)) * HDR


def ring_bytes(elements: int, world_size: int, element_size: int = 4) -> float:
    """Bytes one worker sends (and receives) in a ring allreduce: 2(n-1)/n of the tensor."""
    return 2 * (world_size - 1) / world_size * element_size * elements


@dataclasses.dataclass
class Traffic:
    """Counters of one hook state or process group (per worker, each way; intml figures from the formula in
    ``intml_bytes``, retransmitted datagrams counted apart)."""

    intml_allreduces: int = 0
    intml_elements: int = 0
    intml_bytes: int = 0
    gloo_allreduces: int = 0
    gloo_elements: int = 0
    gloo_bytes: float = 0.0
    packets_out: int = 0
    retransmissions: int = 0


# ---- the link: one Worker, one thread ------------------------------------------------------------------------
class _Link:
    """One rank's Worker on a job. By default each allreduce runs in the caller and the returned Future is
    already complete; with ``threaded`` (INTML_THREAD=1) it runs on a dedicated thread fed by a queue and the
    Future completes later, so autograd can compute the next buckets' gradients meanwhile (DDP's overlap).

    Why synchronous by default: measured with `intml-testbed train` (digits MLP, 4 ranks under torchrun on this
    2-core machine, cnat8, thread and no thread interleaved in one invocation, median step time over seeds), the
    thread never helped: thread vs caller 9.13 vs 8.71, 7.84 vs 6.79 and 7.98 vs 7.45 ms per step with one DDP
    bucket per step (5, 3 and 5 seeds), 8.54 vs 8.18 and 9.41 vs 8.46 ms with five buckets per step (3 seeds
    each). Per-seed figures overlap (the machine is shared), but the direction never changed. With 4 ranks and
    the aggregator on 2 cores there is no idle core for the overlap to use, and the hand-off adds GIL switches
    and wake-ups. The thread stays an option for hosts with spare cores, where communication can overlap
    backward compute. Either way allreduces are served strictly in submission order, which is the order every
    rank must issue them in.
    """

    def __init__(self, w: Worker, config: IntmlConfig, seed: int, traffic: Traffic) -> None:
        self.worker = w
        self.config = config
        self.seed = seed
        self.traffic = traffic
        self.failed: BaseException | None = None
        self._closed = False
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = None
        if config.threaded:
            self._thread = threading.Thread(target=self._serve, name=f"intml-job{w.job}-rank{w.rank}", daemon=True)
            self._thread.start()

    def submit(self, tensor: torch.Tensor, op: str, *, inplace: bool, residual: torch.Tensor | None = None) -> Future:
        """Allreduce the flat float32 CPU `tensor` (sum or mean); the Future holds [tensor] (inplace) or a new
        tensor. With `residual`, send tensor + residual and keep the new compression residual in it."""
        fut: Future = Future()
        item = (tensor, op, inplace, residual, fut)
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
            return IntmlError(f"intml: job {w.job} rank {w.rank}: the link to the aggregator is closed")
        return IntmlError(f"intml: job {w.job} rank {w.rank}: an earlier allreduce through the aggregator "
                          f"{w.host}:{w.port} failed, so this group cannot allreduce any more: {self.failed}")

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
        tensor, op, inplace, residual, fut = item
        try:
            value = self._allreduce(tensor, op, inplace, residual)
        except BaseException as exc:  # noqa: BLE001 -- every failure goes to the waiting Future
            self.failed = exc
            self._fail(fut, exc)
            return
        fut.set_result(value)

    def _allreduce(self, tensor, op, inplace, residual):
        w = self.worker
        flat = tensor.detach().reshape(-1).numpy()  # a view: the tensor is contiguous float32 on the CPU
        x = flat if residual is None else flat + residual.numpy()
        before = w.counters()
        out = w.allreduce(x, op, out=flat if inplace else None)  # in place: no result allocation, no copy back
        after = w.counters()
        if residual is not None:
            np.subtract(x, sent_values(w, x, self.seed), out=residual.numpy())
        t = self.traffic
        t.intml_allreduces += 1
        t.intml_elements += x.size
        t.intml_bytes += intml_bytes(x.size, self.config.codec, self.config.packet_elements, self.config.pool_size)
        t.packets_out += after["packets_out"] - before["packets_out"]
        t.retransmissions += after["retransmissions"] - before["retransmissions"]
        if inplace:
            return [tensor]
        return torch.from_numpy(out).view(tensor.shape)

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


def _connect(config: IntmlConfig, rank: int, world_size: int, control_allreduce: Callable[[torch.Tensor], None],
             traffic: Traffic) -> _Link | None:
    """Join the aggregator at every rank and agree on the outcome. Returns the link, or None when the group
    falls back to Gloo. `control_allreduce(t)` sums an int64 CPU tensor over the group through Gloo, blocking."""
    # Job id and seed: rank 0's (from the config, else drawn at random), shared as a Gloo sum of zeros elsewhere.
    ids = torch.zeros(2, dtype=torch.int64)
    if rank == 0:
        ids[0] = config.job if config.job is not None else 1 + secrets.randbelow(0xFFFFFFFE - 1)
        ids[1] = config.seed if config.seed is not None else secrets.randbits(62)
    control_allreduce(ids)
    job, seed = int(ids[0]), int(ids[1])

    # Status per rank: 0 joined, 1 unreachable (or no address), 2 refused or misconfigured.
    w = None
    reason = ""
    status = torch.zeros(world_size, dtype=torch.int64)
    if not config.aggregator:
        status[rank], reason = 1, "no aggregator address (set INTML_AGGREGATOR=host:port)"
    else:
        try:
            w = Worker(config.aggregator, job=job, rank=rank, world_size=world_size, token=config.token,
                       codec=config.codec, packet_elements=config.packet_elements, pool_size=config.pool_size,
                       seed=seed, timeout=config.connect_timeout)
            w.timeout = config.timeout  # the join waited connect_timeout; allreduces get the training deadline
        except (AllreduceTimeout, OSError) as exc:
            status[rank], reason = 1, f"{type(exc).__name__}: {exc}"
        except (JoinError, ValueError) as exc:
            status[rank], reason = 2, f"{type(exc).__name__}: {exc}"
    control_allreduce(status)
    if not status.any():
        return _Link(w, config, seed, traffic)
    if w is not None:
        w.close()
    failed = status.nonzero().flatten().tolist()
    where = f"aggregator {config.aggregator}" if config.aggregator else "no aggregator configured"
    mine = f" (this rank: {reason})" if reason else ""
    if bool((status == 2).any()):
        refused = (status == 2).nonzero().flatten().tolist()
        raise AggregatorUnavailable(f"intml: ranks {refused} could not join job {job} at {where}: refused by the "
                                    f"aggregator or misconfigured{mine}; check INTML_AGGREGATOR, INTML_TOKEN, "
                                    f"INTML_CODEC, INTML_PACKET_ELEMENTS and INTML_JOB")
    message = f"intml: {where} unreachable from ranks {failed} of {world_size} at start-up{mine}"
    if config.fallback == "gloo":
        warnings.warn(f"{message}; falling back to Gloo's ring allreduce (INTML_FALLBACK=gloo)",
                      IntmlFallbackWarning, stacklevel=3)
        return None
    raise AggregatorUnavailable(f"{message}. Start `intml-aggregator --host HOST --port PORT` and set "
                                f"INTML_AGGREGATOR=HOST:PORT, or set INTML_FALLBACK=gloo to train with Gloo instead")


_LINKS: weakref.WeakSet = weakref.WeakSet()


@atexit.register
def _close_links() -> None:  # leave the jobs, so the aggregator frees their slots now, not after its idle timeout
    for link in list(_LINKS):
        link.close(wait=1.0)


def _sum_op() -> dist.AllreduceOptions:
    opts = dist.AllreduceOptions()
    opts.reduceOp = dist.ReduceOp.SUM
    return opts


# ---- DDP communication hook -----------------------------------------------------------------------------------
class _AggregatorLinked:
    """What the hook state and the backend share: a Gloo group for control messages and the link to the
    aggregator (None when start-up fell back to Gloo)."""

    gloo: dist.ProcessGroup

    def _attach(self, config: IntmlConfig, rank: int, size: int) -> None:
        self.config = config
        self.traffic = Traffic()
        self.link = _connect(config, rank, size, self._control_allreduce, self.traffic)
        if self.link is not None:
            _LINKS.add(self.link)

    def _control_allreduce(self, t: torch.Tensor) -> None:
        self.gloo.allreduce([t], _sum_op()).wait()

    @property
    def using_intml(self) -> bool:
        return self.link is not None

    def _leave(self) -> None:
        if self.link is not None:
            self.link.close()


class IntmlHookState(_AggregatorLinked):
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
        self._residual_of_bucket: dict[int, tuple[tuple, torch.Tensor]] = {}
        self._residual_of_param: dict[int, torch.Tensor] = {}
        self._attach(config if config is not None else IntmlConfig.from_env(**options), self.rank, self.world_size)

    def close(self) -> None:
        """Leave the aggregator's job (also done at interpreter exit)."""
        self._leave()

    def __getstate__(self):  # DDP pickles nothing of it, but keep a state from being sent across processes
        raise TypeError("IntmlHookState holds a socket and a thread; construct it in each rank")

    # -- the hook's work --
    def allreduce_bucket(self, bucket: dist.GradBucket) -> Future:
        buf = bucket.buffer()
        step = self.step
        if bucket.is_last():
            self.step += 1
        if (self.link is None or step < self.config.warmup_steps or buf.dtype != torch.float32
                or buf.device.type != "cpu"):
            return self._gloo_mean(buf)
        residual = self._residual(bucket, buf) if self.config.error_feedback else None
        return self.link.submit(buf, "mean", inplace=False, residual=residual).then(_value)

    def _gloo_mean(self, buf: torch.Tensor) -> Future:
        """The average through Gloo (warm-up, fallback, other dtypes), as torch's default allreduce hook does."""
        t = self.traffic
        t.gloo_allreduces += 1
        t.gloo_elements += buf.numel()
        t.gloo_bytes += ring_bytes(buf.numel(), self.world_size, buf.element_size())
        buf.div_(self.world_size)
        fut = self.gloo.allreduce([buf], _sum_op()).get_future()
        return fut.then(lambda f: f.value()[0])

    def _residual(self, bucket: dist.GradBucket, buf: torch.Tensor) -> torch.Tensor:
        """The bucket's residual, flat like its buffer. DDP rebuilds its buckets after the first step (in the order
        gradients became ready), so residuals are also kept per parameter and moved into the new layout."""
        params = bucket.parameters()
        layout = tuple(id(p) for p in params)
        cached = self._residual_of_bucket.get(bucket.index())
        if cached is not None and cached[0] == layout and cached[1].numel() == buf.numel():
            return cached[1]
        flat = torch.zeros(buf.numel(), dtype=torch.float32)
        if sum(p.numel() for p in params) == buf.numel():
            offset = 0
            for p in params:
                view = flat[offset:offset + p.numel()]
                old = self._residual_of_param.get(id(p))
                if old is not None:
                    view.copy_(old)
                self._residual_of_param[id(p)] = view
                offset += p.numel()
        self._residual_of_bucket[bucket.index()] = (layout, flat)
        return flat


def intml_hook(state: IntmlHookState, bucket: dist.GradBucket) -> Future:
    """DDP communication hook: the bucket's average over the ranks through the aggregator (a Future of a tensor
    shaped like the bucket). Register with ``ddp.register_comm_hook(IntmlHookState(), intml_hook)``."""
    return state.allreduce_bucket(bucket)


# DDP's register_comm_hook compares the annotations with the real types; this module's are strings (PEP 563).
intml_hook.__annotations__ = {"state": IntmlHookState, "bucket": dist.GradBucket,
                              "return": torch.futures.Future[torch.Tensor]}


# ---- process-group backend --------------------------------------------------------------------------------------
def _value(fut: Future):
    """A `then` callback passing the value on. A Future failed from Python (set_exception) holds the exception as
    its value, which C++ consumers such as DDP's reducer would try to cast to a tensor ("Unable to cast ...");
    a callback that raises fails the chained Future properly, so DDP raises "AllreduceTimeout: ..." instead."""
    return fut.value()


class _Work(dist._Work):
    """The Work of an intml allreduce: wait() blocks on the Future and raises its exception."""

    def __init__(self, fut: Future) -> None:
        super().__init__()
        self._fut = fut
        self._chained = fut.then(_value)

    def wait(self, timeout: timedelta | None = None) -> bool:
        self._fut.wait()  # raises the allreduce's own exception (AllreduceTimeout, IntmlError)
        self._chained.wait()  # so that get_future() is complete once wait() returns, as with Gloo
        return True

    def get_future(self) -> Future:
        return self._chained

    def is_completed(self) -> bool:
        return self._fut.done()


def _gloo_group(store: dist.Store, rank: int, size: int, timeout: timedelta) -> dist.ProcessGroup:
    """A ProcessGroup with a Gloo backend, as init_process_group('gloo') builds (not registered with c10d)."""
    pg = dist.ProcessGroup(store, rank, size)
    backend = dist.ProcessGroupGloo(store, rank, size, timeout)
    pg._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.GLOO, backend)
    pg._set_default_backend(dist.ProcessGroup.BackendType.GLOO)
    return pg


class IntmlProcessGroup(_AggregatorLinked, dist.ProcessGroup):
    """``init_process_group("intml")``: allreduce of float32 CPU tensors with SUM or AVG through the aggregator,
    everything else through an inner Gloo group (``self.gloo``) on the same store."""

    def __init__(self, store: dist.Store, rank: int, size: int, timeout: timedelta,
                 config: IntmlConfig | None = None) -> None:
        super().__init__(rank, size)
        self.gloo = _gloo_group(dist.PrefixStore("intml-gloo/", store), rank, size, timeout)
        self._attach(config if config is not None else IntmlConfig.from_env(), rank, size)

    def getBackendName(self) -> str:  # noqa: N802 -- the c10d name
        return BACKEND

    def allreduce(self, tensors, opts=None, op=None, timeout=None):
        if isinstance(tensors, torch.Tensor):
            tensors = [tensors]
        if opts is None or isinstance(opts, (dist.ReduceOp, dist.ReduceOp.RedOpType)):
            reduce_op = opts if opts is not None else (op if op is not None else dist.ReduceOp.SUM)
            opts = dist.AllreduceOptions()
            opts.reduceOp = reduce_op
            if timeout is not None:
                opts.timeout = timeout
        kind = _intml_op(opts.reduceOp)
        if (self.link is not None and kind is not None and len(tensors) == 1 and tensors[0].dtype == torch.float32
                and tensors[0].device.type == "cpu" and tensors[0].is_contiguous()):
            return _Work(self.link.submit(tensors[0], kind, inplace=True))
        t = self.traffic
        t.gloo_allreduces += 1
        t.gloo_elements += sum(x.numel() for x in tensors)
        t.gloo_bytes += sum(ring_bytes(x.numel(), self.size(), x.element_size()) for x in tensors)
        return self.gloo.allreduce(tensors, opts)

    def shutdown(self) -> None:
        self._leave()
        self.gloo.shutdown()

    def abort(self) -> None:
        self.shutdown()

    def __repr__(self) -> str:
        mode = "intml" if self.link is not None else "gloo fallback"
        return f"IntmlProcessGroup(rank={self.rank()}, size={self.size()}, {mode})"


def _intml_op(reduce_op) -> str | None:
    if reduce_op == dist.ReduceOp.SUM:
        return "sum"
    if reduce_op == dist.ReduceOp.AVG:
        return "mean"
    return None


def _delegate(name: str):
    def method(self, *args, **kwargs):
        return getattr(self.gloo, name)(*args, **kwargs)

    method.__name__ = method.__qualname__ = name
    method.__doc__ = f"{name} through the inner Gloo group."
    return method


# Every other collective goes to Gloo. The methods must exist on the class: the C++ trampoline that DDP and the
# functional collectives call through looks them up by name, so __getattr__ would not be seen.
for _name in ("broadcast", "allgather", "_allgather_base", "allgather_coalesced", "allgather_into_tensor_coalesced",
              "all_gather_single", "all_gather_single_coalesced", "allreduce_coalesced", "reduce", "gather",
              "scatter", "reduce_scatter", "_reduce_scatter_base", "reduce_scatter_single",
              "reduce_scatter_single_coalesced", "reduce_scatter_tensor_coalesced", "alltoall", "alltoall_base",
              "all_to_all_single", "send", "recv", "recv_anysource", "barrier", "monitored_barrier"):
    if hasattr(dist.ProcessGroup, _name):
        setattr(IntmlProcessGroup, _name, _delegate(_name))


def _create_process_group(store, rank, size, timeout) -> IntmlProcessGroup:
    return IntmlProcessGroup(store, rank, size, timeout)


if not hasattr(dist.Backend, BACKEND.upper()):
    dist.Backend.register_backend(BACKEND, _create_process_group, devices=["cpu"])
