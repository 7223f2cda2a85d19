"""The hook's and the backend's CUDA path (worker.torch.gpu, worker.gpu.driver), without a GPU: in ranks that call
``intml.worker.torch.gpu.simulate()``, float32 CPU tensors take the CUDA path (the same Link code, DeviceAllreducer
and kernels, on numba's CUDA simulator). With INTML_TEST_CUDA_DEVICE=1 the CUDA path's ranks put their tensors on
a real device instead (rank r on GPU r mod the device count); run this file in its own pytest process then, so that
the forking process has not initialised CUDA. Each training or allreduce sequence runs twice on the same seed, on the
CPU path and on the CUDA path, and must give the same bits: DDP gradients with error feedback (the residuals
too), cnat8 and int32; backend SUM and AVG allreduces; backend reduce-scatters (``reduce_scatter_tensor``) and FSDP2
training on them. The counters say which path each collective took.

Also: CUDA tensors where the CUDA path cannot run go to Gloo under their own reason, with one warning.
Ranks are forked processes against a real aggregator, as in test_torch.py.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import types
import warnings

import numpy as np
import pytest

torch = pytest.importorskip("torch")
import torch.distributed as dist  # noqa: E402
from numba.core import config as numba_config  # noqa: E402

import intml.worker.torch as intml  # noqa: E402
from intml.worker.torch import gpu, routing  # noqa: E402
from intml.worker.torch.link import AggregatorLinked  # noqa: E402
from support.torch_ranks import TOKEN, init_rank, train_fsdp2  # noqa: E402

pytestmark = [pytest.mark.torch, pytest.mark.gpu, pytest.mark.process, pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")]
# gpu.simulate() in a forked rank needs numba.cuda not loaded for a real device in this process (as
# INTML_TEST_CUDA_DEVICE=1 does for test_gpu_codec.py and test_gpu_driver.py)
simulable = pytest.mark.skipif("numba.cuda" in sys.modules and not numba_config.ENABLE_CUDASIM,
                               reason="numba.cuda is loaded for a real device: the simulated path cannot run")
SHAPES = [(37,), (300,), (20, 25), (513,)]  # 1 350 elements, in several buckets
PACKET, POOL, BUCKET_MB = 256, 4, 0.002
STEPS = 2


class Weights(torch.nn.Module):
    """forward(rs) = sum_p <p, r_p>: the gradient of parameter p is exactly r_p."""

    def __init__(self) -> None:
        super().__init__()
        self.ps = torch.nn.ParameterList([torch.nn.Parameter(torch.zeros(s)) for s in SHAPES])

    def forward(self, rs):
        return sum((p * r).sum() for p, r in zip(self.ps, rs, strict=True))


def _grads(seed: int, rank: int, it: int) -> list:
    rng = np.random.default_rng([seed, rank, it])
    return [torch.from_numpy((rng.standard_normal(s) * 2.0 ** int(rng.integers(-20, 3))).astype(np.float32))
            for s in SHAPES]


DEVICE = os.environ.get("INTML_TEST_CUDA_DEVICE") == "1"


def _init(port: int, rank: int, n: int, cuda_path: bool, backend: str = "gloo", **env: str) -> torch.device:
    """The rank's process group, and the device its tensors live on: a real GPU for the CUDA path under DEVICE,
    else the CPU (where simulate() gives float CPU tensors the CUDA path)."""
    if cuda_path and DEVICE:
        device = torch.device("cuda", rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
        if cuda_path:
            gpu.simulate()
    init_rank(port, rank, n, backend, env)
    return device


def _init_backend(port: int, address: str, rank: int, n: int, seed: int, cuda_path: bool,
                  min_elements: int = 1000, **env: str) -> torch.device:
    """_init with the intml backend on this test's aggregator, seed and packets."""
    return _init(port, rank, n, cuda_path, "intml", INTML_AGGREGATOR=address, INTML_SEED=str(seed),
                 INTML_TOKEN=TOKEN, INTML_PACKET_ELEMENTS=str(PACKET), INTML_POOL=str(POOL),
                 INTML_MIN_ELEMENTS=str(min_elements), **env)


def _host(t) -> np.ndarray:
    return t.detach().cpu().numpy()


def hook_rank(port: int, address: str, rank: int, n: int, codec: str, seed: int, cuda_path: bool) -> dict:
    from torch.nn.parallel import DistributedDataParallel as DDP

    device = _init(port, rank, n, cuda_path)
    model = Weights().to(device)
    ddp = DDP(model, bucket_cap_mb=BUCKET_MB, device_ids=[device.index] if device.type == "cuda" else None)
    state = intml.IntmlHookState(aggregator=address, codec=codec, seed=seed, token=TOKEN, packet_elements=PACKET,
                                 pool_size=POOL, error_feedback=True)
    ddp.register_comm_hook(state, intml.intml_hook)
    steps = []
    for it in range(STEPS):
        ddp.zero_grad()
        ddp([g.to(device) for g in _grads(seed, rank, it)]).backward()
        steps.append({"grads": np.concatenate([_host(p.grad).reshape(-1) for p in model.ps]),
                      "residuals": np.concatenate([_host(state.residuals.of_param[id(p)]) for p in model.ps])})
    out = {"steps": steps, "traffic": dataclasses.asdict(state.traffic)}
    state.close()
    dist.destroy_process_group()
    return out


def backend_rank(port: int, address: str, rank: int, n: int, seed: int, cuda_path: bool) -> dict:
    device = _init_backend(port, address, rank, n, seed, cuda_path, INTML_CODEC="int32")
    pg = dist.distributed_c10d._get_default_group()
    rng = np.random.default_rng([seed, rank])
    results = []
    for op, size in ((dist.ReduceOp.SUM, 1500), (dist.ReduceOp.AVG, 1100), (dist.ReduceOp.AVG, 20)):
        t = torch.from_numpy((rng.standard_normal(size) * 1e-3).astype(np.float32)).to(device)
        work = dist.all_reduce(t, op=op, async_op=True)
        work.wait()
        results.append(_host(t).copy())
    out = {"results": results, "traffic": dataclasses.asdict(pg.traffic)}
    dist.destroy_process_group()
    return out


def _same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    return a.dtype == b.dtype and a.view(np.uint32).tolist() == b.view(np.uint32).tolist()


@simulable
def test_hook_cuda_path_equals_cpu_path(ranks):
    """DDP with error feedback (cnat8): gradients and residuals after every step, bit for bit the CPU path's."""
    n, seed = 2, 11
    runs = {cuda_path: ranks(hook_rank, n, "cnat8", seed, cuda_path, timeout=240) for cuda_path in (False, True)}
    for r in range(n):
        cpu, cuda = runs[False][r], runs[True][r]
        for i, (a, b) in enumerate(zip(cpu["steps"], cuda["steps"], strict=True)):
            assert _same_bits(a["grads"], b["grads"]), (r, i)
            assert _same_bits(a["residuals"], b["residuals"]), (r, i)
        assert np.count_nonzero(cuda["steps"][-1]["residuals"]) > 0
        assert cpu["traffic"]["intml_cuda_allreduces"] == 0
        t = cuda["traffic"]
        assert t["intml_cuda_allreduces"] == t["intml_allreduces"] == cpu["traffic"]["intml_allreduces"] > 0
        assert t["intml_cuda_elements"] == t["intml_elements"] == STEPS * sum(int(np.prod(s)) for s in SHAPES)
        assert t["intml_cuda_bytes"] == t["intml_bytes"] and t["gloo_allreduces"] == 0


@simulable
def test_backend_cuda_path_equals_cpu_path(ranks):
    """SUM and AVG allreduces at or above INTML_MIN_ELEMENTS take the CUDA path, bit for bit the CPU path's; a small
    one stays exact through Gloo. An int32 job (its floats staged through pinned host memory: nothing to encode on
    the device)."""
    n, seed = 2, 12
    runs = {cuda_path: ranks(backend_rank, n, seed, cuda_path, timeout=240) for cuda_path in (False, True)}
    for r in range(n):
        cpu, cuda = runs[False][r], runs[True][r]
        for a, b in zip(cpu["results"], cuda["results"], strict=True):
            assert _same_bits(a, b)
        assert cuda["traffic"]["intml_cuda_allreduces"] == cuda["traffic"]["intml_allreduces"] == 2
        assert cuda["traffic"]["gloo_reasons"] == {routing.SMALL: 1}
        assert cpu["traffic"]["intml_cuda_allreduces"] == 0


def half_rank(port: int, address: str, rank: int, n: int, seed: int, cuda_path: bool) -> dict:
    device = _init_backend(port, address, rank, n, seed, cuda_path)
    pg = dist.distributed_c10d._get_default_group()
    rng = np.random.default_rng([seed, rank])
    results = []
    for dtype, op in ((torch.bfloat16, dist.ReduceOp.SUM), (torch.float16, dist.ReduceOp.AVG)):
        t = torch.from_numpy(rng.standard_normal(1100).astype(np.float32)).to(dtype).to(device)
        dist.all_reduce(t, op=op)
        results.append((str(t.dtype), _host(t.view(torch.int16)).copy()))
    out = {"results": results, "traffic": dataclasses.asdict(pg.traffic)}
    dist.destroy_process_group()
    return out


@simulable
def test_backend_cuda_path_takes_bf16_and_fp16(ranks):
    """bfloat16 and float16 tensors (their 16-bit words, encoded on their device) take the CUDA path, bit for bit
    the CPU path's, and come back in their dtype."""
    n, seed = 2, 13
    runs = {cuda_path: ranks(half_rank, n, seed, cuda_path, timeout=240) for cuda_path in (False, True)}
    for r in range(n):
        cpu, cuda = runs[False][r], runs[True][r]
        assert [d for d, _ in cuda["results"]] == ["torch.bfloat16", "torch.float16"]
        for (_, a), (_, b) in zip(cpu["results"], cuda["results"], strict=True):
            assert np.array_equal(a, b)
        assert cuda["traffic"]["intml_cuda_allreduces"] == cuda["traffic"]["intml_allreduces"] == 2
        assert cpu["traffic"]["intml_cuda_allreduces"] == 0 and cpu["traffic"]["intml_allreduces"] == 2


def scatter_rank(port: int, address: str, rank: int, n: int, seed: int, cuda_path: bool) -> dict:
    device = _init_backend(port, address, rank, n, seed, cuda_path)
    pg = dist.distributed_c10d._get_default_group()
    rng = np.random.default_rng([seed, rank])
    results = []
    # shards of 777 and 600 elements: none but rank 0's starts on a chunk of PACKET
    for dtype, op, shard in ((torch.float32, dist.ReduceOp.SUM, 777), (torch.float32, dist.ReduceOp.AVG, 600),
                             (torch.bfloat16, dist.ReduceOp.SUM, 600), (torch.float16, dist.ReduceOp.AVG, 777),
                             (torch.float32, dist.ReduceOp.SUM, 4)):
        x = torch.from_numpy((rng.standard_normal(n * shard) * 2.0 ** int(rng.integers(-8, 4))).astype(np.float32))
        x = x.to(dtype).to(device)
        out = torch.empty(shard, dtype=dtype, device=device)
        work = dist.reduce_scatter_tensor(out, x, op=op, async_op=True)
        work.wait()
        results.append(_host(out.view(torch.int16) if dtype != torch.float32 else out).copy())
    out = {"results": results, "traffic": dataclasses.asdict(pg.traffic)}
    dist.destroy_process_group()
    return out


@simulable
def test_backend_cuda_path_reduce_scatters(ranks):
    """reduce_scatter_tensor (cnat8; float32 SUM and AVG, bfloat16, float16) takes the CUDA path, each rank's shard
    decoded on its device, bit for bit the CPU path's; a small one stays exact through Gloo."""
    n, seed = 2, 14
    runs = {cuda_path: ranks(scatter_rank, n, seed, cuda_path, timeout=240) for cuda_path in (False, True)}
    for r in range(n):
        cpu, cuda = runs[False][r], runs[True][r]
        for i, (a, b) in enumerate(zip(cpu["results"], cuda["results"], strict=True)):
            assert a.dtype == b.dtype and a.tobytes() == b.tobytes(), (r, i)
        assert not np.array_equal(cpu["results"][0], runs[False][1 - r]["results"][0])  # each rank its own shard
        t = cuda["traffic"]
        assert t["intml_cuda_allreduces"] == t["intml_reduce_scatters"] == 4 and t["intml_allreduces"] == 0
        assert t["intml_cuda_elements"] == t["intml_elements"] == n * (777 + 600 + 600 + 777)
        assert t["gloo_reasons"] == {routing.SMALL: 1} and t["gloo_reduce_scatters"] == 1
        assert cpu["traffic"]["intml_cuda_allreduces"] == 0 and cpu["traffic"]["intml_reduce_scatters"] == 4


def fsdp2_rank(port: int, address: str, rank: int, n: int, seed: int, cuda_path: bool) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    device = _init_backend(port, address, rank, n, seed, cuda_path, min_elements=0)
    params, losses = train_fsdp2(init_device_mesh(device.type, (n,)), rank, STEPS)
    out = {"params": params, "losses": losses, "traffic": dataclasses.asdict(dist.group.WORLD.traffic)}
    dist.destroy_process_group()
    return out


@simulable
def test_fsdp2_cuda_path_equals_cpu_path(ranks):
    """FSDP2 (fully_shard) with every gradient reduce-scatter through intml (cnat8): on the CUDA path the gathered
    parameters and the losses are bit for bit the CPU path's, and every reduce-scatter took the CUDA path."""
    n, seed = 2, 15
    runs = {cuda_path: ranks(fsdp2_rank, n, seed, cuda_path, timeout=240) for cuda_path in (False, True)}
    for r in range(n):
        cpu, cuda = runs[False][r], runs[True][r]
        assert all(a.tobytes() == b.tobytes() for a, b in zip(cpu["params"], cuda["params"], strict=True)), r
        assert cpu["losses"] == cuda["losses"]
        t = cuda["traffic"]
        assert t["intml_reduce_scatters"] == cpu["traffic"]["intml_reduce_scatters"] >= STEPS
        assert t["intml_cuda_allreduces"] == t["intml_reduce_scatters"] + t["intml_allreduces"]
        assert t["gloo_reduce_scatters"] == 0 and cpu["traffic"]["intml_cuda_allreduces"] == 0


def _fake(device: str, dtype=torch.float32, contiguous: bool = True, numel: int = 100_000):
    """What routing reads of a tensor, for devices this CPU-only torch cannot make."""
    return types.SimpleNamespace(dtype=dtype, device=torch.device(device), is_contiguous=lambda: contiguous,
                                 numel=lambda: numel)


def test_routing_of_cuda_tensors():
    """CUDA float32 tensors go to intml when the CUDA path can run, else to Gloo under CUDA; the path is not even
    asked about CPU tensors; reduce-scatters of CUDA tensors likewise, their output of the input's dtype and
    device."""
    asked = []

    def problem(why):
        return lambda: asked.append(why) or why

    assert routing.unsupported(_fake("cuda:0"), problem(None)) is None
    assert routing.unsupported(_fake("cuda:0"), problem("no driver")) == routing.CUDA
    assert routing.unsupported(_fake("cuda:0", torch.float64), problem(None)) == routing.DTYPE
    assert routing.unsupported(_fake("cuda:0", torch.float16), problem(None)) is None  # encoded on its device
    assert routing.unsupported(_fake("cuda:0", contiguous=False), problem(None)) == routing.LAYOUT
    assert routing.unsupported(_fake("meta"), problem(None)) == routing.DEVICE
    asked.clear()
    assert routing.unsupported(torch.zeros(3), problem("x")) is None and asked == []
    assert routing.backend_route([_fake("cuda")], "sum", 10, problem(None)) is None
    half = _fake("cuda:0", numel=50_000)
    assert routing.scatter_route(half, _fake("cuda:0"), "sum", 10, 2, problem(None)) is None
    assert routing.scatter_route(half, _fake("cuda:0"), "sum", 10, 2, problem("no driver")) == routing.CUDA
    assert routing.scatter_route(half, _fake("cuda:0"), "sum", 10, 4, problem(None)) == routing.SHAPE
    assert routing.scatter_route(_fake("cuda:1", numel=50_000), _fake("cuda:0"), "sum", 10, 2,
                                 problem(None)) == routing.SHAPE
    assert routing.scatter_route(_fake("cuda:0", torch.float16, numel=50_000), _fake("cuda:0"), "sum", 10, 2,
                                 problem(None)) == routing.SHAPE
    assert routing.scatter_route(_fake("cpu", numel=50_000), _fake("cuda:0"), "sum", 10, 2,
                                 problem(None)) == routing.SHAPE


def test_cuda_fallback_warns_once_naming_the_reason():
    """Two CUDA buckets and a CUDA reduce-scatter to Gloo because the CUDA path cannot run: one
    IntmlUncompressedWarning naming the extra, all counted under routing.CUDA."""
    linked = AggregatorLinked()
    linked.gloo = types.SimpleNamespace(size=lambda: 2)
    linked.traffic, linked._warned = intml.Traffic(), set()
    t = torch.zeros(1000)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        linked._to_gloo([t], routing.CUDA)
        linked._to_gloo([t], routing.CUDA)
        linked._to_gloo([t], routing.CUDA, reduce_scatter=True)
    texts = [str(w.message) for w in caught if issubclass(w.category, intml.IntmlUncompressedWarning)]
    assert len(texts) == 1
    assert "CUDA device" in texts[0] and "intml[cuda]" in texts[0] and "gloo_reasons['cuda']" in texts[0]
    assert linked.traffic.gloo_reasons == {routing.CUDA: 3} and linked.traffic.gloo_reduce_scatters == 1


def _python(code: str) -> list[str]:
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert result.returncode == 0, result.stderr
    return result.stdout.splitlines()


def test_cuda_path_problem_without_a_gpu():
    """Without a GPU (and without the simulator) the path names the cause, and simulate() then refuses (numba's
    CUDA target is loaded). (simulate() first, and the path runs: the ranks of the tests above.)"""
    first, refused = _python("from intml.worker.torch import gpu; print(gpu.PATH.problem())\n"
                             "try:\n    gpu.simulate()\nexcept RuntimeError as e:\n    print(e)")
    if first == "None":
        pytest.skip("this machine has a usable CUDA device")
    assert "needs a CUDA GPU" in first and "before numba.cuda is imported" in refused
