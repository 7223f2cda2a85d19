"""`intml-testbed bench allreduce`: intml vs Gloo's ring allreduce on loopback, in one run.

Starts an aggregator and N worker processes, runs warm-up rounds then timed rounds (all ranks start each round
together, behind a barrier; a round lasts until the slowest rank has its result), and, when torch is installed,
times torch.distributed.all_reduce with Gloo on the same tensor size and prints Gloo time / intml time.
"""

from __future__ import annotations

import contextlib
import os
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Iterator

from intml.protocol import wire
from intml.protocol.job import CODEC_NAMES, ROUNDINGS
from intml.worker.traffic import intml_bytes, intml_packets
from intml.testbed import rank
from intml.testbed.procs import run_ranks, run_token, slowest_per_round
from intml.testbed.timing import emit

JOB = 1


def loopback_packet_elements(codec: str) -> int:
    """The default packet size on loopback: the largest datagram. Per-datagram costs (system calls, the stack,
    the kernels' per-packet work) then weigh least, and loopback's 64 KiB MTU never fragments it."""
    return wire.max_packet_elements(CODEC_NAMES[codec])


def aggregator_slots(max_packet_elements: int) -> int:
    """Slot rows per core of the benchmarks' aggregator: about 4M elements of rows, at least 64."""
    return max(64, (1 << 22) // max_packet_elements)


def pool_problem(pool: int, cores: int, max_packet_elements: int) -> str | None:
    """Why the benchmarks' aggregator (``cores`` cores of aggregator_slots rows) cannot hold a job of ``pool``
    slots, in one line naming the options that would fit; None if it can."""
    slots = aggregator_slots(max_packet_elements)
    if -(-pool // cores) <= slots:  # a core holds the job's slots s % cores == core: ceil(pool / cores) rows
        return None
    return (f"a pool of {pool} needs {-(-pool // cores)} slot rows per aggregator core, and at "
            f"{max_packet_elements} elements per packet each of the {cores} cores has {slots}: use at most "
            f"--pool {slots * cores}, more --cores or fewer --packet-elements")


class AggregatorError(RuntimeError):
    """The aggregator exited before it listened; the message is its last line on stderr."""


@contextlib.contextmanager
def aggregator(cores: int, max_packet_elements: int, host: str = "127.0.0.1",
               prefix: list[str] | None = None, multicast: str | None = None, multicast_ttl: int = 1,
               extra: tuple[str, ...] = ()) -> Iterator[int]:
    """Run `intml-aggregator --port 0` (optionally under a command prefix such as `ip netns exec NS`, and with
    results multicast to `multicast`; ``extra``: more of its options) and yield its base port; the process is
    always terminated on exit. It accepts the run's token (procs.run_token, in INTML_TOKEN), which the ranks get
    through rank_env."""
    cmd = [*(prefix or []), sys.executable, "-m", "intml.aggregator", "--host", host, "--port", "0", "--cores", str(cores),
           "--max-packet-elements", str(max_packet_elements), "--slots", str(aggregator_slots(max_packet_elements)),
           *extra]
    if multicast:
        cmd += ["--multicast", multicast, "--multicast-ttl", str(multicast_ttl)]
    # its stderr goes to a file (not a pipe, which nothing reads while it runs): a start failure becomes one line,
    # and whatever it says later is passed on when it stops
    errors = tempfile.TemporaryFile("w+")
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=errors, text=True,
                            env={**os.environ, "INTML_TOKEN": run_token()})
    started = False
    try:
        line = proc.stdout.readline()
        if "listening on" not in line:
            proc.wait()
            errors.seek(0)
            said = errors.read().strip().splitlines()
            raise AggregatorError(f"the aggregator did not start (exit code {proc.returncode}): "
                                  f"{said[-1] if said else 'it printed nothing'}")
        started = True
        yield int(line.split()[3].rsplit(":", 1)[1])
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        if started:
            errors.seek(0)
            sys.stderr.write(errors.read())
        errors.close()


def run_ranks_intml(aggregators: list[str], elements: int, codec: str, packet_elements: int, pool: int,
                    warmup: int, rounds: int, prefixes: list[list[str]] | None = None, job: int = JOB,
                    timeout: float = 600.0, data_mac: bool = False, collective: str = "allreduce",
                    rounding: str = ROUNDINGS[0]) -> dict:
    """Run one testbed.rank per entry of `aggregators` (the address rank r sends to), each optionally under a
    command prefix; round i takes as long as its slowest rank. A reduce-scatter's hashes are every rank's (of its
    own shard), in rank order, and its ranks are not compared (identical_across_ranks is true)."""
    workers = len(aggregators)
    argvs = [[*(prefixes[r] if prefixes else []),
              *rank.command(aggregators[r], r, workers, elements, codec=codec, packet_elements=packet_elements,
                            pool=pool, warmup=warmup, rounds=rounds, job=job,
                            data_mac=data_mac, collective=collective, rounding=rounding)] for r in range(workers)]
    reports = run_ranks(argvs, "intml", timeout)
    per_round = slowest_per_round(reports)
    return {
        "median_s": statistics.median(per_round),
        "per_round_s": per_round,
        # a host codec's packages vary in size: its payload is counted as the float32 tensor it stands for
        "bytes_per_worker_each_way": intml_bytes(elements, codec if codec in CODEC_NAMES else "int32",
                                                 packet_elements, pool),
        "packets_per_worker_each_way": intml_packets(elements, packet_elements, pool),
        "retransmissions": sum(r["counters"]["retransmissions"] + r["counters"]["fast_retransmissions"]
                               for r in reports),
        "hashes": [r["hashes"] for r in reports] if collective == "reduce_scatter" else reports[0]["hashes"],
        "identical_across_ranks": collective == "reduce_scatter" or all(r["hashes"] == reports[0]["hashes"]
                                                                        for r in reports),
    }


def run_intml(workers: int, elements: int, codec: str, packet_elements: int, pool: int, cores: int, warmup: int,
              rounds: int, multicast: str | None, data_mac: bool = False, rounding: str = ROUNDINGS[0]) -> dict:
    """intml on loopback: an aggregator and `workers` ranks on 127.0.0.1 (``data_mac``: the job's DATA and
    RESULT carry the SipHash tag; ``rounding``: C_nat's, at the workers and the aggregator)."""
    with aggregator(cores, packet_elements, multicast=multicast) as port:
        return run_ranks_intml([f"127.0.0.1:{port}"] * workers, elements, codec, packet_elements, pool, warmup,
                               rounds, data_mac=data_mac, rounding=rounding)


def run(workers: int, elements: int, codec: str, packet_elements: int, pool: int, cores: int, warmup: int,
        rounds: int, gloo: bool, as_json: bool, multicast: str | None = None,
        roundings: tuple[str, ...] = ROUNDINGS[:1]) -> dict:
    """One intml row per rounding (the seed 002 comparison: stochastic against nearest C_nat), then Gloo's."""
    runs = [run_intml(workers, elements, codec, packet_elements, pool, cores, warmup, rounds, multicast,
                      rounding=rounding) for rounding in roundings]
    rows = [{"system": f"intml {codec}" + ("" if rounding == ROUNDINGS[0] else f" {rounding}"),
             "median_s": intml["median_s"], "ate_per_s": elements / intml["median_s"],
             "mb_per_worker": intml["bytes_per_worker_each_way"] / 1e6, "speedup_vs_gloo": float("nan")}
            for rounding, intml in zip(roundings, runs)]
    if gloo:
        try:
            from intml.testbed.gloo import run_local
        except ImportError:
            gloo = False
    if gloo:
        ring = run_local(workers, elements, warmup=warmup, rounds=rounds)
        for row in rows:
            row["speedup_vs_gloo"] = ring["median_s"] / row["median_s"]
        rows.append({"system": "gloo ring (anchor)", "median_s": ring["median_s"],
                     "ate_per_s": elements / ring["median_s"], "mb_per_worker": ring["bytes_per_worker"] / 1e6,
                     "speedup_vs_gloo": 1.0})
    if not all(intml["identical_across_ranks"] for intml in runs):
        raise RuntimeError("intml ranks disagree on the result: the allreduce is not bit-identical")
    emit(rows, as_json, "allreduce on loopback",
         [("system", "system", ""), ("median_s", "median s", ".4f"), ("ate_per_s", "ATE/s", ".3e"),
          ("mb_per_worker", "MB/worker/way", ".1f"), ("speedup_vs_gloo", "Gloo/intml", ".2f")],
         {"workers": workers, "elements": elements, "packet_elements": packet_elements, "pool": pool,
          "cores": cores, "results": f"multicast {multicast}" if multicast else "unicast", "rounds": rounds,
          "retransmissions": sum(intml["retransmissions"] for intml in runs)})
    return {"rows": rows}
