"""`intml-testbed`: benchmarks and the demo."""

from __future__ import annotations

import argparse
import sys

from protocol.cli import OneLineParser, positive


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog="intml-testbed", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    bench = commands.add_parser("bench", help="run a benchmark and print its figures").add_subparsers(
        dest="bench", required=True
    )
    codec = bench.add_parser("codec", help="C_nat kernels vs a memory copy, one thread")
    codec.add_argument("--elements", type=positive(), default=1 << 25, help="array length (default 2**25)")
    codec.add_argument("--repeats", type=positive(), default=11, help="timed runs; the median is reported")
    codec.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    ar = bench.add_parser("allreduce", help="intml vs Gloo's ring allreduce on loopback")
    ar.add_argument("--workers", type=positive(), default=4)
    ar.add_argument("--elements", type=positive(), default=25_000_000)
    ar.add_argument("--codec", choices=("cnat8", "int32"), default="cnat8")
    ar.add_argument("--packet-elements", type=positive(), default=None,
                    help="elements per packet (default 16384 for cnat8, 8192 for int32: 64 KiB loopback datagrams)")
    ar.add_argument("--pool", type=positive(), default=64, help="slots in the job's pool (default 64)")
    ar.add_argument("--cores", type=positive(), default=1, help="aggregator data-plane processes (default 1)")
    ar.add_argument("--warmup", type=int, default=2)
    ar.add_argument("--rounds", type=positive(), default=5)
    ar.add_argument("--no-gloo", action="store_true", help="skip the Gloo anchor")
    ar.add_argument("--json", action="store_true")
    commands.add_parser("demo", help="what `make demo` runs")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "bench" and args.bench == "codec":
        from testbed import bench_codec

        bench_codec.run(args.elements, args.repeats, args.json)
    elif args.command == "bench" and args.bench == "allreduce":
        from testbed import bench_allreduce

        packet_elements = args.packet_elements or (16384 if args.codec == "cnat8" else 8192)
        bench_allreduce.run(args.workers, args.elements, args.codec, packet_elements, args.pool, args.cores,
                            args.warmup, args.rounds, not args.no_gloo, args.json)
    elif args.command == "demo":
        from testbed import bench_allreduce, bench_codec

        bench_codec.run(1 << 24, 7, False)
        print()
        bench_allreduce.run(4, 25_000_000, "cnat8", 16384, 64, 1, 2, 3, True, False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
