"""`intml-testbed`: benchmarks and the demo."""

from __future__ import annotations

import argparse
import sys

from intml.aggregator.cli import (INTERRUPTED, OneLineParser, count, fraction, multicast_group, output_file, positive,
                                  rate)
from intml.protocol import wire
from intml.protocol.codecs.host import parse as parse_host_codec
from intml.protocol.job import (
    AGGREGATOR_MAX_JOBS,
    AGGREGATOR_MAX_POOL,
    CODEC_NAMES,
    MAX_CORES,
    MAX_WORLD,
    ROUNDINGS,
    JobParams,
    codec_name,
)
from intml.testbed.bench_allreduce import AggregatorError
from intml.testbed.netns import MAX_LINKS, MTUS, RESULTS_GROUP, ClusterError

WORKERS = count(1, MAX_WORLD, "ranks per job: MAX_WORLD, one bit each in a slot's 64-bit bitmap")
CORES = count(1, MAX_CORES, "a job's cores on all its aggregators: one byte in the JOIN")
WARMUP = count(0)
# Bytes per element each process of a benchmark holds at least (its arrays of --elements): a rank's float32 input
# and result; the codec bench's input, codes, decoded values, copy, accumulator, integer sums and float64 draw; the
# host codecs bench's input, packages (at most 4 bytes), decoded values and their float64 error.
HELD = {"allreduce": 8, "mac": 8, "cluster": 8, "loss": 8, "codec": 4 + 1 + 4 + 4 + 4 + 4 + 8,
        "host-codecs": 4 + 4 + 4 + 8}


def add_pool(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--pool", type=count(1, AGGREGATOR_MAX_POOL, "the slots intml-aggregator lets one job "
                                             "reserve, its --max-pool"), default=JobParams.pool_size,
                        help=f"slots in the job's pool (default {JobParams.pool_size}, at most {AGGREGATOR_MAX_POOL})")


def results_group(text: str) -> str:
    """An argparse type: the first of the aggregator's results groups, one per job it may hold."""
    return multicast_group(text, AGGREGATOR_MAX_JOBS, "one per job of intml-aggregator's --max-jobs")


def host_codec(text: str) -> str:
    """An argparse type: a host codec's name (protocol.codecs.host.parse)."""
    try:
        return parse_host_codec(text).name
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def codec_size(text: str) -> tuple[str, int]:
    """An argparse type: ``CODEC:ELEMENTS`` (e.g. cnat8:1024) -> (codec, elements per packet)."""
    codec, _, elements = text.partition(":")
    if codec not in CODEC_NAMES or not elements.isdigit() or not 0 < int(elements) <= wire.max_packet_elements(
            CODEC_NAMES[codec]):
        raise argparse.ArgumentTypeError(f"expected CODEC:ELEMENTS, CODEC one of {', '.join(CODEC_NAMES)} and "
                                         f"ELEMENTS from 1 to what one datagram holds, got {text!r}")
    return codec, int(elements)


def build_parser() -> OneLineParser:
    parser = OneLineParser(prog="intml-testbed", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    bench = commands.add_parser("bench", help="run a benchmark and print its figures").add_subparsers(
        dest="bench", required=True
    )
    codec = bench.add_parser("codec", help="C_nat kernels vs a memory copy, one thread")
    codec.add_argument("--elements", type=positive(), default=1 << 25, help="array length (default 2**25)")
    codec.add_argument("--repeats", type=positive(), default=11, help="timed runs; the median is reported")
    codec.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    hc = bench.add_parser("host-codecs", help="the host codecs' wire bits, error and speed on a Gaussian vector")
    hc.add_argument("--elements", type=positive(), default=1 << 20, help="vector length (default 2**20)")
    hc.add_argument("--package", type=positive(), default=16384, help="elements per package (default 16384)")
    hc.add_argument("--repeats", type=positive(), default=3, help="timed runs; the median is reported")
    hc.add_argument("--codec", nargs="+", type=host_codec, help="codec names (default: one of each family)")
    hc.add_argument("--allreduce", action="store_true",
                    help="also time a loopback allreduce of the vector per codec, beside cnat8's, through one "
                         "aggregator core")
    hc.add_argument("--workers", type=WORKERS, default=4, help="ranks of the --allreduce (default 4)")
    hc.add_argument("--rounds", type=positive(), default=5, help="timed allreduces per codec; the median is reported")
    hc.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    bio = bench.add_parser("burstio", help="GSO/GRO and recvmmsg/sendmmsg bursts vs plain sendto/recvfrom on loopback")
    bio.add_argument("--packets", type=positive(), default=200_000, help="datagrams per variant (default 200000)")
    bio.add_argument("--size", type=positive(int, wire.MAX_DATAGRAM, "the largest UDP payload"), nargs="+",
                     default=[1050, 8218],
                     help=f"bytes per datagram, one run each (default 1050 8218, at most {wire.MAX_DATAGRAM})")
    bio.add_argument("--burst", type=positive(), default=256, help="datagrams per burst (default 256)")
    bio.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    mac = bench.add_parser("mac", help="the DATA/RESULT MAC's cost per packet and per loopback allreduce")
    mac.add_argument("--chunks", type=positive(), default=512, help="chunks of the recorded allreduce (default 512)")
    mac.add_argument("--repeats", type=positive(), default=7, help="timed runs; the median is reported")
    mac.add_argument("--workers", type=WORKERS, default=4, help="ranks of the loopback allreduce (default 4)")
    mac.add_argument("--elements", type=positive(), default=4_000_000, help="its tensor size (default 4000000)")
    mac.add_argument("--cores", type=CORES, default=2, help="its aggregator cores (default 2)")
    mac.add_argument("--rounds", type=positive(), default=5, help="its timed allreduces per trial (default 5)")
    mac.add_argument("--trials", type=positive(), default=3,
                     help="aggregators started without and with the MAC, alternately (default 3 each)")
    mac.add_argument("--json", action="store_true", help="print JSON objects instead of tables")
    pc = bench.add_parser("percore", help="one aggregator core and one worker vs raw UDP sinks and senders on loopback")
    pc.add_argument("--size", type=codec_size, nargs="+", default=[("cnat8", 1024), ("cnat8", 256), ("int32", 256)],
                    metavar="CODEC:ELEMENTS", help="packets to send, one run each (default cnat8:1024 cnat8:256 "
                                                   "int32:256)")
    pc.add_argument("--seconds", type=positive(float), default=2.0, help="measured seconds per run (default 2)")
    pc.add_argument("--packets", type=positive(), default=4096,
                    help="chunks of the recorded allreduce: DATA datagrams per rank and pass (default 4096)")
    pc.add_argument("--repeats", type=positive(), default=3, help="runs of each variant; medians reported (default 3)")
    pc.add_argument("--blasters", type=positive(int, 16), default=None,
                    help="sending processes, at most 16 (default: one per CPU the core leaves, at most 4)")
    pc.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    ar = bench.add_parser("allreduce", help="intml vs Gloo's ring allreduce on loopback")
    ar.add_argument("--workers", type=WORKERS, default=4, help=f"ranks (default 4, at most {MAX_WORLD})")
    ar.add_argument("--elements", type=positive(), default=25_000_000, help="tensor size (default 25000000)")
    ar.add_argument("--codec", choices=tuple(CODEC_NAMES), default=codec_name(JobParams.codec))
    ar.add_argument("--packet-elements", type=positive(), default=None,
                    help="elements per packet (default: the most one UDP datagram holds, 65481 for cnat8 and "
                         "16370 for int32; loopback's 64 KiB MTU carries them unfragmented)")
    add_pool(ar)
    ar.add_argument("--cores", type=CORES, default=2, help="aggregator data-plane processes (default 2)")
    results = ar.add_mutually_exclusive_group()
    results.add_argument("--multicast", metavar="GROUP", type=results_group, default=RESULTS_GROUP,
                         help="the aggregator multicasts each result to the job's group (intml-aggregator "
                              f"--multicast; default {RESULTS_GROUP}), as a switch replicates it")
    results.add_argument("--unicast", action="store_true", help="one copy of each result per worker instead")
    ar.add_argument("--warmup", type=WARMUP, default=2, help="untimed allreduces first (default 2)")
    ar.add_argument("--rounds", type=positive(), default=5, help="timed allreduces (default 5)")
    ar.add_argument("--rounding", nargs="+", choices=ROUNDINGS, default=list(ROUNDINGS[:1]),
                    help="C_nat's rounding, one intml run each (default stochastic; 'stochastic nearest': the seed "
                         "002 comparison, docs/rounding.md)")
    ar.add_argument("--no-gloo", action="store_true", help="skip the Gloo anchor")
    ar.add_argument("--json", action="store_true")
    cl = bench.add_parser("cluster", help="intml vs Gloo over shaped links between network namespaces (root)")
    cl.add_argument("--workers", type=WORKERS, nargs="+", default=[4], help="worker counts (default 4)")
    cl.add_argument("--rate", type=rate, nargs="+", default=["100mbit"], help="link rates, e.g. 100mbit 500mbit 1gbit")
    cl.add_argument("--elements", type=positive(), default=None,
                    help="tensor size (default: about 0.3 s of cnat8 traffic at the rate, at most 10M)")
    cl.add_argument("--mtu", type=int, choices=MTUS, default=MTUS[0])
    cl.add_argument("--loss", type=fraction, default=0.0, help="random loss per link direction, e.g. 0.01")
    cl.add_argument("--aggregators", type=count(1, MAX_LINKS, "aggregator namespaces of one topology"), nargs="+",
                    default=[1],
                    help="aggregator counts to run (default 1: in the switch namespace; more: one namespace each, "
                         "the job spread over all; e.g. 1 2 compares them, and their results must be identical)")
    cl.add_argument("--cores", type=CORES, default=None,
                    help="cores per aggregator (default: half the CPUs the workers leave, split over the "
                         "aggregators, at least 1)")
    add_pool(cl)
    cl.add_argument("--warmup", type=WARMUP, default=1, help="untimed allreduces first (default 1)")
    cl.add_argument("--rounds", type=positive(), default=3, help="timed allreduces (default 3)")
    cl.add_argument("--results", choices=("multicast", "unicast"), default="multicast",
                    help="how results reach the workers (default multicast: one copy per completion, replicated by "
                         "the switch namespace; unicast where it cannot route multicast, and each row says which)")
    cl.add_argument("--collective", choices=("allreduce", "reduce_scatter"), default="allreduce",
                    help="what every system runs (default allreduce; reduce_scatter: Gloo's reduce_scatter_tensor "
                         "against intml's)")
    cl.add_argument("--plot", type=output_file, help="write a PNG of time per allreduce against n")
    cl.add_argument("--json", action="store_true")
    gp = bench.add_parser("gpu", help="the CUDA path: device kernels vs a device copy, a hook allreduce of a CUDA "
                                      "bucket vs Gloo (needs a GPU)")
    gp.add_argument("--elements", type=positive(), default=25_000_000, help="bucket size (default 25000000: 100 MB)")
    gp.add_argument("--workers", type=WORKERS, default=2, help="ranks, on GPU rank mod the GPU count (default 2)")
    gp.add_argument("--packet-elements", type=positive(int, wire.max_packet_elements(CODEC_NAMES["cnat8"])),
                    default=wire.max_packet_elements(CODEC_NAMES["cnat8"]), help="elements per packet (default: "
                    "the most one UDP datagram holds)")
    add_pool(gp)
    gp.add_argument("--cores", type=CORES, default=2, help="aggregator data-plane processes (default 2)")
    gp.add_argument("--warmup", type=WARMUP, default=2, help="untimed allreduces first (default 2)")
    gp.add_argument("--rounds", type=positive(), default=5, help="timed allreduces (default 5)")
    gp.add_argument("--repeats", type=positive(), default=11, help="timed runs of each kernel (default 11)")
    gp.add_argument("--json", action="store_true", help="print JSON objects instead of tables")
    lo = bench.add_parser("loss", help="consecutive allreduces under loss vs the loss-free run (root)")
    lo.add_argument("--workers", type=WORKERS, default=4)
    lo.add_argument("--rate", type=rate, default="500mbit")
    lo.add_argument("--elements", type=positive(), default=1_000_000)
    lo.add_argument("--loss", type=fraction, nargs="+", default=[0.01, 0.05])
    lo.add_argument("--mtu", type=int, choices=MTUS, default=MTUS[0])
    add_pool(lo)
    lo.add_argument("--rounds", type=positive(), default=20)
    lo.add_argument("--json", action="store_true")
    for name, sub in bench.choices.items():
        sub.set_defaults(parser=sub, held=HELD.get(name))  # for check
    cluster = commands.add_parser("cluster", help="manage namespace clusters").add_subparsers(
        dest="cluster", required=True)
    up = cluster.add_parser("up", help="build a topology and keep it until Ctrl-C")
    up.add_argument("--workers", type=count(1, MAX_LINKS, "worker links of one topology"), default=4)
    up.add_argument("--rate", type=rate, default="100mbit")
    up.add_argument("--mtu", type=int, choices=MTUS, default=MTUS[0])
    up.add_argument("--loss", type=fraction, default=0.0)
    cluster.add_parser("cleanup", help="remove namespaces left by crashed runs (names starting intml-)")
    from intml.testbed import train as train_cmd

    train_cmd.add_arguments(commands.add_parser("train", help="DDP convergence on load_digits: Gloo vs intml (torchrun)"))
    from intml.testbed import compare as compare_cmd

    compare_cmd.add_arguments(commands.add_parser("compare", help="the same training under each codec: bits, time "
                                                                  "per step, accuracy, time to a target"))
    commands.add_parser("demo", help="what `make demo` runs")
    audit = commands.add_parser("audit", help="attack a live aggregator and workers on loopback; print what held")
    audit.add_argument("--fuzz", type=WARMUP, default=0, metavar="N",
                       help="also fuzz the worker's and the aggregator's receive paths with N datagrams, in-process "
                            "with bounds checking (default 0: none; 1000000 takes minutes)")
    audit.add_argument("--pools", type=count(1, AGGREGATOR_MAX_POOL, "the aggregator's --max-pool"), nargs="+",
                       default=[1, 2, 64, 256], help="the victim's pool sizes (default 1 2 64 256)")
    audit.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    return parser


def available_memory() -> int | None:
    """Bytes this host can give without swapping (MemAvailable), None where it does not say."""
    try:
        with open("/proc/meminfo") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError):
        return None


def memory_problem(processes: int, items: int, bytes_each: int, option: str) -> str | None:
    """Why ``processes`` processes holding ``bytes_each`` bytes for each of ``items`` (the value of ``option``) do
    not fit in this host's available memory (a lower bound: it never refuses a run that fits), or None."""
    need, have = processes * items * bytes_each, available_memory()
    if have is None or need <= have:
        return None
    many = processes > 1
    return (f"{processes} process{'es' if many else ''} of {items} {option[2:]} need{'' if many else 's'} at least "
            f"{need / 2**30:.1f} GiB, and this host has {have / 2**30:.1f} GiB available: use fewer {option}")


def check(args: argparse.Namespace) -> None:
    """The checks that involve several options or the host, before anything starts (a one-line error from the
    subcommand's parser)."""
    if args.command == "bench" and args.held and args.elements is not None:
        workers = getattr(args, "workers", 1)  # the codec bench: one process
        processes = max(workers) if isinstance(workers, list) else workers
        if problem := memory_problem(processes, args.elements, args.held, "--elements"):
            args.parser.option_error("--elements", problem)
    if args.command == "bench" and args.bench == "percore":  # it records one DATA datagram per packet at least
        largest = max(wire.element_datagram_size(CODEC_NAMES[codec], n) for codec, n in args.size)
        if problem := memory_problem(1, args.packets, largest, "--packets"):
            args.parser.option_error("--packets", problem)
    if args.command == "bench" and args.bench == "allreduce":
        from intml.testbed.bench_allreduce import loopback_packet_elements, pool_problem

        limit = loopback_packet_elements(args.codec)
        if args.packet_elements is None:
            args.packet_elements = limit
        elif args.packet_elements > limit:
            args.parser.option_error("--packet-elements", f"one UDP datagram holds at most {limit} {args.codec} "
                                                          f"elements, got {args.packet_elements}")
        if problem := pool_problem(args.pool, args.cores, args.packet_elements):
            args.parser.option_error("--pool", problem)
    if args.command == "bench" and args.bench == "cluster" and args.cores is not None:
        if max(args.aggregators) * args.cores > MAX_CORES:
            args.parser.option_error("--cores", f"{max(args.aggregators)} aggregators of {args.cores} cores exceed "
                                                f"a job's {MAX_CORES} cores: use fewer --cores or --aggregators")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    check(args)
    try:
        code = run(args)  # the audit's: 1 if a check failed
    except (AggregatorError, ClusterError, TimeoutError) as exc:  # the host's doing, not the code's: one line
        raise SystemExit(f"intml-testbed: {exc}") from None
    except KeyboardInterrupt:  # Ctrl-C: the with-blocks on the way here stopped what the run started
        print("intml-testbed: interrupted", file=sys.stderr)
        return INTERRUPTED
    return code or 0


def run(args: argparse.Namespace) -> int | None:
    """Run the subcommand of valid ``args``."""
    if args.command == "bench" and args.bench == "codec":
        from intml.testbed import bench_codec

        bench_codec.run(args.elements, args.repeats, args.json)
    elif args.command == "bench" and args.bench == "host-codecs":
        from intml.testbed import bench_host_codecs

        names = args.codec or bench_host_codecs.CODECS
        bench_host_codecs.run(args.elements, args.package, args.repeats, names, args.json)
        if args.allreduce:
            bench_host_codecs.allreduce(args.workers, args.elements, args.rounds, names, args.json)
    elif args.command == "bench" and args.bench == "burstio":
        from intml.testbed import bench_burstio

        bench_burstio.run(args.packets, tuple(args.size), args.burst, args.json)
    elif args.command == "bench" and args.bench == "mac":
        from intml.testbed import bench_mac

        bench_mac.run(args.chunks, args.repeats, args.workers, args.elements, args.cores, args.rounds, args.trials,
                      args.json)
    elif args.command == "bench" and args.bench == "percore":
        from intml.testbed import bench_percore

        bench_percore.run(args.size, args.seconds, args.packets, args.repeats, args.blasters, args.json)
    elif args.command == "bench" and args.bench == "allreduce":
        from intml.testbed import bench_allreduce

        bench_allreduce.run(args.workers, args.elements, args.codec, args.packet_elements, args.pool, args.cores,
                            args.warmup, args.rounds, not args.no_gloo, args.json,
                            None if args.unicast else args.multicast, tuple(args.rounding))
    elif args.command == "bench" and args.bench == "gpu":
        from intml.testbed import bench_gpu

        bench_gpu.run(args.elements, args.workers, args.packet_elements, args.pool, args.cores, args.warmup,
                      args.rounds, args.repeats, args.json)
    elif args.command == "bench" and args.bench in ("cluster", "loss"):
        from intml.testbed import bench_cluster, netns

        if problem := netns.missing_requirements():
            raise SystemExit(f"intml-testbed: {problem}")
        try:
            if args.bench == "cluster":
                bench_cluster.run(args.workers, args.rate, args.elements, args.mtu, args.loss, args.warmup,
                                  args.rounds, args.pool, args.json, args.plot, args.aggregators, args.cores,
                                  args.results, args.collective)
            else:
                bench_cluster.run_loss(args.workers, args.rate, args.elements, args.loss, args.mtu, args.rounds,
                                       args.pool, args.json)
        except ValueError as exc:
            raise SystemExit(f"intml-testbed: {exc}") from None
    elif args.command == "cluster":
        from intml.testbed import netns

        if problem := netns.missing_requirements():
            raise SystemExit(f"intml-testbed: {problem}")
        if args.cluster == "cleanup":
            removed = netns.remove_namespaces()
            print(f"removed {len(removed)} namespaces" + (f": {' '.join(removed)}" if removed else ""))
        else:
            netns.hold(args.workers, args.rate, args.mtu, args.loss)
    elif args.command == "train":
        from intml.testbed import train as train_cmd

        train_cmd.run_from_args(args)
    elif args.command == "compare":
        from intml.testbed import compare as compare_cmd

        compare_cmd.run_from_args(args)
    elif args.command == "audit":
        from intml.testbed import audit

        return audit.run(args.fuzz, args.json, tuple(args.pools))
    elif args.command == "demo":
        from intml.testbed import bench_allreduce, bench_codec

        bench_codec.run(1 << 24, 7, False)
        print()
        codec = codec_name(JobParams.codec)
        bench_allreduce.run(4, 25_000_000, codec, bench_allreduce.loopback_packet_elements(codec),
                            JobParams.pool_size, 2, 2, 5, True, False, RESULTS_GROUP)
        print()
        from intml.testbed import bench_cluster, netns

        if problem := netns.missing_requirements():
            print(f"skipping the shaped 4-worker cluster: {problem}")
        else:
            bench_cluster.run([4], ["100mbit"], 3_000_000, MTUS[0], 0.0, 1, 3, JobParams.pool_size, False, None)


if __name__ == "__main__":
    sys.exit(main())
