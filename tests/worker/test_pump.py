"""The worker's pump (worker.api.Worker._pump): how the engine's input reaches it in time and in order.

A loaded host's pump drained results for milliseconds while it sent next chunks. With one time read for the whole
pump, a slot sent and answered within it sampled a round trip of 0, SRTT fell to 0, and every answer to a
retransmission set off a burst at once: loss-free runs resent thousands of datagrams in a chain
(docs/window.md, "Two clocks in one pump"). The pump against stand-ins for the sockets and the engine; the order of a Worker's sockets against a live
aggregator."""

from __future__ import annotations

import time
from types import SimpleNamespace

import numpy as np
import pytest
from support.cluster import aggregator

from intml.worker.api import Worker

READ_DELAY = 0.002  # s a stand-in socket takes to deliver each burst: results arriving while the pump drains


class Input:
    """A socket with ``bursts`` bursts waiting, each delivered READ_DELAY after it is asked for."""

    def __init__(self, name: str, bursts: int, log: list) -> None:
        self.name, self.left, self.log = name, bursts, log
        self.rx = None

    def recv_burst(self) -> int:
        if not self.left:
            return 0
        time.sleep(READ_DELAY)
        self.left -= 1
        self.rx = (self.name, time.monotonic())  # what the engine receives: which socket, and when it was read
        return 1


class Engine:
    """Records the time each call was given."""

    progress = (0, 1)
    done = False

    def __init__(self) -> None:
        self.received: list[tuple[str, float, float]] = []  # (socket, read at, now given)
        self.timer_at: list[tuple[float, float]] = []  # (last read before, now given)

    def receive(self, rx: tuple[str, float], now: float) -> SimpleNamespace:
        self.received.append((*rx, now))
        return SimpleNamespace(count=0)

    def handle_timer(self, now: float) -> SimpleNamespace:
        self.timer_at.append((self.received[-1][1], now))
        return SimpleNamespace(count=0)


class Driver:
    """A Worker's step and pump over stand-ins: no session deadline, nothing to send."""

    _step, _pump = Worker._step, Worker._pump

    def __init__(self, inputs: list[Input]) -> None:
        self.engine, self._inputs = Engine(), inputs
        self.session = SimpleNamespace(watch_progress=lambda now: None, get_timer=lambda: None)

    def _send(self, burst) -> None:
        pass


def test_each_burst_is_taken_at_the_time_it_was_read() -> None:
    driver = Driver([Input("group", 3, []), Input("unicast", 2, [])])
    driver._step()
    received = driver.engine.received
    assert [name for name, _, _ in received] == ["group"] * 3 + ["unicast"] * 2  # each input drained in turn
    for name, read_at, now in received:
        assert now >= read_at, f"a {name} burst read at {read_at} taken at {now}: the pump's start, a stale time"
    (last_read, timer_now), = driver.engine.timer_at
    assert timer_now >= last_read


@pytest.mark.process
def test_a_worker_drains_its_results_group_before_its_own_socket() -> None:
    """A round's result goes to the group when the round completes; a re-send of it (STORED) comes to the rank's
    own socket only later, in answer to a duplicate. Drained first, the re-send was taken as the result."""
    with aggregator("--multicast", "239.255.77.1") as agg, \
            Worker(agg.address, job=7, rank=0, world_size=1, token="t", codec="int32") as w:
        assert len(w._inputs) == 2 and w._inputs[0] is not w.io and w._inputs[-1] is w.io
        assert (w.allreduce(np.ones(5, np.float32)) == 1.0).all()
