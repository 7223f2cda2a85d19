"""intml-sim's DDP training-time model against hand-computed cases, and the CLI (the leaf-spine model: tests/aggregator/test_leafspine.py)."""

from __future__ import annotations

import json

import pytest

from intml.sim import training
from intml.sim.__main__ import main


def test_ddp_overlap_hand_computed():
    assert training.buckets(10_000_000) == [262_144, 6_553_600, 3_184_256]
    # compute 0.3 s: forward 0.1, backward 0.2; allreduce 0.01 s per bucket
    t = training.iteration(10_000_000, 0.3, lambda n: 0.01)
    # the last bucket is ready when backward ends (0.3 s) and the others are done by then: 0.3 + 0.01
    assert t == pytest.approx(0.31)
    slow = training.iteration(10_000_000, 0.3, lambda n: n * 1e-7)  # 1 s per 10M elements
    # the first bucket is done (0.131 s) before the second is ready (0.1 + 0.2 x 6.8M / 10M): the second and
    # third then go back to back
    second_ready = 0.1 + 0.2 * (262_144 + 6_553_600) / 10_000_000
    assert slow == pytest.approx(second_ready + 0.65536 + 0.3184256)


def test_training_shape_matches_seed_002():
    # seed 002: 26% (ResNet-110) and 66% (AlexNet) less training time; the communication-heavy model gains more
    resnet = training.predict("ResNet-110", 16, 10e9)["less_time_net"]
    alexnet = training.predict("AlexNet", 16, 10e9)["less_time_net"]
    assert 0 < resnet < alexnet


@pytest.mark.process
def test_cli_run_sweep_json_and_errors(tmp_path, capsys):
    scenario = tmp_path / "s.toml"
    scenario.write_text('name = "t"\nsystems = ["intml-cnat8", "gloo-ring"]\nworkers = 4\nelements = 100000\n'
                        'mode = "packet"\nseed = 3\n')
    assert main(["sweep", str(scenario), "--set", "workers=2,4", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["seeds"] == [3] and len(out["scenario_hash"]) == 16 and out["code_version"]
    assert [(r["system"], r["workers"], r["method"]) for r in out["rows"]] == [
        ("intml-cnat8", 2, "packet"), ("gloo-ring", 2, "flow model"), ("intml-cnat8", 4, "packet"),
        ("gloo-ring", 4, "flow model")]
    assert main(["run", str(scenario), "--csv"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("scenario,scenario_hash,seeds,code_version") and len(lines) == 3
    scenario.write_text('workers = "many"\n')
    assert main(["run", str(scenario)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("intml-sim: error: workers must be an integer") and err.count("\n") == 1
    scenario.write_text('colour = 1\n')
    assert main(["run", str(scenario)]) == 2
    assert "unknown key 'colour'" in capsys.readouterr().err
    scenario.write_text('engine = "bmv2"\n')
    assert main(["run", str(scenario)]) == 2
    assert "engine must be kernel or p4model" in capsys.readouterr().err
    scenario.write_text('mode = "packet"\nengine = "p4model"\nsystems = ["intml-cnat8"]\nworkers = 2\n'
                        'elements = 3000\n')
    assert main(["run", str(scenario), "--json"]) == 0
    assert [r["method"] for r in json.loads(capsys.readouterr().out)["rows"]] == ["packet"]
    scenario.write_text('baselines = "ns3"\n')
    assert main(["run", str(scenario)]) == 2
    assert "baselines must be flow or packet" in capsys.readouterr().err
    # the baselines over the engine's TCP, intml on a shared 2-CPU machine
    scenario.write_text('mode = "packet"\nbaselines = "packet"\ncpus = 2\nswitch = "software"\n'
                        'systems = ["intml-cnat8", "gloo-ring", "ps-colocated", "ps-dedicated"]\nworkers = 4\n'
                        'elements = 20000\n')
    assert main(["run", str(scenario), "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["rows"]
    assert [r["method"] for r in rows] == ["packet"] + ["packet (tcp)"] * 3


@pytest.mark.process
def test_scenario_sizes_the_uplink_queue(tmp_path, capsys):
    """``uplink_queue`` reaches the leaf-spine's links up: 16 partials' worth each way (tests/sim/test_sim_window.py's
    shallow uplinks) drops and marks where the default megabyte does not."""
    scenario = tmp_path / "s.toml"
    scenario.write_text('mode = "packet"\nsystems = ["intml-cnat8"]\nworkers = 8\nracks = 2\nelements = 16384\n'
                        'packet_elements = 256\npool = 64\nrounds = 2\nhost_costs = false\n')
    assert main(["sweep", str(scenario), "--set", "uplink_queue=0,17600", "--json"]) == 0
    deep, shallow = json.loads(capsys.readouterr().out)["rows"]
    assert deep["retransmissions"] == 0 and shallow["retransmissions"] > 0 and shallow["time_s"] > deep["time_s"]
    scenario.write_text('uplink_queue = -1\n')
    assert main(["run", str(scenario)]) == 2
    assert "uplink_queue must be an integer >= 0" in capsys.readouterr().err


@pytest.mark.process
def test_plot_without_matplotlib_is_one_line(monkeypatch, tmp_path, capsys):
    import sys
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib raises ImportError
    assert main(["train", "--workers", "4", "--rate", "10gbit", "--plot", str(tmp_path / "x.png")]) == 2
    assert capsys.readouterr().err == "intml-sim: error: plots need matplotlib: pip install 'intml[plot]'\n"
