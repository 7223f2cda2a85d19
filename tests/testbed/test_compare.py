"""`intml-testbed compare` in process: the summary of each setting, the measured inputs, the simulated step times,
the table, the JSON and the plot, and argument misuse (one line, no traceback). The training itself is replaced
by recorded reports here; tests/torch/test_compare.py runs it live."""

from __future__ import annotations

import contextlib
import json

import pytest

from intml.protocol.codecs.host import FAMILIES
from intml.protocol.packet import HDR
from intml.sim import compare as sim_compare
from intml.sim.costs import HOST_CODEC_COSTS, HOST_COSTS, host_codec_costs
from intml.sim.models import Net, ring
from intml.sim.training import in_network_cpu
from intml.testbed import compare
from intml.testbed.__main__ import main
from intml.worker.costs import HOST_PACKAGE, MEASURE

with contextlib.suppress(ImportError):  # matplotlib's first import builds its font cache by running fc-list, a
    import matplotlib.pyplot  # noqa: F401  process: here, while collecting, and not in the guarded plot test

PARAMETERS = 2048
STEPS = 5


def report(run: str, seed: int, accuracy: list[float], bytes_per_step: float, epoch_s: float = 0.1) -> dict:
    return {"run": run, "seed": seed, "parameters": PARAMETERS, "steps_per_epoch": STEPS, "test_accuracy": accuracy,
            "final_accuracy": accuracy[-1], "epoch_s": [epoch_s] * len(accuracy), "bytes_per_step": bytes_per_step}


REPORTS = [report("gloo", 0, [0.90, 0.96], 4 * PARAMETERS), report("gloo", 1, [0.92, 0.98], 4 * PARAMETERS, 0.3),
           report("uniform8", 0, [0.80, 0.94], PARAMETERS), report("uniform8", 1, [0.90, 0.96], PARAMETERS)]


def test_summary_places_each_epoch_at_its_wall_time() -> None:
    row = sim_compare.summary("x", [0.5, 0.9, 0.96, 0.97], [1.0, 2.0, 3.0, 4.0], 0.25, 0.95, 8.0, 32.0)
    assert row["curve"] == [[1.0, 0.5], [3.0, 0.9], [6.0, 0.96], [10.0, 0.97]]
    assert (row["epochs_to_target"], row["time_to_target_s"], row["final_accuracy"]) == (3, 6.0, 0.97)
    never = sim_compare.summary("x", [0.5], [1.0], 1.0, 0.95, 8.0, 8.0)
    assert never["epochs_to_target"] is None and never["time_to_target_s"] is None
    with pytest.raises(ValueError, match="2 accuracies for 1 epoch times"):
        sim_compare.summary("x", [0.5, 0.6], [1.0], 1.0, 0.95, 8.0, 8.0)


def test_measured_inputs_are_medians_over_seeds_and_host_results_are_float32() -> None:
    inputs = compare.measured(REPORTS, ("gloo", "uniform8"), "average", packet_elements=1024)
    gloo, uniform = inputs["gloo"], inputs["uniform8"]
    assert gloo["accuracy"] == pytest.approx([0.91, 0.97]) and gloo["epoch_s"] == pytest.approx([0.2, 0.2])
    assert gloo["up_bits"] == gloo["down_bits"] == 32  # the ring is symmetric
    assert uniform["up_bits"] == 8
    assert uniform["down_bits"] == 8 * (4 * PARAMETERS + 2 * HDR) / PARAMETERS  # float32 RESULTs, 2 packets


def test_run_spec_maps_a_codec_to_its_training_run() -> None:
    assert [compare.run_spec(c, "average") for c in ("gloo", "cnat8", "uniform8")] == ["gloo", "cnat8-backend",
                                                                                       "uniform8"]
    assert [compare.run_spec(c, "ddp") for c in ("gloo", "cnat8", "uniform8")] == ["gloo", "cnat8", "uniform8"]


def test_shaped_setting_adds_the_timed_exchanges_to_the_compute() -> None:
    inputs = compare.measured(REPORTS, ("gloo", "uniform8"), "average", packet_elements=1024)
    exchange = {"gloo": 0.5, "uniform8": 0.2}
    average = compare.shaped_setting(inputs, "100mbit", exchange, 0.01, "average", 0.95)
    ddp = compare.shaped_setting(inputs, "100mbit", exchange, 0.01, "ddp", 0.95)
    by = {r["codec"]: r for r in average["rows"]}
    assert by["gloo"]["step_s"] == pytest.approx(0.01 + 0.5 / STEPS)  # one averaging per epoch of 5 steps
    assert by["gloo"]["time_to_target_s"] == pytest.approx(2 * (STEPS * 0.01 + 0.5))
    assert by["uniform8"]["epochs_to_target"] is None or by["uniform8"]["epochs_to_target"] == 2
    assert {r["codec"]: r["step_s"] for r in ddp["rows"]} == pytest.approx({"gloo": 0.51, "uniform8": 0.21})


def test_simulated_exchanges_follow_each_codec_model() -> None:
    net = Net(16, 10e9, mtu=9000)
    n = 10_000_000
    assert sim_compare.exchange_seconds("gloo", net, n, 32, 32) == ring(net, n)
    assert sim_compare.exchange_seconds("cnat8", net, n, 8, 8) == in_network_cpu(net, n, "cnat8")
    # host mode: 4 aggregators for 16 workers, so an aggregator's link carries 4 workers' float32 results
    host = sim_compare.exchange_seconds("uniform8", net, n, 8, 32)
    assert host >= 4 * n * 4 * 8 / 10e9
    assert host == pytest.approx(max(4 * n * 4 * 8 / 10e9, n * (host_codec_costs("uniform8").encode + 0.25e-9)
                                     + 2 * -(-n // 1024) * 1.15e-6, 4 * n * host_codec_costs("uniform8").decode / 16
                                     + 4 * -(-n // 1024) * (2 * 1.15e-6 + HOST_PACKAGE) / 16) + net.rtt, rel=1e-3)
    # at 100 Gbit/s the host CPU binds: ten times the rate is far from ten times faster
    fast = sim_compare.exchange_seconds("uniform8", Net(16, 100e9, mtu=9000), n, 8, 32)
    assert fast > host / 10 * 2


def test_simulated_steps_average_or_overlap() -> None:
    net = Net(16, 10e9, mtu=9000)
    average = sim_compare.step_seconds("gloo", "average", net, 25_000_000, 0.06, 10, 32, 32)
    assert average == pytest.approx(0.06 + ring(net, 25_000_000) / 10)
    ddp = sim_compare.step_seconds("gloo", "ddp", net, 25_000_000, 0.06, 10, 32, 32)
    assert 0.06 < ddp < 0.06 + ring(net, 25_000_000)  # buckets overlap the backward pass


def test_host_codec_costs_cover_every_family() -> None:
    assert set(HOST_CODEC_COSTS) == set(FAMILIES)
    assert host_codec_costs("adaptive-huffman-c6") is HOST_CODEC_COSTS["adaptive-huffman"]
    assert host_codec_costs("uniform3") is HOST_CODEC_COSTS["uniform"]
    assert HOST_COSTS["int32"].decode == 0.25e-9
    with pytest.raises(ValueError, match="no host costs"):
        host_codec_costs("gzip")


def test_run_prints_json_with_every_setting_and_plots(monkeypatch, tmp_path, capsys) -> None:
    monkeypatch.setattr(compare.train, "run", lambda **kw: {"reports": REPORTS, "rows": []})
    monkeypatch.setattr(compare, "compute_step_seconds", lambda batch: 0.002)
    out = compare.run(codecs=("gloo", "uniform8"), sim_rates=(10e9, 100e9), sim_models=("digits", "VGG-16"),
                      as_json=True, plot_out=str(tmp_path / "c.png"))
    printed = json.loads(capsys.readouterr().out)
    assert [s["setting"] for s in printed["settings"]] == [
        "loopback", "sim digits 10gbit x16", "sim digits 100gbit x16", "sim VGG-16 10gbit x16",
        "sim VGG-16 100gbit x16"]
    assert printed["settings"] == json.loads(json.dumps(out["settings"]))
    vgg = {r["codec"]: r for r in printed["settings"][3]["rows"]}
    assert vgg["gloo"]["step_s"] > 0.240  # VGG-16's compute plus a share of a 138M-parameter averaging
    assert (tmp_path / "c.png").read_bytes()[:4] == b"\x89PNG"
    text = compare.table(printed["settings"][0], 0.95)
    assert "| gloo | 32.00 | 32.00 | 40 ms | 97.00% | 2 | 400 ms |" in text


@pytest.mark.parametrize("argv, message", [
    (["--codecs", "gloo,uniform8", "--parallel", "fsdp2"], "invalid choice: 'fsdp2'"),
    (["--codecs", "gloo,gzip"], "unknown codec 'gzip'"),
    (["--codecs", "cnat8-ef"], "'cnat8-ef' is not gloo, cnat8 or int32"),
    (["--codecs", "gloo,gloo"], "once each"),
    (["--codecs", "gloo,auto"], "needs --parallel ddp"),
    (["--sim-model", "LeNet"], "invalid choice: 'LeNet'"),
    (["--sim-rate", "fast"], "rate must be like"),
    (["--workers", "1"], "--workers"),
    (["--rate", "100xbit"], "a rate looks like 100mbit"),
    (["--codecs", "gloo", "--rate", "1gbit"], "add one to --codecs"),
])
def test_misuse_is_one_line(argv: list[str], message: str, capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["compare", *argv])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err


def test_the_command_line_times_exchanges_at_each_rate(monkeypatch, capsys) -> None:
    """--rate goes to bench cluster's run_point as tc's rate text, with every intml codec; its rows become a
    netns setting."""
    from intml.testbed import bench_cluster, netns

    calls = []

    def run_point(workers, rate, elements, *args, codecs, with_gloo, results, **kw):
        calls.append((workers, netns.parse_rate(rate), elements, codecs, with_gloo, results))
        return {"rows": [{"system": "intml uniform8", "median_s": 0.2}, {"system": "gloo ring", "median_s": 0.5}]}

    monkeypatch.setattr(compare.train, "run", lambda **kw: {"reports": REPORTS, "rows": []})
    monkeypatch.setattr(compare, "compute_step_seconds", lambda batch: 0.01)
    monkeypatch.setattr(bench_cluster, "run_point", run_point)
    monkeypatch.setattr(netns, "missing_requirements", lambda: None)
    assert main(["compare", "--codecs", "gloo,uniform8", "--workers", "2", "--rate", "100mbit", "--json"]) == 0
    assert calls == [(2, 100_000_000, PARAMETERS, ("uniform8",), True, "unicast")]
    [loopback, shaped] = json.loads(capsys.readouterr().out)["settings"]
    assert shaped["setting"] == "netns 100mbit" and shaped["exchange_s"] == {"uniform8": 0.2, "gloo": 0.5}
    assert {r["codec"]: r["step_s"] for r in shaped["rows"]} == pytest.approx({"gloo": 0.11, "uniform8": 0.05})


def test_intml_sim_compare_replays_the_measured_json(monkeypatch, tmp_path, capsys) -> None:
    """`intml-sim compare` on the testbed's --json gives the testbed's own simulated settings, and refuses another
    file in one line."""
    from intml.sim import output
    from intml.sim.__main__ import main as sim_main

    monkeypatch.setattr(output, "code_version", lambda: "test")  # not git's: no subprocess in process
    monkeypatch.setattr(compare.train, "run", lambda **kw: {"reports": REPORTS, "rows": []})
    monkeypatch.setattr(compare, "compute_step_seconds", lambda batch: 0.002)
    out = compare.run(codecs=("gloo", "uniform8"), sim_rates=(10e9,), sim_models=("VGG-16",), as_json=True)
    measured = tmp_path / "compare.json"
    measured.write_text(capsys.readouterr().out)
    assert sim_main(["compare", str(measured), "--rate", "10gbit", "--model", "VGG-16", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["rows"]
    assert rows == [{"setting": "sim VGG-16 10gbit x16", **{k: v for k, v in r.items() if k != "curve"}}
                    for r in out["settings"][1]["rows"]]
    (tmp_path / "other.json").write_text("{}")
    assert sim_main(["compare", str(tmp_path / "other.json")]) == 2
    err = capsys.readouterr().err
    assert "is not the output of intml-testbed compare --json" in err and len(err.strip().splitlines()) == 1


DDP_CODECS = ("gloo", "cnat8", "int32", "uniform4", "auto")
DDP_REPORTS = [report(codec, 0, [0.90, 0.96], bytes_per_step) for codec, bytes_per_step in (
    ("gloo", 4 * PARAMETERS), ("cnat8", PARAMETERS), ("int32", 4 * PARAMETERS), ("uniform4", PARAMETERS // 2),
    ("auto", 2 * PARAMETERS))]


def test_auto_is_the_codec_the_tuner_settles_on_at_each_simulated_setting() -> None:
    """VGG-16's buckets: cnat8 where the wire binds, the ring and cnat8 where the CPU does; auto's step is the
    chosen codecs' iteration (no later than any fixed codec's) plus its measuring, one step in tuner_every."""
    inputs = compare.measured(DDP_REPORTS, DDP_CODECS, "ddp", packet_elements=1024)
    parameters = 138_357_544
    for rate, choice in ((10e9, "cnat8 x23"), (100e9, "gloo x21, cnat8 x2")):
        rows = {r["codec"]: r for r in sim_compare.setting(inputs, "VGG-16", 16, rate, 0.002, "ddp", 0.95,
                                                            tuner_every=10**9)["rows"]}
        assert rows["auto"]["choice"] == choice
        fixed = min(r["step_s"] for codec, r in rows.items() if codec != "auto")
        assert rows["auto"]["step_s"] <= fixed + parameters * MEASURE / 10**9
        every = sim_compare.setting(inputs, "VGG-16", 16, rate, 0.002, "ddp", 0.95, tuner_every=100)["rows"][-1]
        assert every["step_s"] == pytest.approx(rows["auto"]["step_s"] + parameters * MEASURE * (1 / 100 - 1e-9))
    ten = {r["codec"]: r for r in sim_compare.setting(inputs, "VGG-16", 16, 10e9, 0.002, "ddp", 0.95)["rows"]}
    assert ten["auto"]["up_bits_per_parameter"] == ten["cnat8"]["up_bits_per_parameter"]  # cnat8's bits, weighted
    with pytest.raises(ValueError, match="needs parallel ddp"):
        sim_compare.setting(inputs, "VGG-16", 16, 10e9, 0.002, "average", 0.95)


@pytest.mark.parametrize("model, parameters", [("digits", 45_640), ("VGG-16", 138_357_544)])
def test_auto_settles_on_the_least_simulated_time_of_the_codecs_it_admits(model: str, parameters: int) -> None:
    """The tuner prices Gloo, cnat8 and int32 with the simulator's own models, so at each simulated setting its
    prediction of a bucket's exchange is the simulated one, the codec it settles on per bucket has the least
    simulated exchange of those it admits (no variance charge tips a choice here), and auto's step is no later than
    any admitted fixed codec's but for its measuring."""
    inputs = {codec: {**m, "parameters": parameters}
              for codec, m in compare.measured(DDP_REPORTS, DDP_CODECS, "ddp", packet_elements=1024).items()}
    compute = 0.0004 if model == "digits" else sim_compare.PROFILES[model][1]
    for rate in (100e6, 1e9, 10e9, 100e9):
        net = Net(16, rate, mtu=9000)
        rows = {r["codec"]: r for r in sim_compare.setting(inputs, model, 16, rate, compute, "ddp", 0.95,
                                                            batch=16)["rows"]}
        decision = sim_compare.auto_decision(inputs, net, parameters, compute, 16)
        admitted = [c for c in DDP_CODECS[:-1] if all(c not in choice.refused for choice in decision.choices.values())]
        assert {"gloo", "cnat8", "int32"} <= set(admitted)
        for size, choice in zip(sim_compare.buckets(parameters), decision.choices.values()):
            simulated = {c: sim_compare.exchange_seconds(c, net, size, inputs[c]["up_bits"], inputs[c]["down_bits"])
                         for c in admitted}
            assert choice.seconds == pytest.approx(simulated[choice.codec], rel=1e-12)
            assert simulated[choice.codec] == min(simulated.values())
        measuring = sim_compare.measuring_seconds(parameters, 1)
        assert rows["auto"]["step_s"] <= min(rows[c]["step_s"] for c in admitted) + measuring * (1 + 1e-9)


def test_auto_over_shaped_links_is_the_chosen_codecs_exchange() -> None:
    """netns: the tuner replayed at the link's rate through the software aggregator picks among the timed codecs;
    auto's step is that codec's, its bits that codec's, plus its measuring."""
    inputs = compare.measured(DDP_REPORTS, DDP_CODECS, "ddp", packet_elements=1024)
    exchange = {"gloo": 0.5, "cnat8": 0.1, "int32": 0.3, "uniform4": 0.2}
    assert compare.shaped_auto(inputs, "100mbit", {}, 0.01, 2, 1500, 16) == "cnat8"  # two ranks: 8 bits each way
    assert compare.shaped_auto(inputs, "100gbit", {}, 0.01, 2, 1500, 16) == "int32"  # latency and the CPU bind
    # the aggregator as slow as the timed cnat8 exchange shows (the hook measures it so): the ring's exact floats
    assert compare.shaped_auto(inputs, "100gbit", {"cnat8": 0.1}, 0.01, 2, 1500, 16) == "gloo"
    shaped = compare.shaped_setting(inputs, "100mbit", exchange, 0.01, "ddp", 0.95, "cnat8", 1)
    rows = {r["codec"]: r for r in shaped["rows"]}
    assert rows["auto"]["step_s"] == pytest.approx(0.01 + 0.1 + PARAMETERS * MEASURE)
    assert (rows["auto"]["choice"], rows["auto"]["up_bits_per_parameter"]) == ("cnat8", 8)
    assert "| auto (cnat8) | 8.00 | 8.00 |" in compare.table(shaped, 0.95)


def test_auto_is_compared_in_ddp_beside_gloo_only() -> None:
    compare.check_codecs(DDP_CODECS, "ddp")
    for codecs, parallel in ((DDP_CODECS, "average"), (("cnat8", "auto"), "ddp")):
        with pytest.raises(ValueError, match="needs --parallel ddp and gloo among the codecs"):
            compare.check_codecs(codecs, parallel)


def test_seconds_text() -> None:
    assert [compare.seconds_text(s) for s in (0.0123, 4.56, 1545.1)] == ["12.3 ms", "4.56 s", "1,545 s"]
