"""The benchmark anchor: torch.distributed.all_reduce with the Gloo backend (a ring allreduce over TCP), or its
reduce_scatter_tensor (``collective="reduce_scatter"``: the ring's first half; works on CPU in torch 2.13).

Each rank is its own process started from `command()`, with explicit addresses, so the same ranks can run on
127.0.0.1 (`run_local`) or later in network namespaces (a caller wraps the argv in `ip netns exec NAME ...`).
A rank prints one JSON line: {"rank": r, "per_round_s": [...]}.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import time
from datetime import timedelta
from typing import TYPE_CHECKING

from intml.testbed.procs import free_port, run_ranks, slowest_per_round
from intml.worker.traffic import ring_bytes

if TYPE_CHECKING:  # torch is imported lazily: it is an optional extra of the package
    import torch

# Bounds every collective and the rendezvous, so a rank whose peer died fails instead of waiting
# for Gloo's default of 30 minutes.
GROUP_TIMEOUT = timedelta(seconds=300)

# Inputs are small integers (i % PERIOD + rank), so every float32 sum is exact in any order and the
# result can be compared bit for bit.
PERIOD = 17


def rank_input(rank: int, elements: int) -> torch.Tensor:
    """The float32 tensor rank `rank` contributes: element i is i % PERIOD + rank."""
    import torch

    return torch.arange(elements, dtype=torch.int32).remainder_(PERIOD).add_(rank).to(torch.float32)


def check_sum(result: torch.Tensor, world_size: int, shard: int | None = None) -> None:
    """Raise RuntimeError unless `result` is exactly the sum of rank_input(r, len) over r < world_size (or, given
    ``shard``, that sum's shard of a reduce-scatter: its elements shard * len .. (shard + 1) * len)."""
    import torch

    n = result.numel()
    start = 0 if shard is None else shard * n
    expected = rank_input(0, start + n)[start:].mul_(world_size).add_(world_size * (world_size - 1) // 2)
    if not torch.equal(result, expected):
        wrong = torch.nonzero(result != expected)[0].item()
        raise RuntimeError(
            f"all_reduce result wrong at element {wrong}: got {result[wrong].item()}, "
            f"expected {expected[wrong].item()} (world_size {world_size})"
        )


def rank_main(
    rank: int,
    world_size: int,
    master_addr: str,
    master_port: int,
    elements: int,
    warmup: int,
    rounds: int,
    ifname: str | None = None,
    collective: str = "allreduce",
) -> list[float]:
    """Run one rank: check the first all_reduce (or reduce_scatter_tensor: ``collective="reduce_scatter"``,
    elements a multiple of world_size), then return the seconds of each of `rounds` timed ones.

    `warmup` untimed calls come first; every timed call is preceded by a barrier so the ranks start together.
    ifname sets GLOO_SOCKET_IFNAME, which picks the interface Gloo binds (needed in namespaces).
    """
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"need 0 <= rank < world_size, got rank {rank}, world_size {world_size}")
    if elements < 1 or warmup < 0 or rounds < 1:
        raise ValueError(f"need elements >= 1, warmup >= 0, rounds >= 1; got {elements}, {warmup}, {rounds}")
    if ifname is not None:
        os.environ["GLOO_SOCKET_IFNAME"] = ifname  # read by Gloo when the process group is created

    import torch.distributed as dist

    dist.init_process_group(
        "gloo",
        init_method=f"tcp://{master_addr}:{master_port}",
        rank=rank,
        world_size=world_size,
        timeout=GROUP_TIMEOUT,
    )
    try:
        inputs = rank_input(rank, elements)
        tensor = inputs.clone()
        if collective == "reduce_scatter":
            import torch

            shard = torch.empty(elements // world_size)

            def reduce():
                dist.reduce_scatter_tensor(shard, tensor)

            reduce()
            check_sum(shard, world_size, rank)
        else:
            def reduce():
                dist.all_reduce(tensor)

            reduce()
            check_sum(tensor, world_size)
        times = []
        for call in range(warmup + rounds):
            tensor.copy_(inputs)  # all_reduce is in place: reset so repeated sums cannot overflow to inf
            dist.barrier()
            start = time.perf_counter()
            reduce()
            if call >= warmup:
                times.append(time.perf_counter() - start)
        return times
    finally:
        dist.destroy_process_group()


def command(
    rank: int,
    world_size: int,
    master_addr: str,
    master_port: int,
    elements: int,
    warmup: int,
    rounds: int,
    ifname: str | None = None,
    collective: str = "allreduce",
) -> list[str]:
    """The argv that runs one rank (so a caller can wrap it, e.g. in `ip netns exec NAME ...`)."""
    argv = [
        sys.executable, "-m", "intml.testbed.gloo",
        "--rank", str(rank),
        "--world-size", str(world_size),
        "--master-addr", master_addr,
        "--master-port", str(master_port),
        "--elements", str(elements),
        "--warmup", str(warmup),
        "--rounds", str(rounds),
        "--collective", collective,
    ]  # fmt: skip
    if ifname is not None:
        argv += ["--ifname", ifname]
    return argv


def run_local(world_size: int, elements: int, warmup: int = 2, rounds: int = 5, timeout: float = 300.0) -> dict:
    """Run world_size ranks on 127.0.0.1 and summarise; round i takes as long as its slowest rank.

    Raises RuntimeError with the failing ranks' stderr tails if any rank fails, and TimeoutError if the whole
    run takes longer than `timeout` seconds; either way every rank still running is killed.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    port = free_port()
    # "lo" keeps Gloo's traffic on loopback instead of whatever interface the hostname resolves to.
    argvs = [command(rank, world_size, "127.0.0.1", port, elements, warmup, rounds, ifname="lo")
             for rank in range(world_size)]
    return summarize(run_ranks(argvs, "gloo", timeout), elements)


def summarize(reports: list[dict], elements: int, collective: str = "allreduce") -> dict:
    """Median over rounds, where a round takes as long as its slowest rank."""
    per_round = slowest_per_round(reports)
    world_size = len(reports)
    return {
        "world_size": world_size,
        "elements": elements,
        "rounds": len(per_round),
        "per_round_s": per_round,
        "median_s": statistics.median(per_round),
        # float32; a ring reduce-scatter is the ring allreduce's first half
        "bytes_per_worker": ring_bytes(elements, world_size) / (2 if collective == "reduce_scatter" else 1),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="One rank of a Gloo all_reduce benchmark; prints one JSON line.")
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--world-size", type=int, required=True)
    parser.add_argument("--master-addr", required=True)
    parser.add_argument("--master-port", type=int, required=True)
    parser.add_argument("--elements", type=int, required=True)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--ifname", help="interface Gloo binds (GLOO_SOCKET_IFNAME)")
    parser.add_argument("--collective", choices=("allreduce", "reduce_scatter"), default="allreduce")
    args = parser.parse_args(argv)
    times = rank_main(
        args.rank,
        args.world_size,
        args.master_addr,
        args.master_port,
        args.elements,
        args.warmup,
        args.rounds,
        args.ifname,
        args.collective,
    )
    print(json.dumps({"rank": args.rank, "per_round_s": times}), flush=True)


if __name__ == "__main__":
    main()
