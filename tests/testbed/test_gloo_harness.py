"""Tests of testbed.gloo, the Gloo all_reduce anchor: a real 2-rank run, the sum check, failures and timeouts."""

import pytest

torch = pytest.importorskip("torch")

from intml.testbed import gloo

pytestmark = pytest.mark.process


def test_run_local_two_ranks():
    result = gloo.run_local(2, 10_000, warmup=1, rounds=2, timeout=60)
    assert result["world_size"] == 2
    assert result["elements"] == 10_000
    assert result["rounds"] == 2
    assert len(result["per_round_s"]) == 2
    assert all(t > 0 for t in result["per_round_s"])
    assert min(result["per_round_s"]) <= result["median_s"] <= max(result["per_round_s"])
    assert result["bytes_per_worker"] == 2 * (2 - 1) / 2 * 4 * 10_000


@pytest.mark.parametrize("world_size", [1, 2, 4, 7])
def test_check_sum_accepts_the_true_sum(world_size):
    total = sum(gloo.rank_input(rank, 1000) for rank in range(world_size))
    gloo.check_sum(total, world_size)


def test_check_sum_rejects_a_wrong_tensor():
    total = gloo.rank_input(0, 1000) + gloo.rank_input(1, 1000)
    total[123] += 1
    with pytest.raises(RuntimeError, match="element 123"):
        gloo.check_sum(total, 2)


def test_check_sum_rejects_a_sum_over_too_few_ranks():
    total = gloo.rank_input(0, 1000) + gloo.rank_input(1, 1000)
    with pytest.raises(RuntimeError, match="world_size 3"):
        gloo.check_sum(total, 3)


def test_rank_failure_names_the_rank():
    with pytest.raises(RuntimeError, match=r"rank \d failed[\s\S]*ValueError"):
        gloo.run_local(2, -1, timeout=30)


def test_timeout_kills_the_ranks():
    # Importing torch alone takes longer than this, so the ranks are certainly still running.
    with pytest.raises(TimeoutError):
        gloo.run_local(2, 10_000, timeout=0.2)


def test_command_passes_ifname_only_when_given():
    assert "--ifname" not in gloo.command(0, 2, "10.0.0.1", 29500, 100, 1, 2)
    assert gloo.command(0, 2, "10.0.0.1", 29500, 100, 1, 2, ifname="veth0")[-2:] == ["--ifname", "veth0"]
