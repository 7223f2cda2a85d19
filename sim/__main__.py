"""intml-sim: run, sweep and validate simulated allreduces (docs/sim.md)."""

from __future__ import annotations

import argparse
import os
import sys

from intml.aggregator.cli import (INTERRUPTED, OneLineParser, count, fraction, input_file, output_file, parsed_by,
                                  positive)
from intml.protocol.job import MAX_WORLD
from intml.sim import output, scenario
from intml.sim.costs import TESTBED_CPUS
from intml.sim.run import COLUMNS, Progress, rows
from intml.sim.training import PROFILES
from intml.sim.tuning import BATCH, NOISE_SCALE


def _meta(s: dict) -> dict:
    return {"scenario": s["name"], "scenario_hash": scenario.digest(s), "seeds": s["seed"] if isinstance(
        s["seed"], list) else [s["seed"]], "code_version": output.code_version(), "mode": s["mode"]}


def _emit(meta: dict, got: list[dict], args: argparse.Namespace, columns: tuple[str, ...]) -> None:
    if args.json:
        print(output.as_json(meta, got))
    elif args.csv:
        print(output.as_csv(meta, got), end="")
    else:
        if "scenario" in meta:
            print(f"{meta['scenario']}  (hash {meta['scenario_hash']}, seeds {meta['seeds']}, {meta['code_version']})")
        else:
            load = meta.get("load_average")
            print(f"intml-sim {meta['code_version']}" + (f"  (load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f})"
                                                          if load else ""))
        print(output.table(got, columns))


def cmd_run(args: argparse.Namespace) -> None:
    s = scenario.load(args.scenario)
    if getattr(args, "set", None):
        s = scenario.apply_sets(s, args.set)
    got = list(rows(s, Progress()))
    _emit(_meta(s), got, args, COLUMNS)
    if args.plot:
        series: dict[str, list[tuple[float, float]]] = {}
        for r in got:
            series.setdefault(r["system"], []).append((r[args.x], r[args.y]))
        labels = {"time_s": "seconds per allreduce", "goodput_gbit": "goodput, Gbit/s of float32 tensor"}
        output.plot_lines(args.plot, series, xlabel=args.x, ylabel=labels.get(args.y, args.y), title=s["name"],
                          logx=args.x == "workers", logy=args.y == "time_s", symlogx=args.x == "loss")


def cmd_validate(args: argparse.Namespace) -> None:
    from intml.sim import validate
    got = validate.compare(validate.load(args.testbed), progress=Progress(), cpus=args.cpus)
    meta = {"testbed": args.testbed, "code_version": output.code_version(), "calibration": validate.CALIBRATION}
    _emit(meta, got, args, validate.COLUMNS)
    if args.plot:
        validate.plot(got, args.plot)


def cmd_loss(args: argparse.Namespace) -> None:
    from intml.sim import loss
    got = loss.table(args.workers, args.loss, args.pool, args.rto, elements=args.elements, rate=args.rate,
                     seed=args.seed)
    _emit({"code_version": output.code_version(), "seeds": [args.seed]}, got, args, loss.COLUMNS)


def cmd_train(args: argparse.Namespace) -> None:
    if args.codec:
        cmd_train_codec(args)
        return
    from intml.sim import training
    got = training.table(args.workers, args.rate)
    _emit({"code_version": output.code_version(), "profiles": training.SOURCES}, got, args, training.COLUMNS)
    if args.plot:
        training.plot(got, args.plot)


def cmd_compare(args: argparse.Namespace) -> None:
    import json

    from intml.sim import compare
    try:
        measured = json.loads(open(args.measured).read())
        inputs, compute_s, parallel = measured["inputs"], measured["compute_step_s"], measured["parallel"]
        target = args.target or measured["target_accuracy"]
        batch = measured.get("batch_per_rank", BATCH)
        every = args.tuner_every or measured.get("tuner_every", 1)
    except (ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"{args.measured} is not the output of intml-testbed compare --json ({exc!r})") from None
    settings = [compare.setting(inputs, model, n, rate, compute_s, parallel, target, batch=batch,
                                tuner_every=every)
                for model in args.model for rate in args.rate for n in args.workers]
    got = [{"setting": s["setting"], **{k: v for k, v in r.items() if k != "curve"}} for s in settings
           for r in s["rows"]]
    _emit({"code_version": output.code_version(), "measured": args.measured, "parallel": parallel,
           "target_accuracy": target, "how": compare.HOW}, got, args, compare.COLUMNS)
    if args.plot:
        compare.plot(settings, args.plot, target, f"simulated steps, measured accuracy per epoch ({parallel})")


def cmd_train_codec(args: argparse.Namespace) -> None:
    """``train --codec``: the tuner's choice (auto) or a fixed codec per model and rate, or step by step."""
    from intml.sim import tuning
    models = tuple(args.model or tuning.PROFILES)
    options = {"switch": not args.no_switch, "gso": not args.no_gso, "noise_scale": args.noise_scale,
               "batch": args.batch}
    meta = {"code_version": output.code_version(), "profiles": tuning.SOURCES, **options}
    if args.change:
        changes = sorted([(0, args.rate[0])] + args.change)
        got = [row for model in models for row in tuning.steps(model, args.workers, changes, args.steps, args.codec,
                                                                   **options)]
        _emit(meta, got, args, tuning.STEP_COLUMNS)
    else:
        _emit(meta, tuning.table(args.workers, args.rate, args.codec, models=models, **options), args,
              tuning.COLUMNS)


def step_rate(text: str) -> tuple[int, float]:
    """``STEP:RATE`` (``20:100gbit``): the link rate from that step on."""
    step, _, rate = text.partition(":")
    if not step.isdigit() or not rate:
        raise ValueError(f"a rate change is STEP:RATE, as in 20:100gbit; got {text!r}")
    return int(step), scenario.parse_rate(rate)


def cmd_bench(args: argparse.Namespace) -> None:
    from intml.sim import bench
    got = bench.table(args.workers, args.elements)
    _emit({"code_version": output.code_version(), "load_average": os.getloadavg()}, got, args, bench.COLUMNS)


def build_parser() -> OneLineParser:
    p = OneLineParser(prog="intml-sim", description=__doc__)
    rate = parsed_by(scenario.parse_rate)
    sub = p.add_subparsers(dest="command", required=True)

    def outputs(q: argparse.ArgumentParser, plot: bool = True) -> None:
        fmt = q.add_mutually_exclusive_group()
        fmt.add_argument("--json", action="store_true", help="one JSON object (hash, seeds, code version, rows)")
        fmt.add_argument("--csv", action="store_true", help="CSV rows, each with the hash, seeds and code version")
        if plot:
            q.add_argument("--plot", metavar="PNG", type=output_file,
                           help="write a plot (needs matplotlib: the plot extra)")

    def axes(q: argparse.ArgumentParser) -> None:
        q.add_argument("--x", default="workers", choices=("workers", "loss", "rate", "elements", "pool", "racks",
                                                               "uplink_rate"),
                       help="the plot's x axis (default workers)")
        q.add_argument("--y", default="time_s", choices=("time_s", "goodput_gbit"), help="its y axis")

    r = sub.add_parser("run", help="run a scenario file")
    r.add_argument("scenario", type=input_file)
    outputs(r)
    axes(r)
    r.set_defaults(fn=cmd_run)
    sw = sub.add_parser("sweep", help="run a scenario with keys swept: --set workers=2,4,8")
    sw.add_argument("scenario", type=input_file)
    sw.add_argument("--set", action="append", default=[], metavar="KEY=V1,V2,...")
    outputs(sw)
    axes(sw)
    sw.set_defaults(fn=cmd_run)
    v = sub.add_parser("validate", help="replay `intml-testbed bench cluster --json` points and compare")
    v.add_argument("testbed", type=input_file, help="the testbed's JSON output")
    v.add_argument("--cpus", type=count(0), default=TESTBED_CPUS, help="CPUs of the machine every rank, the "
                   "aggregator and the kernel's forwarding share (the testbed's VM: 2); 0: every host its own CPU")
    outputs(v)
    v.set_defaults(fn=cmd_validate)
    lo = sub.add_parser("loss", help="slot completion times under loss at scale (p50, p99)")
    lo.add_argument("--workers", type=positive(), nargs="+", default=[64, 256, 1024])
    lo.add_argument("--loss", type=fraction, nargs="+", default=[1e-4])
    lo.add_argument("--pool", type=positive(), nargs="+", default=[64, 256])
    lo.add_argument("--rto", type=positive(float), nargs="+", default=[0.001, 0.05])
    lo.add_argument("--elements", type=positive(), default=25_000_000)
    lo.add_argument("--rate", type=rate, default=100e9)
    lo.add_argument("--seed", type=count(0), default=1)
    outputs(lo, plot=False)
    lo.set_defaults(fn=cmd_loss)
    t = sub.add_parser("train", help="training time per iteration: DDP bucket overlap, intml vs the ring")
    t.add_argument("--workers", type=count(2, None, "a ring needs two"), default=16)
    t.add_argument("--rate", type=rate, nargs="+", default=[10e9, 25e9, 100e9], help="link rates (default 10gbit "
                                                                                     "25gbit 100gbit)")
    t.add_argument("--codec", help="auto: what the online tuner picks per bucket and why (docs/tuner.md); a codec "
                   "name (cnat8, int32, uniform8...): that codec fixed; default: intml cnat8 against the ring")
    t.add_argument("--model", nargs="+", choices=sorted(PROFILES), help="with --codec: these model profiles only")
    t.add_argument("--no-switch", action="store_true", help="with --codec: no switch sums cnat8 and int32; "
                   "every codec goes through the software aggregator")
    t.add_argument("--no-gso", action="store_true", help="with --codec: ranks send and receive without GSO/GRO")
    t.add_argument("--noise-scale", type=positive(float), default=NOISE_SCALE, help="with --codec: the "
                   f"gradients' per-sample noise scale (default {NOISE_SCALE}; sim/tuning.py)")
    t.add_argument("--batch", type=positive(), default=BATCH, help=f"with --codec: per rank (default {BATCH})")
    t.add_argument("--change", type=parsed_by(step_rate), action="append", default=[], metavar="STEP:RATE",
                   help="with --codec: the link rate changes at that step (the first --rate before); prints "
                        "every step's choice")
    t.add_argument("--steps", type=positive(), default=12, help="with --change: steps to run (default 12)")
    outputs(t)
    t.set_defaults(fn=cmd_train)
    c = sub.add_parser("compare", help="each codec's step time and time to a target at scale, from a measured "
                                        "`intml-testbed compare --json`")
    c.add_argument("measured", type=input_file, help="the JSON of intml-testbed compare --json")
    c.add_argument("--workers", type=count(2, None, "a ring needs two"), nargs="+", default=[16])
    c.add_argument("--rate", type=rate, nargs="+", default=[10e9, 100e9], help="link rates (default 10gbit 100gbit)")
    c.add_argument("--model", nargs="+", default=["digits", "VGG-16"], choices=("digits", *PROFILES),
                   help="digits (the measured MLP) or sim.training's profiles (default digits VGG-16)")
    c.add_argument("--target", type=positive(float, 1.0, "an accuracy"), default=None,
                   help="accuracy to reach (default: the measured run's)")
    c.add_argument("--tuner-every", type=positive(), default=None, metavar="K",
                   help="auto measures one step in K (INTML_TUNER_EVERY; default: the measured run's)")
    outputs(c)
    c.set_defaults(fn=cmd_compare)
    b = sub.add_parser("bench", help="packet events per second: the engine alone, and with the real cores")
    b.add_argument("--workers", type=count(1, MAX_WORLD, "ranks of one job on the real cores: MAX_WORLD"), default=64)
    b.add_argument("--elements", type=positive(), default=25_000_000)
    outputs(b, plot=False)
    b.set_defaults(fn=cmd_bench)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        args.fn(args)
    except (ValueError, output.PlotUnavailable) as exc:  # a bad scenario (ScenarioError) or job parameter
        print(f"intml-sim: error: {exc}", file=sys.stderr)
        return 2
    except RuntimeError as exc:
        print(f"intml-sim: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("intml-sim: interrupted", file=sys.stderr)
        return INTERRUPTED
    return 0


if __name__ == "__main__":
    sys.exit(main())
