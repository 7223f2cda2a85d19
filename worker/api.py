"""The public worker API: join a job on an aggregator and allreduce numpy arrays through it.

    from intml.worker import Worker
    with Worker("127.0.0.1:48879", job=7, rank=0, world_size=4, token="s3cret") as w:
        g = w.allreduce(grad, op="mean")

A Worker drives the sans-I/O StreamEngine with a burst socket: it blocks in poll() until a result arrives or
the next retransmission is due. ``allreduce_async`` does the same on an asyncio event loop.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import select
import socket
import time

import numpy as np

from intml.burstio.mmsg import BurstSocket, addr_key, addr_of
from intml.protocol import wire
from intml.protocol.packet import HDR
from intml.protocol.wire import Codec, MsgType
from intml.worker.engine import StreamEngine

CODECS = {"cnat8": Codec.CNAT8, "int32": Codec.INT32}
JOIN_RESEND = 0.2  # seconds between JOIN retransmissions


class AllreduceTimeout(TimeoutError):
    """No progress by the deadline: an unreachable aggregator or a missing peer."""


class JoinError(RuntimeError):
    """The aggregator refused the JOIN (its reason is the message)."""


def token_hash(token: str) -> int:
    """The 64-bit job token carried on the wire (the shared secret itself never is)."""
    return int.from_bytes(hashlib.blake2b(token.encode(), digest_size=8).digest(), "big")


def parse_address(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"aggregator address must be host:port, got {text!r}")
    return socket.gethostbyname(host or "127.0.0.1"), int(port)


def _group_socket(group: int, host: str, port: int) -> socket.socket:
    """A socket receiving the job's results multicast group (an address key) on the interface that reaches the
    aggregator at host:port. Workers on one host share the group's port (SO_REUSEADDR): each gets a copy."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((host, port))  # no traffic: just the route's local address
        local = probe.getsockname()[0]
    ip = socket.inet_ntoa((group >> 16).to_bytes(4, "big"))
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((ip, group & 0xFFFF))
    sock.setsockopt(socket.IPPROTO_IP, socket.IP_ADD_MEMBERSHIP, socket.inet_aton(ip) + socket.inet_aton(local))
    return sock


class Worker:
    """One rank of one job. Joins on construction; ``close()`` (or leaving the ``with`` block) leaves the job."""

    def __init__(self, aggregator: str, *, job: int, rank: int, world_size: int, token: str = "",
                 codec: str = "cnat8", packet_elements: int = 1024, pool_size: int = 64, seed: int = 0,
                 timeout: float = 30.0, rto: float = 0.05, min_rto: float = 0.05, max_rto: float = 1.0,
                 burst: int = 256,
                 transport=None) -> None:
        if codec not in CODECS:
            raise ValueError(f"codec must be one of {sorted(CODECS)}, got {codec!r}")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank must be in [0, {world_size}), got {rank}")
        if not 0 <= job <= 0xFFFFFFFE:
            raise ValueError(f"job must be in [0, 2**32 - 2], got {job}")
        limit = wire.max_packet_elements(CODECS[codec])
        if not 1 <= packet_elements <= limit or not 1 <= pool_size <= 0xFFFF:
            raise ValueError(f"packet_elements must be in [1, {limit}] for {codec} and pool_size in [1, 65535]")
        self.host, self.port = parse_address(aggregator)
        self.job, self.rank, self.world_size = job, rank, world_size
        self.codec = CODECS[codec]
        self.timeout = timeout
        self._join_params = dict(world_size=world_size, packet_elements=packet_elements, pool_size=pool_size,
                                 codec=int(self.codec), seed=seed, token=token_hash(token))
        sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        sock.bind(("0.0.0.0", 0))
        # room for any datagram: a statistics reply can be longer than a data packet
        rx_burst = max(burst, 2 * pool_size)
        self.io = BurstSocket(sock, burst=rx_burst, max_packet=wire.MAX_DATAGRAM)
        if transport is not None:
            self.io = transport(self.io)  # e.g. worker.faults.FaultyTransport for tests
        self._poll = select.poll()  # every socket results arrive on
        self._poll.register(self.io.fileno(), select.POLLIN)
        self._control_poll = select.poll()  # control replies come to this socket only
        self._control_poll.register(self.io.fileno(), select.POLLIN)
        self.cores, groups = self._join_all()
        self._inputs = [self.io]  # sockets results arrive on: this one, and the job's multicast groups if any
        self.results_groups = ["%s:%d" % addr_of(g) for g in groups]  # where the cores multicast completions
        self._closed = False
        for group, name in zip(groups, self.results_groups):
            try:
                results = BurstSocket(_group_socket(group, self.host, self.port), burst=rx_burst,
                                      max_packet=wire.MAX_DATAGRAM)
            except OSError as exc:
                self.close()  # leave the job: a retry must not find this rank still bound
                raise JoinError(f"{self._who()}: cannot receive the job's results on multicast group {name}: "
                                f"{exc.strerror or exc}") from None
            self._inputs.append(results if transport is None else transport(results))
            self._poll.register(results.fileno(), select.POLLIN)
        agg = [addr_key(self.host, self.port + i) for i in range(self.cores)]
        self.engine = StreamEngine(job=job, rank=rank, world_size=world_size, codec=self.codec,
                                   packet_elements=packet_elements, pool_size=pool_size, seed=seed, agg_addrs=agg,
                                   rto=rto, min_rto=min_rto, max_rto=max_rto)

    # ---- membership -------------------------------------------------------------------------------------
    def _who(self) -> str:
        return f"job {self.job} rank {self.rank}"

    def _join_all(self) -> tuple[int, list[int]]:
        """Join every core; returns (cores, the distinct results groups the cores named, as address keys). The
        cores place a job in their tables independently, so they may name different groups."""
        acks = [self._join(self.port)]
        cores = int(acks[0]["cores"])
        acks += [self._join(self.port + i) for i in range(1, cores)]
        groups = {int(ack["group"]) << 16 | int(ack["group_port"]) for ack in acks if ack["group"]}
        return cores, sorted(groups)

    def _join(self, port: int) -> np.void:
        request = wire.pack_join({"type": int(MsgType.JOIN), "job": self.job, "rank": self.rank}, self._join_params)
        target = addr_key(self.host, port)
        deadline = time.monotonic() + self.timeout
        while time.monotonic() < deadline:
            self.io.send_one(request, target)
            for data in self._control_replies(target, JOIN_RESEND):
                typ = data[wire.OFFSETS["type"]]
                if typ == MsgType.JOIN_ACK:
                    return wire.unpack_join(data)[1]
                if typ == MsgType.ERROR:
                    raise JoinError(f"{self._who()}: aggregator {self.host}:{port} refused the join: "
                                    f"{data[HDR:].decode(errors='replace')}")
        raise AllreduceTimeout(f"{self._who()}: no answer to JOIN from aggregator {self.host}:{port} within "
                               f"{self.timeout} s; is intml-aggregator running there and reachable?")

    def _control_replies(self, source: int, wait: float):
        """Yield the control datagrams (not results) from `source` arriving within `wait` seconds."""
        end = time.monotonic() + wait
        while (left := end - time.monotonic()) > 0:
            if not self._control_poll.poll(left * 1000):
                continue
            n = self.io.recv_burst()
            for i in range(n):
                length = int(self.io.rx_len[i])
                if length >= HDR and int(self.io.rx_addr[i]) == source:
                    data = bytes(self.io.rx_data[i, :length])
                    if data[wire.OFFSETS["type"]] != MsgType.RESULT:
                        yield data

    def close(self) -> None:
        """Leave the job (the aggregator frees its slots when every rank has left) and close the socket."""
        if self._closed:
            return
        self._closed = True
        leave = wire.pack({"type": int(MsgType.LEAVE), "job": self.job, "rank": self.rank})
        for i in range(self.cores):
            try:
                self.io.send_one(leave, addr_key(self.host, self.port + i))
            except OSError:
                pass  # best effort: an idle job is torn down anyway
        for rx in self._inputs:
            rx.sock.close()

    def __enter__(self) -> Worker:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- allreduce --------------------------------------------------------------------------------------
    def _prepare(self, x: np.ndarray, op: str, out: np.ndarray | None,
                 sent: np.ndarray | None) -> tuple[np.ndarray, float]:
        if op not in ("sum", "mean"):
            raise ValueError(f"op must be 'sum' or 'mean', got {op!r}")
        if self._closed:
            raise RuntimeError(f"{self._who()}: the worker is closed")
        arr = np.asarray(x)
        if arr.dtype.kind != "f":
            raise TypeError(f"allreduce takes a floating-point array, got {arr.dtype}")
        now = time.monotonic()
        n = self.engine.start(arr, now, self.io.tx_ptr, self.io.tx_len, self.io.tx_addr, out, sent=sent)
        self._send(n)
        return arr, now

    def _send(self, n: int) -> None:
        if n:
            self.io.send_burst(n)  # anything the kernel would not take is retransmitted on timeout

    def _pump(self, now: float) -> bool:
        """Drain received results and fire due retransmissions; True if a chunk completed."""
        before = self.engine.progress
        io = self.io
        for rx in self._inputs:
            while (n := rx.recv_burst()) > 0:
                self._send(self.engine.receive(rx.rx_data, rx.rx_len, rx.rx_addr, n, now, io.tx_ptr, io.tx_len,
                                               io.tx_addr))
        self._send(self.engine.handle_timer(now, io.tx_ptr, io.tx_len, io.tx_addr))
        return self.engine.progress != before or self.engine.done

    def _wait(self, last_progress: float) -> float:
        """Seconds until the next retransmission or the progress deadline, whichever is first."""
        return min(self.engine.get_timer(), last_progress + self.timeout) - time.monotonic()

    def _step(self, last_progress: float) -> float:
        """Pump once; returns the time of the last progress, or raises AllreduceTimeout past the deadline."""
        now = time.monotonic()
        if self._pump(now):
            return now
        if now - last_progress >= self.timeout:
            self.engine.check_finite()  # the real cause, if this rank stopped sending at a NaN or infinity
            raise AllreduceTimeout(self._timeout_message())
        return last_progress

    def _finish(self, arr: np.ndarray, op: str, out: np.ndarray | None) -> np.ndarray:
        self.engine.check_finite()
        out = self.engine.result.reshape(arr.shape) if out is None else out
        if op == "mean":
            out /= np.float32(self.world_size)
        return out

    def allreduce(self, x: np.ndarray, op: str = "sum", out: np.ndarray | None = None, *,
                  sent: np.ndarray | None = None) -> np.ndarray:
        """Sum (or mean) of x over all ranks, as float32 of x's shape; identical at every rank.

        ``out``: a C-contiguous float32 array of x.size elements to write the result into and return (x itself
        for an in-place allreduce, as torch.distributed does); reusing one across calls avoids allocating and
        page-faulting a tensor-sized result every time. ``sent``: a float32 array of the same layout that receives
        what this rank put on the wire, decoded (before the mean's division; see StreamEngine.start)."""
        arr, last_progress = self._prepare(x, op, out, sent)
        while not self.engine.done:
            if (wait := self._wait(last_progress)) > 0:
                self._poll.poll(wait * 1000)
            last_progress = self._step(last_progress)
        return self._finish(arr, op, out)

    async def allreduce_async(self, x: np.ndarray, op: str = "sum", out: np.ndarray | None = None, *,
                              sent: np.ndarray | None = None) -> np.ndarray:
        """allreduce on the running asyncio event loop (other tasks run while waiting for results)."""
        loop = asyncio.get_running_loop()
        readable = asyncio.Event()
        for rx in self._inputs:
            loop.add_reader(rx.fileno(), readable.set)
        try:
            arr, last_progress = self._prepare(x, op, out, sent)
            while not self.engine.done:
                if (wait := self._wait(last_progress)) > 0:
                    try:
                        await asyncio.wait_for(readable.wait(), wait)
                    except asyncio.TimeoutError:
                        pass
                readable.clear()
                last_progress = self._step(last_progress)
            return self._finish(arr, op, out)
        finally:
            for rx in self._inputs:
                loop.remove_reader(rx.fileno())

    def _timeout_message(self) -> str:
        done, chunks = self.engine.progress
        base = (f"{self._who()}: allreduce #{self.engine.allreduce_seq} made no progress for {self.timeout} s "
                f"({done}/{chunks} chunks done, {len(self.engine.pending_slots())} slots waiting)")
        missing, silent = self._ask_missing_ranks()
        if missing is None:
            return base + f"; the aggregator {self.host}:{self.port} did not answer a statistics request"
        if silent is None:
            return base + (f"; the aggregator no longer knows job {self.job} (torn down after its --idle-timeout, "
                           f"or restarted): create the Worker again to rejoin")
        if not missing:
            return base + "; the aggregator holds no incomplete round for this job (results lost?)"
        silence = ", ".join(f"rank {r} silent {silent.get(str(r), '?')} s" for r in missing)
        return base + f"; waiting for ranks {missing} ({silence})"

    def _ask_missing_ranks(self) -> tuple[list[int] | None, dict | None]:
        """Ask every core for the job's incomplete rounds: the union of their missing ranks (None: no answer)
        and how long each rank has been silent (None: no core knows the job)."""
        request = wire.pack({"type": int(MsgType.STATS_REQUEST), "job": self.job, "rank": self.rank})
        missing: set[int] = set()
        silent: dict | None = None
        answered = False
        for i in range(self.cores):
            target = addr_key(self.host, self.port + i)
            self.io.send_one(request, target)
            for data in self._control_replies(target, 0.5):
                if data[wire.OFFSETS["type"]] != MsgType.STATS_REPLY:
                    continue
                answered = True
                job = json.loads(data[HDR:]).get("jobs", {}).get(str(self.job))
                if job:
                    silent = {**(silent or {}), **job["silent_s"]}
                    for round_ in job["pending"]:
                        missing.update(round_["missing_ranks"])
                break
        return (sorted(missing) if answered else None), silent

    def counters(self) -> dict[str, int]:
        """Packets, retransmissions and drops seen by this worker."""
        return self.engine.counters()

    def __repr__(self) -> str:
        return f"Worker({self.host}:{self.port}, job={self.job}, rank={self.rank}/{self.world_size}, {self.codec.name})"
