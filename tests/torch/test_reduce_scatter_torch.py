"""``reduce_scatter_tensor`` on the intml process group: float32 CPU SUM and AVG of at least INTML_MIN_ELEMENTS
elements go through the aggregator, bit for bit the allreduce of the same input restricted to the rank's shard
(the protocol's oracle, protocol.reference.allreduce, at the same collective number; with the int32 codec, whose
rounding draws no random bits, also the group's own all_reduce); async Work as for all_reduce; everything else
through Gloo, counted under its reason. 2 to 4 ranks in forked processes, one aggregator process."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
import torch.distributed as dist  # noqa: E402

import intml.worker.torch as intml  # noqa: E402
from intml.protocol import reference  # noqa: E402
from support.torch_ranks import TOKEN, init_rank  # noqa: E402

pytestmark = [pytest.mark.torch, pytest.mark.process]

PACKET, POOL, MIN = 256, 8, 1000
SHARDS = [(0, "sum", 1000), (1, "mean", 777), (2, "async", 2048), (3, "base", 1001)]  # (call, kind, shard elements)


def rs_rank(port: int, address: str, rank: int, n: int, seed: int, codec: str) -> dict:
    init_rank(port, rank, n, "intml", {"INTML_AGGREGATOR": address, "INTML_SEED": str(seed), "INTML_TOKEN": TOKEN,
                                   "INTML_PACKET_ELEMENTS": str(PACKET), "INTML_POOL": str(POOL),
                                   "INTML_MIN_ELEMENTS": str(MIN), "INTML_CODEC": codec})
    pg = dist.distributed_c10d._get_default_group()
    assert isinstance(pg, intml.IntmlProcessGroup)
    rng = np.random.default_rng([seed, rank])
    calls = []
    for _, kind, shard in SHARDS:
        x = torch.from_numpy((rng.standard_normal(n * shard) * 2.0 ** int(rng.integers(-6, 3))).astype(np.float32))
        out = torch.empty(shard)
        op = dist.ReduceOp.AVG if kind == "mean" else dist.ReduceOp.SUM
        if kind == "async":
            work = dist.reduce_scatter_tensor(out, x, async_op=True)
            assert work.wait() and work.is_completed() and work.get_future().value()[0] is out
        elif kind == "base":
            pg._reduce_scatter_base(out, x, dist.ReduceScatterOptions()).wait()
        else:
            dist.reduce_scatter_tensor(out, x, op=op)
        calls.append({"input": x.numpy(), "out": out.numpy().copy()})
    # with int32 (no random bits) the group's own all_reduce of the same input, restricted, is the same
    x = torch.from_numpy(rng.standard_normal(n * 1500).astype(np.float32))
    out, full = torch.empty(1500), x.clone()
    dist.reduce_scatter_tensor(out, x)
    dist.all_reduce(full)
    own = {"out": out.numpy().copy(), "allreduce": full.numpy()[rank * 1500:(rank + 1) * 1500].copy()}
    before = dict(vars(pg.traffic))
    # through Gloo, exactly: below the threshold, float64, MAX, AVG below the threshold, and the list form
    delegated = {}
    small = torch.arange(4 * n, dtype=torch.float32) + rank
    got = torch.empty(4)
    dist.reduce_scatter_tensor(got, small)
    want = (torch.arange(4 * n, dtype=torch.float32) * n + sum(range(n)))[rank * 4:(rank + 1) * 4]
    delegated["small sum"] = torch.equal(got, want)
    dist.reduce_scatter_tensor(got, small, op=dist.ReduceOp.AVG)
    delegated["small mean"] = torch.equal(got, want / n)
    big64 = torch.ones(n * MIN, dtype=torch.float64)
    got64 = torch.empty(MIN, dtype=torch.float64)
    dist.reduce_scatter_tensor(got64, big64)
    delegated["float64"] = torch.equal(got64, torch.full((MIN,), float(n), dtype=torch.float64))
    dist.reduce_scatter_tensor(got, small, op=dist.ReduceOp.MAX)
    delegated["max"] = torch.equal(got, (torch.arange(4 * n, dtype=torch.float32) + n - 1)[rank * 4:(rank + 1) * 4])
    listed = torch.empty(4)
    dist.reduce_scatter(listed, list(small.chunk(n)))
    delegated["list form"] = torch.equal(listed, want)
    traffic = {k: v - before[k] if isinstance(v, (int, float)) else v for k, v in vars(pg.traffic).items()}
    dist.destroy_process_group()
    return {"calls": calls, "own": own, "delegated": delegated, "traffic": traffic,
            "intml_reduce_scatters": pg.traffic.intml_reduce_scatters}


@pytest.mark.parametrize("n, codec", [(2, "cnat8"), (4, "cnat8"), (3, "int32")])
def test_reduce_scatter_tensor_is_the_allreduce_restricted(ranks, n, codec):
    seed = 40 + n
    results = ranks(rs_rank, n, seed, codec, timeout=120)
    for k, kind, shard in SHARDS:
        xs = [res["calls"][k]["input"] for res in results]
        total = reference.allreduce(xs, codec=codec, seed=seed, allreduce_seq=k, packet_elements=PACKET)
        if kind == "mean":
            total = total / np.float32(n)
        for rank, res in enumerate(results):
            want = total[rank * shard:(rank + 1) * shard]
            assert res["calls"][k]["out"].tobytes() == want.tobytes(), f"rank {rank} call {k} ({kind})"
    for rank, res in enumerate(results):
        if codec == "int32":
            assert res["own"]["out"].tobytes() == res["own"]["allreduce"].tobytes(), f"rank {rank}"
        assert res["delegated"] == dict.fromkeys(res["delegated"], True), res["delegated"]
        assert res["intml_reduce_scatters"] == len(SHARDS) + 1
        t = res["traffic"]
        assert (t["intml_reduce_scatters"], t["gloo_reduce_scatters"]) == (0, 4), t  # the list form: not routed
        assert t["gloo_reasons"] == {"small": 3, "dtype": 1}, t
