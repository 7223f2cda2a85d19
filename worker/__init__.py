"""The host library: stream tensors through an intml aggregator (SwitchML-style in-network aggregation).

The socket driver (``Worker``) is loaded on first use, so that ``import intml.worker.engine`` stays sans-I/O."""

from __future__ import annotations

from typing import TYPE_CHECKING

__all__ = ["AllreduceTimeout", "JoinError", "Worker"]

if TYPE_CHECKING:
    from intml.worker.api import AllreduceTimeout, JoinError, Worker


def __getattr__(name: str):
    if name in __all__:
        from intml.worker import api

        return getattr(api, name)
    raise AttributeError(f"module 'intml.worker' has no attribute {name!r}")
