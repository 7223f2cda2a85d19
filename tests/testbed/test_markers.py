"""tests/conftest.py's guard: a test without the ``process`` (or ``netns``) marker that forks, runs a subprocess or
binds, connects or sends on an IP socket fails, naming itself and the marker; the same test marked ``process``
passes, and so do Unix-domain socket pairs (the asyncio loop's self-pipe). Run in a fresh pytest process, as the
audit hook is installed once per interpreter."""

from __future__ import annotations

from pathlib import Path

import pytest

pytestmark = pytest.mark.process

pytest_plugins = ["pytester"]

CONFTEST = Path(__file__).resolve().parents[1] / "conftest.py"

INNER = '''
import os
import socket
import subprocess
import sys

import pytest


def bind():
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.bind(("127.0.0.1", 0))


def test_unmarked_bind():
    bind()


@pytest.mark.process
def test_marked_bind():
    bind()


def test_unmarked_subprocess():
    subprocess.run([sys.executable, "-c", "pass"], check=True)


def test_unmarked_fork():
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    os.waitpid(pid, 0)


@pytest.mark.netns
def test_netns_marked_subprocess():
    subprocess.run([sys.executable, "-c", "pass"], check=True)


def test_unmarked_unix_socketpair():
    a, b = socket.socketpair()
    with a, b:
        a.sendall(b"x")
        assert b.recv(1) == b"x"


@pytest.mark.slow
def test_slow_is_declared():
    pass
'''


def test_unmarked_io_fails_and_names_the_marker(pytester: pytest.Pytester) -> None:
    pytester.makeconftest(CONFTEST.read_text())
    pytester.makepyfile(test_inner=INNER)
    result = pytester.runpytest_subprocess("--strict-markers", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=4, failed=3)
    for name, event in [("test_unmarked_bind", "socket.bind"), ("test_unmarked_subprocess", "subprocess.Popen"),
                        ("test_unmarked_fork", "os.fork")]:
        result.stdout.fnmatch_lines([f"*test_inner.py::{name} triggered {event}: mark it pytest.mark.process*"])


def test_an_undeclared_marker_is_an_error(pytester: pytest.Pytester) -> None:
    pytester.makeconftest(CONFTEST.read_text())
    pytester.makepyfile(test_inner="import pytest\n\n@pytest.mark.procss\ndef test_typo():\n    pass\n")
    result = pytester.runpytest_subprocess("--strict-markers", "-p", "no:cacheprovider")
    assert result.ret != 0
    result.stdout.fnmatch_lines(["*'procss' not found in `markers` configuration option*"])
