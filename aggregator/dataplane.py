"""The aggregator's data-plane driver: moves bursts between a UDP socket and an AggregatorCore.

uvloop handles readiness and timers only; every datagram is handled inside the core's Numba kernel, received
and sent in bursts (recvmmsg/sendmmsg over preallocated buffers, burstio.mmsg), never as a Python object.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import sys
import time

import numpy as np
import uvloop

from intml.aggregator.congestion import deep_queue, mark_results
from intml.aggregator.core import AggregatorCore
from intml.aggregator.datapath import job_name
from intml.aggregator.slots import result_width
from intml.burstio.mmsg import BurstSocket
from intml.protocol import keys, wire
from intml.protocol.address import addr_key_of
from intml.protocol.burst import Burst
from intml.protocol.job import BURST, CODEC_NAMES
from intml.protocol.packet import HDR
from intml.protocol.wire import NO_EXP, MsgType

BURSTS_PER_WAKEUP = 64  # then yield to the event loop so timers and other sockets are served


class DataPlane:
    def __init__(self, core: AggregatorCore, sock: socket.socket, *, burst: int = BURST,
                 stats_interval: float = 0.0) -> None:
        self.core = core
        max_packet = result_width(core.max_elements)  # the largest DATA datagram is as long as the largest RESULT
        self.io = BurstSocket(sock, burst=burst, max_packet=max_packet)
        self.stats_interval = stats_interval
        self._return_scheduled = False

    def on_readable(self) -> None:
        """The data plane first: every burst waiting (up to BURSTS_PER_WAKEUP) is received, aggregated and its
        results sent, marked if a full burst left a deep queue behind (aggregator.congestion); only then does the
        control plane answer the control datagrams the kernel admitted."""
        for _ in range(BURSTS_PER_WAKEUP):
            n = self.io.recv_burst()
            if n == 0:
                break
            tx = self.core.receive(self.io.rx, time.monotonic())
            mark_results(tx, n == self.io.burst and deep_queue(self.io.sock), self.core.marks)
            self.io.send(tx)
        if self.io.pending and not self._return_scheduled:  # datagrams already read (GRO) do not make the socket
            self._return_scheduled = True  # readable: come back for them, once (the reader's calls must not
            asyncio.get_running_loop().call_soon(self._come_back)  # each start another chain of returns)
        for reply, addr in self.core.take_replies():
            try:
                self.io.send_one(reply, addr)
            except OSError:  # a destination the kernel refuses, or a socket full past send_timeout
                self.io.send_failed += 1
        self.core.count_send_failures(self.io.send_failed)
        self.io.send_failed = 0

    def _come_back(self) -> None:
        self._return_scheduled = False
        self.on_readable()

    async def _idle_timer(self) -> None:
        while True:
            deadline = self.core.get_timer()
            await asyncio.sleep(1.0 if deadline is None else max(0.05, deadline - time.monotonic()))
            for job in self.core.handle_timer(time.monotonic()):
                print(f"core {self.core.core}: job {job_name(job)} idle for {self.core.idle_timeout} s, torn down",
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
    answered at once: a throwaway core takes a JOIN and a completing DATA packet of each codec (its results marked),
    and a loopback BurstSocket sends and receives one burst, with and without GRO (burstio's send and receive
    kernels)."""
    core = AggregatorCore(rows=2 * len(CODEC_NAMES), max_elements=max_elements, burst=burst)  # open mode: token ""
    member = 0x7F000001 << 16 | 1  # 127.0.0.1:1, never sent to

    def receive(datagram: bytes) -> list[tuple[bytes, int]]:
        rx = Burst.rows_of(1, len(datagram))
        rx.fill([(datagram, member)])
        mark_results(core.receive(rx, 0.0), False)
        return core.take_replies()

    for job, codec in enumerate(CODEC_NAMES.values(), start=1):
        params = {"world_size": 1, "packet_elements": 1, "pool_size": 1, "codec": int(codec), "nonce": bytes(16)}
        join = {"type": int(MsgType.JOIN), "job": job, "rank": 0}
        [(challenge, _)] = receive(wire.pack_join(join, params))  # the handshake, then a DATA packet: one per burst
        proved = wire.pack_join(join, {**params, "cookie": bytes(wire.unpack_challenge(challenge)[1]["cookie"])})
        receive(keys.seal(keys.token_key(""), proved, wire.JOIN_MAC))
        data = {"type": int(MsgType.DATA), "job": job, "count": 1, "codec": int(codec), "exp": 0, "next_exp": NO_EXP}
        receive(wire.pack(data, np.zeros(1, wire.payload_dtype(codec))))
    for gro in (False, True):  # both receive paths: GRO is on by default only for small datagrams (burstio)
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock, contextlib.suppress(OSError):
            sock.bind(("127.0.0.1", 0))  # no loopback (a bare network namespace): the kernels compile on first use
            io = BurstSocket(sock, burst=burst, max_packet=HDR, gro=gro)
            out = Burst.rows_of(1, HDR)
            out.fill([(bytes(HDR), addr_key_of(*sock.getsockname()))])
            io.send(out)
            deadline = time.monotonic() + 1.0
            while io.recv_burst() == 0 and time.monotonic() < deadline:
                time.sleep(0.001)


def run_core(core: AggregatorCore, sock: socket.socket, burst: int, stats_interval: float) -> None:
    """Serve one data-plane core until interrupted (the body of each --cores process)."""
    plane = DataPlane(core, sock, burst=burst, stats_interval=stats_interval)
    try:
        uvloop.run(plane.serve())
    except KeyboardInterrupt:
        pass
    finally:
        sys.stdout.flush()
