"""``INTML_CODEC=auto`` in the DDP hook (worker/torch/auto.py): every rank applies the same codec per bucket step
after step, a pinned bucket keeps its codec, a change of the measured link rate changes the choice, and a rank
whose copy of the statistics differs makes every rank fall back with a warning naming it. Config misuse is one
line. Ranks are forked processes (tests/support/cluster.py) against the room's aggregator process.
"""

from __future__ import annotations

import dataclasses
import urllib.request
import warnings

import numpy as np
import pytest

torch = pytest.importorskip("torch")
import torch.distributed as dist  # noqa: E402
from support.torch_ranks import TOKEN, init_rank  # noqa: E402
from test_torch import PACKET, POOL  # noqa: E402

import intml.worker.torch as intml  # noqa: E402
from intml.sim import models  # noqa: E402
from intml.sim.models import Net  # noqa: E402
from intml.sim.tuning import COSTS as SIM_COSTS  # noqa: E402
from intml.worker.torch.auto import COSTS, AutoCodec, IntmlTunerWarning  # noqa: E402
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


def scrape(port: int) -> dict[str, float]:
    """The endpoint's samples, by name and labels as the text format writes them."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        text = response.read().decode()
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
            if line and not line.startswith("#")}


def auto_rank(port: int, address: str, rank: int, n: int) -> dict:
    from torch.nn.parallel import DistributedDataParallel as DDP

    init_rank(port, rank, n, "gloo", {"INTML_AGGREGATOR": address, "INTML_TOKEN": TOKEN, "INTML_SEED": "5",
                                      "INTML_PACKET_ELEMENTS": str(PACKET), "INTML_POOL": str(POOL)})
    out: dict = {"applied": [], "digests": [], "codec1": []}
    # a run whose measured link rate drops from FAST to SLOW (injected), bucket 1 pinned to int32, its metrics served
    state = intml.IntmlHookState(codec="auto", codec_pin=PIN, metrics_port=0)
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
    out["metrics"] = scrape(state.metrics.server_port)
    out["pool"] = state.auto.network.pool
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
    assert results[0]["pool"] == POOL  # the tuner's in-network model has the links' window
    # each rank's endpoint: the codec per bucket now, its predicted seconds and variance ratio, the changes
    for rank, r in enumerate(results):
        metrics, labels = r["metrics"], f'bucket="0",rank="{rank}"'  # the text format sorts the labels
        assert metrics[f'intml_tuner_codec{{bucket="0",codec="{slow}",rank="{rank}"}}'] == 1
        assert metrics[f'intml_tuner_codec{{bucket="1",codec="int32",rank="{rank}"}}'] == 1
        assert metrics[f"intml_tuner_predicted_seconds{{{labels}}}"] > 0
        assert 0 <= metrics[f"intml_tuner_variance_ratio{{{labels}}}"] <= 0.5
        assert metrics[f'intml_tuner_changes_total{{rank="{rank}"}}'] >= 1 + (fast != GLOO)  # to fast's, to slow's
        assert metrics[f'intml_tuner_decisions_total{{rank="{rank}"}}'] == STEPS_FAST + STEPS_SLOW - 1
        assert metrics[f'intml_tuner_fallbacks_total{{rank="{rank}"}}'] == 0

    # the perturbed rank decided differently: every rank falls back (pins kept) and names it
    for r in results:
        assert any(f"ranks [{PERTURBED_RANK}]" in w for w in r["warnings"]), r["warnings"]
        assert r["after"] == ({}, GLOO, "int32")


LOSSY_STEPS = 10


def lossy_rank(port: int, address: str, rank: int, n: int) -> dict:
    """Auto with each rank's data-plane datagrams dropped, duplicated and reordered (its own seed), its measured
    link rate clamped slow so that the buckets go through intml, its other measurements its own."""
    from support.faults import faulty_sockets
    from torch.nn.parallel import DistributedDataParallel as DDP

    with faulty_sockets(drop=0.03, duplicate=0.02, reorder=0.03, seed=1000 * rank):
        init_rank(port, rank, n, "gloo", {"INTML_AGGREGATOR": address, "INTML_TOKEN": TOKEN, "INTML_SEED": "7",
                                          "INTML_PACKET_ELEMENTS": str(PACKET), "INTML_POOL": str(POOL)})
        state = intml.IntmlHookState(codec="auto", timeout=60)
        model, ddp = _model(DDP)
        ddp.register_comm_hook(state, intml.intml_hook)
        measured = state.auto.measured
        state.auto.measured = lambda: dataclasses.replace(measured(), link_rate=SLOW)
        out: dict = {"applied": [], "digests": []}
        for step in range(LOSSY_STEPS):
            _step(ddp, rank, step)
            out["applied"].append(dict(state.auto.applied))
            out["digests"].append(state.auto.tuner and state.auto.tuner.last_digest)
        out["retransmissions"] = state.traffic.retransmissions
        out["rates"] = state.auto.rates
        state.close()
    dist.destroy_process_group()
    return out


@pytest.mark.process
def test_every_rank_decides_the_same_under_loss(ranks) -> None:
    """Datagrams lost, duplicated and reordered at every rank, each its own way: the ranks' own measurements
    differ, their decisions and the codecs they apply do not, and the buckets went through intml."""
    results = ranks(lossy_rank, 3, timeout=240)
    for r in results[1:]:
        assert r["applied"] == results[0]["applied"] and r["digests"] == results[0]["digests"]
    assert any(codec != GLOO for codec in results[0]["applied"][-1].values()), results[0]["applied"]
    assert sum(r["retransmissions"] for r in results) > 0  # the loss was real, and recovered from
    assert len({r["rates"][1] for r in results}) == 3  # each rank measured its own aggregator rate


def test_the_tuner_measures_and_decides_at_one_step_in_every() -> None:
    """INTML_TUNER_EVERY=3: buckets are measured and the statistics shared at steps 3, 6, 9 only (step 0 is DDP's
    provisional one); the codecs stay what they were in between."""
    shared = []

    def allreduce_sum(t: torch.Tensor) -> torch.Tensor:
        shared.append(len(shared))
        out = 2 * t  # two ranks with the same statistics, and each rank's slot its same last digest
        out[-2:] = t[-2]
        return out

    auto = AutoCodec(0, 2, 1, {}, False, allreduce_sum, every=3)
    grad = torch.randn(1000, generator=torch.Generator().manual_seed(0))
    measured = []
    for _ in range(10):
        auto.observe(0, grad, None)
        measured.append(0 in auto.stats)
        auto.done(0, grad, 32e3, 1e-3, aggregated=False)
        auto.end_step()
    assert measured == [i % 3 == 0 for i in range(10)] and len(shared) == 3
    with pytest.raises(ValueError, match="INTML_METRICS_PORT serves the tuner's metrics") as info:
        intml.IntmlConfig.from_env({"INTML_CODEC": "cnat8", "INTML_METRICS_PORT": "9464"})
    assert "\n" not in str(info.value)
    with pytest.raises(ValueError, match="INTML_TUNER_EVERY must be >= 1") as info:
        intml.IntmlConfig.from_env({"INTML_CODEC": "auto", "INTML_TUNER_EVERY": "0"})
    assert "\n" not in str(info.value)


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


def test_auto_prices_the_network_as_the_simulator_does() -> None:
    """The hook's tuner and the simulator's have one model of each network (worker.costs'): the same seconds for
    the same network, that of sim.models on a Net with its round trip and MTU, the hook's pool as the window."""
    auto = AutoCodec(0, 2, 1, {}, False, lambda t: t, pool=4)
    assert auto.network.pool == 4 and not auto.network.switch
    for world, rate, elements, packet, size in ((2, 10e9, 1 << 20, 8192, 1), (16, 1e9, 1 << 24, 2230, 4)):
        network, net = Network(rtt=30e-6, mtu=1500), Net(world, rate, delay=15e-6, mtu=1500, switch_latency=0.0)
        assert COSTS.ring(world, rate, elements, network) == SIM_COSTS.ring(world, rate, elements, network) \
            == models.ring(net, elements)
        assert COSTS.in_network(world, rate, elements, packet, size, network) \
            == SIM_COSTS.in_network(world, rate, elements, packet, size, network)
        net = Net(world, rate, delay=auto.network.rtt / 2, mtu=auto.network.mtu, switch_latency=0.0)
        assert COSTS.in_network(world, rate, elements, packet, size, auto.network) \
            == models.in_network(net, elements, packet, 4, size)


def test_train_takes_auto_as_a_hook_run() -> None:
    """``intml-testbed train --runs auto``: the tuner's run, through the hook only."""
    from intml.testbed import train

    run = train.parse_run("auto-ef")
    assert (run["codec"], run["integration"], run["error_feedback"]) == ("auto", "hook", True)
    with pytest.raises(ValueError, match="auto runs in the DDP hook"):
        train.parse_run("auto-backend")
