"""The suite's markers, and a guard that holds the in-process tests to being in-process.

``make check`` runs ``-m "not process and not netns and not torch and not gpu and not slow"``; ``make test`` runs
everything. A test that starts a process or uses a real network socket must say so with ``process`` (or
``netns``): while a test without either runs (setup, call and teardown), an audit hook turns a fork, an exec, a
subprocess or an IP socket's bind/connect/send into an error that names the missing marker, so a wrong mark fails
in ``make test`` and not only as a slow ``make check``. (Unix-domain sockets pass: the asyncio loop's self-pipe.)
"""

from __future__ import annotations

import socket
import sys
from collections.abc import Iterator

import pytest

MARKERS = {
    "process": "starts processes (aggregator, ranks, CLIs) or uses real sockets",
    "netns": "builds network namespaces (needs root, iproute2, nftables)",
    "torch": "imports torch (the PyTorch backend and hook)",
    "gpu": "runs the CUDA kernels, on a device or on numba's CUDA simulator",
    "slow": "in-process but takes seconds; left out of make check",
}
OUT_OF_PROCESS = ("process", "netns")
_PROCESS_EVENTS = frozenset({"os.fork", "os.forkpty", "os.exec", "os.posix_spawn", "os.spawn", "os.system",
                             "subprocess.Popen"})
_SOCKET_EVENTS = frozenset({"socket.bind", "socket.connect", "socket.sendto", "socket.sendmsg"})
_guarded: str | None = None  # the node id of the running unmarked test, while it runs


class UnmarkedIO(RuntimeError):
    """An unmarked (in-process) test started a process or used a network socket."""


def _audit(event: str, args: tuple) -> None:
    if _guarded is None:
        return
    if event in _PROCESS_EVENTS or (event in _SOCKET_EVENTS and getattr(args[0], "family", None) != socket.AF_UNIX):
        raise UnmarkedIO(f"{_guarded} triggered {event}: mark it pytest.mark.process (tests/conftest.py)")


def pytest_sessionstart(session: pytest.Session) -> None:
    """In xdist's controller, before its workers start: compile the shared kernels once (support/warm.py), then
    start the P4 programs' and the bounds-checked kernels' compiles in the background (support/background.py)."""
    config = session.config
    if hasattr(config, "workerinput") or not config.getoption("numprocesses", None):
        return
    from support.checked import warm_in_background
    from support.p4build import compile_in_background
    from support.warm import warm_cache

    line = warm_cache()
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        reporter.write_line(line)
    if not config.getoption("markexpr"):  # a run of every test (make check leaves the P4 ones out)
        # after the warm-up, whose children take both cores
        config._intml_background = [c for c in (compile_in_background(), warm_in_background()) if c is not None]


def pytest_sessionfinish(session: pytest.Session) -> None:
    children = getattr(session.config, "_intml_background", ())
    if children:
        from support.background import stop

        for child in children:
            stop(child)


def pytest_configure(config: pytest.Config) -> None:
    for name, doc in MARKERS.items():
        config.addinivalue_line("markers", f"{name}: {doc}")
    if not getattr(sys, "_intml_test_audit", False):  # audit hooks cannot be removed: install one per interpreter
        sys.addaudithook(_audit)
        sys._intml_test_audit = True


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    global _guarded
    if not any(item.get_closest_marker(m) for m in OUT_OF_PROCESS):
        _guarded = item.nodeid
    try:
        return (yield)
    finally:
        _guarded = None
