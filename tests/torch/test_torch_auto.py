"""``INTML_CODEC=auto`` in the DDP hook (worker/torch/auto.py): every rank applies the same codec per bucket step
after step, a pinned bucket keeps its codec, a change of the measured link rate changes the choice, and a rank
whose copy of the statistics differs makes every rank fall back with a warning naming it. Config misuse is one
line. Ranks are forked processes (tests/support/cluster.py) against the room's aggregator process.
"""

from __future__ import annotations

import dataclasses
import warnings

import numpy as np
import pytest

torch = pytest.importorskip("torch")
import torch.distributed as dist  # noqa: E402
from support.torch_ranks import TOKEN, init_rank  # noqa: E402
from test_torch import PACKET, POOL  # noqa: E402

import intml.worker.torch as intml  # noqa: E402
from intml.sim.tuning import COSTS as SIM_COSTS  # noqa: E402
from intml.worker.torch.auto import IntmlTunerWarning, ring_seconds  # noqa: E402
from intml.worker.tuner import GLOO, Measured, Network  # noqa: E402

pytestmark = [pytest.mark.torch]

FAST, SLOW = 1e13, 1e5  # bit/s injected as the measured link rate: latency binds, then bytes
STEPS_FAST, STEPS_SLOW = 5, 9
PERTURBED_RANK, PERTURBED_STEP = 1, 3
PIN = "1:int32"


def _model(ddp_class):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(100, 30, bias=False), torch.nn.Linear(30, 30, bias=False))
    return model, ddp_class(model, bucket_cap_mb=0.003)  # from the second step two buckets: 900 and 3000 elements


def _step(ddp, rank: int, step: int) -> None:
    gen = torch.Generator().manual_seed(100 * rank + step)  # each rank its own data: the ranks' spread is the noise
    inputs, weights = torch.randn(8, 100, generator=gen), torch.randn(8, 30, generator=gen)
    ddp.zero_grad()
    (ddp(inputs) * weights).sum().backward()


def auto_rank(port: int, address: str, rank: int, n: int) -> dict:
    from torch.nn.parallel import DistributedDataParallel as DDP

    init_rank(port, rank, n, "gloo", {"INTML_AGGREGATOR": address, "INTML_TOKEN": TOKEN, "INTML_SEED": "5",
                                      "INTML_PACKET_ELEMENTS": str(PACKET), "INTML_POOL": str(POOL)})
    out: dict = {"applied": [], "digests": [], "codec1": []}
    # a run whose measured link rate drops from FAST to SLOW (injected), bucket 1 pinned to int32
    state = intml.IntmlHookState(codec="auto", codec_pin=PIN)
    model, ddp = _model(DDP)
    ddp.register_comm_hook(state, intml.intml_hook)
    rate = FAST
    state.auto.measured = lambda: Measured(rate, 1e9, 0.0)
    for step in range(STEPS_FAST + STEPS_SLOW):
        rate = FAST if step < STEPS_FAST else SLOW
        _step(ddp, rank, step)
        out["applied"].append(dict(state.auto.applied))
        out["digests"].append(state.auto.tuner and state.auto.tuner.last_digest)
        out["codec1"].append(state.auto.codec(1))
    out["traffic"] = dataclasses.asdict(state.traffic)
    state.close()

    # a run where one rank's copy of the shared statistics differs at one step
    state = intml.IntmlHookState(codec="auto", codec_pin=PIN)
    model, ddp = _model(DDP)
    ddp.register_comm_hook(state, intml.intml_hook)
    shared_sum, step_now = state.auto.allreduce_sum, [0]

    def perturbed(t: torch.Tensor) -> torch.Tensor:
        t = shared_sum(t)
        if rank == PERTURBED_RANK and step_now[0] == PERTURBED_STEP:
            t[-n - 1] += 1.0  # the last bucket's nonfinite count: this rank alone decides from other numbers
        return t

    state.auto.allreduce_sum = perturbed
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(PERTURBED_STEP + 3):
            step_now[0] = step
            _step(ddp, rank, step)
    out["warnings"] = [str(w.message) for w in caught if w.category is IntmlTunerWarning]
    out["after"] = (dict(state.auto.applied), state.auto.codec(0), state.auto.codec(1))
    state.close()
    dist.destroy_process_group()
    return out


@pytest.mark.process
def test_auto_decides_alike_keeps_pins_follows_the_link_and_falls_back_on_disagreement(ranks) -> None:
    n = 3
    results = ranks(auto_rank, n, timeout=240)
    # every rank applied the same codecs and made the same decisions, step after step
    for r in results[1:]:
        assert r["applied"] == results[0]["applied"] and r["digests"] == results[0]["digests"]
    applied = results[0]["applied"]
    assert all(c == "int32" for c in results[0]["codec1"]), results[0]["codec1"]  # pinned, whatever the rate
    # the tuner settles on one codec for bucket 0 on the fast link, and changes it once the link is slow
    fast, slow = applied[STEPS_FAST - 1].get(0), applied[-1].get(0)
    assert fast is not None and slow is not None and fast != slow, applied
    assert results[0]["traffic"]["intml_allreduces"] > 0

    # the perturbed rank decided differently: every rank falls back (pins kept) and names it
    for r in results:
        assert any(f"ranks [{PERTURBED_RANK}]" in w for w in r["warnings"]), r["warnings"]
        assert r["after"] == ({}, GLOO, "int32")


def test_auto_config_misuse_is_one_line() -> None:
    for options, words in (({"codec": "cnat8", "codec_pin": "0:int32"}, "needs INTML_CODEC=auto"),
                           ({"codec": "auto", "codec_pin": "0"}, "BUCKET:CODEC"),
                           ({"codec": "auto", "codec_pin": "0:signsgd"}, "cannot pin signsgd"),
                           ({"codec": "auto", "codec_pin": "0:int33"}, "is not gloo"),
                           ({"codec": "auto", "rounding": "nearest"}, "cannot go with INTML_CODEC=auto")):
        with pytest.raises(ValueError, match=words) as info:
            intml.IntmlConfig.from_env({}, **options)
        assert "\n" not in str(info.value)
    assert intml.IntmlConfig.from_env({"INTML_CODEC": "auto", "INTML_CODEC_PIN": "0:int32, 3:gloo"}).pins() == \
        {0: "int32", 3: "gloo"}


def test_auto_ring_model_is_the_simulators() -> None:
    """The hook's model of Gloo's ring (the worker layer does not import the simulator's): the same bytes at the
    rate; the simulator's adds TCP's overhead and a per-step latency."""
    for world, elements in ((2, 1 << 20), (16, 1 << 24)):
        ours, theirs = ring_seconds(world, 10e9, elements, Network()), SIM_COSTS.ring(world, 10e9, elements, Network())
        assert 0.9 < ours / theirs <= 1.0


def test_train_takes_auto_as_a_hook_run() -> None:
    """``intml-testbed train --runs auto``: the tuner's run, through the hook only."""
    from intml.testbed import train

    run = train.parse_run("auto-ef")
    assert (run["codec"], run["integration"], run["error_feedback"]) == ("auto", "hook", True)
    with pytest.raises(ValueError, match="auto runs in the DDP hook"):
        train.parse_run("auto-backend")
