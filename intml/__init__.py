"""intml: in-network aggregation of natural-compression (C_nat) gradients, SwitchML style, over UDP.

The repository's top-level folders install as this one namespace: ``intml.protocol`` (wire format, codecs,
arithmetic), ``intml.aggregator`` (the switch emulator), ``intml.worker`` (the host library),
``intml.burstio`` (burst socket I/O) and ``intml.testbed`` (clusters and benchmarks). The PyTorch integration is
``intml.worker.torch``.

``from intml import Worker`` loads the socket driver on first use only, so that importing a sans-I/O core
(``intml.aggregator.core``, ``intml.worker.engine``) loads no socket code.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

__all__ = ["AllreduceTimeout", "JoinError", "Worker"]
__version__ = "0.1.0"

if TYPE_CHECKING:
    from intml.worker.api import AllreduceTimeout, JoinError, Worker


def __getattr__(name: str):
    if name in __all__:
        from intml.worker import api

        return getattr(api, name)
    raise AttributeError(f"module 'intml' has no attribute {name!r}")
