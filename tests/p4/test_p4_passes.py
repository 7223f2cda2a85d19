"""A packet's passes on a real switch: other packets' passes run between them (BMv2 gives each egress port a
thread, and every packet recirculates through its own port), and a packet can be lost between two passes (a full
egress queue). Whatever the schedule, the ranks receive the aggregator core's result, byte for byte (a re-send
with its STORED mark), once they retransmit what they have no result for; no schedule makes the switch send
another result. The pipeline model
(intml.p4.model, ``enter``) runs the program's passes one at a time; every schedule of two contributions of three
passes each, with and without a loss after each pass, is tried."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from support.harness import stored, worker_addr
from test_p4_model import data, joined

from intml.protocol.wire import MsgType

ELEMENTS = 150  # three passes
RANKS = (0, 1)


def codes(seed: int) -> np.ndarray:
    """Valid C_nat codes: 0 or ±2^k with small k (data_bound admits them at exponent 0 for n = 2)."""
    rng = np.random.default_rng(seed)
    k = rng.integers(0, 8, ELEMENTS)
    return np.where(rng.random(ELEMENTS) < 0.1, 0, 0x40 | k | (rng.random(ELEMENTS) < 0.5) * 0x80).astype(np.uint8)


def schedules(losses: bool):
    """(order of pass steps by rank, {rank: passes after which it is lost}) for every interleaving of the two
    ranks' three passes, and, with ``losses``, every point one packet is lost after a pass that is not its last."""
    for slots in itertools.combinations(range(6), 3):
        order = [0 if i in slots else 1 for i in range(6)]
        yield order, {}
        if losses:
            for rank in RANKS:
                for after in (1, 2):
                    yield order, {rank: after}


def run(schedule: list[int], lost: dict[int, int], previous: bool):
    """The round (allreduce 2) under ``schedule``, then each rank's retransmission until it has a result. Returns
    the results each rank received (not the PENDINGs) and the reference's result."""
    _, ref, model = joined(2, ELEMENTS)
    if previous:  # a complete earlier round on the same set: its sums are in the lanes
        for rank in RANKS:
            packet = data(rank, 0, codes(10 + rank))
            assert model.receive(packet, worker_addr(rank), 0.0) == ref.receive(packet, worker_addr(rank))
    packets = {rank: data(rank, 2, codes(rank)) for rank in RANKS}
    expected = [out for rank in RANKS for out in ref.receive(packets[rank], worker_addr(rank))]
    assert len(expected) == 2 and {addr for _, addr in expected} == {worker_addr(r) for r in RANKS}
    result = expected[0][0]
    flights = {rank: model.enter(packets[rank], worker_addr(rank), 0.0) for rank in RANKS}
    steps = {rank: 0 for rank in RANKS}
    received: dict[int, list[bytes]] = {rank: [] for rank in RANKS}

    def deliver(sent):
        for datagram, addr in sent:
            if datagram[3] != MsgType.PENDING:  # (the round waits on the other rank: the timer goes on)
                received[next(r for r in RANKS if worker_addr(r) == addr)].append(datagram)

    for rank in schedule:
        if rank not in flights or steps[rank] == lost.get(rank):
            continue  # finished, or lost between passes
        out = next(flights[rank])
        steps[rank] += 1
        if out is not None:
            deliver(out)
            del flights[rank]
    for _ in range(3):  # the ranks' timers: a retransmission per rank that has no result
        for rank in RANKS:
            if not received[rank]:
                deliver(model.receive(packets[rank], worker_addr(rank), 0.0))
    return received, result


@pytest.mark.parametrize("previous", [False, True])
def test_interleaved_passes_give_the_cores_result(previous: bool) -> None:
    """Finding: a completion's pass 1 ran before the opener's pass 1 and added onto the previous round's lane."""
    for schedule, lost in schedules(losses=False):
        received, result = run(schedule, lost, previous)
        for rank in RANKS:
            assert received[rank] and set(received[rank]) <= {result, stored(result)}, (schedule, rank)


@pytest.mark.parametrize("previous", [False, True])
def test_a_packet_lost_between_passes_is_repaired_by_retransmission(previous: bool) -> None:
    """Finding: a contribution (or the completing packet) lost after pass 0 kept its bit, its retransmission was
    dropped as a known rank, and re-sends returned stale codes of the later passes."""
    tried = 0
    for schedule, lost in schedules(losses=True):
        if not lost:
            continue
        tried += 1
        received, result = run(schedule, lost, previous)
        for rank in RANKS:
            assert received[rank] and set(received[rank]) <= {result, stored(result)}, (schedule, lost, rank)
            assert all(d[3] == MsgType.RESULT for d in received[rank])
    assert tried == 20 * 4


def test_back_to_back_passes_send_the_completion_at_once() -> None:
    """No interleaving, no loss: the completing packet multicasts the result (no retransmission needed)."""
    _, ref, model = joined(2, ELEMENTS)
    for rank in RANKS:
        packet = data(rank, 2, codes(rank))
        assert model.receive(packet, worker_addr(rank), 0.0) == ref.receive(packet, worker_addr(rank))
        assert model.last_passes == 3
