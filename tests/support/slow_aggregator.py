"""A deliberately slowed aggregator for overload tests: the real data plane (aggregator.dataplane.DataPlane) and
core over a real loopback UDP socket, in a forked process, except that the core's data path spends
``per_datagram`` seconds of each received burst's datagrams asleep before handling it, and the socket's receive
buffer is small. It so handles at most 1 / per_datagram datagrams a second whatever the machine's load (it
sleeps, it does not spin: the test's workers keep the CPU), and a queue longer than the buffer is dropped by the
kernel, as a switch's full queue drops.

``slow_aggregator(per_datagram, rcvbuf)`` yields a ``SlowAggregator``: its port, the receive buffer the kernel
granted, and ``counters()``, the core's totals (asked for over a pipe: its packets are too short for a
STATS_REQUEST).
"""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing as mp
import os
import signal
import socket
import time
from collections.abc import Iterator
from typing import Any, NamedTuple

import numpy as np
import uvloop
from support.cluster import HOST, TOKENS

from intml.aggregator.core import AggregatorCore
from intml.aggregator.dataplane import DataPlane, warm_up
from intml.aggregator.kernel import KernelDataPath
from intml.protocol.burst import Burst

MAX_ELEMENTS = 1024
BURST = 16  # datagrams per receive: a slowed core answers every BURST * per_datagram seconds, not in long silences


class SlowDataPath(KernelDataPath):
    """The kernel's data path, sleeping ``per_datagram`` seconds per received datagram before each burst."""

    def __init__(self, per_datagram: float, **kwargs) -> None:
        super().__init__(**kwargs)
        self.per_datagram = per_datagram

    def process(self, rx: Burst, now: float) -> tuple[Burst, np.ndarray]:
        time.sleep(self.per_datagram * rx.count)
        return super().process(rx, time.monotonic())


async def _serve_plane(plane: DataPlane, conn) -> None:
    def answer() -> None:
        conn.recv()
        conn.send(plane.core.stats(time.monotonic())["core_counters"])

    asyncio.get_running_loop().add_reader(conn.fileno(), answer)
    await plane.serve()


def _serve(conn, per_datagram: float, rcvbuf: int) -> None:
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.bind((HOST, 0))
    core = AggregatorCore(SlowDataPath(per_datagram, rows=256, max_elements=MAX_ELEMENTS, burst=BURST), tokens=TOKENS)
    plane = DataPlane(core, sock, burst=BURST)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)  # after BurstSocket asked for 64 MiB
    warm_up(MAX_ELEMENTS, BURST)
    conn.send((sock.getsockname()[1], sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF)))
    uvloop.run(_serve_plane(plane, conn))


class SlowAggregator(NamedTuple):
    port: int
    rcvbuf: int  # bytes, as the kernel granted (SO_RCVBUF doubles the request for its bookkeeping)
    conn: Any

    def counters(self) -> dict[str, int]:
        """The core's counters (protocol.stats.STAT_NAMES), totals over every job."""
        self.conn.send("counters")
        if not self.conn.poll(10.0):
            raise AssertionError("the slowed aggregator did not report its counters within 10 s")
        return self.conn.recv()


@contextlib.contextmanager
def slow_aggregator(per_datagram: float, rcvbuf: int) -> Iterator[SlowAggregator]:
    """Run the slowed aggregator until the block ends."""
    ctx = mp.get_context("fork")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_serve, args=(child, per_datagram, rcvbuf), daemon=True)
    proc.start()
    try:
        if not parent.poll(60.0):
            raise RuntimeError("the slowed aggregator did not start within 60 s")
        yield SlowAggregator(*parent.recv(), parent)
    finally:
        if proc.is_alive():
            os.kill(proc.pid, signal.SIGKILL)
        proc.join(timeout=5)

