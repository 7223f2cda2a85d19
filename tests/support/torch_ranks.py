"""The torch tests' ranks: forked processes on loopback, each with a process group over a TCP rendezvous and a
shared aggregator process (the spawning side is tests/torch/conftest.py's ``ranks`` fixture)."""

from __future__ import annotations

import os
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from support.cluster import run_ok

from intml.testbed.procs import free_port

TOKEN = "test-torch"  # the aggregator of support.cluster.aggregator accepts it


def init_rank(rendezvous: Any, rank: int, n: int, backend: str = "gloo", env: dict | None = None) -> None:
    """A rank's preamble: its INTML_* environment, one torch thread (the ranks share two cores), and the default
    process group, rendezvous at a TCP port on 127.0.0.1 or at a ``TCPStore`` that outlives the group."""
    import torch
    import torch.distributed as dist

    if backend == "intml":
        import intml.worker.torch  # noqa: F401  (registers the backend, whoever forked this rank)
    os.environ.update(env or {})
    torch.set_num_threads(1)
    where = {"init_method": f"tcp://127.0.0.1:{rendezvous}"} if isinstance(rendezvous, int) else {"store": rendezvous}
    dist.init_process_group(backend, rank=rank, world_size=n, timeout=timedelta(seconds=60), **where)


def run_ranks(address: str, fn: Callable, n: int, *args: Any, timeout: float = 120.0) -> list[Any]:
    """``fn(port, address, rank, n, *args)`` in n forked ranks with one fresh rendezvous port; their results."""
    port = free_port()
    return run_ok(fn, [(port, address, r, n, *args) for r in range(n)], timeout=timeout)
