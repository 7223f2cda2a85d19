"""Compile the kernels that most test files share, once, before the test workers start.

On a cold Numba cache (a fresh clone) each xdist worker, and each aggregator that a test starts meanwhile, compiled
the data plane's kernels for itself: ``process_burst`` alone costs about 35 s of CPU per process. Two children
compile disjoint halves into Numba's cache (``cache=True`` kernels), one per core; every process after them loads
the machine code from the cache. ``tests/conftest.py`` runs ``warm_cache`` in the xdist controller, and the
Makefile's install runs it while pip installs the optional extras (pip leaves the second core idle then).

``python -m support.warm``, in tests/, runs ``warm_cache``; ``python -m support.warm aggregator|worker``
runs one part in this process.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from intml.protocol.burst import Burst


def aggregator() -> None:
    """The data plane (process_burst, burstio's receive and send kernels), the leaf's kernel, then host mode at
    both ends (its JOINs pass through process_burst: in this process, it is in the cache by then)."""
    from support.harness import Network

    from intml.aggregator.dataplane import warm_up
    from intml.aggregator.leafspine import leaf_core

    warm_up(64, 64)
    leaf_core(rows=2, max_elements=8).datapath.process(_junk(), 0.0)
    Network(2, codec="uniform8", packet_elements=64, pool_size=2).allreduce([np.ones(100, np.float32)] * 2)


def worker() -> None:
    """The worker's engine kernels (start, receive, timer) for the switch codecs, then the spine's kernel."""
    from support.harness import agg_addr, engine_receive, engine_start, engine_timer

    from intml.aggregator.leafspine import SpineCore
    from intml.protocol.codec import Codec
    from intml.protocol.packet import HDR
    from intml.worker.engine import StreamEngine

    for codec in (Codec.CNAT8, Codec.INT32):
        engine = StreamEngine(job=1, rank=0, world_size=2, codec=codec, packet_elements=64, pool_size=2, seed=1,
                              agg_addrs=[agg_addr()], rto=0.02, min_rto=0.005, max_rto=1.0)
        engine_start(engine, np.ones(300, np.float32), 0.0)
        engine_receive(engine, [(bytes(HDR), agg_addr())], 0.0)
        engine_timer(engine, 1.0)
    SpineCore(rows=2, max_elements=8).process(_junk(), 0.0)


def _junk() -> Burst:
    """A burst of one datagram that no job owns: a kernel compiles, drops it and counts it."""
    from support.harness import agg_addr

    from intml.protocol.burst import Burst
    from intml.protocol.packet import HDR

    junk = Burst.rows_of(1, HDR)
    junk.fill([(bytes(HDR), agg_addr(1))])
    return junk


TIMEOUT = 900.0  # s: four times a cold compile on a loaded machine; a child still busy then is killed


def _finish(child: subprocess.Popen, deadline: float) -> str:
    """The child's stderr once it exits (read while waiting: a full pipe never blocks it), killed at deadline."""
    try:
        return child.communicate(timeout=max(0.0, deadline - time.monotonic()))[1]
    except subprocess.TimeoutExpired:
        child.kill()
        return child.communicate()[1] + f"\nstill compiling after {TIMEOUT:.0f} s: killed"


PARTS = {"aggregator": aggregator, "worker": worker}


def warm_cache() -> str:
    """Run every part, each in its own child, and wait for them. Returns a line for the session's header."""
    start = time.monotonic()
    tests = Path(__file__).resolve().parents[1]
    children = {part: subprocess.Popen([sys.executable, "-m", "support.warm", part], cwd=tests,
                                       stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
                for part in PARTS}
    errors = {part: _finish(child, start + TIMEOUT) for part, child in children.items()}
    failed = [f"{part}: {errors[part].strip().splitlines()[-1:]}" for part, child in children.items()
              if child.returncode != 0]
    if failed:  # the tests then compile what they need themselves (slower, not wrong): say why
        return f"Numba cache warm-up failed ({'; '.join(failed)})"
    return f"Numba cache warmed in {time.monotonic() - start:.1f} s (tests/support/warm.py)"


if __name__ == "__main__":
    if len(sys.argv) > 1:
        PARTS[sys.argv[1]]()
    else:
        print(warm_cache())
