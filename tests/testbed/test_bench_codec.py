"""`intml-testbed bench codec`: its kernels take turns within each repeat, the two encodes swapping places in every
second one, and one tiny run reports every kernel and the paired stochastic / deterministic ratio (no timing
assertions)."""

import json
import math

import pytest

from intml.testbed import bench_codec
from intml.testbed.timing import interleaved_times


def test_interleaved_times_runs_every_fn_once_per_round_in_turn():
    calls = []
    fns = {name: (lambda name=name: calls.append(name)) for name in ("a", "b", "c")}
    times = interleaved_times(fns, repeats=3, warmup=1)
    assert calls == ["a", "b", "c"] * 4  # one warm-up round, then three timed rounds
    assert {name: len(t) for name, t in times.items()} == {"a": 3, "b": 3, "c": 3}
    assert all(t >= 0 for ts in times.values() for t in ts)


def test_interleaved_times_alternates_two_fns_places_every_second_round():
    calls = []
    fns = {name: (lambda name=name: calls.append(name)) for name in ("a", "b", "c", "d")}
    times = interleaved_times(fns, repeats=3, warmup=1, alternate=("b", "c"))
    assert calls == ["a", "b", "c", "d"] * 2 + ["a", "c", "b", "d"] + ["a", "b", "c", "d"]
    assert {name: len(t) for name, t in times.items()} == {"a": 3, "b": 3, "c": 3, "d": 3}


def test_pair_ratios_take_each_pair_of_repeats_whole():
    assert bench_codec.pair_ratios([1.0, 3.0, 2.0, 2.0, 9.0], [2.0, 2.0, 1.0, 3.0, 1.0]) == [1.0, 1.0]
    assert bench_codec.pair_ratios([3.0], [2.0]) == [1.5]


@pytest.mark.process  # platform.processor() runs uname
def test_one_tiny_run_reports_every_kernel_and_the_paired_ratio(capsys):
    rows = bench_codec.run(elements=5000, repeats=3, as_json=True)
    report = json.loads(capsys.readouterr().out)
    assert [row["kernel"] for row in rows] == [row["kernel"] for row in report["rows"]]
    assert {"stochastic encode", "deterministic encode", "memory copy (anchor)"} <= {row["kernel"] for row in rows}
    assert all(math.isfinite(row["ratio_to_copy"]) and row["ratio_to_copy"] > 0 for row in rows)
    ratio = report["stochastic encode × deterministic (median over pairs of repeats)"]
    assert math.isfinite(ratio) and ratio > 0
