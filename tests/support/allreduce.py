"""Allreduce jobs run by live worker processes against a real aggregator, and their oracle: each rank's inputs,
protocol.reference's result for the plan, and the bit-for-bit comparison (the end-to-end, P4-engine,
reduce-scatter and offload tests share them)."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from typing import NamedTuple

import numpy as np

from intml.protocol import reference
from support.cluster import HOST, run_ok

PACKET = 256  # elements per packet: odd tensor sizes leave a partial last chunk
POOL = 8  # fewer slots than chunks, so slots (and their shadow sets) are reused within an allreduce
CODECS = ("cnat8", "int32")
_job_ids = itertools.count(100)


def new_job() -> int:
    return next(_job_ids)


# ---- inputs and the oracle ----------------------------------------------------------------------------------
class Spec(NamedTuple):
    """One allreduce of a plan: the tensor's shape, op, and how it is made."""

    shape: tuple
    op: str = "sum"
    zero_head: bool = False  # the first chunk is all zeros at every rank (a chunk without exponent)
    transposed: bool = False  # a non-contiguous 2-D view
    float64: bool = False  # handed to allreduce as float64


PLAN = (
    Spec((5003,)),
    Spec((0,)),
    Spec((1,)),
    Spec((37, 101)),
    Spec((2001,), op="mean"),
    Spec((3001,), zero_head=True),
    Spec((29, 31), transposed=True, float64=True),
)
SMALL_PLAN = (Spec((5003,)), Spec((37, 101)))


def make_input(seed: int, rank: int, k: int, spec: Spec) -> np.ndarray:
    """Rank `rank`'s tensor for allreduce #k: normal values at a per-rank, per-tensor scale."""
    rng = np.random.default_rng([seed, rank, k])
    size = int(np.prod(spec.shape))
    x = rng.standard_normal(size) * 2.0 ** int(rng.integers(-6, 7))
    if spec.zero_head:
        x[: PACKET + 17] = 0.0
    x = x.astype(np.float64 if spec.float64 else np.float32)
    if spec.transposed:
        return x.reshape(spec.shape[::-1]).T
    return x.reshape(spec.shape)


def expected_results(n: int, codec: str, seed: int, plan, packet: int = PACKET) -> list[np.ndarray]:
    """The oracle's result of each allreduce of the plan (allreduce #k has sequence number k)."""
    out = []
    for k, spec in enumerate(plan):
        xs = [make_input(seed, r, k, spec) for r in range(n)]
        total = reference.allreduce(xs, codec=codec, seed=seed, allreduce_seq=k, packet_elements=packet)
        total = total.reshape(spec.shape)
        if spec.op == "mean":
            total = total / np.float32(n)
        assert total.dtype == np.float32
        out.append(total)
    return out


def assert_bits_equal(got: np.ndarray, want: np.ndarray, what: str) -> None:
    got = np.asarray(got)
    assert got.dtype == np.float32, f"{what}: dtype {got.dtype}, expected float32"
    assert got.shape == want.shape, f"{what}: shape {got.shape}, expected {want.shape}"
    g = np.ascontiguousarray(got).reshape(-1).view(np.uint32)
    w = np.ascontiguousarray(want).reshape(-1).view(np.uint32)
    bad = np.flatnonzero(g != w)
    assert bad.size == 0, (f"{what}: {bad.size} of {g.size} elements differ from the reference, first at "
                           f"{bad[:5].tolist()}: got {got.reshape(-1)[bad[:5]]}, want {want.reshape(-1)[bad[:5]]}")


def check_results(results: list[dict], n: int, codec: str, seed: int, plan, what: str) -> None:
    want = expected_results(n, codec, seed, plan)
    assert len(results) == n
    for rank, res in enumerate(results):
        assert len(res["outs"]) == len(plan)
        for k, (got, w) in enumerate(zip(res["outs"], want)):
            assert_bits_equal(got, w, f"{what} rank {rank} allreduce #{k} {plan[k]}")


# ---- worker process bodies (module level: they also work with the 'spawn' start method) -----------------
def allreduce_worker(port: int | str, job: int, rank: int, n: int, codec: str, seed: int, plan, *,
                     faults: float = 0.0, use_async: bool = False, timeout: float = 30.0, pool: int = POOL,
                     into: bool = False) -> dict:
    """Join `job`, allreduce the plan's tensors in order, leave; returns results and counters. `into`: results
    go into caller buffers, in place (out=x) where x is contiguous float32, else a new out array. ``port``: the
    aggregator's on HOST, or the Worker's whole aggregator argument (several aggregators)."""
    from support.faults import faulty_sockets

    from intml.worker import Worker

    # one seed per socket: the unicast one, then any group's
    sockets = faulty_sockets(drop=faults, duplicate=faults, reorder=faults, seed=1000 * job + 100 * rank) \
        if faults else contextlib.nullcontext()
    xs = [make_input(seed, rank, k, spec) for k, spec in enumerate(plan)]
    ticks = None
    address = port if isinstance(port, str) else f"{HOST}:{port}"
    with sockets, Worker(address, job=job, rank=rank, world_size=n, token="t", codec=codec,
                         packet_elements=PACKET, pool_size=pool, seed=seed, timeout=timeout) as w:
        if use_async:
            outs, ticks = asyncio.run(_allreduce_async_all(w, xs, plan))
        elif into:
            outs = []
            for x, spec in zip(xs, plan):
                buf = x if x.dtype == np.float32 and x.flags.c_contiguous else np.empty(x.shape, np.float32)
                got = w.allreduce(x, op=spec.op, out=buf)
                assert got is buf
                outs.append(got)
        else:
            outs = [w.allreduce(x, op=spec.op) for x, spec in zip(xs, plan)]
        return {"outs": outs, "counters": w.counters(), "faults": dict(getattr(w.io, "counts", {})), "ticks": ticks,
                "groups": w.results_groups, "group_gro": [getattr(s, "gro", None) for s in w._inputs[1:]]}


async def _allreduce_async_all(w, xs, plan):
    ticks = 0
    stop = asyncio.Event()

    async def ticker():
        nonlocal ticks
        while not stop.is_set():
            await asyncio.sleep(0.001)
            ticks += 1

    task = asyncio.ensure_future(ticker())
    try:
        outs = [await w.allreduce_async(x, op=spec.op) for x, spec in zip(xs, plan)]
    finally:
        stop.set()
        await task
    return outs, ticks


def run_job(port: int, n: int, codec: str, seed: int, plan, job: int | None = None, **kwargs) -> list[dict]:
    job = new_job() if job is None else job
    return run_ok(allreduce_worker, [(port, job, r, n, codec, seed, plan) for r in range(n)], timeout=90, **kwargs)


def shard_of(total: np.ndarray, rank: int, n: int) -> np.ndarray:
    """Rank `rank`'s shard of a reduce-scatter's full result."""
    size = total.size // n
    return total.reshape(-1)[rank * size:(rank + 1) * size]


# a reduce-scatter plan: (kind, spec) per collective, kind "rs" or "allreduce"
RS_PLAN = (("rs", Spec((4 * 1000,))), ("allreduce", Spec((37, 101))), ("rs", Spec((4 * 77,), op="mean")),
           ("rs", Spec((8,))))


def reduce_scatter_worker(port: int, job: int, rank: int, n: int, codec: str, seed: int, plan, faults: float,
                          use_async: bool) -> dict:
    from support.faults import faulty_sockets

    from intml.worker import Worker

    specs = [spec for _, spec in plan]
    xs = [make_input(seed, rank, k, spec) for k, spec in enumerate(specs)]
    with faulty_sockets(drop=faults, duplicate=faults, reorder=faults, seed=100 * job + rank), \
            Worker(f"127.0.0.1:{port}", job=job, rank=rank, world_size=n, token="t", codec=codec,
                   packet_elements=PACKET, pool_size=8, seed=seed) as w:
        outs = []
        for (kind, spec), x in zip(plan, xs):
            if kind == "allreduce":
                outs.append(w.allreduce(x, op=spec.op))
            elif use_async:
                outs.append(asyncio.run(w.reduce_scatter_async(x, op=spec.op)))
            else:
                outs.append(w.reduce_scatter(x, op=spec.op))
        return {"outs": outs, "faults": dict(w.io.counts)}
