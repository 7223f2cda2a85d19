"""The bounds-checked kernels' Numba cache (``testbed.audit.boundscheck_env``), compiled in the cores' idle time.

The audit's fuzz campaign and the worker's forgery property run in children whose Numba compiles every kernel with
bounds checking, into a cache of their own: about 60 s of CPU on a fresh clone, almost all of the campaign's time.
``warm_in_background`` starts a short campaign (it reaches every receive path's kernels) at the session's beginning
(support/background.py) under a lock; the campaign's test takes the lock first (``warmed``), so it waits for that
compile instead of compiling beside it. Either may get the lock first: the second then loads the cache."""

from __future__ import annotations

import fcntl
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from support.background import start

from intml.testbed import audit

CAMPAIGN = ("100", "3")  # datagrams and seed: enough to reach every receive path's kernels


def _lock() -> Path:
    cache = Path(audit.boundscheck_env()["NUMBA_CACHE_DIR"])
    cache.mkdir(parents=True, exist_ok=True)
    return cache / "warm.lock"


def warm_in_background() -> subprocess.Popen:
    """A short checked campaign at the lowest priority, holding the lock (util-linux ``flock``)."""
    return start(["flock", str(_lock()), sys.executable, "-m", "intml.testbed.audit", *CAMPAIGN],
                 env=audit.boundscheck_env())


@contextmanager
def warmed() -> Iterator[None]:
    """Held while the caller runs checked kernels: the background compile, if it runs, has finished first."""
    with _lock().open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield
