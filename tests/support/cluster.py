"""End-to-end test harness: a real aggregator process and real worker processes on 127.0.0.1.

* ``Aggregator`` / ``aggregator(...)``: starts ``python -m intml.aggregator --port 0 ...`` from the repository root,
  waits for its "listening on HOST:PORT cores K" line, answers ``stats()`` through an operator's STATS_REQUEST
  (MAC'd under its first token), and always kills the process (and its core processes) at teardown. It knows the
  tokens ``TOKENS`` (through --token-file) unless given others; ``tokens=()`` runs it open.
* ``Procs`` / ``run_procs(...)``: worker processes (multiprocessing, 'fork' by default) that report an
  ``Outcome`` through one Queue; waits are bounded and leftovers are killed on exit.

Everything is found relative to this file, so the tests run from any working directory.
"""

from __future__ import annotations

import contextlib
import json
import multiprocessing as mp
import os
import queue
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Self

REPO_ROOT = Path(__file__).resolve().parents[2]
from intml.aggregator.core import operator_request
from intml.protocol import keys, wire

HOST = "127.0.0.1"
ALL_JOBS = 0xFFFFFFFF
START_METHOD = os.environ.get("INTML_E2E_START_METHOD", "fork")
TOKENS = ("t", "right", "test-torch")  # the tokens the tests' workers use
STATS_REQUEST_SIZE = 16384  # an operator's request: the reply (every job) may be 3 times as large
OPERATOR_RANK = 0xFFFF
_LISTENING = re.compile(r"intml-aggregator listening on (\S+):(\d+) cores (\d+)")


def repo_env() -> dict[str, str]:
    """The environment for subprocesses: unbuffered output; they import the installed package."""
    env = dict(os.environ)
    env["PYTHONUNBUFFERED"] = "1"
    return env


def run_cli(*args: str, timeout: float = 60.0) -> subprocess.CompletedProcess:
    """Run ``python -m intml.aggregator ARGS`` to completion (for argument errors); text output captured."""
    return subprocess.run([sys.executable, "-m", "intml.aggregator", *args], cwd=REPO_ROOT, env=repo_env(),
                          capture_output=True, text=True, timeout=timeout, check=False)


def free_udp_port() -> int:
    """A UDP port on 127.0.0.1 that nobody listens on (bound, then released)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


class Aggregator:
    """A running ``python -m intml.aggregator`` process."""

    def __init__(self, *extra: str, cores: int = 1, idle_timeout: float | None = None,
                 startup_timeout: float = 60.0, tokens: tuple[str, ...] = TOKENS) -> None:
        self.cores = cores
        self.tokens = tokens or ("",)
        self.args = ["--host", HOST, "--port", "0", "--cores", str(cores)]
        self._token_path = None
        if tokens:
            fd, self._token_path = tempfile.mkstemp(prefix="intml-agg-", suffix=".tokens")
            with os.fdopen(fd, "w") as f:
                f.write("\n".join(tokens) + "\n")
            self.args += ["--token-file", self._token_path]
        if idle_timeout is not None:
            self.args += ["--idle-timeout", str(idle_timeout)]
        self.args += list(extra)
        self.startup_timeout = startup_timeout
        self.proc: subprocess.Popen | None = None
        self.port = 0
        fd, self._out_path = tempfile.mkstemp(prefix="intml-agg-", suffix=".out")
        os.close(fd)
        fd, self._err_path = tempfile.mkstemp(prefix="intml-agg-", suffix=".err")
        os.close(fd)

    @property
    def address(self) -> str:
        return f"{HOST}:{self.port}"

    def stdout(self) -> str:
        return Path(self._out_path).read_text(errors="replace")

    def stderr(self) -> str:
        return Path(self._err_path).read_text(errors="replace")

    def start(self) -> Aggregator:
        # O_APPEND files: the child writes at the end whatever we read; a pipe nobody drains could block it.
        env = repo_env()
        env.pop("INTML_TOKEN", None)  # the tokens are this object's
        with open(self._out_path, "ab") as out, open(self._err_path, "ab") as err:
            self.proc = subprocess.Popen([sys.executable, "-m", "intml.aggregator", *self.args], cwd=REPO_ROOT,
                                         env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=err,
                                         start_new_session=True)  # its own process group: cores die with it
        deadline = time.monotonic() + self.startup_timeout
        while True:
            match = _LISTENING.search(self.stdout())
            if match:
                self.port = int(match.group(2))
                assert int(match.group(3)) == self.cores, match.group(0)
                return self
            if self.proc.poll() is not None:
                self.stop()
                raise RuntimeError(f"aggregator exited with {self.proc.returncode} before listening:\n"
                                   f"{self.stderr()}")
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"aggregator did not print its listening line within {self.startup_timeout} s")
            time.sleep(0.02)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self) -> None:
        """Terminate the aggregator and every process of its group; kill whatever is left."""
        proc = self.proc
        if proc is None:
            return
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)  # the group we created: the --cores children too
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=5)

    def cleanup(self) -> None:
        self.stop()
        for path in filter(None, (self._out_path, self._err_path, self._token_path)):
            with contextlib.suppress(OSError):
                os.unlink(path)

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.cleanup()

    # ---- statistics -------------------------------------------------------------------------------------
    def stats(self, job: int = ALL_JOBS, timeout: float = 2.0, attempts: int = 3) -> list[dict]:
        """One STATS_REPLY per core (JSON after the header), core 0 first: the operator's view."""
        return operator_stats(self.port, self.cores, self.tokens[0], job, timeout, attempts)

    def job_ids(self) -> set[int]:
        """The jobs any core still lists."""
        return {int(j) for reply in self.stats() for j in reply["jobs"]}


def operator_stats(port: int, cores: int, token: str, job: int = ALL_JOBS, timeout: float = 2.0,
                   attempts: int = 3) -> list[dict]:
    """Each core's answer (JSON) to an operator's STATS_REQUEST (MAC'd under ``token``), core 0 first."""
    replies = []
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.bind((HOST, 0))
        for core in range(cores):
            target = (HOST, port + core)
            replies.append(_ask(s, lambda: operator_request(token, time.time_ns(), job, STATS_REQUEST_SIZE), target,
                                timeout, attempts))
    return replies


def _ask(s: socket.socket, request: Callable[[], bytes], target: tuple[str, int], timeout: float,
         attempts: int) -> dict:
    """Send a fresh ``request()`` (each is answered once) until a STATS_REPLY comes back."""
    for _ in range(attempts):
        s.sendto(request(), target)
        end = time.monotonic() + timeout
        while (left := end - time.monotonic()) > 0:
            s.settimeout(left)
            try:
                data, source = s.recvfrom(1 << 16)
            except TimeoutError:
                break
            if source == target and len(data) >= wire.HEADER_SIZE \
                    and data[wire.OFFSETS["type"]] == wire.MsgType.STATS_REPLY:
                return json.loads(data[wire.HEADER_SIZE:-keys.MAC_SIZE])
    raise AssertionError(f"no STATS_REPLY from {target[0]}:{target[1]} after {attempts} requests")


def join_over(sock: socket.socket, target: tuple[str, int], job: int, rank: int, *, token: str = TOKENS[0],
              timeout: float = 2.0, **params: int) -> bytes:
    """The JOIN handshake from a bound UDP socket (JOIN, CHALLENGE, the proved JOIN); returns the core's reply to
    the proved JOIN (a JOIN_ACK or an ERROR)."""
    header = {"type": int(wire.MsgType.JOIN), "job": job, "rank": rank}
    nonce = os.urandom(keys.NONCE_SIZE)
    sock.settimeout(timeout)
    sock.sendto(wire.pack_join(header, {**params, "nonce": nonce}), target)
    cookie = bytes(wire.unpack_challenge(sock.recv(1 << 16))[1]["cookie"])
    proved = wire.pack_join(header, {**params, "nonce": nonce, "cookie": cookie})
    sock.sendto(keys.seal(keys.token_key(token), proved, wire.JOIN_MAC), target)
    return sock.recv(1 << 16)


@contextlib.contextmanager
def aggregator(*extra: str, cores: int = 1, idle_timeout: float | None = None, tokens: tuple[str, ...] = TOKENS):
    agg = Aggregator(*extra, cores=cores, idle_timeout=idle_timeout, tokens=tokens)
    try:
        agg.start()
        yield agg
    finally:
        agg.cleanup()


# ---- worker processes ---------------------------------------------------------------------------------------
@dataclass
class Outcome:
    """What a worker process reported: its return value, or the exception it raised."""

    key: Any
    ok: bool
    value: Any = None
    exc_type: str = ""
    message: str = ""
    traceback: str = ""
    elapsed: float = 0.0

    def unwrap(self) -> Any:
        if not self.ok:
            raise AssertionError(f"worker {self.key!r} raised {self.exc_type}: {self.message}\n{self.traceback}")
        return self.value


def _child(q, key, fn: Callable, args: tuple, kwargs: dict) -> None:
    start = time.monotonic()
    try:
        value = fn(*args, **kwargs)
        q.put(Outcome(key, True, value, elapsed=time.monotonic() - start))
    except BaseException as exc:  # noqa: BLE001 -- report everything, including SystemExit
        q.put(Outcome(key, False, None, type(exc).__name__, str(exc), traceback.format_exc(),
                      time.monotonic() - start))


@dataclass
class Procs:
    """Worker processes that report one Outcome each through a Queue. Use as a context manager: every
    process still running at exit is killed."""

    start_method: str = START_METHOD
    ctx: Any = field(init=False)
    queue: Any = field(init=False)
    procs: dict = field(init=False, default_factory=dict)
    outcomes: dict = field(init=False, default_factory=dict)

    def __post_init__(self) -> None:
        self.ctx = mp.get_context(self.start_method)
        self.queue = self.ctx.Queue()

    def start(self, key: Any, fn: Callable, *args: Any, **kwargs: Any) -> None:
        if key in self.procs:
            raise ValueError(f"duplicate worker key {key!r}")
        p = self.ctx.Process(target=_child, args=(self.queue, key, fn, args, kwargs), daemon=True,
                             name=f"intml-e2e-{key}")
        p.start()
        self.procs[key] = p

    def kill(self, key: Any) -> None:
        p = self.procs[key]
        if p.is_alive():
            os.kill(p.pid, signal.SIGKILL)
        p.join(timeout=5)

    def collect(self, keys, timeout: float) -> dict[Any, Outcome]:
        """Wait (at most `timeout` s in all) for the outcomes of `keys`; a process that died without
        reporting, or one still silent at the deadline, is an AssertionError."""
        keys = list(keys)
        deadline = time.monotonic() + timeout
        died_at: dict[Any, float] = {}
        while missing := [k for k in keys if k not in self.outcomes]:
            try:
                outcome = self.queue.get(timeout=0.2)
                self.outcomes[outcome.key] = outcome
                continue
            except queue.Empty:
                pass
            now = time.monotonic()
            for k in missing:
                if self.procs[k].exitcode is not None:
                    died_at.setdefault(k, now)
                    if now - died_at[k] > 1.0:  # exited and its report (if any) would have arrived by now
                        raise AssertionError(f"worker {k!r} exited with code {self.procs[k].exitcode} "
                                             f"without reporting")
            if now > deadline:
                raise AssertionError(f"workers {missing!r} did not report within {timeout} s")
        for k in keys:
            self.procs[k].join(timeout=5)
        return {k: self.outcomes[k] for k in keys}

    def close(self) -> None:
        for p in self.procs.values():
            if p.is_alive():
                os.kill(p.pid, signal.SIGKILL)
        for p in self.procs.values():
            p.join(timeout=5)
        self.queue.close()
        self.queue.cancel_join_thread()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def run_procs(fn: Callable, arg_list: list[tuple], timeout: float = 60.0, start_method: str = START_METHOD,
              **kwargs: Any) -> list[Outcome]:
    """Run fn(*args, **kwargs) for each args in a process of its own (all at once); outcomes in order."""
    with Procs(start_method) as procs:
        for i, args in enumerate(arg_list):
            procs.start(i, fn, *args, **kwargs)
        outcomes = procs.collect(range(len(arg_list)), timeout)
    return [outcomes[i] for i in range(len(arg_list))]


def run_ok(fn: Callable, arg_list: list[tuple], timeout: float = 60.0, start_method: str = START_METHOD,
           **kwargs: Any) -> list[Any]:
    """run_procs, asserting that every process returned; their values in order."""
    return [o.unwrap() for o in run_procs(fn, arg_list, timeout, start_method, **kwargs)]
