"""`intml-testbed compare`: the same training under each codec, side by side. Per codec and setting: wire bits
per parameter each way, time per step, final test accuracy, and the epoch and wall time at which the test
accuracy first reaches ``--target``.

A codec is a name: ``gloo`` (Gloo's float32 ring), a switch codec (``cnat8``, ``int32``), a host codec
(``uniform8``, ``adaptive-huffman``...: docs/codecs.md) or ``auto``, the online tuner (docs/tuner.md: with
``--parallel ddp``, beside gloo, its fallback). Every codec trains the digits MLP of ``intml-testbed
train`` (``--parallel average``: weights averaged after every epoch, seed 001's scheme, the default; or ``ddp``:
gradients allreduced every step, through the DDP hook), all in the same run. What is measured where:

* **loopback** (measured end to end): the training runs, every rank under torchrun on 127.0.0.1 and one aggregator
  (``train.run``). Accuracy after every epoch, the bits each worker sends (``train``'s accounting: packages and
  packet headers; Gloo: the ring's 2(n-1)/n x 32, a model), and each epoch's wall time, summed over its steps.
  Bits received: the same as sent for gloo and the switch codecs; a host codec's RESULT packages as its
  ``encode_result`` builds them, float32 unless the codec sends less, plus the headers.
* **netns RATE** (measured in two parts): the ranks and the aggregator in network namespaces behind ``tc tbf``
  links of that rate (``bench_cluster.run_point``, results by unicast), timing one allreduce of all the model's
  parameters per codec, Gloo's ring over the same links. A step is the local compute, measured in this process
  (forward, backward and SGD step of one rank's batch, one thread), plus the exchange: every step with DDP, the
  step's share of one averaging per epoch otherwise. Running torchrun's ranks in the namespaces as well would
  only add the same compute to the same exchanges. auto's exchange is that of the codec the tuner settles on at
  the link's rate (``sim.tuning.settled``: the model as the one bucket timed, the software aggregator at the rate
  its timed switch-codec exchange shows, the compared codecs as candidates), and its accuracy the loopback run's.
* **sim MODEL RATE xW** (simulated): ``sim.compare``'s models of the exchange at W workers (the measured bits per
  parameter, the host CPU costs of ``sim.costs``), and the model's parameters and compute (``digits``: the
  measured ones). Its accuracy curve is the MEASURED curve, each epoch placed at the simulated time it ends:
  what the larger model would reach if it learned per epoch as the digits model does. auto: the tuner replayed
  per bucket at the setting (``sim.compare``), with the loopback run's accuracy.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
from pathlib import Path

import numpy as np

from intml.protocol.codecs.host import parse as host_codec
from intml.protocol.job import CODEC_NAMES, JobParams
from intml.protocol.packet import HDR
from intml.sim import compare as sim_compare
from intml.sim import tuning
from intml.sim.run import Progress
from intml.sim.scenario import parse_rate
from intml.testbed import train
from intml.testbed.bench_cluster import result_package_bytes
from intml.worker.tuner import Network

DEFAULT_CODECS = ("gloo", "cnat8", "int32", "uniform4", "uniform8", "adaptive-huffman", "bitmask", "qsgd127")
DEFAULT_SIM_MODELS = ("digits", "VGG-16")
AUTO = sim_compare.AUTO


def run_spec(codec: str, parallel: str) -> str:
    """The ``train`` run that trains with ``codec``: gloo as is; with ddp any codec through the DDP hook; with
    average a switch codec through the backend, a host codec's name as is (a Worker of host mode averages)."""
    if codec in CODEC_NAMES and parallel != "ddp":
        return f"{codec}-backend"
    return codec


def check_codecs(codecs: tuple[str, ...], parallel: str) -> None:
    """ValueError, one line, unless ``parallel`` is one of PARALLEL and every codec is gloo, a switch codec, a
    host codec or auto (with ddp, beside gloo), each given once."""
    if parallel not in sim_compare.PARALLEL:
        raise ValueError(f"parallel must be one of {', '.join(sim_compare.PARALLEL)}, got {parallel!r}")
    if len(set(codecs)) != len(codecs) or not codecs:
        raise ValueError(f"codecs must be given once each, got {','.join(codecs)}")
    if AUTO in codecs and (parallel != "ddp" or "gloo" not in codecs):
        raise ValueError("auto runs in the DDP hook and falls back to gloo: it needs --parallel ddp and gloo "
                         "among the codecs")
    for codec in codecs:
        if codec not in ("gloo", AUTO) and codec not in CODEC_NAMES:
            try:
                host_codec(codec)
            except ValueError as exc:
                raise ValueError(f"codec {codec!r} is not gloo, {' or '.join(CODEC_NAMES)}, and {exc}") from None


def compute_step_seconds(batch: int, steps: int = 200) -> float:
    """One rank's local step of the digits MLP (forward, backward, SGD step of ``batch`` examples, one thread):
    the median over ``steps`` steps after 20 unmeasured ones."""
    import time

    import torch

    torch.set_num_threads(1)
    model = train.make_model(0)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(batch, 64)
    y = torch.randint(0, train.CLASSES, (batch,))
    times = []
    for i in range(20 + steps):
        start = time.perf_counter()
        opt.zero_grad(set_to_none=False)
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        if i >= 20:
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def measured(reports: list[dict], codecs: tuple[str, ...], parallel: str, packet_elements: int) -> dict[str, dict]:
    """Per codec, from its runs' reports (medians over seeds, epoch by epoch): the accuracy curve, each epoch's
    wall time, bits per parameter each way, and the run's shape."""
    out = {}
    for codec in codecs:
        mine = [r for r in reports if r["run"] == run_spec(codec, parallel)]
        parameters = mine[0]["parameters"]
        up = statistics.median(8 * r["bytes_per_step"] / parameters for r in mine)
        if codec in ("gloo", AUTO) or codec in CODEC_NAMES:  # auto: a host codec's float32 result is not counted
            down = up
        else:
            packets = -(-parameters // packet_elements)
            down = 8 * (result_package_bytes(codec, parameters, packet_elements) + packets * HDR) / parameters
        out[codec] = {"accuracy": np.median([r["test_accuracy"] for r in mine], axis=0).tolist(),
                      "epoch_s": np.median([r["epoch_s"] for r in mine], axis=0).tolist(),
                      "up_bits": up, "down_bits": down, "parameters": parameters,
                      "steps_per_epoch": mine[0]["steps_per_epoch"], "seeds": len(mine)}
    return out


def loopback_setting(inputs: dict[str, dict], target: float) -> dict:
    rows = [sim_compare.summary(codec, m["accuracy"], m["epoch_s"],
                                statistics.median(m["epoch_s"]) / m["steps_per_epoch"], target, m["up_bits"],
                                m["down_bits"]) for codec, m in inputs.items()]
    return {"setting": "loopback", "kind": "measured end to end (torchrun ranks on 127.0.0.1)", "rows": rows}


def exchanges_per_epoch(parallel: str, steps_per_epoch: int) -> int:
    return steps_per_epoch if parallel == "ddp" else 1


def shaped_auto(inputs: dict[str, dict], rate: str, exchange_s: dict[str, float], compute_s: float, workers: int,
                mtu: int, batch: int) -> str:
    """The codec the tuner settles on over the shaped links (the module's docstring), with the software
    aggregator's rate as the hook measures it: elements x ranks per second of a switch codec's timed exchange."""
    parameters = inputs[AUTO]["parameters"]
    candidates = tuple(c for c in inputs if c != AUTO)
    summed = [parameters * workers / exchange_s[c] for c in CODEC_NAMES if c in exchange_s]
    return tuning.settled([parameters], compute_s, workers, parse_rate(rate), candidates=candidates, batch=batch,
                          network=Network(switch=False, mtu=mtu),
                          aggregator_rate=max(summed, default=tuning.AGGREGATOR_RATE))[0]


def shaped_setting(inputs: dict[str, dict], rate: str, exchange_s: dict[str, float], compute_s: float,
                   parallel: str, target: float, auto: str | None = None, tuner_every: int = 1) -> dict:
    """A netns setting: each epoch is the measured compute of its steps plus its exchanges as timed over the
    shaped links; auto's exchange is that of the codec ``auto`` that the tuner settles on, its bits that codec's,
    plus the tuner's measuring at one step in ``tuner_every``."""
    rows = []
    for codec, m in inputs.items():
        steps = m["steps_per_epoch"]
        timed = auto if codec == AUTO else codec
        epoch = steps * compute_s + exchanges_per_epoch(parallel, steps) * exchange_s[timed]
        if codec == AUTO:
            epoch += steps * sim_compare.measuring_seconds(m["parameters"], tuner_every)
        rows.append(sim_compare.summary(codec, m["accuracy"], [epoch] * len(m["accuracy"]), epoch / steps, target,
                                        inputs[timed]["up_bits"], inputs[timed]["down_bits"]))
        if codec == AUTO:
            rows[-1]["choice"] = auto
    return {"setting": f"netns {rate}", "kind": "measured compute + exchanges measured over tc tbf links",
            "exchange_s": exchange_s, "rows": rows}


def table(setting: dict, target: float) -> str:
    """One setting as markdown."""
    lines = [f"{setting['setting']} ({setting['kind']})",
             f"| codec | bits/parameter up | down | time per step | final accuracy | epochs to {target:.0%} | "
             f"time to {target:.0%} |", "|---|---|---|---|---|---|---|"]
    for r in setting["rows"]:
        reach = ("never", "—") if r["epochs_to_target"] is None else (str(r["epochs_to_target"]),
                                                                        seconds_text(r["time_to_target_s"]))
        codec = f"{r['codec']} ({r['choice']})" if "choice" in r else r["codec"]
        lines.append(f"| {codec} | {r['up_bits_per_parameter']:.2f} | {r['down_bits_per_parameter']:.2f} | "
                     f"{seconds_text(r['step_s'])} | {100 * r['final_accuracy']:.2f}% | {reach[0]} | {reach[1]} |")
    return "\n".join(lines)


def seconds_text(seconds: float) -> str:
    if seconds < 1:
        return f"{seconds * 1e3:.3g} ms"
    return f"{seconds:.3g} s" if seconds < 1000 else f"{seconds:,.0f} s"


def run(codecs: tuple[str, ...] = DEFAULT_CODECS, parallel: str = "average", workers: int = 4, seeds: int = 1,
        epochs: int = 20, rates: tuple[str, ...] = (), mtu: int = 1500, rounds: int = 3,
        sim_workers: tuple[int, ...] = (16,), sim_rates: tuple[float, ...] = (), sim_models: tuple[str, ...] =
        DEFAULT_SIM_MODELS, target: float = 0.95, packet_elements: int = JobParams.packet_elements,
        batch: int = 16, as_json: bool = False, plot_out: str | None = None, quiet: bool = False) -> dict:
    """Train under every codec (loopback), time the exchanges at each ``rates`` in namespaces, simulate each
    ``sim_rates`` x ``sim_workers`` x ``sim_models``; print the tables (or JSON) and return everything."""
    from intml.testbed import bench_cluster

    check_codecs(codecs, parallel)
    for model in sim_models:
        sim_compare.profile(model, 1, 1.0)  # a ValueError for an unknown model before anything starts
    tuner_every = int(os.environ.get("INTML_TUNER_EVERY", "1"))  # the ranks' (train passes the environment on)
    progress = Progress()
    total, done = seeds * len(codecs) + len(rates), 0

    def step(_: object = None) -> None:
        nonlocal done
        done += 1
        progress(done, total)

    result = train.run(workers=workers, seeds=seeds, epochs=epochs, runs=tuple(run_spec(c, parallel) for c in codecs),
                       batch=batch, target=target, packet_elements=packet_elements, quiet=True, parallel=parallel,
                       on_report=step)
    inputs = measured(result["reports"], codecs, parallel, packet_elements)
    compute_s = compute_step_seconds(batch)
    settings = [loopback_setting(inputs, target)]
    parameters = next(iter(inputs.values()))["parameters"]
    intml_codecs = tuple(c for c in codecs if c not in ("gloo", AUTO))
    for rate in rates:
        point = bench_cluster.run_point(workers, rate, parameters, mtu, 0.0, 1, rounds, JobParams.pool_size,
                                        with_gloo="gloo" in codecs, results="unicast", codecs=intml_codecs)
        exchange_s = {row["system"].removeprefix("intml ").replace("gloo ring", "gloo"): row["median_s"]
                      for row in point["rows"]}
        auto = shaped_auto(inputs, rate, exchange_s, compute_s, workers, mtu, batch) if AUTO in codecs else None
        settings.append(shaped_setting(inputs, rate, exchange_s, compute_s, parallel, target, auto, tuner_every))
        step()
    for model in sim_models:
        for rate in sim_rates:
            for n in sim_workers:
                settings.append(sim_compare.setting(inputs, model, n, rate, compute_s, parallel, target,
                                                    batch=batch, tuner_every=tuner_every))
    out = {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
           "machine": f"{platform.machine()}, {os.cpu_count()} CPUs", "load_average": list(os.getloadavg()),
           "parallel": parallel, "workers": workers, "seeds": seeds, "epochs": epochs, "batch_per_rank": batch,
           "target_accuracy": target, "packet_elements": packet_elements, "mtu": mtu,
           "compute_step_s": compute_s, "tuner_every": tuner_every, "codecs": list(codecs), "inputs": inputs,
           "settings": settings, "training": result["rows"]}
    if plot_out:
        sim_compare.plot(settings, plot_out, target, f"digits MLP, {parallel}, {workers} workers, {epochs} epochs, "
                                         f"{seeds} seed{'s' if seeds > 1 else ''} (median)")
    if as_json:
        print(json.dumps(out, indent=1))
    elif not quiet:
        print(f"{parallel} training of the digits MLP: {workers} workers, {seeds} seeds, {epochs} epochs; local "
              f"compute {1e3 * compute_s:.3g} ms per step (this process); {out['date']}, load average "
              + " ".join(f"{x:.2f}" for x in out["load_average"]))
        for setting in settings:
            print()
            print(table(setting, target))
    return out


def _codecs_arg(text: str) -> tuple[str, ...]:
    return tuple(text.split(","))  # checked with --parallel by run_from_args


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of `intml-testbed compare`; pass the parsed namespace to run_from_args."""
    from intml.aggregator.cli import count, output_file, parsed_by, positive, rate
    from intml.protocol.job import MAX_WORLD
    from intml.sim.scenario import parse_rate
    from intml.sim.training import PROFILES
    from intml.testbed.netns import MTUS

    parser.add_argument("--codecs", type=_codecs_arg, default=DEFAULT_CODECS, metavar="C1,C2,...",
                        help=f"gloo, cnat8, int32, host codecs' names and auto (the tuner: with --parallel ddp, beside "
                             f"gloo) (default {','.join(DEFAULT_CODECS)})")
    parser.add_argument("--parallel", choices=sim_compare.PARALLEL, default="average",
                        help="average: weights averaged after every epoch; ddp: gradients every step, through "
                             "the DDP hook (default average)")
    parser.add_argument("--workers", type=count(2, MAX_WORLD, "ranks per job: MAX_WORLD"), default=4,
                        help="ranks of the training and of the shaped links (default 4)")
    parser.add_argument("--seeds", type=positive(), default=1, help="seeds 0..N-1 per codec (default 1)")
    parser.add_argument("--epochs", type=positive(), default=20, help="(default 20)")
    parser.add_argument("--batch", type=positive(), default=16, help="batch per rank (default 16)")
    parser.add_argument("--target", type=positive(float, 1.0, "an accuracy"), default=0.95,
                        help="the accuracy whose epoch and wall time are reported (default 0.95)")
    parser.add_argument("--rate", type=rate, nargs="+", default=[], metavar="RATE",
                        help="time the exchanges over shaped links at these rates, in network namespaces (root; "
                             "tc's syntax: 100mbit 1gbit; default: none)")
    parser.add_argument("--mtu", type=int, choices=MTUS, default=MTUS[0], help="the shaped links' MTU (1500)")
    parser.add_argument("--rounds", type=positive(), default=3, help="timed exchanges per codec and rate (3)")
    parser.add_argument("--sim-rate", type=parsed_by(parse_rate), nargs="+", default=[], metavar="RATE",
                        help="simulate these link rates (10gbit 100gbit; default: none)")
    parser.add_argument("--sim-workers", type=count(2, None, "a ring needs two"), nargs="+", default=[16],
                        help="simulated workers (default 16)")
    parser.add_argument("--sim-model", choices=("digits", *PROFILES), nargs="+", default=list(DEFAULT_SIM_MODELS),
                        help="simulated models: digits (the measured MLP) or sim.training's profiles "
                             f"(default {' '.join(DEFAULT_SIM_MODELS)})")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the tables")
    parser.add_argument("--plot", metavar="PNG", type=output_file,
                        help="accuracy against wall time, one panel per setting, one line per codec")
    parser.set_defaults(parser=parser)  # run_from_args's cross-option check names the option


def run_from_args(args: argparse.Namespace) -> dict:
    try:
        check_codecs(args.codecs, args.parallel)
    except ValueError as exc:
        args.parser.option_error("--codecs", str(exc))
    if args.rate and args.codecs == ("gloo",):
        args.parser.option_error("--rate", "the shaped links time intml codecs beside gloo: add one to --codecs")
    if args.rate:
        from intml.testbed import netns

        if problem := netns.missing_requirements():
            raise SystemExit(f"intml-testbed: --rate: {problem}")
    return run(codecs=args.codecs, parallel=args.parallel, workers=args.workers, seeds=args.seeds,
               epochs=args.epochs, rates=tuple(args.rate), mtu=args.mtu, rounds=args.rounds,
               sim_workers=tuple(args.sim_workers), sim_rates=tuple(args.sim_rate), sim_models=tuple(args.sim_model),
               target=args.target, batch=args.batch, as_json=args.json, plot_out=args.plot)
