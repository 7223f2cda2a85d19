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

Modules: ``config`` (``IntmlConfig``), ``link`` (joining the aggregator, the allreduce thread, the errors),
``feedback`` (error feedback's residuals), ``accounting`` (traffic counters), ``hook`` and ``backend``.
"""

from __future__ import annotations

from intml.protocol.traffic import intml_bytes, ring_bytes
from intml.worker.torch.accounting import Traffic
from intml.worker.torch.backend import BACKEND, IntmlProcessGroup  # importing it registers the backend
from intml.worker.torch.config import IntmlConfig
from intml.worker.torch.hook import IntmlHookState, intml_hook
from intml.worker.torch.link import AggregatorUnavailable, IntmlError, IntmlFallbackWarning

__all__ = [
    "BACKEND",
    "AggregatorUnavailable",
    "IntmlConfig",
    "IntmlError",
    "IntmlFallbackWarning",
    "IntmlHookState",
    "IntmlProcessGroup",
    "Traffic",
    "intml_bytes",
    "intml_hook",
    "ring_bytes",
]
