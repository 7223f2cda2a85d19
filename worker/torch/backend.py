"""The "intml" process-group backend: ``init_process_group("intml")`` allreduces float32, bfloat16 and float16
tensors (CPU, or CUDA through ``gpu``'s device path) of at least ``INTML_MIN_ELEMENTS`` elements (default 64 Ki)
with SUM or AVG through the aggregator (several at once, coalesced, as one of their concatenation), and sends
every smaller allreduce (losses, metrics, counters: exact), every other collective, op and dtype to an inner Gloo
group on the same store (SwitchML's PyTorch patch falls back to Gloo the same way). ``routing`` has the rule and its
reasons. ``reduce_scatter_tensor`` (FSDP's and ZeRO's gradient reduction) follows the same rule through the aggregator,
which sends each rank only the chunks of its shard (a CUDA tensor's shard decoded on its device); a host codec's
reduce-scatter is its whole allreduce, the shard kept (host mode has no reduce-scatter;
``Traffic.host_reduce_scatters`` counts them).

Every intml allreduce runs on the link's thread, so ``dist.all_reduce(t, async_op=True)`` returns a Work at once,
as Gloo's does, and ``work.wait()`` / ``work.is_completed()`` / ``work.get_future()`` behave as Gloo's. The
backend cannot tell an async call from a blocking one (``dist.all_reduce`` waits on the same Work), so a blocking
call pays one hand-off to the thread and back: measured 2.50 against 2.44 ms per blocking 64 Ki-element allreduce
in the caller (2 ranks on this 2-core machine, loopback, medians of 125 interleaved calls), and no difference
beyond noise at 1 Mi elements (24.0 against 24.4 ms). Allreduces run in the order they were issued, which is the order
every rank must issue them in. Importing this module registers the backend."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.futures import Future

from intml.worker.torch import routing
from intml.protocol.codecs.host.powersgd import PowerSGD
from intml.worker.torch.auto import AUTO
from intml.worker.torch.config import IntmlConfig
from intml.worker.torch.link import CPU, AggregatorLinked, value

BACKEND = "intml"
DEVICES = (CPU, torch.device("cuda"))  # Gloo takes CUDA tensors too (it stages them through the host)


class _Work(dist._Work):
    """The Work of an intml allreduce: wait() blocks on the Future and raises its exception."""

    def __init__(self, fut: Future) -> None:
        super().__init__()
        self._fut = fut
        self._chained = fut.then(value)

    def wait(self, timeout: timedelta | None = None) -> bool:
        self._fut.wait()  # raises the allreduce's own exception (AllreduceTimeout, IntmlError)
        self._chained.wait()  # so that get_future() is complete once wait() returns, as with Gloo
        return True

    def get_future(self) -> Future:
        return self._chained

    def is_completed(self) -> bool:
        return self._fut.done()


def _gloo_group(store: dist.Store, rank: int, size: int, timeout: timedelta) -> dist.ProcessGroup:
    """A ProcessGroup with a Gloo backend, as init_process_group('gloo') builds (not registered with c10d), on
    keys of its own in `store`: this incarnation's.

    Why not the store's keys as they are: a store can outlive the group (torchrun's agent store lives as long as
    the job), and ``destroy_process_group()`` resets c10d's group counter, so a re-initialised group gets the same
    name and store prefix as the one before. Gloo's rendezvous would then read the previous incarnation's
    addresses, whose listeners are gone ("Gloo connectFullMesh failed ... Connection refused", while a rank that
    read the new keys waits out the timeout). Every rank adds 1 to a counter in the store before the rendezvous,
    and no rank can finish a rendezvous before every rank has added, so (count - 1) // size numbers the
    incarnation alike at every rank."""
    incarnation = (store.add("intml-incarnations", 1) - 1) // size
    store = dist.PrefixStore(f"intml-gloo/{incarnation}/", store)
    pg = dist.ProcessGroup(store, rank, size)
    backend = dist.ProcessGroupGloo(store, rank, size, timeout)
    for device in DEVICES:
        pg._register_backend(device, dist.ProcessGroup.BackendType.GLOO, backend)
    pg._set_default_backend(dist.ProcessGroup.BackendType.GLOO)
    return pg


class IntmlProcessGroup(AggregatorLinked, dist.ProcessGroup):
    """``init_process_group("intml")``: allreduce of float32 (or 16-bit) tensors of at least ``config.min_elements``
    elements with SUM or AVG through the aggregator, on a thread; everything else through an inner Gloo group
    (``self.gloo``) on the same store. ``self.traffic`` counts both paths, and why each allreduce went to Gloo."""

    def __init__(self, store: dist.Store, rank: int, size: int, timeout: timedelta,
                 config: IntmlConfig | None = None) -> None:
        super().__init__(rank, size)
        config = config if config is not None else IntmlConfig.from_env()  # refused before any rendezvous
        if config.codec == AUTO:  # an allreduce here is no bucket that recurs step after step, as the tuner needs
            raise ValueError("INTML_CODEC=auto runs in the DDP hook (IntmlHookState), not the intml backend: choose "
                             "a codec for the backend")
        if isinstance(config.host_codec(), PowerSGD):  # low rank needs a gradient's matrix shape: a DDP bucket's
            raise ValueError(f"INTML_CODEC={config.codec} runs in the DDP hook (IntmlHookState), not the intml "
                             f"backend: an allreduce here has no matrix shape to take a low rank of")
        self.gloo = _gloo_group(store, rank, size, timeout)
        # c10d keeps a group's name and description in its backends (ProcessGroup::setGroupName forwards to them,
        # getGroupName reads the first), so a group with none has no name ("ProcessGroup name not set"), and
        # functional collectives, DeviceMesh and FSDP2, which find groups by name, cannot use it. The inner Gloo
        # backend holds them, as it would for init_process_group("gloo"). The collectives still come here: the
        # C++ trampoline calls this class's methods first.
        for device in DEVICES:
            self._register_backend(device, dist.ProcessGroup.BackendType.GLOO, self.gloo._get_backend(CPU))
        self._set_default_backend(dist.ProcessGroup.BackendType.GLOO)
        # always on a thread: async_op=True must return at once, and a call does not say whether it is async
        self._attach(config, rank, size, threaded=True)

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
        return self._route(tensors, opts, self.gloo.allreduce)

    def allreduce_coalesced(self, tensors, opts=None):
        """``all_reduce_coalesced`` and ``_coalescing_manager``'s allreduces (DDP's and FSDP's path for several
        tensors at once): routed as one allreduce of all the tensors' elements, and through intml as one
        allreduce of their concatenation."""
        return self._route(tensors, opts if opts is not None else dist.AllreduceCoalescedOptions(),
                           self.gloo.allreduce_coalesced)

    def _route(self, tensors: list[torch.Tensor], opts, gloo_allreduce: Callable):
        """An allreduce of `tensors` through intml, or through `gloo_allreduce` (Gloo's allreduce or its coalesced
        one) for routing's reason."""
        kind = _intml_op(opts.reduceOp)
        reason = (routing.FALLBACK if self.link is None
                  else routing.backend_route(tensors, kind, self.config.min_elements, self._cuda_problem))
        if reason is None:
            return _Work(self._submit(tensors, kind))
        self._to_gloo(tensors, reason)
        if kind == "mean" and all(t.is_floating_point() for t in tensors):
            return self._gloo_mean(tensors, opts, gloo_allreduce)
        return gloo_allreduce(tensors, opts)

    def _submit(self, tensors: list[torch.Tensor], kind: str) -> Future:
        """Allreduce `tensors` in place through intml: one tensor as it is, several (one dtype and device, as
        routing checked) as one allreduce of their concatenation, copied back when it completes."""
        if len(tensors) == 1:
            return self.link.submit(tensors[0], kind, inplace=True)
        flat = torch.cat([t.reshape(-1) for t in tensors])

        def scatter_back(fut: Future) -> list[torch.Tensor]:
            fut.value()  # raises the allreduce's exception
            for t, part in zip(tensors, flat.split([t.numel() for t in tensors]), strict=True):
                t.copy_(part.view_as(t))
            return tensors

        return self.link.submit(flat, kind, inplace=True).then(scatter_back)

    def reduce_scatter_single(self, output, input, opts=None):  # noqa: A002 -- c10d's names
        """``reduce_scatter_tensor`` (and FSDP's gradient reduce-scatter): a float32 or 16-bit input (CPU, or CUDA
        through ``gpu``'s device path) of at least ``config.min_elements`` elements, SUM or AVG, through the
        aggregator, which sends each rank only the chunks of its shard (bit for bit the allreduce restricted to
        it); anything else through Gloo (AVG as its sum over the world size, waited for in the call: Gloo's
        reduce-scatter Work has no Future), counted under its routing reason."""
        if opts is None or isinstance(opts, (dist.ReduceOp, dist.ReduceOp.RedOpType)):
            reduce_op = opts if opts is not None else dist.ReduceOp.SUM
            opts = dist.ReduceScatterOptions()
            opts.reduceOp = reduce_op
        kind = _intml_op(opts.reduceOp)
        reason = (routing.FALLBACK if self.link is None
                  else routing.scatter_route(output, input, kind, self.config.min_elements, self.size(),
                                             self._cuda_problem))
        if reason is None:
            return _Work(self.link.submit_reduce_scatter(input, output, kind))
        self._to_gloo([input], reason, reduce_scatter=True)
        if kind != "mean" or not output.is_floating_point():
            return self.gloo.reduce_scatter_single(output, input, opts)
        sum_opts = dist.ReduceScatterOptions()
        sum_opts.reduceOp, sum_opts.timeout = dist.ReduceOp.SUM, opts.timeout
        self.gloo.reduce_scatter_single(output, input, sum_opts).wait()  # Gloo's Work here has no Future to chain
        fut: Future = Future()
        fut.set_result([output.div_(self.size())])
        return _Work(fut)

    _reduce_scatter_base = reduce_scatter_single  # the older name of the same call (dist._reduce_scatter_base)

    def _gloo_mean(self, tensors: list[torch.Tensor], opts, gloo_allreduce: Callable) -> _Work:
        """AVG through Gloo, which has no AVG: its sum (by `gloo_allreduce`, Gloo's allreduce or its coalesced
        one), divided by the world size when it completes."""
        sum_opts = type(opts)()
        sum_opts.reduceOp, sum_opts.timeout = dist.ReduceOp.SUM, opts.timeout
        size = self.size()
        fut = gloo_allreduce(tensors, sum_opts).get_future()
        return _Work(fut.then(lambda f: [t.div_(size) for t in f.value()]))

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
              "all_gather_single", "all_gather_single_coalesced", "reduce", "gather",
              "scatter", "reduce_scatter", "reduce_scatter_single_coalesced", "reduce_scatter_tensor_coalesced",
              "alltoall", "alltoall_base",
              "all_to_all_single", "send", "recv", "recv_anysource", "barrier", "monitored_barrier"):
    if hasattr(dist.ProcessGroup, _name):
        setattr(IntmlProcessGroup, _name, _delegate(_name))


def monitored_barrier(group: dist.ProcessGroup | None = None, timeout: timedelta | None = None,
                      wait_all_ranks: bool = False) -> None:
    """``dist.monitored_barrier`` for any group, an intml group included: rank 0 waits at most `timeout` (default:
    the group's) for every other rank and raises naming the first one missing (all of them with
    `wait_all_ranks`). Torch's own refuses every backend but Gloo by name ("only implemented for GLOO backend":
    distributed_c10d compares ``get_backend(group)`` with "gloo", then calls the group's ``monitored_barrier``),
    so it cannot take a third-party backend; an intml group's runs on its inner Gloo group, and any other group
    goes to torch's."""
    pg = group if group is not None else dist.distributed_c10d._get_default_group()
    if not isinstance(pg, IntmlProcessGroup):
        dist.monitored_barrier(group, timeout, wait_all_ranks)
        return
    pg.monitored_barrier(timeout, wait_all_ranks=wait_all_ranks)


def _create_process_group(opts, pg_options) -> IntmlProcessGroup:
    """c10d's creator (its extended API, which names the group's global ranks: none for the default group).
    INTML_JOB is the default group's job id; every other intml group (``new_group``, a DeviceMesh dimension's
    groups) is a job of its own whose id its rank 0 draws at random, so that groups never collide on the
    aggregator."""
    config = IntmlConfig.from_env()
    if opts.global_ranks_in_group:
        config = dataclasses.replace(config, job=None)
    return IntmlProcessGroup(opts.store, opts.group_rank, opts.group_size, opts.timeout, config)


if not hasattr(dist.Backend, BACKEND.upper()):
    dist.Backend.register_backend(BACKEND, _create_process_group, extended_api=True, devices=["cpu", "cuda"])
