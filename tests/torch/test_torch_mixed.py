"""bfloat16 and float16 through the "intml" backend and the DDP hook: the same dtype out, through intml (the
group's ``.traffic`` counts them), bit-identical across ranks, equal to ``protocol.reference`` of the float32
values rounded to the dtype (to nearest, ties to even: torch's conversion), within C_nat's bound of the exact sum;
float16 sums beyond its range are +-Inf, as torch's conversion gives. FSDP2 with a bfloat16
``MixedPrecisionPolicy`` reduce-scatters through intml and trains the digits model to within 1 point of Gloo's
accuracy, Gloo run beside it in the same ranks.

Ranks are forked processes (tests/support/cluster.py) against a real aggregator process, as in test_torch.py.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

torch = pytest.importorskip("torch")
import torch.distributed as dist  # noqa: E402
from support.torch_ranks import TOKEN, init_rank  # noqa: E402
from test_torch import PACKET, POOL  # noqa: E402

from intml.protocol import reference  # noqa: E402

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}
N_ELEMENTS = 3000  # above the tests' INTML_MIN_ELEMENTS
MIN = 1000


pytestmark = [pytest.mark.torch, pytest.mark.process]


def _env(address: str, seed: int) -> dict[str, str]:
    return {"INTML_AGGREGATOR": address, "INTML_TOKEN": TOKEN, "INTML_PACKET_ELEMENTS": str(PACKET),
            "INTML_POOL": str(POOL), "INTML_MIN_ELEMENTS": str(MIN), "INTML_SEED": str(seed)}


def _inputs(seed: int, rank: int, dtype: torch.dtype, n: int) -> torch.Tensor:
    rng = np.random.default_rng([seed, rank])
    return torch.from_numpy((rng.standard_normal(n) * 2.0 ** rng.integers(-4, 4, n)).astype(np.float32)).to(dtype)


def mixed_rank(port: int, address: str, rank: int, n: int, seed: int) -> dict:
    init_rank(port, rank, n, "intml", _env(address, seed))
    pg = dist.distributed_c10d._get_default_group()
    out: dict = {"calls": []}
    for name, dtype in DTYPES.items():
        x = _inputs(seed, rank, dtype, N_ELEMENTS)
        t = x.clone()
        dist.all_reduce(t)
        m = x.clone()
        dist.all_reduce(m, op=dist.ReduceOp.AVG)
        shard = torch.empty(N_ELEMENTS // n, dtype=dtype)
        dist.reduce_scatter_tensor(shard, x)
        out["calls"].append({"dtype": name, "input": x.float().numpy(), "sum": _bits(t), "mean": _bits(m),
                             "shard": _bits(shard)})
    # float16: a sum beyond its range (65504) is +-Inf at every rank; the rest of the tensor stays right
    big = torch.full((N_ELEMENTS,), 0.5, dtype=torch.float16)
    big[:10], big[10:20] = 40000.0, -40000.0
    dist.all_reduce(big)
    out["big"] = _bits(big)
    out["traffic"] = dataclasses.asdict(pg.traffic)
    dist.destroy_process_group()
    return out


def _bits(t: torch.Tensor) -> tuple[str, np.ndarray]:
    """A 16-bit tensor as (dtype, its bits) for the trip to the test process (numpy has no bfloat16)."""
    return str(t.dtype), t.view(torch.int16).numpy().copy()


def _values(bits: tuple[str, np.ndarray]) -> np.ndarray:
    dtype = getattr(torch, bits[0].removeprefix("torch."))
    return torch.from_numpy(bits[1]).view(dtype).float().numpy()


def _rounded(values: np.ndarray, dtype: torch.dtype) -> np.ndarray:
    return torch.from_numpy(values.astype(np.float32)).to(dtype).float().numpy()


def test_bf16_and_fp16_allreduce_and_reduce_scatter_through_intml(ranks) -> None:
    n, seed = 2, 61
    results = ranks(mixed_rank, n, seed, timeout=180)
    for k, name in enumerate(DTYPES):
        dtype = DTYPES[name]
        xs = np.stack([r["calls"][k]["input"] for r in results])
        exact = xs.astype(np.float64).sum(axis=0)
        # collective numbers: 3 per dtype (sum, mean, reduce-scatter)
        seq = 3 * k
        want_sum = reference.allreduce(list(xs), codec="cnat8", seed=seed, allreduce_seq=seq, packet_elements=PACKET)
        want_mean = reference.allreduce(list(xs), codec="cnat8", seed=seed, allreduce_seq=seq + 1,
                                        packet_elements=PACKET) / np.float32(n)
        want_rs = reference.allreduce(list(xs), codec="cnat8", seed=seed, allreduce_seq=seq + 2,
                                      packet_elements=PACKET)
        for rank, r in enumerate(results):
            call = r["calls"][k]
            for what in ("sum", "mean", "shard"):
                assert call[what][0] == str(dtype), (name, what, call[what][0])  # the same dtype out
            got = _values(call["sum"])
            assert np.array_equal(got, _rounded(want_sum, dtype)), f"{name} sum at rank {rank}"
            assert np.array_equal(_values(call["mean"]), _rounded(want_mean, dtype)), f"{name} mean"
            lo, hi = rank * N_ELEMENTS // n, (rank + 1) * N_ELEMENTS // n
            assert np.array_equal(_values(call["shard"]), _rounded(want_rs[lo:hi], dtype)), f"{name} shard"
            assert np.array_equal(call["sum"][1], results[0]["calls"][k]["sum"][1])  # the same bits everywhere
            # C_nat's bound: a contribution x rounds to a power of two less than |x| from it, so the sum s' of
            # the rounded ones is within sum |x| of the exact sum and below 2 sum |x| in magnitude; the switch's
            # re-encode of s' is less than |s'| from it: 3 sum |x| in all; then the 16-bit rounding, 2**-8 (bf16)
            # or 2**-11 (fp16) of the result
            ulp = 2.0 ** -8 if dtype == torch.bfloat16 else 2.0 ** -11
            scale = np.abs(xs.astype(np.float64)).sum(axis=0)
            assert (np.abs(got - exact) <= 3 * scale + ulp * np.abs(got)).all(), name
            # unbiased: the mean of the normalised errors (each within [-3, 3], so their mean's standard deviation
            # is below 3 / sqrt(3000) = 0.055) is within 0.2 of 0; a biased rounding (say, always down) is not
            assert abs(np.mean((got - exact) / scale)) < 0.2, np.mean((got - exact) / scale)
    for r in results:
        big = _values(r["big"])
        assert (big[:10] == np.inf).all() and (big[10:20] == -np.inf).all() and (big[20:] == 1.0).all()
        assert np.array_equal(r["big"][1], results[0]["big"][1])
        t = r["traffic"]
        assert t["intml_allreduces"] == 5 and t["intml_reduce_scatters"] == 2 and t["gloo_allreduces"] == 0, t


def hook_rank(port: int, address: str, rank: int, n: int, seed: int) -> dict:
    """DDP of a bfloat16 model with the intml hook: every bucket through intml, gradients bfloat16."""
    import intml.worker.torch as intml
    from torch.nn.parallel import DistributedDataParallel as DDP

    init_rank(port, rank, n, "gloo")
    torch.manual_seed(0)
    model = torch.nn.Linear(100, 100).to(torch.bfloat16)
    ddp = DDP(model)
    state = intml.IntmlHookState(aggregator=address, token=TOKEN, seed=seed, packet_elements=PACKET, pool_size=POOL)
    ddp.register_comm_hook(state, intml.intml_hook)
    x = torch.randn(8, 100, generator=torch.Generator().manual_seed(rank)).to(torch.bfloat16)
    ddp(x).float().sum().backward()
    out = {"grad": _bits(model.weight.grad), "traffic": dataclasses.asdict(state.traffic)}
    state.close()
    dist.destroy_process_group()
    return out


def test_ddp_hook_takes_bf16_buckets(ranks) -> None:
    n = 2
    results = ranks(hook_rank, n, 5, timeout=120)
    for r in results:
        assert r["grad"][0] == "torch.bfloat16"
        assert np.array_equal(r["grad"][1], results[0]["grad"][1])
        assert r["traffic"]["intml_allreduces"] >= 1 and r["traffic"]["gloo_allreduces"] == 0, r["traffic"]


def fsdp2_rank(port: int, address: str, rank: int, n: int, epochs: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from intml.testbed.train import load_data, make_model, shards

    init_rank(port, rank, n, "intml", _env(address, 77))
    x_tr, y_tr, x_te, y_te = (torch.from_numpy(a) for a in load_data())
    mine = torch.from_numpy(shards(len(x_tr), n, 0)[rank])
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)
    out = {}
    for backend in ("gloo", "intml"):
        mesh = init_device_mesh("cpu", (n,), backend_override={0: "gloo"} if backend == "gloo" else None)
        model = make_model(3)
        for layer in model:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, mesh=mesh, mp_policy=policy)
        fully_shard(model, mesh=mesh, mp_policy=policy)
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        gen = torch.Generator().manual_seed(rank)
        for _ in range(epochs):
            order = mine[torch.randperm(len(mine), generator=gen)]
            for i in range(len(order) // 16):
                idx = order[i * 16:(i + 1) * 16]
                loss = torch.nn.functional.cross_entropy(model(x_tr[idx]).float(), y_tr[idx])
                loss.backward()
                opt.step()
                opt.zero_grad()
        with torch.no_grad():
            out[backend] = float((model(x_te).float().argmax(dim=1) == y_te).float().mean())
        if backend == "intml":
            out["traffic"] = dataclasses.asdict(mesh.get_group().traffic)
    dist.destroy_process_group()
    return out


def test_fsdp2_bf16_mixed_precision_trains_as_gloo_does(ranks) -> None:
    n, epochs = 2, 4
    results = ranks(fsdp2_rank, n, epochs, timeout=600)
    gloo, mine = results[0]["gloo"], results[0]["intml"]
    assert gloo > 0.9, gloo  # it trained
    assert abs(mine - gloo) <= 0.01, (mine, gloo)
    print(f"digits test accuracy after {epochs} epochs, FSDP2 bf16: Gloo {gloo:.4f}, intml {mine:.4f}")
    for r in results:
        t = r["traffic"]
        # the two hidden layers' gradients went through intml; the output layer's (510 elements) is below MIN
        assert t["intml_reduce_scatters"] >= 2 * epochs * 40, t
        assert set(t["gloo_reasons"]) <= {"small"} and t["intml_reduce_scatters"] == 2 * t["gloo_reduce_scatters"], t

