"""Running the ranks of a benchmark as separate programs, each printing one JSON line.

Ranks are programs with explicit addresses rather than multiprocessing children so that the same ranks run on
127.0.0.1 or inside network namespaces (the caller prefixes an argv with `ip netns exec NAME`).
"""

from __future__ import annotations

import json
import os
import secrets
import socket
import subprocess
import tempfile
import time
from pathlib import Path


def run_token() -> str:
    """This run's job token: INTML_TOKEN if the caller set one, else a fresh one, put into INTML_TOKEN so that the
    aggregators this run starts and its ranks (rank_env) share it."""
    return os.environ.setdefault("INTML_TOKEN", secrets.token_hex(16))


def rank_env() -> dict[str, str]:
    """The environment of a rank: this one (with the run's INTML_TOKEN), with one OpenMP thread. Ranks import the
    installed package."""
    run_token()
    env = dict(os.environ)
    # N ranks share the machine's 2 cores; torch's default of one intra-op thread per core would
    # oversubscribe them, and idle OpenMP threads spinning would steal CPU from the collective.
    env["OMP_NUM_THREADS"] = "1"
    return env


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (a rendezvous binds it shortly after)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def slowest_per_round(reports: list[dict]) -> list[float]:
    """Each round's seconds at its slowest rank: a round lasts until every rank has its result."""
    return [max(times) for times in zip(*(report["per_round_s"] for report in reports))]


def _tail(path: Path, chars: int = 2000) -> str:
    return path.read_text(errors="replace")[-chars:].strip()


def run_ranks(argvs: list[list[str]], what: str, timeout: float) -> list[dict]:
    """Start every argv, wait for all, and return each rank's last stdout line parsed as JSON.

    Raises RuntimeError with the failing ranks' stderr tails if any rank fails (at the first failure: its
    peers would only wait for it), and TimeoutError past `timeout` seconds; either way every rank still
    running is killed.
    """
    env = rank_env()
    with tempfile.TemporaryDirectory(prefix="intml-ranks-") as tmp:
        logs = [(Path(tmp, f"{rank}.out"), Path(tmp, f"{rank}.err")) for rank in range(len(argvs))]
        procs = []
        try:
            for argv, (out, err) in zip(argvs, logs):
                with out.open("w") as stdout, err.open("w") as stderr:  # files, so a full pipe cannot block a rank
                    procs.append(subprocess.Popen(argv, env=env, stdout=stdout, stderr=stderr))
            deadline = time.monotonic() + timeout
            while True:
                codes = [proc.poll() for proc in procs]
                if None not in codes or any(code not in (None, 0) for code in codes):
                    break
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{what}: {len(argvs)} ranks took longer than {timeout} s")
                time.sleep(0.05)
        finally:
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
                proc.wait()
        failed = [rank for rank, code in enumerate(codes) if code not in (None, 0)]  # ranks killed here excluded
        if failed:
            raise RuntimeError("\n".join(f"{what} rank {rank} failed (exit code {codes[rank]}):\n"
                                         f"{_tail(logs[rank][1])}" for rank in failed))
        return [json.loads(out.read_text().strip().splitlines()[-1]) for out, _ in logs]
