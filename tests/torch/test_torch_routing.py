"""The "intml" backend's routing and async allreduces.

* Precision: small allreduces (losses, metrics) go exactly through Gloo; a tensor at or above
  ``INTML_MIN_ELEMENTS`` goes through intml and equals ``protocol.reference``; the threshold is configurable; the
  counters say which path each allreduce took and why; a large tensor intml cannot take warns once per reason.
* Async: ``dist.all_reduce(t, async_op=True)`` returns before the peer has even called it, completes later with
  the reference's result, and several outstanding ones complete in order.

Ranks are forked processes (tests/support/cluster.py) against a real aggregator process, as in test_torch.py.
"""

from __future__ import annotations

import dataclasses
import os
import time
import warnings
from datetime import timedelta

import numpy as np
import pytest

torch = pytest.importorskip("torch")
import torch.distributed as dist  # noqa: E402
from support.cluster import run_ok  # noqa: E402
from test_torch import PACKET, POOL, assert_reference  # noqa: E402

import intml.worker.torch as intml  # noqa: E402
from intml.testbed.procs import free_port  # noqa: E402
from support.torch_ranks import TOKEN, init_rank  # noqa: E402

pytestmark = [pytest.mark.torch, pytest.mark.process]

ISSUE_EXAMPLE = [3, 100, 1000, 5000, 1e6, 0.1, 123.456, 1e-20]  # returned [8, 256, 1024, 1024, ...] before
LARGE = 70_000  # above the 64 Ki default


def _init(port: int, rank: int, n: int, address: str, seed: int, **env: str) -> dist.ProcessGroup:
    init_rank(port, rank, n, "intml", {"INTML_AGGREGATOR": address, "INTML_SEED": str(seed), "INTML_TOKEN": TOKEN,
                                       "INTML_PACKET_ELEMENTS": str(PACKET), "INTML_POOL": str(POOL), **env})
    return dist.distributed_c10d._get_default_group()


def _uncompressed(caught) -> list[str]:
    return [str(w.message) for w in caught if issubclass(w.category, intml.IntmlUncompressedWarning)]


def precision_rank(port: int, address: str, rank: int, n: int, seed: int) -> dict:
    os.environ.pop("INTML_MIN_ELEMENTS", None)
    pg = _init(port, rank, n, address, seed)
    assert pg.config.min_elements == 65536
    out: dict = {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        t = torch.tensor(ISSUE_EXAMPLE, dtype=torch.float32)
        dist.all_reduce(t)
        out["sum"] = t.numpy().copy()
        t = torch.tensor(ISSUE_EXAMPLE, dtype=torch.float32) * (rank + 1)
        dist.all_reduce(t, op=dist.ReduceOp.AVG)
        out["avg"] = t.numpy().copy()
        out["small_warnings"] = _uncompressed(caught)
        out["after_small"] = dataclasses.asdict(pg.traffic)
        x = torch.from_numpy(np.random.default_rng([seed, rank]).standard_normal(LARGE).astype(np.float32))
        t = x.clone()
        dist.all_reduce(t)
        out["large"] = {"input": x.numpy(), "result": t.numpy().copy()}
        out["after_large"] = dataclasses.asdict(pg.traffic)
        for _ in range(2):  # large but float64: Gloo, one warning for both
            dist.all_reduce(torch.ones(LARGE, dtype=torch.float64))
        out["dtype_warnings"] = _uncompressed(caught)
    out["traffic"] = dataclasses.asdict(pg.traffic)
    # the threshold is configurable: a group with INTML_MIN_ELEMENTS=100 (a new job, allreduce numbers from 0)
    os.environ["INTML_MIN_ELEMENTS"] = "100"
    group = dist.new_group(backend="intml")
    x = torch.from_numpy(np.random.default_rng([seed, rank, 1]).standard_normal(100).astype(np.float32))
    t = x.clone()
    dist.all_reduce(t, group=group)
    out["at_threshold"] = {"input": x.numpy(), "result": t.numpy().copy()}
    below = torch.full((99,), 0.1 * (rank + 1))
    dist.all_reduce(below, group=group)
    out["below_threshold"] = below.numpy().copy()
    out["group_traffic"] = dataclasses.asdict(group.traffic)
    dist.destroy_process_group()
    return out


def async_rank(port: int, address: str, rank: int, n: int, seed: int, delay: float) -> dict:
    pg = _init(port, rank, n, address, seed, INTML_MIN_ELEMENTS="1000")
    rng = np.random.default_rng([seed, rank])
    inputs = [rng.standard_normal(size).astype(np.float32) for size in (4000, 5000, 1200, 3000)]
    out: dict = {"inputs": inputs}
    dist.barrier()  # through Gloo: both ranks start together, then rank 1 keeps rank 0 waiting
    if rank == 1:
        time.sleep(delay)
    t = torch.from_numpy(inputs[0].copy())
    start = time.monotonic()
    work = dist.all_reduce(t, async_op=True)
    out["returned_after"] = time.monotonic() - start
    out["completed_at_return"] = work.is_completed()
    work.wait()
    out["waited"] = time.monotonic() - start
    out["completed_after_wait"] = work.is_completed() and work.get_future().done()
    out["first"] = t.numpy().copy()
    # several outstanding: issued back to back, completed in issue order; waiting on the last finishes them all
    order: list[int] = []
    tensors = [torch.from_numpy(x.copy()) for x in inputs[1:]]
    ops = [dist.ReduceOp.SUM, dist.ReduceOp.AVG, dist.ReduceOp.SUM]
    works = [dist.all_reduce(t, op=op, async_op=True) for t, op in zip(tensors, ops, strict=True)]
    for i, w in enumerate(works):
        w.get_future().then(lambda _f, i=i: order.append(i))
    works[-1].wait()
    out["all_completed"] = [w.is_completed() for w in works]
    for w in works:
        w.wait()
    out["order"] = order
    out["outstanding"] = [t.numpy().copy() for t in tensors]
    out["traffic"] = dataclasses.asdict(pg.traffic)
    dist.destroy_process_group()
    return out


def test_small_allreduces_are_exact_large_ones_compressed(ranks) -> None:
    n, seed = 2, 41
    results = ranks(precision_rank, n, seed, timeout=120)
    x = np.array(ISSUE_EXAMPLE, dtype=np.float32)
    large = np.stack([r["large"]["input"] for r in results]).astype(np.float64)
    for rank, r in enumerate(results):
        assert r["sum"].tobytes() == (x + x).tobytes(), f"rank {rank}: {r['sum']} != {x + x}"
        want_avg = (x + x * np.float32(2)) / np.float32(2)  # AVG of x and 2x: Gloo's float32 sum, divided by 2
        assert r["avg"].tobytes() == want_avg.tobytes(), f"rank {rank}: {r['avg']} != {want_avg}"
        assert r["small_warnings"] == [], r["small_warnings"]  # kept exact on purpose: no warning
        small = r["after_small"]
        assert (small["intml_allreduces"], small["gloo_allreduces"], small["gloo_reasons"]) == (0, 2, {"small": 2})
        # the large tensor went through intml (the counters say so) and equals protocol.reference
        after = r["after_large"]
        assert after["intml_allreduces"] == 1 and after["intml_elements"] == LARGE, after
        assert after["intml_bytes"] == intml.intml_bytes(LARGE, "cnat8", PACKET, POOL)
        assert r["large"]["result"].tobytes() == results[0]["large"]["result"].tobytes()
        assert_reference(large, r["large"]["result"], "cnat8", seed, 0, "sum", f"rank {rank} large")
        # large float64: Gloo, one warning naming the reason for two such allreduces
        assert len(r["dtype_warnings"]) == 1 and "float32" in r["dtype_warnings"][0], r["dtype_warnings"]
        t = r["traffic"]
        assert t["gloo_reasons"] == {"small": 2, "dtype": 2} and t["gloo_allreduces"] == 4, t
        assert t["gloo_bytes"] > t["intml_bytes"] > 0, t  # both paths' bytes counted
        # INTML_MIN_ELEMENTS=100: 100 elements through intml (allreduce 0 of the new job), 99 through Gloo
        g = r["group_traffic"]
        assert (g["intml_allreduces"], g["gloo_allreduces"], g["gloo_reasons"]) == (1, 1, {"small": 1}), g
        xs = np.stack([q["at_threshold"]["input"] for q in results]).astype(np.float64)
        assert_reference(xs, r["at_threshold"]["result"], "cnat8", seed, 0, "sum", f"rank {rank} at threshold")
        below = np.float32(0.1) * np.float32(1) + np.float32(0.1) * np.float32(2)
        assert np.array_equal(r["below_threshold"], np.full(99, below, dtype=np.float32)), r["below_threshold"]


def test_async_allreduce_returns_at_once_and_completes_in_order(ranks) -> None:
    n, seed, delay = 2, 43, 1.5
    results = ranks(async_rank, n, seed, delay, timeout=120)
    r0 = results[0]
    # rank 0 called while rank 1 slept: the call returned at once, not completed; wait() waited for rank 1
    assert r0["returned_after"] < 0.5, r0["returned_after"]
    assert r0["completed_at_return"] is False
    assert r0["waited"] > delay / 2, r0["waited"]
    inputs = [np.stack([r["inputs"][k] for r in results]).astype(np.float64) for k in range(4)]
    ops = ["sum", "sum", "mean", "sum"]
    for rank, r in enumerate(results):
        assert r["completed_after_wait"] is True
        assert_reference(inputs[0], r["first"], "cnat8", seed, 0, "sum", f"rank {rank} delayed async")
        assert r["all_completed"] == [True, True, True], r["all_completed"]
        assert r["order"] == [0, 1, 2], r["order"]
        for k, got in enumerate(r["outstanding"], 1):
            assert_reference(inputs[k], got, "cnat8", seed, k, ops[k], f"rank {rank} outstanding {k}")
            assert got.tobytes() == results[0]["outstanding"][k - 1].tobytes()
        assert r["traffic"]["intml_allreduces"] == 4 and r["traffic"]["gloo_allreduces"] == 0, r["traffic"]


def hook_float64_rank(port: int, address: str) -> dict:
    """The hook with a float64 model at world size 1: intml cannot encode its buckets, so Gloo, with a warning."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1,
                            timeout=timedelta(seconds=60))
    model = torch.nn.Linear(300, 300).double()
    ddp = DDP(model)
    state = intml.IntmlHookState(aggregator=address, token=TOKEN, connect_timeout=30)
    ddp.register_comm_hook(state, intml.intml_hook)
    exact = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(2):
            x = torch.randn(8, 300, dtype=torch.float64, generator=torch.Generator().manual_seed(step))
            ddp.zero_grad()
            ddp(x).sum().backward()
            want = torch.autograd.grad(model(x).sum(), model.weight)[0]  # the same gradient without DDP
            exact.append(torch.equal(model.weight.grad, want))
    out = {"warnings": _uncompressed(caught), "traffic": dataclasses.asdict(state.traffic), "exact": exact}
    state.close()
    dist.destroy_process_group()
    return out


def test_hook_warns_once_when_a_bucket_cannot_be_compressed(agg) -> None:
    [out] = run_ok(hook_float64_rank, [(free_port(), agg.address)], timeout=120)
    assert len(out["warnings"]) == 1 and "float32" in out["warnings"][0], out["warnings"]
    t = out["traffic"]
    assert t["intml_allreduces"] == 0 and t["gloo_allreduces"] >= 2 and set(t["gloo_reasons"]) == {"dtype"}, t
    assert out["exact"] == [True, True]
