"""`intml-testbed bench percore`: one tiny run's JSON report has every row, finite ratios to the anchors of the same
run, and counts that add up (no timing assertions); bad sizes are one-line errors."""

import json
import math
import subprocess
import sys

import pytest
from support.cluster import REPO_ROOT, repo_env

from intml.testbed.bench_mac import POOL, WORLD
from intml.testbed.bench_percore import CORE_VARIANTS, WORKER_VARIANTS

pytestmark = pytest.mark.process

CHUNKS = 128


def run_bench(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "intml.testbed", "bench", "percore", *args], cwd=REPO_ROOT,
                          env=repo_env(), capture_output=True, text=True, timeout=300, check=False)


@pytest.fixture(scope="module")
def report() -> dict:
    done = run_bench("--size", "cnat8:256", "--seconds", "0.4", "--packets", str(CHUNKS), "--repeats", "1", "--json")
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_core_rows_and_their_counts(report: dict) -> None:
    [size] = report["sizes"]
    assert (size["codec"], size["packet_elements"], size["datagram_bytes"]) == ("cnat8", 256, 26 + 256)
    # bootstrap packets carry no elements: POOL of them per CHUNKS data packets of each rank
    assert size["elements_per_datagram"] == 256 * CHUNKS / (CHUNKS + POOL)
    core = size["core"]
    assert core["receiver_offloads"].startswith("mmsg") and core["blaster_offloads"].startswith("mmsg")
    rows = {row["variant"]: row for row in core["rows"]}
    assert list(rows) == list(CORE_VARIANTS)
    for row in rows.values():
        assert all(math.isfinite(row[k]) and row[k] > 0 for k in ("ratio_to_sink", "ratio_to_echo", "cpu_share",
                                                                    "datagrams_per_s", "elements_per_s",
                                                                    "datagrams_per_cpu_s", "elements_per_cpu_s"))
        assert row["received"] > 0 and row["received"] + row["lost"] == row["sent"] and row["lost"] >= 0
    agg, sink, echo, alone = (rows[v] for v in CORE_VARIANTS)
    assert sink["ratio_to_sink"] == 1.0 and echo["ratio_to_echo"] == 1.0
    assert sink["packets_out"] == 0 and echo["packets_out"] == echo["received"]
    for core in (agg, alone):  # every DATA datagram a core took was added, re-answered or dropped for a reason
        assert core["received"] == core["contributions"] + core["results_resent"] + core["dropped"]
        assert core["packets_out"] == (WORLD * core["completions"] + core["results_resent"]
                                       + core["drop_duplicate_incomplete"])  # each answered by a PENDING
        assert 0 < WORLD * core["completions"] <= core["contributions"]
    # the kernel alone takes the recorded allreduce whole, pass after pass on fresh cores, loss-free: every round
    # of every pass completes
    passes, rest = divmod(alone["received"], WORLD * (CHUNKS + POOL))
    assert passes >= 1 and rest == 0
    assert alone["received"] == alone["contributions"] == WORLD * alone["completions"]


def test_worker_rows(report: dict) -> None:
    worker = report["sizes"][0]["worker"]
    assert worker["results_per_run"] == worker["data_per_run"] == CHUNKS + POOL and worker["burst"] == POOL
    rows = {row["variant"]: row for row in worker["rows"]}
    assert list(rows) == list(WORKER_VARIANTS)
    assert rows[WORKER_VARIANTS[0]]["ratio_to_raw"] == 1.0
    for row in rows.values():
        assert all(math.isfinite(row[k]) and row[k] > 0 for k in ("ratio_to_raw", "cpu_share", "packets_per_s",
                                                                    "packets_per_cpu_s"))
        for per in ("s", "cpu_s"):  # 256 elements in each chunk's result, none in the POOL bootstrap results
            full = row[f"packets_per_{per}"] * 256 * CHUNKS / (CHUNKS + POOL)
            assert row[f"elements_per_{per}"] == pytest.approx(full)
    assert rows[WORKER_VARIANTS[2]]["recv_us"] == rows[WORKER_VARIANTS[2]]["send_us"] == 0.0


@pytest.mark.parametrize("size", ["cnat9:256", "cnat8", "int32:0", "int32:16371"])
def test_bad_size_is_one_line(size: str) -> None:
    done = run_bench("--size", size)
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1 and "CODEC:ELEMENTS" in lines[0], done.stderr
