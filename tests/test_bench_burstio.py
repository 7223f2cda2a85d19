"""`intml-testbed bench burstio`: its JSON report, with the plain-socket anchor in the same run, and one-line
errors for bad options (no traceback)."""

import json
import subprocess
import sys

import pytest
from cluster import REPO_ROOT, repo_env


def run_bench(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "intml.testbed", "bench", "burstio", *args], cwd=REPO_ROOT,
                          env=repo_env(), capture_output=True, text=True, timeout=120, check=False)


def test_bench_burstio_json() -> None:
    done = run_bench("--packets", "2000", "--size", "1024", "--burst", "64", "--json")
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    rows = {row["variant"].split()[0]: row for row in report["rows"]}
    assert set(rows) == {"burst", "plain"} and rows["plain"]["ratio_to_plain"] == 1.0
    assert all(row["packets_per_s"] > 0 for row in rows.values())


@pytest.mark.parametrize("args, needle", [(["--size", "70000"], "at most 65507"), (["--packets", "0"], "> 0"),
                                          (["--burst", "x"], "expected an integer")])
def test_bench_burstio_rejects_bad_options(args: list[str], needle: str) -> None:
    done = run_bench(*args)
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1 and needle in lines[0], done.stderr
