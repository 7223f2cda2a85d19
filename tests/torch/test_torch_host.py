"""Host codecs (protocol.codecs.host) through torch: ``INTML_CODEC=uniform8`` under the "intml" backend and
``IntmlHookState(codec="topk0.01", error_feedback=True)`` under DDP. Every rank gets the bits of the codec's
reference (tests/support/host_codec.py), float32 and bfloat16 (widened exactly, rounded back once), reduce-scatter
as the allreduce's shard; the traffic counters hold the measured package bytes; error feedback is applied once.
A name that is no codec is refused in one line; a host codec's CUDA tensors need no CUDA path.

Ranks are forked processes (tests/support/cluster.py) against the room's aggregator process.
"""

from __future__ import annotations

import dataclasses
import types

import numpy as np
import pytest

torch = pytest.importorskip("torch")
import torch.distributed as dist  # noqa: E402
from support.host_codec import rank_key, reference  # noqa: E402
from support.torch_ranks import TOKEN, init_rank  # noqa: E402
from test_torch import PACKET, POOL  # noqa: E402

import intml.worker.torch as intml  # noqa: E402
from intml.protocol.codecs.host import parse  # noqa: E402
from intml.protocol.packet import HDR  # noqa: E402
from intml.worker.torch import routing  # noqa: E402
from intml.worker.torch.link import AggregatorLinked  # noqa: E402

pytestmark = [pytest.mark.torch]

N = 3000  # above MIN: through intml
MIN = 1000
SEED = 29
OUT, IN = 30, 100  # the hook's one-parameter model: one bucket of 3000 elements


def host_rank(port: int, address: str, rank: int, n: int) -> dict:
    """uniform8 through the backend (sum, mean, bfloat16, reduce-scatter), then topk0.01 with error feedback
    through the DDP hook, two steps."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    init_rank(port, rank, n, "intml", {"INTML_AGGREGATOR": address, "INTML_TOKEN": TOKEN, "INTML_SEED": str(SEED),
                                       "INTML_CODEC": "uniform8", "INTML_PACKET_ELEMENTS": str(PACKET),
                                       "INTML_POOL": str(POOL), "INTML_MIN_ELEMENTS": str(MIN)})
    pg = dist.distributed_c10d._get_default_group()
    x = torch.from_numpy(np.random.default_rng([SEED, rank]).standard_normal(N).astype(np.float32))
    out: dict = {"input": x.numpy().copy()}
    t = x.clone()
    dist.all_reduce(t)
    out["sum"] = t.numpy().copy()
    t = x.clone()
    dist.all_reduce(t, op=dist.ReduceOp.AVG)
    out["mean"] = t.numpy().copy()
    t = x.to(torch.bfloat16)
    dist.all_reduce(t)
    out["bf16"] = (str(t.dtype), t.view(torch.int16).numpy().copy())
    shard = torch.empty(N // n)
    dist.reduce_scatter_tensor(shard, x)
    out["shard"] = shard.numpy().copy()
    out["traffic"] = dataclasses.asdict(pg.traffic)

    state = intml.IntmlHookState(pg, codec="topk0.01", error_feedback=True)
    torch.manual_seed(0)
    model = torch.nn.Linear(IN, OUT, bias=False)
    ddp = DDP(model)
    ddp.register_comm_hook(state, intml.intml_hook)
    out["local"], out["grad"] = [], []
    for step in range(2):
        gen = torch.Generator().manual_seed(10 * rank + step)
        inputs, weights = torch.randn(8, IN, generator=gen), torch.randn(8, OUT, generator=gen)
        out["local"].append((weights.T @ inputs).numpy())  # this rank's own gradient of (model(inputs) * w).sum()
        model.weight.grad = None
        (ddp(inputs) * weights).sum().backward()
        out["grad"].append(model.weight.grad.numpy().copy())
    out["residual"] = state.residuals.of_param[id(model.weight)].numpy().copy()
    out["hook_traffic"] = dataclasses.asdict(state.traffic)
    state.close()
    dist.destroy_process_group()
    return out


def _wire(codec, xs: list[np.ndarray], rank: int, allreduce: int) -> tuple[int, int]:
    """(bytes rank `rank` sends, bytes it receives) in a host-codec allreduce of xs: packages and headers."""
    keys = [rank_key(SEED, allreduce, r) for r in range(len(xs))]
    sent = received = 0
    for lo in range(0, xs[0].size, PACKET):
        parts = [x[lo:lo + PACKET] for x in xs]
        packages = [codec.encode(p, k, lo) for p, k in zip(parts, keys)]
        result = codec.encode_result(codec.combine([codec.decode(q, p.size) for q, p in zip(packages, parts)]))
        sent += len(packages[rank]) + HDR
        received += len(result) + HDR
    return sent, received


def _compressed(codec, x: np.ndarray, key: int) -> np.ndarray:
    """What one rank puts on the wire for x, decoded: the error feedback's C(x)."""
    return np.concatenate([codec.decode(codec.encode(x[lo:lo + PACKET], key, lo), x[lo:lo + PACKET].size)
                           for lo in range(0, x.size, PACKET)])


@pytest.mark.process
def test_backend_and_hook_run_host_codecs_bit_for_bit(ranks) -> None:
    n = 2
    results = ranks(host_rank, n, timeout=180)
    uniform8, topk = parse("uniform8"), parse("topk0.01")
    xs = [r["input"] for r in results]
    wide = [torch.from_numpy(x).to(torch.bfloat16).float().numpy() for x in xs]  # what the bfloat16 inputs hold
    want = {"sum": reference(uniform8, xs, seed=SEED, allreduce=0, packet_elements=PACKET),
            "mean": reference(uniform8, xs, seed=SEED, allreduce=1, packet_elements=PACKET, mean=True)}
    # bfloat16: the float32 result of the exact float32 inputs, rounded once to bfloat16 (to nearest even)
    bf16 = torch.from_numpy(reference(uniform8, wide, seed=SEED, allreduce=2, packet_elements=PACKET))
    want_bf16 = bf16.to(torch.bfloat16).view(torch.int16).numpy()
    scattered = reference(uniform8, xs, seed=SEED, allreduce=3, packet_elements=PACKET)
    for rank, r in enumerate(results):
        for what in ("sum", "mean"):
            np.testing.assert_array_equal(r[what].view(np.uint32), want[what].view(np.uint32), err_msg=what)
        assert r["bf16"][0] == "torch.bfloat16"
        np.testing.assert_array_equal(r["bf16"][1], want_bf16)
        size = N // n
        np.testing.assert_array_equal(r["shard"].view(np.uint32),
                                      scattered[rank * size:(rank + 1) * size].view(np.uint32))
        # the counters hold the measured packages: a reduce-scatter is a whole allreduce, and says so
        t = r["traffic"]
        wire = [_wire(uniform8, inputs, rank, a) for a, inputs in enumerate((xs, xs, wide, xs))]
        assert t["intml_allreduces"] == 3 and t["intml_reduce_scatters"] == t["host_reduce_scatters"] == 1, t
        assert t["gloo_allreduces"] == 0 and t["intml_elements"] == 4 * N, t
        assert t["intml_bytes"] == sum(s for s, _ in wire) and t["host_result_bytes"] == sum(g for _, g in wire), t

    # the hook: topk0.01 with error feedback; step 2 sends its gradient plus step 1's residual, once
    local = [[g.reshape(-1) for g in r["local"]] for r in results]
    keys = [[rank_key(SEED, step, rank) for step in range(2)] for rank in range(n)]
    residual = [np.zeros(OUT * IN, np.float32) for _ in range(n)]
    received = 0
    for step in range(2):
        sent = [local[rank][step] + residual[rank] for rank in range(n)]
        want_grad = reference(topk, sent, seed=SEED, allreduce=step, packet_elements=PACKET, mean=True)
        for rank, r in enumerate(results):
            np.testing.assert_array_equal(r["grad"][step].reshape(-1).view(np.uint32), want_grad.view(np.uint32),
                                          err_msg=f"step {step} rank {rank}")
        residual = [s - _compressed(topk, s, keys[rank][step]) for rank, s in enumerate(sent)]
        received += _wire(topk, sent, 0, step)[1]
    for rank, r in enumerate(results):
        np.testing.assert_array_equal(r["residual"].reshape(-1), residual[rank])
    t = results[0]["hook_traffic"]
    assert t["intml_allreduces"] == 2 and t["gloo_allreduces"] == 0 and t["host_result_bytes"] == received, t
    # a topk result is dense (the sum of sparse packages at different indices): it comes back longer than it went
    assert t["host_result_bytes"] > t["intml_bytes"], t


def test_config_takes_host_codecs_and_refuses_others_in_one_line() -> None:
    config = intml.IntmlConfig.from_env({"INTML_CODEC": "adaptive-huffman-c6"})
    assert config.host_codec().name == "adaptive-huffman-c6"
    assert intml.IntmlConfig.from_env({}, codec="topk0.01").host_codec().name == "topk0.01"
    assert intml.IntmlConfig.from_env({"INTML_CODEC": "int32"}).host_codec() is None
    for name, why in (("uniform9000", "uniform takes an integer in 2..16"), ("gzip", "")):
        with pytest.raises(ValueError) as caught:
            intml.IntmlConfig.from_env({"INTML_CODEC": name})
        text = str(caught.value)
        assert "\n" not in text and f"got {name!r}" in text and why in text, text
        assert "cnat8 or int32" in text and "adaptive-huffman" in text and "topk" in text, text
    with pytest.raises(ValueError, match="randomk0.01: it is unbiased .* grow without bound"):
        intml.IntmlConfig.from_env({"INTML_CODEC": "randomk0.01", "INTML_ERROR_FEEDBACK": "1"})
    assert intml.IntmlConfig.from_env({"INTML_CODEC": "randomk0.01"}).host_codec().name == "randomk0.01"
    with pytest.raises(ValueError, match="INTML_ROUNDING=nearest is C_nat's; uniform8 rounds as it defines"):
        intml.IntmlConfig.from_env({"INTML_CODEC": "uniform8", "INTML_ROUNDING": "nearest"})
    assert intml.IntmlConfig.from_env({"INTML_CODEC": "powersgd2"}).host_codec().name == "powersgd2"
    with pytest.raises(ValueError, match="powersgd2: PowerSGD keeps its own error feedback"):
        intml.IntmlConfig.from_env({"INTML_CODEC": "powersgd2", "INTML_ERROR_FEEDBACK": "1"})
    # the backend's allreduces have no matrix shape: refused in one line, before any rendezvous
    with pytest.raises(ValueError, match="^INTML_CODEC=powersgd2 runs in the DDP hook [^\n]*$"):
        intml.IntmlProcessGroup(dist.HashStore(), 0, 2, dist.default_pg_timeout,
                                intml.IntmlConfig.from_env({"INTML_CODEC": "powersgd2"}))


def test_a_host_codecs_cuda_tensors_need_no_cuda_path() -> None:
    """A host codec encodes on the CPU, so its CUDA tensors go through intml (staged through host memory) where
    intml[cuda] cannot run; a switch codec's go to Gloo under CUDA there."""
    cuda = types.SimpleNamespace(dtype=torch.float32, device=torch.device("cuda:0"), is_contiguous=lambda: True,
                                 numel=lambda: 100_000)
    for codec, reason in ((parse("uniform8"), None), (None, routing.CUDA)):
        linked = AggregatorLinked()
        linked.link = types.SimpleNamespace(worker=types.SimpleNamespace(host_codec=codec),
                                            cuda=types.SimpleNamespace(problem=lambda: "no GPU here"))
        assert routing.unsupported(cuda, linked._cuda_problem) == reason


def cuda_rank(port: int, address: str, rank: int, n: int) -> dict:
    """uniform8 through the backend on CUDA tensors, float32 and bfloat16 allreduces and a float32 reduce-scatter,
    and the same values on the CPU."""
    init_rank(port, rank, n, "intml", {"INTML_AGGREGATOR": address, "INTML_TOKEN": TOKEN, "INTML_SEED": str(SEED),
                                       "INTML_CODEC": "uniform8", "INTML_PACKET_ELEMENTS": str(PACKET),
                                       "INTML_POOL": str(POOL), "INTML_MIN_ELEMENTS": str(MIN)})
    x = torch.from_numpy(np.random.default_rng([SEED, rank]).standard_normal(N).astype(np.float32))
    out: dict = {"input": x.numpy().copy(), "results": []}
    for t in (x.cuda(), x.to("cuda", torch.bfloat16)):
        dist.all_reduce(t)
        out["results"].append((str(t.device.type), str(t.dtype), t.cpu().float().numpy()))
    shard = torch.empty(N // n, device="cuda")
    dist.reduce_scatter_tensor(shard, x.cuda())
    out["shard"] = shard.cpu().numpy()
    out["traffic"] = dataclasses.asdict(dist.distributed_c10d._get_default_group().traffic)
    dist.destroy_process_group()
    return out


@pytest.mark.process
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_tensors_are_staged_through_host_memory(ranks) -> None:
    """CUDA tensors with a host codec: through intml, staged as float32 CPU copies, the result back on the device in
    the tensor's dtype, bit for bit the codec's reference (bfloat16: rounded once); a reduce-scatter's shard too."""
    results = ranks(cuda_rank, 2, timeout=180)
    xs = [r["input"] for r in results]
    wide = [torch.from_numpy(x).to(torch.bfloat16).float().numpy() for x in xs]
    want32 = reference(parse("uniform8"), xs, seed=SEED, allreduce=0, packet_elements=PACKET)
    want16 = torch.from_numpy(reference(parse("uniform8"), wide, seed=SEED, allreduce=1, packet_elements=PACKET))
    scattered = reference(parse("uniform8"), xs, seed=SEED, allreduce=2, packet_elements=PACKET)
    for rank, r in enumerate(results):
        (dev32, dtype32, got32), (dev16, dtype16, got16) = r["results"]
        assert (dev32, dtype32, dev16, dtype16) == ("cuda", "torch.float32", "cuda", "torch.bfloat16")
        np.testing.assert_array_equal(got32.view(np.uint32), want32.view(np.uint32))
        np.testing.assert_array_equal(got16, want16.to(torch.bfloat16).float().numpy())
        assert r["traffic"]["intml_allreduces"] == 2 and r["traffic"]["gloo_allreduces"] == 0, r["traffic"]
        np.testing.assert_array_equal(r["shard"].view(np.uint32),
                                      scattered[rank * N // 2:(rank + 1) * N // 2].view(np.uint32))
        assert r["traffic"]["host_reduce_scatters"] == 1 and r["traffic"]["gloo_reduce_scatters"] == 0, r["traffic"]


def powersgd_rank(port: int, address: str, rank: int, n: int) -> dict:
    """powersgd2 through the DDP hook, three steps on a two-layer model (two matrices, two biases): each step's
    bucket as DDP hands it over (its parameters' names, this rank's own gradients) and as the hook returns it."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    init_rank(port, rank, n, "gloo", {"INTML_AGGREGATOR": address, "INTML_TOKEN": TOKEN,
                                      "INTML_PACKET_ELEMENTS": str(PACKET), "INTML_POOL": str(POOL)})
    out: dict = {}
    state = intml.IntmlHookState(codec="powersgd2")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(12, 10), torch.nn.Tanh(), torch.nn.Linear(10, 4))
    names = {id(p): name for name, p in model.named_parameters()}
    ddp = DDP(model)
    out |= {"job": state.link.worker.job, "buckets": [],
            "shapes": {name: tuple(p.shape) for name, p in model.named_parameters()}}

    def hook(s, bucket):
        out["buckets"].append({"index": bucket.index(), "names": [names[id(p)] for p in bucket.parameters()],
                               "local": [g.detach().numpy().reshape(-1).copy() for g in bucket.gradients()]})
        return intml.intml_hook(s, bucket).then(lambda f: out["buckets"][-1].update(
            average=f.value().detach().numpy().copy()) or f.value())

    ddp.register_comm_hook(state, hook)
    for step in range(3):
        gen = torch.Generator().manual_seed(10 * rank + step)
        model.zero_grad()
        ddp(torch.randn(16, 12, generator=gen)).square().sum().backward()
    state.close()
    dist.destroy_process_group()
    return out


@pytest.mark.process
def test_the_hook_runs_powersgd_in_two_rounds_bit_for_bit(ranks) -> None:
    """Every rank's averaged bucket is the same bits, and those of PowerSGD computed here from the ranks' own
    gradients: each matrix's factors summed as the aggregator's host mode sums them (the codec's reference), the
    biases summed exactly in the first round; error feedback and Q's warm start carried from step to step."""
    from intml.protocol.codecs.host.powersgd import LowRank
    from intml.worker.torch.lowrank import as_matrix

    n = 2
    results = ranks(powersgd_rank, n, timeout=180)
    codec, job = parse("powersgd2"), results[0]["job"]
    states: list[dict[str, LowRank]] = [{} for _ in range(n)]
    allreduce = 0

    def summed(parts: list[list[np.ndarray]]) -> list[np.ndarray]:
        nonlocal allreduce
        flat = reference(codec, [np.concatenate(p) for p in parts], seed=0, allreduce=allreduce,
                         packet_elements=PACKET)
        allreduce += 1
        return np.split(flat, np.cumsum([x.size for x in parts[0]])[:-1])

    assert len(results[0]["buckets"]) == 3
    for step in range(3):
        buckets = [r["buckets"][step] for r in results]
        names = buckets[0]["names"]
        assert all(b["names"] == names for b in buckets)
        shaped = results[0]["shapes"]
        matrices = [i for i, name in enumerate(names) if as_matrix(torch.Size(shaped[name]))]
        vectors = [i for i in range(len(names)) if i not in matrices]
        for rank in range(n):
            for i in matrices:
                if names[i] not in states[rank]:
                    key = (job << 24) ^ (buckets[0]["index"] << 12) ^ i
                    states[rank][names[i]] = LowRank(as_matrix(torch.Size(shaped[names[i]])), 2, key)
        first = summed([[states[r][names[i]].first(buckets[r]["local"][i]) for i in matrices]
                        + [buckets[r]["local"][i] for i in vectors] for r in range(n)])
        second = summed([[states[r][names[i]].second(p) for i, p in zip(matrices, first)] for r in range(n)])
        sums: dict[int, np.ndarray] = {}
        for rank in range(n):
            for i, q in zip(matrices, second):
                sums[i] = states[rank][names[i]].finish(q)  # the same update at every rank
        sums.update(zip(vectors, first[len(matrices):]))
        want = np.concatenate([sums[i] for i in range(len(names))]) / np.float32(n)
        for rank, b in enumerate(buckets):
            np.testing.assert_array_equal(b["average"].view(np.uint32), want.view(np.uint32),
                                          err_msg=f"step {step} rank {rank}")
