"""The send window at scale, in the packet-level simulator (docs/window.md): 64 workers on a software aggregator
(the testbed's process and its CPU costs) whose receive queue holds 1024 datagrams, a quarter of the workers' 64 x 64
slots. Without marks every worker fills its pool and the queue drops the excess; with the aggregator marking the
results of bursts read from 256 or more waiting datagrams, the windows, which start at the pool, learn the queue in
the first allreduce (whose first bursts overflow it) and from then on keep it short: no drops, no retransmissions,
the aggregator busy the whole time. With 1% random loss on every link as well, an allreduce after the first takes a
few times the loss-free one, not the seconds of timeouts it took before a silent core's probes took turns over its
slots (docs/window.md, "Random loss at scale"). On a switch ASIC the egress ports mark instead, from their own queues
(the P4 program's rule): behind a shallow, slow port to each host the windows are cut and the drops stop; on a run
whose queues stay short nothing is marked and nothing changes. In a leaf-spine whose leaves' ports up to the spine
are shallow, the leaves' partials are marked there and the spine echoes the marks in its results: the windows
follow that queue too, and keep it busy: an allreduce after the first takes about what the deep queues' does.
Every result is exact."""

from __future__ import annotations

import pytest

from intml.protocol.codec import Codec
from intml.protocol.partial import partial_size
from intml.protocol.wire import MsgType, element_datagram_size
from intml.sim import network
from intml.sim.packet_level import PacketResult, PacketRun, simulate
from intml.worker.costs import WIRE_OVERHEAD

pytestmark = pytest.mark.slow

N, POOL, PACKET, CHUNKS, ROUNDS = 64, 64, 256, 64, 3
QUEUE, DEPTH = 1024, 256
DATA = N * (CHUNKS + POOL)  # datagrams of one allreduce at the aggregator: every chunk and bootstrap of every rank


def run(mark_depth: int | None, loss: float = 0.0, rounds: int = ROUNDS) -> PacketResult:
    r = simulate(PacketRun(workers=N, elements=PACKET * CHUNKS, packet_elements=PACKET, pool=POOL, rounds=rounds,
                           switch="software", rx_queue=QUEUE, mark_depth=mark_depth, loss=loss, inputs="shared",
                           rto=0.002, min_rto=0.002, check=True))
    busy = r.cpu_seconds["aggregator"] / sum(r.times)
    print(f"\nmark depth {mark_depth}, loss {loss:.0%}, {rounds} allreduces: {[f'{t * 1e3:.2f}' for t in r.times]} ms, "
          f"retransmissions {r.retransmissions} ({r.retransmissions / (rounds * DATA):.1%}), queue drops "
          f"{r.rx_drops}, random losses {r.lost}, marks {r.counters['congestion_marks']}, aggregator busy {busy:.1%}")
    assert r.exact
    return r


@pytest.fixture(scope="module")
def marked() -> PacketResult:
    return run(DEPTH)


def test_marks_keep_a_shallow_queue_from_dropping(marked: PacketResult):
    unmarked = run(None)
    assert unmarked.rx_drops > 0.1 * ROUNDS * DATA  # the scenario does overflow the queue, every allreduce
    first = run(DEPTH, rounds=1)
    later = marked.retransmissions - first.retransmissions  # the allreduces after the first
    assert marked.rx_drops == first.rx_drops and later < 0.02 * (ROUNDS - 1) * DATA
    assert marked.retransmissions < unmarked.retransmissions / 2
    # the aggregator, the bottleneck, never waits for the windows: its busy time fills the later allreduces
    assert marked.cpu_seconds["aggregator"] - first.cpu_seconds["aggregator"] > 0.95 * sum(marked.times[1:])
    assert marked.counters["congestion_marks"] > 0



def test_random_loss_costs_round_trips_not_seconds(marked: PacketResult):
    """Under 1% loss per link direction, 47% of the rounds lose some rank's datagram: a slot's round trip then includes
    a peer's recovery, and a probe of a slot whose own datagram arrived goes unanswered. The second allreduce took
    2.5 s when a silent core's probes did not take turns over its slots: the slots with the shortest RTOs were probed
    again and again, the backoff doubling at each probe, while the lost ones waited; and 35 ms (3.6x) when a
    core's first probe after a result waited for the RTO's floor (2 ms) rather than 2 SRTT (the tail probe): the
    stalls on a peer's loss were mostly that wait."""
    lossy = run(DEPTH, loss=0.01, rounds=2)
    assert lossy.lost > 0.005 * 2 * DATA
    assert lossy.times[1] < 3 * marked.times[1]


# An ASIC whose ports to the hosts run at half the hosts' rate with room for 16 results each: a pool of 64 overflows
ASIC_N, DOWN_RATE = 8, 5e9
DOWN_QUEUE = 16 * (element_datagram_size(Codec.CNAT8, PACKET, False) + WIRE_OVERHEAD)


def asic_run(marks: bool, **options) -> PacketResult:
    options = {"rounds": ROUNDS, "workers": ASIC_N, **options}
    r = simulate(PacketRun(elements=PACKET * CHUNKS, packet_elements=PACKET, pool=POOL,
                           asic_marks=marks, inputs="shared", host_costs=False, check=True, **options))
    print(f"\nASIC marks {marks}, {options}: {[f'{t * 1e6:.1f}' for t in r.times]} us, retransmissions "
          f"{r.retransmissions}, queue drops {r.queue_drops}, results marked {r.results_marked}, partials marked "
          f"{r.partials_marked}, windows {min(r.windows):.1f}-{max(r.windows):.1f}")
    assert r.exact
    return r


def test_an_asic_port_marks_its_queue_and_the_windows_follow():
    shallow = dict(downlink_rate=DOWN_RATE, downlink_queue=DOWN_QUEUE)
    unmarked, marked_ = asic_run(False, **shallow), asic_run(True, **shallow)
    assert unmarked.queue_drops > 0 and unmarked.results_marked == 0 and min(unmarked.windows) == POOL
    assert marked_.results_marked > 0 and max(marked_.windows) <= POOL / 2
    assert marked_.queue_drops < unmarked.queue_drops / 2 and marked_.retransmissions < unmarked.retransmissions
    assert max(marked_.times) < min(unmarked.times)  # the drops' recovery cost more than the smaller windows
    # a leaf-spine's leaves mark their ports to the hosts alike
    racks = asic_run(True, racks=2, **shallow)
    assert racks.results_marked > 0 and max(racks.windows) < POOL  # cut, and growing back once the queue is short
    # the default queues stay short: no mark, and the run is the run without marks, instant for instant
    plain, quiet = asic_run(False), asic_run(True)
    assert quiet.results_marked == 0 and quiet.times == plain.times and quiet.counters == plain.counters


# A leaf-spine of 2 racks whose links between leaf and spine hold 16 partials each way: a leaf sends a 4-byte sum per
# element up for each round its 4 ranks send 1-byte codes in, so its port up is the first queue to fill
UPLINK_QUEUE = 16 * (partial_size(PACKET) + WIRE_OVERHEAD)
HOLD = 50e-6  # a leaf's hold on its re-sent partials: a rack's duplicates of one round come within a microsecond


def test_a_leafs_port_up_marks_partials_and_the_spine_echoes_them(monkeypatch):
    uplink = dict(racks=2, uplink_queue=UPLINK_QUEUE)
    marked_, first = asic_run(True, **uplink), asic_run(True, rounds=1, **uplink)
    with monkeypatch.context() as m:  # as before: the port up marks nothing (results only)
        m.setattr(network, "MARKED", frozenset((MsgType.RESULT,)))
        unmarked = asic_run(True, **uplink)
    assert unmarked.partials_marked == 0 and unmarked.queue_drops > 0 and min(unmarked.windows) == POOL
    assert marked_.partials_marked > 0 and max(marked_.windows) < POOL / 2
    # the windows learn the queue in the first allreduce (which starts at the pool, as before); none drops after it
    assert marked_.times[0] == unmarked.times[0] and marked_.retransmissions == first.retransmissions
    assert marked_.queue_drops == first.queue_drops < unmarked.queue_drops / 2
    assert max(marked_.times[1:]) < 0.7 * min(unmarked.times[1:])  # the drops' recovery cost more than the windows
    # and the windows keep the port up busy: within a fifth of the deep queues' allreduce. Halving at each mark
    # (down to half the depth marks start at, below the round trip's slots) and bootstrap rounds in the window
    # (64 of them, a few percent of a partial each at the port, a window at a time) took 124-133 us against 71
    deep = asic_run(True, racks=2)
    assert deep.partials_marked == 0 and max(marked_.times[1:]) < 1.2 * deep.times[1]


def test_a_leafs_hold_sends_one_partial_up_for_its_racks_duplicates():
    """64 workers in 4 racks of 16 behind the same ports up: the first allreduce's recovery ends with a rack's 16
    ranks resending the same chunk, whose rack is complete and whose result the spine has not sent yet. With a
    hold the leaf sends its stored partial up once for them (docs/window.md, "One partial per wave of
    duplicates"). Once each (no hold), they fill the port up as the second allreduce starts, its bootstrap rounds
    come back marked and join the window: the allreduces after the first take 98-104 us against 71-80 us at 8
    racks, and the first 379 us."""
    uplink = dict(workers=N, uplink_queue=UPLINK_QUEUE)
    four, eight = (asic_run(True, racks=racks, leaf_hold=HOLD, **uplink) for racks in (4, 8))
    unheld = asic_run(True, racks=4, **uplink)
    assert max(four.times[1:]) < 1.05 * max(eight.times[1:]) and max(four.times[1:]) < 0.8 * min(unheld.times[1:])
    assert four.queue_drops <= eight.queue_drops < unheld.queue_drops / 10 and four.times[0] < unheld.times[0] / 3


def test_a_result_lost_after_a_pending_costs_round_trips_not_the_rto_floor():
    """4 workers at 5% loss (the ``cnat8_loss_software`` golden's scenario, seed 2). Rank 0's tail probe of its last
    slot is answered by a PENDING: a peer's datagram was lost. The peer's own probe completes the round, and the
    result is lost on the way to rank 0. With nothing sent later to overtake the slot, it waited its own timer, the
    RTO's floor (the allreduce took 52.0 ms). Its tail probe after the PENDING recovers it in round trips
    (docs/window.md, "A tail loss after a PENDING")."""
    r = simulate(PacketRun(workers=4, elements=60000, codec="cnat8", packet_elements=256, pool=8, rate=1e9,
                           switch="software", loss=0.05, rounds=1, seed=2, check=True))
    print(f"\n4 workers, 5% loss, seed 2: {r.times[0] * 1e3:.2f} ms, retransmissions {r.retransmissions}")
    assert r.exact and r.times[0] < 0.005


def test_a_spent_tail_probe_is_followed_by_a_second_not_the_rto_floor():
    """4 workers at 5% loss (the ``cnat8_loss_software`` golden's scenario, seed 6). At the second allreduce's end
    ranks 0-2 had one slot in flight each, the same chunk, whose round rank 3's PENDING showed incomplete. Their
    tail probes were spent by 204.1 ms, no answer restarting a silence, and a probe of a core's one slot in flight
    is a whole round of probes: each core backed off, and its next probe waited twice the RTO's floor (the
    allreduce took 102.1 ms). The second tail probe, a tail probe's wait after the first, recovers it in round
    trips (docs/window.md, "A second tail probe")."""
    r = simulate(PacketRun(workers=4, elements=60000, codec="cnat8", packet_elements=256, pool=8, rate=1e9,
                           switch="software", loss=0.05, rounds=2, seed=6, check=True))
    print(f"\n4 workers, 5% loss, seed 6: {r.times[1] * 1e3:.2f} ms, retransmissions {r.retransmissions}")
    assert r.exact and r.times[1] < 0.005
