"""One intml worker rank as its own program, so benchmarks can start ranks anywhere (on loopback, or inside a
network namespace with `ip netns exec`). It prints one JSON line: per-round seconds, a hash of every round's
result (to check bit-identical results across ranks and runs), and the worker's counters.

    python -m intml.testbed.rank --aggregator 198.18.0.1:48879 --rank 0 --world-size 4 --elements 1000000

With ``--collective reduce_scatter`` each timed round is a reduce-scatter instead (elements a multiple of the world
size), and the hashes are of this rank's shard.

Each round starts with a one-element allreduce, which completes at every rank at the same moment: a barrier
that needs no other channel between the namespaces.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time

import numpy as np

from intml.aggregator.cli import OneLineParser, positive
from intml.protocol.codecs.host import parse as host_codec
from intml.protocol.job import CODEC_NAMES, ROUNDINGS, JobParams, WorkerTimers, codec_name

COLLECTIVES = ("allreduce", "reduce_scatter")


def rank_input(rank: int, elements: int, seed: int = 0) -> np.ndarray:
    """Gradient-like float32 data, different at every rank and reproducible."""
    return np.random.default_rng([seed, rank]).standard_normal(elements).astype(np.float32)


def run(args: argparse.Namespace) -> dict:
    from intml.worker import Worker

    x = rank_input(args.rank, args.elements, args.seed)
    one = np.ones(1, np.float32)
    scatter = args.collective == "reduce_scatter"
    y = np.empty(x.size // args.world_size if scatter else x.size, np.float32)  # reused, as Gloo reuses its tensor
    times, hashes = [], []
    with Worker(args.aggregator, job=args.job, rank=args.rank, world_size=args.world_size, token=args.token,
                codec=args.codec, packet_elements=args.packet_elements, pool_size=args.pool, seed=args.seed,
                timeout=args.timeout, data_mac=args.data_mac, rounding=args.rounding) as w:
        for i in range(args.warmup + args.rounds):
            w.allreduce(one)  # barrier
            start = time.perf_counter()
            if scatter:
                w.reduce_scatter(x, out=y)
            else:
                w.allreduce(x, out=y)
            elapsed = time.perf_counter() - start
            if i >= args.warmup:
                times.append(elapsed)
                hashes.append(hashlib.sha256(y).hexdigest()[:16])  # hashes the buffer in place, no copy
        return {"rank": args.rank, "per_round_s": times, "hashes": hashes, "counters": w.counters()}


def command(aggregator: str, rank: int, world_size: int, elements: int, *, codec: str = codec_name(JobParams.codec),
            packet_elements: int = JobParams.packet_elements, pool: int = JobParams.pool_size, warmup: int = 1,
            rounds: int = 3, job: int = 1, seed: int = 1, timeout: float = WorkerTimers.timeout,
            data_mac: bool = JobParams.data_mac, collective: str = "allreduce",
            rounding: str = ROUNDINGS[0]) -> list[str]:
    """The argv of one rank (prefix it with `ip netns exec NAME` to run it in a namespace)."""
    return [sys.executable, "-m", "intml.testbed.rank", "--aggregator", aggregator, "--rank", str(rank),
            "--world-size", str(world_size), "--elements", str(elements), "--codec", codec,
            "--packet-elements", str(packet_elements), "--pool", str(pool), "--warmup", str(warmup),
            "--rounds", str(rounds), "--job", str(job), "--seed", str(seed), "--timeout", str(timeout),
            "--collective", collective, "--rounding", rounding, *(["--data-mac"] if data_mac else [])]


def codec_arg(text: str) -> str:
    """A switch codec's name, or a host codec's (run through the aggregator's host mode)."""
    if text not in CODEC_NAMES:
        try:
            host_codec(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(f"not {' or '.join(CODEC_NAMES)}, and {exc}") from None
    return text


def main(argv: list[str] | None = None) -> int:
    p = OneLineParser(prog="python -m intml.testbed.rank", description=__doc__)
    p.add_argument("--aggregator", required=True, help="host:port of the aggregator")
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world-size", type=positive(), required=True)
    p.add_argument("--elements", type=positive(), required=True)
    p.add_argument("--codec", type=codec_arg, default=codec_name(JobParams.codec),
                   help="a switch codec (cnat8, int32) or a host codec's name (uniform8: docs/codecs.md)")
    p.add_argument("--packet-elements", type=positive(), default=JobParams.packet_elements)
    p.add_argument("--pool", type=positive(), default=JobParams.pool_size)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--rounds", type=positive(), default=3)
    p.add_argument("--job", type=int, default=1)
    p.add_argument("--token", default=os.environ.get("INTML_TOKEN", ""),
                   help="the job's token (default: INTML_TOKEN, as the aggregator's; not on the command line of a "
                        "shared machine)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--timeout", type=positive(float), default=WorkerTimers.timeout)
    p.add_argument("--data-mac", action="store_true", help="the job's DATA and RESULT carry a SipHash tag")
    p.add_argument("--rounding", choices=ROUNDINGS, default=ROUNDINGS[0], help="C_nat's rounding (default stochastic)")
    p.add_argument("--collective", choices=COLLECTIVES, default="allreduce",
                   help="what each timed round runs (reduce_scatter: elements a multiple of the world size)")
    print(json.dumps(run(p.parse_args(argv))), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
