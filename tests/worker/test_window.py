"""The send window (worker.window) and the aggregator's congestion mark (aggregator.congestion): marks cut the
window, by half the marked share of results, losses never do, a cut window holds slots back (lowest chunk first, no
more in flight than the window, the lowest chunk always admitted), bootstrap rounds go outside it until a queue
marks one, and results stay bit-identical to protocol.reference through marks, losses and the DATA/RESULT MAC
(which is checked with the mark masked)."""

from __future__ import annotations

import numpy as np
import pytest
from support import harness
from support.harness import Network

from intml.protocol import reference
from intml.worker.state import HELD, IDLE
from intml.worker.window import (
    FLOOR,
    W_BOOTSTRAPS,
    W_CWND,
    admitted,
    on_bootstrap_mark,
    on_mark,
    window_state,
)

SEED = 123
P = 64


def inputs(n: int, chunks: int, k: int) -> list[np.ndarray]:
    return [np.random.default_rng([k, r]).standard_normal(chunks * P - 7).astype(np.float32) for r in range(n)]


@pytest.mark.parametrize("mac", [None, (0x0123456789ABCDEF, 0x0FEDCBA987654321)])
@pytest.mark.parametrize("drop", [0.0, 0.05])
def test_marks_cut_the_window_and_results_stay_exact(monkeypatch, mac, drop):
    monkeypatch.setattr(harness, "core_receive", harness.marking(True))
    n, pool = 3, 16
    net = Network(n, packet_elements=P, pool_size=pool, seed=SEED, data_mac_key=mac, drop=drop, fault_seed=5)
    for k in range(2):
        xs = inputs(n, 60, k)
        got = net.allreduce(xs)
        want = reference.allreduce(xs, codec="cnat8", seed=SEED, allreduce_seq=k, packet_elements=P)
        for g in got:
            np.testing.assert_array_equal(g, want)
    for e in net.engines:
        assert e.send_window == FLOOR  # every result marked: cut to the floor
        assert e.window[W_BOOTSTRAPS] == 1.0  # bootstrap results among them: bootstrap rounds are in the window
        assert e.counters()["congestion_marks"] == e.counters()["results"] > 0
        assert e.counters()["drop_bad_mac"] == 0


def test_random_loss_never_cuts_the_window():
    n, pool = 3, 16
    net = Network(n, packet_elements=P, pool_size=pool, seed=SEED, drop=0.1, fault_seed=3)
    net.allreduce(inputs(n, 60, 0))
    assert sum(e.counters()["retransmissions"] + e.counters()["fast_retransmissions"] for e in net.engines) > 0
    assert all(e.send_window == pool and e.counters()["congestion_marks"] == 0 for e in net.engines)
    assert all(e.window[W_BOOTSTRAPS] == 0.0 for e in net.engines)


def test_a_cut_window_holds_slots_back_lowest_chunk_first(monkeypatch):
    monkeypatch.setattr(harness, "core_receive", harness.marking(True))  # every result marked: the window stays at the floor
    n, pool, window = 3, 16, int(FLOOR)
    net = Network(n, packet_elements=P, pool_size=pool, seed=SEED, drop=0.05, fault_seed=9)
    for e in net.engines:
        e.window[W_CWND] = window
        e.window[W_BOOTSTRAPS] = 1.0  # as after a marked bootstrap result: bootstrap rounds are in the window
    xs = inputs(n, 70, 0)
    net.start(xs)
    completed = []
    while not net.done:
        for e in net.engines:
            harness.check_window(e.state.cur_chunk, e.state.parked, window)
        completed.append(net.engines[0].completed())
        net.step()
    want = reference.allreduce(xs, codec="cnat8", seed=SEED, allreduce_seq=0, packet_elements=P)
    for e in net.engines:
        np.testing.assert_array_equal(e.result, want)
    assert completed == sorted(completed) and max(net.engines[0].counters()["packets_out"], 0) > 0


def test_window_law():
    pool = 64
    w = window_state(pool)
    assert w[W_CWND] == pool
    on_mark(w, True, pool)
    assert w[W_CWND] == pool / 2  # alpha starts at 1: the first cut halves
    on_mark(w, True, pool)  # a second mark within the same window's worth of results: no second cut
    assert w[W_CWND] == pool / 2
    for _ in range(40):  # one slot per window's worth of results
        on_mark(w, False, pool)
    assert pool / 2 + 1 < w[W_CWND] < pool / 2 + 2
    for _ in range(400):
        on_mark(w, True, pool)
    assert w[W_CWND] == FLOOR
    small = window_state(2)
    on_mark(small, True, 2)
    assert small[W_CWND] == 2  # never below the pool's own size
    for _ in range(3000):
        on_mark(w, False, pool)
    assert w[W_CWND] == pool


def test_a_cut_follows_the_marked_share():
    """DCTCP's cut: with one result in a window's worth marked, alpha falls toward that share and each cut takes
    little; every result marked, alpha rises and the cuts halve again. Halving at each mark would hold the window
    at half of the depth the marks start at, and leave a shallow queue idle."""
    pool = 64
    w = window_state(pool)
    for _ in range(200):  # a mark in every window's worth of results
        on_mark(w, True, pool)
        for _ in range(int(w[W_CWND])):
            on_mark(w, False, pool)
    before = w[W_CWND]
    on_mark(w, True, pool)
    assert before * 0.9 < w[W_CWND] < before  # alpha under a fifth: a cut of under a tenth
    assert w[W_CWND] > pool / 2
    for _ in range(2000):
        on_mark(w, True, pool)
    assert w[W_CWND] == FLOOR


def test_bootstrap_rounds_go_outside_the_window_until_one_comes_marked():
    """A bootstrap round carries no elements: a few percent of a data round on a switch's port, which queues bytes.
    Until a bootstrap result comes marked it neither counts in flight nor waits; from then on it does, as on a
    software aggregator's socket, which queues datagrams."""
    slots = 8
    w = window_state(slots)
    w[W_CWND] = 2.0
    answered = np.full(slots, -np.inf)
    cur = np.array([-8, -7, -6, -5, HELD, HELD, HELD, IDLE], np.int64)  # four bootstrap rounds in flight
    parked = np.array([0, 0, 0, 0, -3, -4, 5, 0], np.int64)
    assert admitted(w, cur, parked, answered, slots) == 5  # the lowest held, a bootstrap round, goes at once
    cur[:] = [0, 1, -6, -5, HELD, HELD, HELD, IDLE]  # two data chunks in flight: the window is full ...
    assert admitted(w, cur, parked, answered, slots) == 5  # ... for data alone
    parked[4:6] = [9, 8]
    assert admitted(w, cur, parked, answered, slots) == -1
    cur[:2] = [-8, -7]  # bootstrap rounds only in flight: a data chunk goes
    assert admitted(w, cur, parked, answered, slots) == 6
    on_bootstrap_mark(w)
    assert admitted(w, cur, parked, answered, slots) == -1  # now four in flight: the window holds chunk 5 back
    parked[4:6] = [-3, -4]
    assert admitted(w, cur, parked, answered, slots) == -1  # and bootstrap rounds too
    cur[:4] = [IDLE, IDLE, IDLE, -5]
    assert admitted(w, cur, parked, answered, slots) == 5
