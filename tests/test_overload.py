"""Graceful overload (issue 11): an aggregator core slower than the workers' offered load, with a finite queue
(tests/harness.py, ``service`` and ``queue``), on the virtual clock.

SwitchML's self-clocking keeps n x pool datagrams in flight whatever the aggregator's speed: with 8 ranks of 64
slots, 512, against a core that serves 32 per millisecond behind a queue of 1024 (it holds every rank's bootstrap
burst). The engine before the window (main at 4768a64) kept 16 ms of queue, three times its RTO floor: half its
datagrams were retransmissions (31,656 of 64,680 over two allreduces) and its goodput was half the core's rate.
With the window every rank's result is still the oracle's bit for bit, retransmissions stay under 1% and goodput
near the core's rate.
"""

from __future__ import annotations

import numpy as np
import pytest
from harness import Network, make_inputs
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from intml.protocol import reference

P = 16  # elements per packet: many packets for little arithmetic


def assert_reference(net: Network, xs: list[np.ndarray], seq: int) -> None:
    expected = reference.allreduce(xs, codec="cnat8", seed=net.seed, allreduce_seq=seq, packet_elements=P)
    for rank, engine in enumerate(net.engines):
        got = engine.result
        bad = np.flatnonzero(got.view(np.uint32) != expected.view(np.uint32))
        assert bad.size == 0, f"rank {rank}: {bad.size} elements differ from the oracle, first at {bad[:5]}"


def allreduce(net: Network, xs: list[np.ndarray], shuffle_seed: int, max_steps: int = 20_000) -> float:
    """One allreduce, each core's arrivals shuffled every step; returns the virtual time it took."""
    start = net.now
    net.start(xs)
    Network.run_together([net], shuffle_seed=shuffle_seed, max_steps=max_steps)
    return net.now - start


def retransmissions(net: Network) -> tuple[int, int]:
    """(datagrams resent, by timer or fast retransmit; datagrams sent) over every rank."""
    counters = [e.counters() for e in net.engines]
    return (sum(c["retransmissions"] + c["fast_retransmissions"] for c in counters),
            sum(c["packets_out"] for c in counters))


@pytest.mark.parametrize("cores", [1, 2])
def test_a_slowed_core_keeps_its_rate_without_retransmissions(cores):
    """8 ranks, the default pool of 64, each core serving 32 datagrams per ms behind a 1024-datagram queue: two
    allreduces of 2000 chunks, exact; retransmissions under 1% of the datagrams sent; goodput (elements per
    virtual second) at least 90% of what the cores can serve (a chunk costs one datagram of each rank)."""
    n, pool, chunks, service = 8, 64, 2000, 32
    net = Network(n, packet_elements=P, pool_size=pool, cores=cores, service=service, queue=1024)
    capacity = cores * service / net.dt * P / n  # elements per second
    for seq in range(2):
        xs = make_inputs(n, chunks * P, P, "normal", seed=seq)
        elapsed = allreduce(net, xs, shuffle_seed=seq)
        assert_reference(net, xs, seq)
        assert chunks * P / elapsed >= 0.9 * capacity, f"allreduce {seq}: goodput {chunks * P / elapsed:.0f} el/s"
    resent, sent = retransmissions(net)
    assert resent < 0.01 * sent, f"{resent} retransmissions of {sent} datagrams"
    assert all(1 <= e.window < pool for e in net.engines)  # it shrank, never below one slot


def test_a_slowed_core_with_loss_is_exact():
    """The same overload with 2% of the datagrams lost each way: every rank's results are still the oracle's."""
    n, chunks = 8, 300
    net = Network(n, packet_elements=P, pool_size=64, service=32, queue=1024, drop=0.02, fault_seed=3)
    for seq in range(2):
        xs = make_inputs(n, chunks * P, P, "normal", seed=10 + seq)
        allreduce(net, xs, shuffle_seed=seq)
        assert_reference(net, xs, seq)
    assert net.uplink.counts["dropped"] and net.downlink.counts["dropped"]


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(n=st.integers(2, 4), pool=st.integers(1, 6), chunks=st.integers(1, 20), service=st.integers(1, 8),
       queue=st.integers(4, 16), drop=st.sampled_from([0.0, 0.1]), reorder=st.sampled_from([0.0, 0.2]),
       fault_seed=st.integers(0, 3))
def test_windows_under_overload_and_faults_never_deadlock(n, pool, chunks, service, queue, drop, reorder,
                                                          fault_seed):
    """Windows that shrink on each rank at different times (timeouts, losses, delay) may leave ranks with
    different chunks in flight; the smallest unsent chunk always goes once every chunk below it is done, so
    every allreduce completes, exact, whatever the overload and the faults. (The queue holds a datagram of each
    rank: with less, ranks whose timers fire together could lose each other's datagrams for a long time.)"""
    net = Network(n, packet_elements=P, pool_size=pool, service=service, queue=queue, drop=drop, reorder=reorder,
                  duplicate=drop, fault_seed=fault_seed)
    for seq in range(2):
        xs = make_inputs(n, chunks * P - seq, P, "normal", seed=seq)
        allreduce(net, xs, shuffle_seed=fault_seed, max_steps=50_000)
        assert_reference(net, xs, seq)
