"""The aggregator's data plane with GRO: datagrams already read from the socket (a coalesced read cut into more
rows than one wakeup takes) are served without waiting for the socket to become readable again."""

from __future__ import annotations

import asyncio
import socket

import numpy as np
import pytest

from intml.aggregator.dataplane import BURSTS_PER_WAKEUP, DataPlane
from intml.burstio.mmsg import BurstSocket, addr_key
from intml.protocol.burst import Burst

pytestmark = pytest.mark.process


class CountingCore:
    """Just enough of an AggregatorCore for DataPlane: counts the datagrams it is handed, answers nothing."""

    max_elements = 64
    marks = False

    def __init__(self) -> None:
        self.received = 0
        self.out = Burst.rows_of(1, 1)

    def receive(self, rx: Burst, now: float) -> Burst:
        self.received += rx.count
        return self.out

    def take_replies(self) -> list:
        return []

    def count_send_failures(self, n: int) -> None:
        pass


def test_pending_gro_reads_are_served_without_new_datagrams(monkeypatch) -> None:
    monkeypatch.setenv("INTML_GSO", "1")
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as a, socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as b:
        a.bind(("127.0.0.1", 0))
        b.bind(("127.0.0.1", 0))
        core = CountingCore()
        plane = DataPlane(core, b, burst=1)  # one row per burst: a wakeup takes BURSTS_PER_WAKEUP datagrams
        assert plane.io.gro
        sender = BurstSocket(a, burst=1 + BURSTS_PER_WAKEUP, max_packet=64, gso=True)
        n = 1 + BURSTS_PER_WAKEUP  # a single datagram, then one GSO run: the wakeup leaves one row of it read
        sender.tx_data[:n] = np.arange(n, dtype=np.uint8)[:, None]
        sender.tx_len[:n] = [10] + [40] * BURSTS_PER_WAKEUP
        sender.tx_addr[:n] = addr_key(*b.getsockname())
        assert sender.send_burst(n) == n

        async def serve() -> None:
            loop = asyncio.get_running_loop()
            loop.add_reader(plane.io.fileno(), plane.on_readable)
            try:
                for _ in range(200):
                    if core.received == n:
                        return
                    await asyncio.sleep(0.01)
            finally:
                loop.remove_reader(plane.io.fileno())

        asyncio.run(serve())
        assert core.received == n and not plane.io.pending


class EndlessPending:
    """A BurstSocket stand-in whose read rows never run out (``pending``) and that has nothing new to read."""

    pending, send_failed = True, 0

    def recv_burst(self) -> int:
        return 0

    def send(self, burst: Burst) -> None:
        pass


def test_pending_reads_schedule_one_return_however_often_the_reader_fires() -> None:
    """While reads are pending the data plane comes back on the next loop iteration, once: a wakeup by the reader
    while a return is already scheduled must not start a second chain (the chains grew by one per iteration and
    starved the timers)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.bind(("127.0.0.1", 0))
        plane = DataPlane(CountingCore(), s, burst=1)
        plane.io = EndlessPending()
        calls = 0
        on_readable = plane.on_readable

        def counted() -> None:
            nonlocal calls
            calls += 1
            on_readable()

        plane.on_readable = counted

        async def run() -> int:
            for _ in range(5):  # the reader fires five times before the loop turns
                plane.on_readable()
            for _ in range(20):
                await asyncio.sleep(0)
            return calls

        assert asyncio.run(run()) <= 5 + 20, calls  # the five wakeups, then at most one return per loop iteration
