"""`intml-testbed bench burstio`: its JSON report, with the plain-socket anchor in the same run, and one-line
errors for bad options (no traceback)."""

import json
import subprocess
import sys

import pytest
from support.cluster import REPO_ROOT, repo_env

pytestmark = pytest.mark.process


def run_bench(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "intml.testbed", "bench", "burstio", *args], cwd=REPO_ROOT,
                          env=repo_env(), capture_output=True, text=True, timeout=120, check=False)


def test_bench_burstio_json() -> None:
    """Every variant at every size in one report: GSO/GRO, each alone, sendmmsg/recvmmsg, and the plain anchor."""
    done = run_bench("--packets", "2000", "--size", "1050", "8218", "--burst", "64", "--json")
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    rows = {(row["size"], row["variant"].split()[0]): row for row in report["rows"]}
    variants = {"gso+gro", "gso", "gro", "mmsg", "plain"}
    assert set(rows) == {(size, v) for size in (1050, 8218) for v in variants} and report["sizes"] == [1050, 8218]
    for size in (1050, 8218):
        assert rows[size, "plain"]["ratio_to_plain"] == 1.0 and rows[size, "mmsg"]["ratio_to_mmsg"] == 1.0
        assert all(rows[size, v]["packets_per_s"] > 0 and rows[size, v]["lost"] == 0 for v in variants)


@pytest.mark.parametrize("args, needle", [(["--size", "70000"], "at most 65507"), (["--packets", "0"], "> 0"),
                                          (["--burst", "x"], "expected an integer")])
def test_bench_burstio_rejects_bad_options(args: list[str], needle: str) -> None:
    done = run_bench(*args)
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1 and needle in lines[0], done.stderr
