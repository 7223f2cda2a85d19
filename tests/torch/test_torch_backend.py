"""The "intml" process group as a first-class c10d backend: named and registered as Gloo's groups are, so that
functional collectives, DeviceMesh (1-D and 2-D, intml on the data-parallel dimension) and FSDP2 ``fully_shard``
work; ``monitored_barrier``; destroy and re-initialise in one process; the start-up errors' wording.

Ranks are forked processes (tests/support/cluster.py) on 127.0.0.1 with a real aggregator process, as in test_torch.py.
The int32 codec and integer-valued tensors make intml's sums exact where a test compares values; FSDP2 trains on
random data and is compared with Gloo within the int32 bound stated at its assertion.
"""

from __future__ import annotations

import time
from datetime import timedelta

import numpy as np
import pytest

torch = pytest.importorskip("torch")
import torch.distributed as dist  # noqa: E402
from support.cluster import run_ok  # noqa: E402

import intml.worker.torch as intml  # noqa: E402
from intml.worker.torch import link  # noqa: E402
from support.torch_ranks import TOKEN, init_rank, train_fsdp2  # noqa: E402

pytestmark = [pytest.mark.torch, pytest.mark.process]

# every float32 SUM/AVG through intml; a JOIN may wait behind 4 ranks loading their kernels on this 2-core machine
ENV = {"INTML_TOKEN": TOKEN, "INTML_CODEC": "int32", "INTML_MIN_ELEMENTS": "0", "INTML_CONNECT_TIMEOUT": "30"}


def _store(port: int, rank: int, n: int) -> dist.TCPStore:
    """One store for every group of the process, as torchrun's agent store is: it outlives them."""
    return dist.TCPStore("127.0.0.1", port, n, rank == 0, timeout=timedelta(seconds=60))


def _init(store: dist.TCPStore, address: str, rank: int, n: int, backend: str = "intml", **env: str) -> None:
    init_rank(store, rank, n, backend, {**ENV, "INTML_AGGREGATOR": address, **env})


def _registered(pg: dist.ProcessGroup) -> dict:
    """How c10d knows a group: its name, description, and the registry entries under that name."""
    c10d = dist.distributed_c10d
    name = pg.group_name
    return {"name": name, "desc": pg.group_desc, "in_world": c10d._world.pg_names.get(pg) == name,
            "resolves": c10d._resolve_process_group(name) is pg, "backend": dist.get_backend(pg)}


# ---- rank bodies (module level: run in forked processes) ---------------------------------------------------
def meshes_rank(port: int, address: str, rank: int, n: int) -> dict:
    import torch.distributed._functional_collectives as fc
    from torch.distributed.device_mesh import init_device_mesh

    store = _store(port, rank, n)
    _init(store, address, rank, n)
    pg = dist.group.WORLD
    out: dict = {"world": _registered(pg), "type": type(pg).__name__}
    gloo = dist.new_group(backend="gloo")  # the anchor: how c10d registers a Gloo group
    out["gloo"] = _registered(gloo)
    x = torch.arange(100, dtype=torch.float32) * (rank + 1)
    before = pg.traffic.intml_allreduces
    out["fc_sum"] = fc.all_reduce(x, "sum", pg).numpy()
    out["fc_avg"] = fc.all_reduce(x, "avg", pg).numpy()
    out["fc_intml_allreduces"] = pg.traffic.intml_allreduces - before
    out["fc_all_gather"] = fc.all_gather_tensor(torch.full((3,), float(rank)), 0, pg).numpy()
    out["fc_reduce_scatter"] = fc.reduce_scatter_tensor(torch.arange(2.0 * n) * (rank + 1), "sum", 0, pg).numpy()
    mesh = init_device_mesh("cpu", (n,))
    out["mesh1d_is_world"] = mesh.get_group() is pg
    out["mesh1d_sum"] = fc.all_reduce(x, "sum", mesh).numpy()

    def dims(mesh2d) -> dict:
        got = {}
        for dim in ("dp", "tp"):
            g = mesh2d.get_group(dim)
            t = torch.full((1000,), float(rank + 1))
            dist.all_reduce(t, group=g)
            got[dim] = {**_registered(g), "type": type(g).__name__, "sum": float(t[0]),
                        "ranks": dist.get_process_group_ranks(g),
                        "job": g.link.worker.job if isinstance(g, intml.IntmlProcessGroup) else None,
                        "intml_allreduces": g.traffic.intml_allreduces if hasattr(g, "traffic") else None}
        return got

    out["mesh2d"] = dims(init_device_mesh("cpu", (n // 2, 2), mesh_dim_names=("dp", "tp")))
    out["world_job"] = pg.link.worker.job
    dist.destroy_process_group()
    # Gloo by default, intml on the data-parallel dimension only
    _init(store, address, rank, n, backend="gloo")
    out["override"] = dims(init_device_mesh("cpu", (n // 2, 2), mesh_dim_names=("dp", "tp"),
                                            backend_override={"dp": "intml"}))
    dist.destroy_process_group()
    return out


def fsdp2_rank(port: int, address: str, rank: int, n: int, steps: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    _init(_store(port, rank, n), address, rank, n)
    pg = dist.group.WORLD
    out = {}
    out["gloo"] = train_fsdp2(init_device_mesh("cpu", (n,), backend_override={0: "gloo"}), rank, steps)
    out["intml"] = train_fsdp2(init_device_mesh("cpu", (n,)), rank, steps)
    out["intml traffic"] = dict(vars(pg.traffic))
    # HSDP: gradients reduce-scattered within a shard group, then allreduced across replicas through intml
    mesh = init_device_mesh("cpu", (2, n // 2), mesh_dim_names=("replicate", "shard"))
    out["hsdp"] = train_fsdp2(mesh, rank, steps)
    out["hsdp replicate traffic"] = dict(vars(mesh.get_group("replicate").traffic))
    dist.destroy_process_group()
    return out


def barrier_rank(port: int, address: str, rank: int, n: int) -> dict:
    _init(_store(port, rank, n), address, rank, n)
    pg = dist.group.WORLD
    out = {}
    intml.monitored_barrier(timeout=timedelta(seconds=10))
    pg.monitored_barrier(timedelta(seconds=10), wait_all_ranks=True)
    out["all ranks"] = True
    # rank 1 stays away: rank 0's barrier must fail within its timeout, naming rank 1
    if rank == 0:
        start = time.monotonic()
        try:
            intml.monitored_barrier(timeout=timedelta(seconds=1), wait_all_ranks=True)
            out["missing"] = None
        except RuntimeError as exc:
            out["missing"] = str(exc)
        out["seconds"] = time.monotonic() - start
    else:
        time.sleep(2.5)
    dist.destroy_process_group()
    return out


def reinit_rank(store_port: int, address: str, rank: int, n: int, rounds: int, job: int) -> list[dict]:
    """init, one allreduce through intml, destroy; `rounds` times, on a store that outlives the processes (as
    torchrun's agent store outlives restarted workers), with INTML_JOB fixed: each round needs the previous
    rounds' store keys ignored and their job left."""
    store = dist.TCPStore("127.0.0.1", store_port, n, False, timeout=timedelta(seconds=60))
    out = []
    for k in range(rounds):
        start = time.monotonic()
        if rank:  # the others come back later than rank 0, which would read their previous keys first
            time.sleep(0.5)
        _init(store, address, rank, n, INTML_JOB=str(job))
        pg = dist.group.WORLD
        t = torch.arange(1000, dtype=torch.float32) * (rank + 1)
        dist.all_reduce(t)
        out.append({"name": pg.group_name, "job": pg.link.worker.job, "intml": pg.traffic.intml_allreduces,
                    "exact": bool(torch.equal(t, torch.arange(1000, dtype=torch.float32) * n * (n + 1) / 2)),
                    "seconds": time.monotonic() - start})
        dist.destroy_process_group()
    return out


# ---- tests ---------------------------------------------------------------------------------------------------
def test_named_registered_functional_collectives_and_device_meshes(ranks) -> None:
    n = 4
    results = ranks(meshes_rank, n, timeout=120)
    x = np.arange(100, dtype=np.float32)
    tri = n * (n + 1) // 2
    for rank, r in enumerate(results):
        # named and registered as the Gloo group beside it is (c10d names groups "0", "1", ... in creation order)
        assert r["type"] == "IntmlProcessGroup"
        assert r["world"] == {"name": "0", "desc": "default_pg", "in_world": True, "resolves": True,
                              "backend": "intml"}, r["world"]
        assert r["gloo"] == {"name": "1", "desc": "undefined", "in_world": True, "resolves": True,
                             "backend": "gloo"}, r["gloo"]
        # functional collectives: allreduce through intml (exact: int32, integer values), the others through Gloo
        assert np.array_equal(r["fc_sum"], x * tri) and np.array_equal(r["fc_avg"], x * tri / n)
        assert r["fc_intml_allreduces"] == 2
        assert np.array_equal(r["fc_all_gather"], np.repeat(np.arange(n, dtype=np.float32), 3))
        assert np.array_equal(r["fc_reduce_scatter"], np.arange(2.0 * n)[2 * rank:2 * rank + 2] * tri)
        assert r["mesh1d_is_world"] and np.array_equal(r["mesh1d_sum"], x * tri)
        # 2-D mesh under the intml default: both dimensions' groups are intml groups, each a job of its own
        dp, tp = r["mesh2d"]["dp"], r["mesh2d"]["tp"]
        assert dp["ranks"] == [rank % 2, rank % 2 + 2] and tp["ranks"] == [rank - rank % 2, rank - rank % 2 + 1]
        for g, desc in ((dp, "mesh_dp"), (tp, "mesh_tp")):
            assert g["type"] == "IntmlProcessGroup" and g["desc"] == desc and g["resolves"] and g["in_world"], g
            assert g["backend"] == "intml" and g["intml_allreduces"] == 1, g
            assert g["sum"] == sum(q + 1 for q in g["ranks"]), g
        assert len({r["world_job"], dp["job"], tp["job"]}) == 3, "groups must not share a job on the aggregator"
        # Gloo default, intml on the data-parallel dimension only
        dp, tp = r["override"]["dp"], r["override"]["tp"]
        assert dp["type"] == "IntmlProcessGroup" and dp["backend"] == "intml" and dp["intml_allreduces"] == 1, dp
        assert tp["type"] == "ProcessGroup" and tp["backend"] == "gloo", tp
        assert dp["resolves"] and tp["resolves"] and dp["desc"] == "mesh_dp"
        assert dp["sum"] == sum(q + 1 for q in dp["ranks"]) and tp["sum"] == sum(q + 1 for q in tp["ranks"])
    # every rank of a subgroup is in the same job
    for dim in ("dp", "tp"):
        jobs = {tuple(r["mesh2d"][dim]["ranks"]): set() for r in results}
        for r in results:
            jobs[tuple(r["mesh2d"][dim]["ranks"])].add(r["mesh2d"][dim]["job"])
        assert all(len(j) == 1 for j in jobs.values()), jobs


def test_fsdp2_fully_shard_matches_gloo(ranks) -> None:
    n, steps = 4, 3
    results = ranks(fsdp2_rank, n, steps, timeout=120)
    gloo_params, gloo_losses = results[0]["gloo"]
    for run in ("gloo", "intml", "hsdp"):
        params = results[0][run][0]
        for rank, r in enumerate(results[1:], 1):  # every rank gathers the same full parameters
            assert all(np.array_equal(a, b) for a, b in zip(params, r[run][0], strict=True)), (run, rank)
        # Within int32's bound of Gloo: each summed gradient element is off by at most n u / 2, u = 2**-26 of the
        # tensor's largest |g| at n = 4 (test_torch.int32_bound), i.e. 3e-8 of it, plus float32 rounding of the
        # sum in another order (a few ulp); 3 SGD steps at lr 0.1 move parameters by < 1e-6 for that. A wrong shard,
        # a missing division by n or a stale gradient moves them by > 1e-3.
        for i, (a, b) in enumerate(zip(params, gloo_params, strict=True)):
            gap = float(np.abs(a - b).max())
            assert gap <= 1e-6, f"{run}: parameter {i} differs from Gloo's by {gap:.3g}"
        assert np.allclose(results[0][run][1], gloo_losses, rtol=1e-5, atol=1e-6), (run, results[0][run][1])
    for r in results:
        assert r["hsdp replicate traffic"]["intml_allreduces"] >= steps, r["hsdp replicate traffic"]
        assert r["hsdp replicate traffic"]["gloo_allreduces"] == 0, r["hsdp replicate traffic"]
    assert gloo_losses[-1] < gloo_losses[0], gloo_losses  # it trained


def test_monitored_barrier(ranks) -> None:
    n = 2
    results = ranks(barrier_rank, n, timeout=60)
    assert all(r["all ranks"] for r in results)
    message = results[0]["missing"]
    assert message is not None and "1" in message and "monitoredBarrier" in message, message
    assert results[0]["seconds"] < 5, results[0]


def test_destroy_and_reinit_repeatedly(agg) -> None:
    """Three rounds in each of two generations of processes (a restart) on one store held here."""
    n, rounds, job = 2, 3, 0x1D000001
    store = dist.TCPStore("127.0.0.1", 0, n, True, timeout=timedelta(seconds=60), wait_for_workers=False)
    for generation in range(2):
        results = run_ok(reinit_rank, [(store.port, agg.address, r, n, rounds, job) for r in range(n)], timeout=90)
        for rank, rounds_of_rank in enumerate(results):
            assert len(rounds_of_rank) == rounds
            for k, got in enumerate(rounds_of_rank):
                # the same group name each round: the same store prefix, whose old keys must not be read
                assert got == {**got, "name": "0", "job": job, "intml": 1, "exact": True}, (generation, rank, k, got)
                assert got["seconds"] < 10, (generation, rank, k, got)  # no connect timeout waited out
    deadline = time.monotonic() + 5
    while job in agg.job_ids():  # the last round's LEAVEs freed the job
        assert time.monotonic() < deadline, f"job {job} still held by the aggregator after every rank left"
        time.sleep(0.1)


# ---- start-up errors: one sentence that says what is wrong and how to fix it -----------------------------------
def test_startup_failure_messages() -> None:
    s = link.startup_failure
    msg = s([link.NO_ADDRESS, link.NO_ADDRESS], 7, None, "")
    assert msg == "intml: INTML_AGGREGATOR is not set at ranks [0, 1] of 2", msg
    assert "configured unreachable" not in msg
    msg = s([link.JOINED, link.UNREACHABLE], 7, "10.0.0.1:9000", "AllreduceTimeout: no JOIN_ACK")
    assert msg == ("intml: the aggregator at 10.0.0.1:9000 is unreachable from ranks [1] of 2 at start-up "
                   "(this rank: AllreduceTimeout: no JOIN_ACK)"), msg
    msg = s([link.NO_ADDRESS, link.UNREACHABLE], 7, None, "")
    assert "INTML_AGGREGATOR is not set at ranks [0] of 2 and the aggregator is unreachable from ranks [1]" in msg
    msg = s([link.REFUSED, link.UNREACHABLE], 7, "h:1", "JOIN refused: the token is wrong")
    assert msg.startswith("intml: the aggregator at h:1 refused ranks [0] of 2 for job 7 (this rank: JOIN refused")
    assert "INTML_TOKEN" in msg
    msg = s([link.MISCONFIGURED, link.JOINED], 7, "foo", "aggregator address must be host:port, got 'foo'")
    assert "ranks [0] of 2 have an invalid intml setting" in msg and "host:port" in msg
    for text in (s([link.NO_ADDRESS], 1, None, ""), msg):
        assert text.count(". ") == 0 and text.startswith("intml: "), text  # one sentence


def test_config_messages_name_the_variable_and_the_kind() -> None:
    with pytest.raises(ValueError, match=r"^INTML_POOL must be an integer, got '1.5'$"):
        intml.IntmlConfig.from_env({"INTML_POOL": "1.5"})
    with pytest.raises(ValueError, match=r"^INTML_TIMEOUT must be a number, got 'soon'$"):
        intml.IntmlConfig.from_env({"INTML_TIMEOUT": "soon"})
    with pytest.raises(ValueError, match=r"^INTML_CONNECT_TIMEOUT must be a positive number of seconds, got -1.0$"):
        intml.IntmlConfig.from_env({"INTML_CONNECT_TIMEOUT": "-1"})
