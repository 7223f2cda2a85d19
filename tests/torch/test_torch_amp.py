"""Mixed-precision training over the "intml" backend, against Gloo in the same test: DDP on 2 CPU ranks with CPU
autocast (bf16) and ``torch.amp.GradScaler``, and an infinity injected into one rank's gradient at chosen steps.
The allreduce passes it on to every rank, as Gloo's does, so every rank's scaler finds it, skips exactly those
steps and halves its scale; training then goes on and converges.

Ranks are forked processes (tests/support/cluster.py) with the aggregator a real ``python -m intml.aggregator`` process,
as in tests/torch/test_torch.py.
"""

from __future__ import annotations

import os
from datetime import timedelta

import numpy as np
import pytest

torch = pytest.importorskip("torch")
import torch.distributed as dist  # noqa: E402
from support.cluster import aggregator, run_ok  # noqa: E402

import intml.worker.torch as intml  # noqa: E402
from intml.testbed.procs import free_port  # noqa: E402

pytestmark = [pytest.mark.torch, pytest.mark.process]

TOKEN = "test-torch"
STEPS = 24
OVERFLOW = (4, 6, 11, 12)  # the steps at which rank 1's gradient holds +Inf (Gloo skips exactly these)
INF_RANK = 1


def amp_rank(port: int, backend: str, address: str, rank: int, n: int, seed: int) -> dict:
    """STEPS steps of a small regression under bf16 autocast and GradScaler; rank INF_RANK's first-layer gradient
    gets +Inf at the OVERFLOW steps (a hook on the parameter, before DDP's allreduce). Returns the scale after
    each step, whether each step changed the parameters, the losses and the backend's traffic."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    env = {"INTML_AGGREGATOR": address, "INTML_SEED": str(seed), "INTML_TOKEN": TOKEN, "INTML_MIN_ELEMENTS": "0"}
    os.environ.update(env if backend == "intml" else {})
    torch.set_num_threads(1)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=n,
                            timeout=timedelta(seconds=60))
    torch.manual_seed(seed)  # the same initial weights at every rank
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
    ddp = DDP(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**12, growth_interval=4)
    g = torch.Generator().manual_seed(seed * 10 + rank)
    x = torch.randn(128, 16, generator=g)
    w = torch.linspace(-1, 1, 16).reshape(16, 1)
    y = torch.tanh(x @ w)
    step_now = [-1]

    def inject(grad):
        if rank == INF_RANK and step_now[0] in OVERFLOW:
            grad = grad.clone()
            grad[3, 5] = float("inf")
        return grad

    model[0].weight.register_hook(inject)
    scales, moved, losses = [], [], []
    for step in range(STEPS):
        step_now[0] = step
        before = [p.detach().clone() for p in model.parameters()]
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = ddp(x)
        loss = ((out.float() - y) ** 2).mean()
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        scales.append(float(scaler.get_scale()))
        moved.append(any(not torch.equal(a, p.detach()) for a, p in zip(before, model.parameters())))
        losses.append(float(loss))
    pg = dist.distributed_c10d._get_default_group()
    traffic = dict(vars(pg.traffic)) if isinstance(pg, intml.IntmlProcessGroup) else {}
    params = np.concatenate([p.detach().numpy().reshape(-1) for p in model.parameters()])
    dist.destroy_process_group()
    return {"scales": scales, "moved": moved, "losses": losses, "traffic": traffic, "params": params}


def test_grad_scaler_skips_the_steps_gloo_skips() -> None:
    n, seed = 2, 5
    port = free_port()
    gloo = run_ok(amp_rank, [(port, "gloo", "", r, n, seed) for r in range(n)], timeout=120)
    with aggregator(idle_timeout=20) as agg:
        port = free_port()
        got = run_ok(amp_rank, [(port, "intml", agg.address, r, n, seed) for r in range(n)], timeout=120)
        assert agg.alive(), agg.stderr()
    skipped = [s for s in range(STEPS) if not gloo[0]["moved"][s]]
    assert skipped == list(OVERFLOW)  # Gloo's own run: the injected infinities, and nothing else
    for rank, r in enumerate(got):
        assert [s for s in range(STEPS) if not r["moved"][s]] == skipped, f"intml rank {rank} skipped other steps"
        assert r["scales"] == gloo[rank]["scales"], f"intml rank {rank}: the scale took another path"
        assert r["traffic"]["intml_allreduces"] >= STEPS and r["traffic"]["gloo_allreduces"] == 0, r["traffic"]
    assert got[0]["params"].tobytes() == got[1]["params"].tobytes()  # the ranks stayed in step
    # converges as Gloo's run does: the loss falls to under a third of its start in both (C_nat's rounding makes
    # intml's path differ from Gloo's in the digits, not in the trend)
    for run in (gloo, got):
        first, last = run[0]["losses"][0], np.mean(run[0]["losses"][-3:])
        assert last < first / 3, (first, run[0]["losses"])
    assert np.mean(got[0]["losses"][-3:]) < 1.5 * np.mean(gloo[0]["losses"][-3:])


def feedback_rank(port: int, address: str, seed: int) -> dict:
    """Error feedback at world size 1 with +Inf, -Inf and NaN in the first step's gradient: those elements come back
    as themselves and their residual is 0, so the next step's values there are the new gradient alone."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1,
                            timeout=timedelta(seconds=60))
    model = torch.nn.Linear(64, 1, bias=False)
    ddp = DDP(model)
    state = intml.IntmlHookState(aggregator=address, codec="cnat8", error_feedback=True, seed=seed, token=TOKEN)
    ddp.register_comm_hook(state, intml.intml_hook)
    g = torch.Generator().manual_seed(seed)
    out = {"grads": [], "residuals": []}
    for step in range(2):
        x = torch.randn(1, 64, generator=g) * 0.37
        if step == 0:
            x[0, :3] = torch.tensor([float("inf"), float("-inf"), float("nan")])
        ddp.zero_grad()
        ddp(x).sum().backward()
        out["grads"].append(model.weight.grad.numpy().reshape(-1).copy())
        out["residuals"].append(state.residuals.of_param[id(model.weight)].numpy().reshape(-1).copy())
    state.close()
    dist.destroy_process_group()
    return out


def test_error_feedback_resets_a_non_finite_residual() -> None:
    with aggregator(idle_timeout=20) as agg:
        [out] = run_ok(feedback_rank, [(free_port(), agg.address, 3)], timeout=120)
    first, second = out["grads"]
    assert first[0] == np.inf and first[1] == -np.inf and np.isnan(first[2])
    assert out["residuals"][0][:3].tolist() == [0.0, 0.0, 0.0]  # reset, not carried into the next step
    assert np.isfinite(out["residuals"][0]).all() and np.count_nonzero(out["residuals"][0][3:]) > 30
    assert np.isfinite(second).all()  # the next step is not poisoned


def test_rounding_option() -> None:
    """INTML_ROUNDING / IntmlConfig.rounding and Worker(rounding=): stochastic by default, nearest on request
    (the JOIN's flag), anything else refused in one line before any socket is opened."""
    from intml.protocol.job import JobParams
    from intml.worker.api import Worker

    assert intml.IntmlConfig.from_env({}).rounding == "stochastic"
    assert intml.IntmlConfig.from_env({"INTML_ROUNDING": "nearest"}).rounding == "nearest"
    with pytest.raises(ValueError, match="INTML_ROUNDING must be one of stochastic, nearest, got 'up'"):
        intml.IntmlConfig.from_env({"INTML_ROUNDING": "up"})
    with pytest.raises(ValueError, match="rounding must be one of stochastic, nearest, got 'up'"):
        Worker("127.0.0.1:9", job=1, rank=0, world_size=1, rounding="up")
    assert JobParams(world_size=2, nearest=True).flags == 2 and JobParams(world_size=2).flags == 0
