"""The send window (worker.window) and the aggregator's congestion mark (aggregator.congestion): marks cut the
window, losses never do, a cut window holds slots back (lowest chunk first, no more in flight than the window, the
lowest chunk always admitted), and results stay bit-identical to protocol.reference through marks, losses and the
DATA/RESULT MAC (which is checked with the mark masked)."""

from __future__ import annotations

import numpy as np
import pytest
from support import harness
from support.harness import Network

from intml.protocol import reference
from intml.worker.window import DECREASE, FLOOR, W_CWND, on_mark, window_state

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
        assert e.counters()["congestion_marks"] == e.counters()["results"] > 0
        assert e.counters()["drop_bad_mac"] == 0


def test_random_loss_never_cuts_the_window():
    n, pool = 3, 16
    net = Network(n, packet_elements=P, pool_size=pool, seed=SEED, drop=0.1, fault_seed=3)
    net.allreduce(inputs(n, 60, 0))
    assert sum(e.counters()["retransmissions"] + e.counters()["fast_retransmissions"] for e in net.engines) > 0
    assert all(e.send_window == pool and e.counters()["congestion_marks"] == 0 for e in net.engines)


def test_a_cut_window_holds_slots_back_lowest_chunk_first(monkeypatch):
    monkeypatch.setattr(harness, "core_receive", harness.marking(True))  # every result marked: the window stays at the floor
    n, pool, window = 3, 16, int(FLOOR)
    net = Network(n, packet_elements=P, pool_size=pool, seed=SEED, drop=0.05, fault_seed=9)
    for e in net.engines:
        e.window[W_CWND] = window
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
    assert w[W_CWND] == pool * DECREASE
    on_mark(w, True, pool)  # a second mark within the same window's worth of results: no second cut
    assert w[W_CWND] == pool * DECREASE
    for _ in range(40):  # one slot per window's worth of results
        on_mark(w, False, pool)
    assert pool * DECREASE + 1 < w[W_CWND] < pool * DECREASE + 2
    for _ in range(400):
        on_mark(w, True, pool)
    assert w[W_CWND] == FLOOR
    small = window_state(2)
    on_mark(small, True, 2)
    assert small[W_CWND] == 2  # never below the pool's own size
    for _ in range(3000):
        on_mark(w, False, pool)
    assert w[W_CWND] == pool
