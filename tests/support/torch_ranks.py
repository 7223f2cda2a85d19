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


def train_fsdp2(mesh: Any, rank: int, steps: int) -> tuple[list[Any], list[float]]:
    """A small MLP (the same at every rank), each Linear and the root sharded over `mesh` with FSDP2's
    ``fully_shard`` (on the mesh's device), `steps` SGD steps on this rank's batches; the full parameters (gathered,
    as numpy arrays) and the losses."""
    import torch
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(7)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 64), torch.nn.Tanh(),
                                torch.nn.Linear(64, 4))
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(100 + rank)
    device = torch.device(mesh.device_type, torch.cuda.current_device()) if mesh.device_type == "cuda" else "cpu"
    losses = []
    for _ in range(steps):
        x, y = torch.randn(32, 16, generator=gen), torch.randint(0, 4, (32,), generator=gen)
        loss = torch.nn.functional.cross_entropy(model(x.to(device)), y.to(device))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    return [p.full_tensor().detach().cpu().numpy().copy() for p in model.parameters()], losses
