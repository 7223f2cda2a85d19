"""The loopback benchmark CLI (`intml-testbed bench allreduce`) end to end, at a small size: it runs the
aggregator and the ranks, checks they agree bit for bit, and reports its figures as JSON."""

import json
import subprocess
import sys

import pytest
from support.cluster import REPO_ROOT, repo_env

pytestmark = pytest.mark.process


def run_cli(*args: str, timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "intml.testbed", "bench", "allreduce", *args], cwd=REPO_ROOT,
                          env=repo_env(), capture_output=True, text=True, timeout=timeout, check=False)


@pytest.mark.parametrize("results", [[], ["--unicast"], ["--cores", "1", "--multicast", "239.255.43.0"]])
def test_bench_allreduce_json(results):
    done = run_cli("--workers", "3", "--elements", "300001", "--warmup", "1",
                   "--rounds", "2", "--no-gloo", "--json", *results, timeout=180)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    row = report["rows"][0]
    assert report["workers"] == 3 and report["packet_elements"] == 65481
    assert report["cores"] == (1 if "1" in results else 2)
    assert report["results"] == ("unicast" if results == ["--unicast"] else
                                 f"multicast {results[-1] if results else '239.255.42.0'}")
    assert row["system"] == "intml cnat8" and row["median_s"] > 0
    assert row["mb_per_worker"] == pytest.approx((300001 + 26 * (5 + 5)) / 1e6)


def test_bench_allreduce_compares_the_roundings():
    """--rounding stochastic nearest: one intml row per rounding (each bit-identical across ranks, else the bench
    fails), the deterministic arm named."""
    done = run_cli("--workers", "2", "--elements", "200000", "--warmup", "1", "--rounds", "1", "--no-gloo",
                   "--unicast", "--rounding", "stochastic", "nearest", "--json", timeout=180)
    assert done.returncode == 0, done.stderr
    rows = json.loads(done.stdout)["rows"]
    assert [r["system"] for r in rows] == ["intml cnat8", "intml cnat8 nearest"]
    assert all(r["median_s"] > 0 and r["ate_per_s"] == pytest.approx(200000 / r["median_s"]) for r in rows)


def test_bench_allreduce_rejects_both_result_modes():
    done = run_cli("--unicast", "--multicast", "239.1.1.1", timeout=60)
    assert done.returncode == 2 and "not allowed with" in done.stderr
