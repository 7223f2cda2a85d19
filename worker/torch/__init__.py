"""PyTorch integration: intml as a drop-in for Gloo's ring allreduce in ``torch.distributed``.

Two ways in, both configured from ``INTML_*`` environment variables (or keyword arguments, which win):

* **DDP communication hook** (keeps Gloo as the process group, options for error feedback and warm-up)::

      import intml.worker.torch as intml
      ddp.register_comm_hook(intml.IntmlHookState(), intml.intml_hook)

* **Process-group backend** (``import intml.worker.torch`` registers it)::

      import intml.worker.torch  # noqa: F401
      dist.init_process_group("intml")          # instead of "gloo"

  Its ``allreduce`` of float32, bfloat16 or float16 CPU or CUDA tensors (docs/mixed-precision.md) of at least
  ``INTML_MIN_ELEMENTS`` elements (default 65536) with SUM or AVG goes through the aggregator. Smaller allreduces
  (losses, metrics, counters) go exactly through an inner Gloo group built on the same store, and so does every other
  collective, op and dtype (SwitchML's PyTorch patch falls back to Gloo the same way). DDP with no hook then sends
  its full buckets through intml (every default bucket is above the threshold) and a small tail bucket exactly
  through Gloo; the hook compresses every bucket. ``dist.all_reduce(t, async_op=True)`` returns at once and completes
  later, as with Gloo.

  The group is named and registered with c10d as a Gloo group is, so functional collectives, ``init_device_mesh``
  (1-D, or 2-D with intml on every dimension or, through ``backend_override={"dp": "intml"}``, on the
  data-parallel one only) and FSDP2 ``fully_shard`` use it. Every intml group other than the default one
  (``new_group(backend="intml")``, a mesh dimension's groups) is a job of its own on the aggregator, its id drawn
  by the group's rank 0 (``INTML_JOB`` names the default group's). ``destroy_process_group()`` leaves the jobs,
  and ``init_process_group("intml")`` may follow it in the same process, any number of times.
  ``intml.monitored_barrier(group, timeout)`` is ``dist.monitored_barrier`` for intml groups (torch's refuses
  every backend but Gloo by name).

Routing: ``.traffic`` of the hook state or process group counts the allreduces and bytes through intml and
through Gloo, and ``.traffic.gloo_reasons`` why each went to Gloo (``routing``). A tensor a user may have expected
to be compressed that goes to Gloo (large but not a float32 or 16-bit float, on a device other than the CPU and
CUDA, on CUDA where ``intml[cuda]`` cannot run, not contiguous, an op other than SUM or AVG) warns once per reason
with an ``IntmlUncompressedWarning``. A group's first allreduce sent to Gloo for its size says so once, and its totals
are said when it is destroyed (``IntmlRoutingWarning``). Coalesced allreduces go as one of their concatenation.
A live rank keeps its job alive on the aggregator however long it pauses (``Worker.start_keepalive``).

Environment (see ``IntmlConfig``): ``INTML_AGGREGATOR=host:port`` (required unless falling back),
``INTML_TOKEN``, ``INTML_CODEC`` (cnat8 | int32 | a host codec's name: uniform8, topk0.01, ...: docs/codecs.md),
``INTML_ROUNDING`` (stochastic | nearest, docs/rounding.md),
``INTML_JOB``, ``INTML_SEED`` (default: from torch's seed, so a seeded run repeats bit for bit),
``INTML_PACKET_ELEMENTS``,
``INTML_POOL``, ``INTML_TIMEOUT``, ``INTML_CONNECT_TIMEOUT``, ``INTML_FALLBACK`` (error | gloo),
``INTML_ERROR_FEEDBACK`` (0 | 1, hook only), ``INTML_WARMUP_STEPS`` (hook only), ``INTML_THREAD`` (0 | 1, hook
only), ``INTML_MIN_ELEMENTS`` (backend only).

Start-up: every rank joins the aggregator, then the ranks agree over Gloo on the outcome, so they all take
the same path: all use intml, all fall back to Gloo with an ``IntmlFallbackWarning`` (``INTML_FALLBACK=gloo``),
or all raise ``AggregatorUnavailable`` naming the ranks that could not join and why. An aggregator that
*refuses* the join (``JoinError``: wrong token, job id taken, mismatched parameters) is a configuration
error and always raises. Mid-training, an allreduce that makes no progress for ``INTML_TIMEOUT`` seconds
raises ``intml.AllreduceTimeout`` (naming the ranks the aggregator waits for) through the returned Future,
so ``loss.backward()`` / ``dist.all_reduce`` raise instead of hanging; later intml allreduces of the same
group fail at once with ``IntmlError``.

CUDA tensors: where ``intml.worker.gpu`` imports (the ``intml[cuda]`` extra, a device and its driver), a float32
CUDA tensor is encoded and decoded on its device and only its 8-bit codes cross PCIe (``gpu``; docs/gpu.md);
``.traffic.intml_cuda_*`` count those allreduces. Results are bit for bit the CPU path's, so CPU and GPU ranks
may share a job.

Host codecs (``INTML_CODEC=uniform8``, ``adaptive-huffman``, ``topk0.01``...: protocol.codecs.host) are summed by
the aggregator's host mode and encoded on the CPU: 16-bit and CUDA tensors go as an exact float32 CPU copy, their
result rounded back once; a reduce-scatter is the whole allreduce with this rank's shard kept
(``.traffic.host_reduce_scatters``); ``.traffic`` holds the measured package bytes (docs/torch.md, "Host codecs").

Modules: ``config`` (``IntmlConfig``), ``link`` (joining the aggregator, the allreduce thread, the errors),
``feedback`` (error feedback's residuals), ``accounting`` (traffic counters), ``routing`` (intml or Gloo, and
why), ``gpu`` (the CUDA path), ``hook`` and ``backend``.
"""

from __future__ import annotations

from intml.worker.torch.accounting import Traffic
from intml.worker.torch.backend import BACKEND, IntmlProcessGroup, monitored_barrier  # importing it registers the backend
from intml.worker.torch.config import IntmlConfig
from intml.worker.torch.hook import IntmlHookState, intml_hook
from intml.worker.torch.link import AggregatorUnavailable, IntmlError, IntmlFallbackWarning
from intml.worker.torch.routing import IntmlRoutingWarning, IntmlUncompressedWarning
from intml.worker.traffic import intml_bytes, ring_bytes

__all__ = [
    "BACKEND",
    "AggregatorUnavailable",
    "IntmlConfig",
    "IntmlError",
    "IntmlFallbackWarning",
    "IntmlHookState",
    "IntmlProcessGroup",
    "IntmlRoutingWarning",
    "IntmlUncompressedWarning",
    "Traffic",
    "intml_bytes",
    "intml_hook",
    "monitored_barrier",
    "ring_bytes",
]
