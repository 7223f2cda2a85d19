"""`intml-testbed bench allreduce`: intml vs Gloo's ring allreduce on loopback, in one run.

Starts an aggregator and N worker processes, runs warm-up rounds then timed rounds (all ranks start each round
together, behind a barrier; a round lasts until the slowest rank has its result), and, when torch is installed,
times torch.distributed.all_reduce with Gloo on the same tensor size and prints Gloo time / intml time.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator

import numpy as np

from protocol.packet import HDR
from protocol.wire import Codec
from testbed.timing import emit

JOB = 1


@contextlib.contextmanager
def aggregator(cores: int, max_packet_elements: int, host: str = "127.0.0.1",
               prefix: list[str] | None = None) -> Iterator[int]:
    """Run `intml-aggregator --port 0` (optionally under a command prefix such as `ip netns exec NS`) and yield
    its base port; the process is always terminated on exit."""
    cmd = [*(prefix or []), sys.executable, "-m", "aggregator", "--host", host, "--port", "0", "--cores", str(cores),
           "--max-packet-elements", str(max_packet_elements), "--slots", str(max(64, (1 << 22) // max_packet_elements))]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        if "listening on" not in line:
            raise RuntimeError(f"aggregator did not start: {line!r} (exit code {proc.poll()})")
        yield int(line.split()[3].rsplit(":", 1)[1])
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _rank(rank: int, world: int, address: str, elements: int, codec: str, packet_elements: int, pool: int,
          warmup: int, rounds: int, barrier, results) -> None:
    from worker import Worker

    x = np.random.default_rng(rank).standard_normal(elements).astype(np.float32)
    try:
        with Worker(address, job=JOB, rank=rank, world_size=world, token="bench", codec=codec,
                    packet_elements=packet_elements, pool_size=pool, seed=1, timeout=60) as w:
            times = []
            for i in range(warmup + rounds):
                barrier.wait(timeout=120)
                start = time.perf_counter()
                w.allreduce(x)
                if i >= warmup:
                    times.append(time.perf_counter() - start)
            results.put((rank, times, w.counters()))
    except Exception as exc:  # report, so the parent fails with the reason instead of a barrier timeout
        results.put((rank, repr(exc), {}))
        barrier.abort()


def run_intml(workers: int, elements: int, codec: str, packet_elements: int, pool: int, cores: int, warmup: int,
              rounds: int, address: str | None = None) -> dict:
    """Median seconds per allreduce over `rounds` (each round timed by its slowest rank)."""
    ctx = mp.get_context("spawn")
    barrier, results = ctx.Barrier(workers), ctx.Queue()
    with contextlib.ExitStack() as stack:
        if address is None:
            address = f"127.0.0.1:{stack.enter_context(aggregator(cores, packet_elements))}"
        procs = [ctx.Process(target=_rank, args=(r, workers, address, elements, codec, packet_elements, pool,
                                                 warmup, rounds, barrier, results)) for r in range(workers)]
        for p in procs:
            p.start()
        try:
            reports = [results.get(timeout=600) for _ in procs]
        finally:
            for p in procs:
                p.join(timeout=10)
                if p.is_alive():
                    p.kill()
    failed = [f"rank {r}: {t}" for r, t, _ in reports if isinstance(t, str)]
    if failed:
        raise RuntimeError("intml benchmark failed: " + "; ".join(failed))
    per_round = np.max([t for _, t, _ in reports], axis=0)
    counters = {r: c for r, _, c in reports}
    width = Codec[codec.upper()].bytes_per_element
    chunks = -(-elements // packet_elements)
    return {
        "median_s": statistics.median(per_round.tolist()),
        "per_round_s": per_round.tolist(),
        "bytes_per_worker_each_way": elements * width + (chunks + min(pool, chunks)) * HDR,
        "retransmissions": sum(c["retransmissions"] for c in counters.values()),
    }


def run(workers: int, elements: int, codec: str, packet_elements: int, pool: int, cores: int, warmup: int,
        rounds: int, gloo: bool, as_json: bool) -> dict:
    intml = run_intml(workers, elements, codec, packet_elements, pool, cores, warmup, rounds)
    rows = [{"system": f"intml {codec}", "median_s": intml["median_s"], "ate_per_s": elements / intml["median_s"],
             "mb_per_worker": intml["bytes_per_worker_each_way"] / 1e6, "speedup_vs_gloo": float("nan")}]
    if gloo:
        try:
            from testbed.gloo import run_local
        except ImportError:
            gloo = False
    if gloo:
        ring = run_local(workers, elements, warmup=warmup, rounds=rounds)
        ratio = ring["median_s"] / intml["median_s"]
        rows[0]["speedup_vs_gloo"] = ratio
        rows.append({"system": "gloo ring (anchor)", "median_s": ring["median_s"],
                     "ate_per_s": elements / ring["median_s"], "mb_per_worker": ring["bytes_per_worker"] / 1e6,
                     "speedup_vs_gloo": 1.0})
    emit(rows, as_json, "allreduce on loopback",
         [("system", "system", ""), ("median_s", "median s", ".4f"), ("ate_per_s", "ATE/s", ".3e"),
          ("mb_per_worker", "MB/worker/way", ".1f"), ("speedup_vs_gloo", "Gloo/intml", ".2f")],
         {"workers": workers, "elements": elements, "packet_elements": packet_elements, "pool": pool,
          "cores": cores, "rounds": rounds, "retransmissions": intml["retransmissions"]})
    return {"rows": rows}
