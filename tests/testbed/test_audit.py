"""`intml-testbed audit`: a short run against a live aggregator holds everywhere, and its fuzz campaign runs with
bounds checking and counts no crash."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from support.checked import warmed

from intml.testbed import audit

pytestmark = [pytest.mark.process]


def test_a_short_audit_holds(capsys):
    assert audit.run(0, True, pools=(1, 64)) == 0
    report = json.loads(capsys.readouterr().out)
    outcomes = {row["check"]: row["outcome"] for row in report["rows"]}
    assert len(outcomes) == 10 and set(outcomes.values()) <= {"held", "skipped"}, report
    assert outcomes["two tenants, same job id"] == "held"
    assert report["seconds"] < 120


def test_the_fuzz_campaign_is_bounds_checked_and_counts_crashes():
    with warmed():  # the session's background compile of the checked kernels, if it runs, has finished
        stats = audit.fuzz_checked(4000, seed=3)
    assert stats["boundscheck"] and stats["crashes"] == 0, stats.get("first_crash")
    assert stats["worker_datagrams"] + stats["aggregator_datagrams"] >= 4000
    assert stats["worker_results"] > 0 and stats["aggregator_completions"] > 0  # it reached the accepting paths


def test_the_worker_forgery_property_holds_bounds_checked():
    """tests/worker/test_forgery.py's in-bounds property, in a child whose Numba compiles every kernel with bounds
    checking. It runs after the campaign above (a file's tests run in order), which compiled the same kernels into
    the checked cache they share: the child loads them, where alone it would compile them again (40 s of CPU)."""
    forgery = Path(__file__).parents[1] / "worker" / "test_forgery.py"
    proc = subprocess.run([sys.executable, "-m", "pytest", str(forgery), "-q", "-x", "-p", "no:cacheprovider",
                           "-k", "in_bounds_when_checked"], cwd=forgery.parent, env=audit.boundscheck_env(),
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0 and "1 passed" in proc.stdout, proc.stdout[-4000:] + proc.stderr[-2000:]


def test_fuzz_counts_an_exception_as_a_crash(monkeypatch):
    """The campaign's crash counter can fire: a receive path that raises is counted, not fatal."""
    from intml.worker.engine import StreamEngine

    def broken(self, rx, now):
        raise IndexError("index is out of bounds")

    monkeypatch.setattr(StreamEngine, "receive", broken)
    stats = audit.fuzz_receive_paths(600, seed=1)
    assert stats["crashes"] > 0 and "IndexError" in stats["first_crash"]


def test_audit_rejects_a_bad_pool_in_one_line():
    proc = subprocess.run([sys.executable, "-m", "intml.testbed", "audit", "--pools", "0"], capture_output=True,
                          text=True, timeout=60, check=False)
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
