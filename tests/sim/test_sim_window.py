"""The send window at scale, in the packet-level simulator (docs/window.md): 64 workers on a software aggregator
(the testbed's process and its CPU costs) whose receive queue holds 1024 datagrams, a quarter of the workers' 64 x 64
slots. Without marks every worker fills its pool and the queue drops the excess; with the aggregator marking the
results of bursts read from 256 or more waiting datagrams, the windows keep the queue short: no drops, no
retransmissions, the aggregator busy the whole time. Under 1% random loss on every link the window is not cut by the
losses (only marks cut it), and the allreduces stay exact."""

from __future__ import annotations

import pytest

from intml.sim.packet_level import PacketRun, simulate

pytestmark = pytest.mark.slow

N, POOL, PACKET, CHUNKS, ROUNDS = 64, 64, 256, 64, 2
QUEUE, DEPTH = 1024, 256


def run(mark_depth: int | None, loss: float = 0.0):
    r = simulate(PacketRun(workers=N, elements=PACKET * CHUNKS, packet_elements=PACKET, pool=POOL, rounds=ROUNDS,
                           switch="software", rx_queue=QUEUE, mark_depth=mark_depth, loss=loss, inputs="shared",
                           rto=0.002, min_rto=0.002, check=True))
    data = ROUNDS * N * (CHUNKS + POOL)  # every chunk and every slot's bootstrap packet, every rank
    busy = r.cpu_seconds["aggregator"] / sum(r.times)
    print(f"\nmark depth {mark_depth}, loss {loss:.0%}: allreduces {[f'{t * 1e3:.2f}' for t in r.times]} ms, "
          f"retransmissions {r.retransmissions} ({r.retransmissions / data:.1%}), queue drops {r.rx_drops}, "
          f"random losses {r.lost}, marks {r.counters['congestion_marks']}, aggregator busy {busy:.1%}")
    return r, r.retransmissions / data, busy


def test_marks_keep_a_shallow_queue_from_dropping():
    unmarked, unmarked_retx, _ = run(None)
    assert unmarked.exact and unmarked.rx_drops > 0.05 * ROUNDS * N * CHUNKS  # the scenario does overflow the queue
    marked, retx, busy = run(DEPTH)
    assert marked.exact
    assert marked.rx_drops == 0 and retx < 0.02 <= unmarked_retx
    assert busy > 0.9  # the aggregator, the bottleneck, never waits for the windows
    assert marked.counters["congestion_marks"] > 0


def test_random_loss_does_not_close_the_window():
    lossy, retx, _ = run(DEPTH, loss=0.01)
    assert lossy.exact and lossy.lost > 0 and lossy.rx_drops == 0
    unmarked_lossy, unmarked_retx, _ = run(None, loss=0.01)
    assert retx < unmarked_retx  # the queue's drops come on top of the random losses without the window
    assert sum(lossy.times) < sum(unmarked_lossy.times)
