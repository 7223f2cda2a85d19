"""The aggregator's data-plane driver: moves bursts between a UDP socket and an AggregatorCore.

uvloop handles readiness and timers only; every datagram is handled inside the core's Numba kernel, received
and sent in bursts (recvmmsg/sendmmsg over preallocated buffers, burstio.mmsg), never as a Python object.
"""

from __future__ import annotations

import asyncio
import json
import socket
import sys
import time

import numpy as np
import uvloop

from intml.aggregator.core import AggregatorCore
from intml.burstio.mmsg import BurstSocket
from intml.protocol import wire
from intml.protocol.job import CODEC_NAMES
from intml.protocol.packet import HDR
from intml.protocol.wire import NO_EXP, MsgType

BURSTS_PER_WAKEUP = 64  # then yield to the event loop so timers and other sockets are served


class DataPlane:
    def __init__(self, core: AggregatorCore, sock: socket.socket, *, burst: int = 256,
                 stats_interval: float = 0.0) -> None:
        self.core = core
        max_packet = HDR + 4 * core.max_elements
        self.io = BurstSocket(sock, burst=burst, max_packet=max_packet)
        self.stats_interval = stats_interval

    def on_readable(self) -> None:
        for _ in range(BURSTS_PER_WAKEUP):
            if self.io.recv_burst() == 0:
                return
            self.io.send(self.core.receive(self.io.rx, time.monotonic()))
            for reply, addr in self.core.take_replies():
                try:
                    self.io.send_one(reply, addr)
                except OSError:  # a destination the kernel refuses, or a socket full past send_timeout
                    self.io.send_failed += 1
            self.core.count_send_failures(self.io.send_failed)
            self.io.send_failed = 0

    async def _idle_timer(self) -> None:
        while True:
            deadline = self.core.get_timer()
            await asyncio.sleep(1.0 if deadline is None else max(0.05, deadline - time.monotonic()))
            for job_id in self.core.handle_timer(time.monotonic()):
                print(f"core {self.core.core}: job {job_id} idle for {self.core.idle_timeout} s, torn down",
                      flush=True)

    async def _stats_timer(self) -> None:
        while True:
            await asyncio.sleep(self.stats_interval)
            print(json.dumps(self.core.stats(time.monotonic())), flush=True)

    async def serve(self) -> None:
        loop = asyncio.get_running_loop()
        loop.add_reader(self.io.fileno(), self.on_readable)
        tasks = [asyncio.ensure_future(self._idle_timer())]
        if self.stats_interval > 0:
            tasks.append(asyncio.ensure_future(self._stats_timer()))
        try:
            await asyncio.gather(*tasks)
        finally:
            loop.remove_reader(self.io.fileno())


def warm_up(max_elements: int, burst: int) -> None:
    """Compile (or load from Numba's cache) every kernel the data plane runs, so that the first packet is
    answered at once: a throwaway core takes a JOIN and a completing DATA packet of each codec, received and
    sent through a loopback BurstSocket (burstio's receive and send kernels)."""
    core = AggregatorCore(rows=2 * len(CODEC_NAMES), max_elements=max_elements, burst=burst)
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.bind(("127.0.0.1", 0))
        io = BurstSocket(sock, burst=burst, max_packet=HDR + 4 * max_elements)
        datagrams = []
        for job, codec in enumerate(CODEC_NAMES.values(), start=1):
            params = {"world_size": 1, "packet_elements": 1, "pool_size": 1, "codec": int(codec), "seed": 0,
                      "token": 0, "cores": 0}
            datagrams.append(wire.pack_join({"type": int(MsgType.JOIN), "job": job, "rank": 0}, params))
            data = {"type": int(MsgType.DATA), "job": job, "count": 1, "codec": int(codec), "exp": 0,
                    "next_exp": NO_EXP}
            datagrams.append(wire.pack(data, np.zeros(1, wire.payload_dtype(codec))))
        for datagram in datagrams:
            sock.sendto(datagram, sock.getsockname())
        received = 0
        deadline = time.monotonic() + 5.0
        while received < len(datagrams) and time.monotonic() < deadline:
            if io.recv_burst(1) == 0:  # one at a time: each JOIN is handled before its job's DATA
                time.sleep(0.001)
                continue
            received += 1
            io.send(core.receive(io.rx, time.monotonic()))
            for reply, addr in core.take_replies():
                io.send_one(reply, addr)


def run_core(core: AggregatorCore, sock: socket.socket, burst: int, stats_interval: float) -> None:
    """Serve one data-plane core until interrupted (the body of each --cores process)."""
    plane = DataPlane(core, sock, burst=burst, stats_interval=stats_interval)
    try:
        uvloop.run(plane.serve())
    except KeyboardInterrupt:
        pass
    finally:
        sys.stdout.flush()
