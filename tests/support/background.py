"""Children that the suite starts at its beginning and that run in the cores' idle time: the suite leaves part of
the two cores idle while its tests wait on sockets and timers (about 15% of a fresh clone's ``make test``). Each
child runs at the lowest CPU priority in a session of its own, so that the session's end can kill it with whatever
it started (``stop``). A test that needs a child's work waits for it (a file lock that the child holds), its own
core then free for the child."""

from __future__ import annotations

import os
import signal
import subprocess


def start(args: list[str], cwd: str | os.PathLike | None = None, env: dict[str, str] | None = None) \
        -> subprocess.Popen:
    """``args`` at nice 19, in a new session, its output discarded."""
    return subprocess.Popen(["nice", "-n", "19", *args], cwd=cwd, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)


def stop(child: subprocess.Popen) -> None:
    """Kill the child's process group if it still runs, and reap it."""
    if child.poll() is None:
        os.killpg(child.pid, signal.SIGKILL)
    child.wait()
