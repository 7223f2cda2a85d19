"""``intml-sim train --codec``: the tuner on the simulator's rates and model profiles (sim/tuning.py)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from intml.sim import tuning
from intml.sim.__main__ import main
from intml.worker.tuner import FIELDS, measure


def test_the_choice_switches_when_the_simulated_rate_changes_mid_run() -> None:
    rows = tuning.run("AlexNet", 16, [(0, 10e9), (8, 100e9)], 14)
    got = [tuning.summary(r["codecs"]) for r in rows]
    assert got[:3] == ["gloo x11"] * 3  # the fallback, until a variance estimate and 3 steps of cnat8 winning
    assert got[3:10] == ["cnat8 x11"] * 7  # and for 2 steps after the rate rose (hysteresis)
    # at 100 Gbit the hosts' CPU binds cnat8: Gloo's ring for the 25 MB buckets, int32 for the 1 MB first one
    # (the ring's 2(n - 1) latencies) and the smaller last one
    assert got[10:] == ["gloo x9, int32 x2"] * 4
    assert rows[9]["step_s"] > rows[10]["step_s"]
    assert "gloo beat cnat8 by over 10% for 3 steps" in rows[10]["decision"].choices["bucket1"].reason
    assert rows[10]["decision"].choices["bucket0"].codec == "int32"


def test_a_fixed_codec_is_pinned_in_every_bucket() -> None:
    rows = tuning.table(16, [10e9], "uniform8", models=("ResNet-50",))
    assert rows[0]["codec"] == "uniform8 x5" and rows[0]["why"] == "pinned"
    auto = tuning.table(16, [10e9], models=("ResNet-50",))
    assert auto[0]["codec"] == "cnat8 x5" and auto[0]["step_s"] < rows[0]["step_s"]


def test_the_closed_form_statistics_match_measured_gaussians() -> None:
    elements, signal, noise = 200_000, 1.0, 3.0
    x = np.random.default_rng(2).normal(0, np.sqrt(signal + noise), elements).astype(np.float32)
    measured = dict(zip(FIELDS, measure(x, 4)))
    closed = dict(zip(FIELDS, tuning.gaussian_stats(elements, 4, signal, noise, first=True)))
    for name in ("norm_sq", "entropy", "range_sq", "max_abs", "median_abs", "tern"):
        assert closed[name] == pytest.approx(measured[name], rel=0.15), name


@pytest.mark.process  # code_version runs git
def test_cli_auto_at_two_rates(capsys) -> None:
    assert main(["train", "--codec", "auto", "--model", "AlexNet", "--rate", "10gbit", "100gbit", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["rows"]
    assert [(r["rate_gbit"], r["codec"]) for r in rows] == [(10, "cnat8 x11"), (100, "gloo x9, int32 x2")]


@pytest.mark.process  # code_version runs git
def test_cli_rate_change_prints_every_step(capsys) -> None:
    assert main(["train", "--codec", "auto", "--model", "ResNet-50", "--rate", "10gbit", "--change", "6:100gbit",
                 "--steps", "10", "--csv"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 11  # a header and 10 steps
    assert "gloo beat cnat8" in lines[9] and ",cnat8 x5," in lines[8] and ",cnat8 x5," not in lines[9]


@pytest.mark.process  # code_version runs git
def test_cli_a_codec_auto_cannot_run_is_a_one_line_error(capsys) -> None:
    assert main(["train", "--codec", "signsgd"]) == 2
    err = capsys.readouterr().err
    assert "not an estimate of the gradients' mean" in err and len(err.strip().splitlines()) == 1


@pytest.mark.process  # code_version runs git
def test_cli_a_malformed_rate_change_is_refused(capsys) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["train", "--codec", "auto", "--change", "x:1gbit"])
    assert exit_.value.code == 2 and "STEP:RATE" in capsys.readouterr().err
