"""`intml-testbed`: benchmarks and the demo."""

from __future__ import annotations

import argparse
import sys


def _positive(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="intml-testbed", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    bench = commands.add_parser("bench", help="run a benchmark and print its figures").add_subparsers(
        dest="bench", required=True
    )
    codec = bench.add_parser("codec", help="C_nat kernels vs a memory copy, one thread")
    codec.add_argument("--elements", type=_positive, default=1 << 25, help="array length (default 2**25)")
    codec.add_argument("--repeats", type=_positive, default=11, help="timed runs; the median is reported")
    codec.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    commands.add_parser("demo", help="what `make demo` runs")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "bench" and args.bench == "codec":
        from testbed import bench_codec

        bench_codec.run(args.elements, args.repeats, args.json)
    elif args.command == "demo":
        from testbed import bench_codec

        bench_codec.run(1 << 25, 11, False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
