"""The public worker API: join a job on an aggregator and allreduce numpy arrays through it.

    from intml.worker import Worker
    with Worker("127.0.0.1:48879", job=7, rank=0, world_size=4, token="s3cret") as w:
        g = w.allreduce(grad, op="mean")

A Worker is a thin socket driver of two sans-I/O objects: the control plane's ``WorkerSession`` (join, leave,
deadlines, statistics) and the data plane's ``StreamEngine``. It feeds them the datagrams it receives and the
clock, and sends what they hand out; it blocks in poll() until a datagram arrives or their next timer is due.
``allreduce_async`` does the same on an asyncio event loop.

A job may spread its slots over several aggregators: ``Worker("h1:p1,h2:p2", ...)`` (every rank lists the same
ones in the same order); the job's data plane is all their cores, in that order.
"""

from __future__ import annotations

import asyncio
import select
import socket
import threading
import time
from collections.abc import Callable

import numpy as np

from intml.burstio.mmsg import BurstSocket, addr_key, offload_default
from intml.protocol import wire
from intml.protocol.address import addr_of, format_addr
from intml.protocol.burst import Burst
from intml.protocol.job import BURST, ROUNDINGS, JobParams, WorkerTimers
from intml.worker.engine import StreamEngine
from intml.worker.host import HostStreamEngine
from intml.worker.session import (
    Event,
    JobJoined,
    JoinRefused,
    JoinTimedOut,
    NoProgress,
    StatsAnswered,
    WorkerSession,
)


class AllreduceTimeout(TimeoutError):
    """No progress by the deadline: an unreachable aggregator or a missing peer."""


class JoinError(RuntimeError):
    """The aggregator refused the JOIN (its reason is the message)."""


def parse_address(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"aggregator address must be host:port, got {text!r}")
    return socket.gethostbyname(host or "127.0.0.1"), int(port)


def parse_aggregators(text: str) -> list[tuple[str, int]]:
    """A job's aggregators, ``host:port[,host:port...]`` (each port that of the aggregator's core 0)."""
    return [parse_address(part.strip()) for part in text.split(",")]


def rank_socket(sock: socket.socket, burst: int, datagram: int) -> BurstSocket:
    """A rank's unicast socket: it takes any datagram (a statistics reply can be longer than a data packet), with
    GRO where the job's datagrams (``datagram`` bytes) are short enough for it to pay (burstio.mmsg.offload_default):
    a GRO read lands in a 64 KiB buffer, so the longest datagram still fits."""
    return BurstSocket(sock, burst=burst, max_packet=wire.MAX_DATAGRAM, gro=offload_default(datagram)[1])


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
                 codec: str = "cnat8", packet_elements: int = JobParams.packet_elements,
                 pool_size: int = JobParams.pool_size, seed: int = JobParams.seed,
                 timeout: float = WorkerTimers.timeout, rto: float = WorkerTimers.rto,
                 min_rto: float = WorkerTimers.min_rto, max_rto: float = WorkerTimers.max_rto,
                 burst: int = BURST, connect_timeout: float | None = None, data_mac: bool = False,
                 rounding: str = "stochastic") -> None:
        """``aggregator``: ``host:port``, or several, comma-separated: the job's slots are spread over all their
        cores (every rank must give the same list in the same order). ``token``: the job's shared secret, one
        the aggregator was started with (--token-file / INTML_TOKEN; "" for an aggregator in open mode); it
        never travels. ``timeout``: an allreduce that makes no progress
        this long raises AllreduceTimeout. ``connect_timeout``: how long the JOIN may wait for the aggregator
        (default: ``timeout``). ``data_mac``: DATA and RESULT packets carry a keyed MAC (every rank must agree).
        ``rounding``: "stochastic" (unbiased C_nat) or "nearest" (deterministic, biased: docs/rounding.md), at the
        workers and the switch; every rank must agree. ``codec``: "cnat8" or "int32", summed as a switch would, or
        a host codec's name (``uniform8``...: protocol.codecs.host), summed by the aggregator's host mode
        (docs/protocol.md, "Host mode"; float32 allreduces only)."""
        if rounding not in ROUNDINGS:
            raise ValueError(f"rounding must be one of {', '.join(ROUNDINGS)}, got {rounding!r}")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank must be in [0, {world_size}), got {rank}")
        if not 0 <= job <= 0xFFFFFFFE:
            raise ValueError(f"job must be in [0, 2**32 - 2], got {job}")
        params = JobParams.of(world_size=world_size, codec=codec, packet_elements=packet_elements,
                              pool_size=pool_size, seed=seed, data_mac=data_mac, nearest=rounding == "nearest")
        timers = WorkerTimers(timeout=timeout, connect_timeout=timeout if connect_timeout is None else connect_timeout,
                              rto=rto, min_rto=min_rto, max_rto=max_rto)
        self.aggregators = parse_aggregators(aggregator)
        self.host, self.port = self.aggregators[0]
        self.job, self.rank, self.world_size = job, rank, world_size
        self.codec = params.codec
        self.codec_name = codec
        self.host_codec = params.host_codec  # None for a switch codec
        self.timeout = timeout
        self.session = WorkerSession(job=job, rank=rank, params=params, token=token,
                                     aggregator=[addr_key(h, p) for h, p in self.aggregators], timeout=timeout,
                                     connect_timeout=timers.connect_timeout)
        sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        sock.bind(("0.0.0.0", 0))
        rx_burst = max(burst, 2 * pool_size)
        datagram = (wire.MAX_DATAGRAM if params.host_codec else
                    wire.element_datagram_size(params.codec, params.packet_elements, params.data_mac))
        self.io = rank_socket(sock, rx_burst, datagram)
        self._poll = select.poll()  # every socket results arrive on
        self._poll.register(self.io.fileno(), select.POLLIN)
        self._control_poll = select.poll()  # control replies come to this socket only
        self._control_poll.register(self.io.fileno(), select.POLLIN)
        # sockets results arrive on: the job's multicast groups if any (inserted before), then this one (_pump)
        self._inputs = [self.io]
        self._closed = False
        # held while a call drives the session and engine, so that the keepalive thread never runs beside it
        self._busy = threading.Lock()
        self._stop_keepalive = threading.Event()
        self._keepalive_thread: threading.Thread | None = None
        joined = self._join()
        self.cores = joined.cores
        self.results_groups = [format_addr(g) for g in joined.groups]  # where the cores multicast completions
        for group, name in zip(joined.groups, self.results_groups):
            try:
                via = next(addr for addr, ack in self.session.acks.items() if ack["group"] << 16 | ack["group_port"]
                           == group)  # a core that named the group: the interface that reaches it
                # only the job's results come to its group: rows of one result each, which lets GRO coalesce
                # them (a switch's, or a kernel's, replicated GSO batch arrives in one read)
                results = BurstSocket(_group_socket(group, *addr_of(via)), burst=rx_burst, max_packet=datagram)
            except OSError as exc:
                self.close()  # leave the job: a retry must not find this rank still bound
                raise JoinError(f"{self._who()}: cannot receive the job's results on multicast group {name}: "
                                f"{exc.strerror or exc}") from None
            self._inputs.insert(0, results)
            self._poll.register(results.fileno(), select.POLLIN)
        engine = dict(job=job, rank=rank, world_size=world_size, packet_elements=packet_elements, pool_size=pool_size,
                      seed=seed, agg_addrs=joined.addrs, rto=timers.rto, min_rto=timers.min_rto, max_rto=timers.max_rto,
                      data_mac_keys=joined.data_keys if data_mac else None)
        self.engine: StreamEngine | HostStreamEngine = (
            StreamEngine(codec=self.codec, nearest=params.nearest, **engine) if self.host_codec is None
            else HostStreamEngine(codec=self.host_codec, **engine))  # the aggregator's host mode sums it
        # where the job's peers are: a fresh job's start, or the next allreduce of one this rank rejoins
        self.engine.resume(joined.allreduce, joined.shadow_sets)

    # ---- control plane: the session's datagrams over the unicast socket ---------------------------------
    def _who(self) -> str:
        return f"job {self.job} rank {self.rank}"

    def _aggregator_name(self) -> str:
        return ",".join(f"{host}:{port}" for host, port in self.aggregators)

    def _control(self, wanted: tuple[type, ...]) -> Event:
        """Run the session over the unicast socket until it reports an event of a ``wanted`` type; returns it.
        Results arriving meanwhile are dropped, as no allreduce is running."""
        session = self.session
        while True:
            now = time.monotonic()
            while (event := session.next_event()) is not None:
                if isinstance(event, wanted):
                    return event
            for data, addr in session.datagrams_to_send(now):
                self.io.send_one(data, addr)
            timer = session.get_timer()
            if self._control_poll.poll(max(0.0, timer - now) * 1000 if timer is not None else None):
                now = time.monotonic()
                while self.io.recv_burst() > 0:
                    for data, addr in self.io.rx.datagrams():
                        session.receive(data, addr, now)
            if (timer := session.get_timer()) is not None and time.monotonic() >= timer:
                session.handle_timer(time.monotonic())

    def _join(self) -> JobJoined:
        """Join every core; returns the session's JobJoined (cores, the distinct results groups the cores named).
        The cores place a job in their tables independently, so they may name different groups."""
        self.session.connect(time.monotonic())
        event = self._control((JobJoined, JoinRefused, JoinTimedOut))
        if isinstance(event, (JoinRefused, JoinTimedOut)):
            self.close()  # LEAVE the cores that accepted: a retry must not find this rank still bound there
        if isinstance(event, JoinRefused):
            raise JoinError(f"{self._who()}: aggregator {format_addr(event.addr)} refused the join: "
                            f"{event.reason}")
        if isinstance(event, JoinTimedOut):
            raise AllreduceTimeout(f"{self._who()}: no answer to JOIN from aggregator {format_addr(event.addr)} "
                                   f"within {self.session.connect_timeout} s; is intml-aggregator running there and "
                                   f"reachable?")
        return event

    def start_keepalive(self) -> None:
        """Keep the job alive while this worker is idle (paused between allreduces for longer than the
        aggregator's idle timeout: an evaluation, a checkpoint, a debugger): a daemon thread sends the session's
        keepalives when due, until ``close()``. Nothing is sent while allreduces run."""
        if self._keepalive_thread is None and self.session.keepalive_every is not None and not self._closed:
            self._keepalive_thread = threading.Thread(target=self._keep_alive, daemon=True,
                                                      name=f"intml-keepalive-job{self.job}-rank{self.rank}")
            self._keepalive_thread.start()

    def _keep_alive(self) -> None:
        while True:
            with self._busy:
                if self._closed:
                    return
                now = time.monotonic()
                if (timer := self.session.get_timer()) is not None and timer <= now:
                    self.session.handle_timer(now)
                    self._send_control(now)
                timer = self.session.get_timer()
            # woken early by close(); the next due time, or (an allreduce left a deadline behind) a short nap
            if self._stop_keepalive.wait(max(0.01, timer - time.monotonic()) if timer is not None else 1.0):
                return

    def _send_control(self, now: float) -> None:
        for data, addr in self.session.datagrams_to_send(now):
            try:
                self.io.send_one(data, addr)
            except OSError:
                pass  # best effort: a keepalive or LEAVE lost is sent again, or the job ends on its idle timeout

    def close(self) -> None:
        """Leave the job (the aggregator frees its slots when every rank has left) and close the socket. The
        keepalive thread has ended when it returns."""
        if self._closed:
            return
        self._stop_keepalive.set()
        with self._busy:
            self._close()
        # Joined, not left to end on its own: the thread's end drops its reference to this worker (Thread.run deletes
        # its target), and where that is the last one the worker's arrays, views of torch tensors, are freed on the
        # thread. Freeing a tensor releases the GIL in C++; a daemon thread that retakes it while the interpreter
        # finalizes exits by unwinding, which C++ answers with std::terminate: a rank that had finished training died
        # with SIGABRT ("terminate called without an active exception").
        keepalive = self._keepalive_thread
        if keepalive is not None and keepalive is not threading.current_thread():
            keepalive.join(timeout=self.timeout)  # woken by the stop event, it has at most a keepalive left to send

    def _close(self) -> None:
        self._closed = True
        self.session.leave()
        self._send_control(time.monotonic())
        for rx in self._inputs:
            rx.sock.close()

    def __enter__(self) -> Worker:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- allreduce --------------------------------------------------------------------------------------
    def _prepare(self, x: np.ndarray, op: str, out: np.ndarray | None, sent: np.ndarray | None,
                 scatter: bool = False, dtype: str | None = None) -> np.ndarray:
        if op not in ("sum", "mean"):
            raise ValueError(f"op must be 'sum' or 'mean', got {op!r}")
        if self._closed:
            raise RuntimeError(f"{self._who()}: the worker is closed")
        arr = np.asarray(x)
        if arr.dtype.kind != "f" and dtype in (None, "float32"):
            raise TypeError(f"allreduce takes a floating-point array, or 16-bit words with dtype='bfloat16' or "
                            f"'float16', got {arr.dtype}")
        self._begin(lambda now: self.engine.start(arr, now, out, sent=sent, scatter=scatter, dtype=dtype,
                                                  mean=op == "mean"))
        return arr

    def _begin(self, start: Callable[[float], Burst]) -> None:
        now = time.monotonic()
        self._send(start(now))
        self.session.watch_progress(now)

    def _send(self, burst: Burst) -> None:
        if burst.count:
            self.io.send(burst)  # anything the kernel would not take is retransmitted on timeout

    def _pump(self) -> bool:
        """Drain received results and fire due retransmissions; True if a chunk completed.

        Each burst is taken at the time it was read. A pump drains for as long as results keep coming and sends
        next chunks as it goes, so with one time for the whole pump a slot sent and answered within it had a round
        trip of 0: SRTT fell to 0 on a loaded host, and every answer then set off its burst or tail probe at once
        (worker.retransmit; docs/window.md, "Two clocks in one pump"). The multicast groups are drained first,
        the order the aggregator sent in: a result sent again (STORED) comes to this socket only after its round's
        first sending to the group, and taken first it hid the proof that the retransmission was not needed."""
        engine = self.engine
        before = engine.progress
        for rx in self._inputs:
            while rx.recv_burst() > 0:
                self._send(engine.receive(rx.rx, time.monotonic()))
        self._send(engine.handle_timer(time.monotonic()))
        return engine.progress != before or engine.done

    def _wait(self) -> float:
        """Seconds until the next retransmission or the progress deadline, whichever is first."""
        timers = [t for t in (self.engine.get_timer(), self.session.get_timer()) if t is not None]
        return min(timers) - time.monotonic()

    def _step(self) -> None:
        """Pump once; raises AllreduceTimeout once the session says the allreduce made no progress in time."""
        session = self.session
        progressed = self._pump()
        now = time.monotonic()
        if progressed:
            session.watch_progress(now)
            return
        if (deadline := session.get_timer()) is None or deadline > now:
            return
        session.handle_timer(now)
        self._send_control(now)  # a keepalive, if the allreduce stalled for longer than its interval
        while (event := session.next_event()) is not None:
            if isinstance(event, NoProgress):
                raise AllreduceTimeout(self._timeout_message())

    def _finish(self, arr: np.ndarray, out: np.ndarray | None, scatter: bool = False) -> np.ndarray:
        self.session.unwatch_progress()
        if out is None:
            out = self.engine.result if scatter else self.engine.result.reshape(arr.shape)
        return out

    def allreduce(self, x: np.ndarray, op: str = "sum", out: np.ndarray | None = None, *,
                  sent: np.ndarray | None = None, dtype: str | None = None) -> np.ndarray:
        """Sum (or mean) of x over all ranks, of x's shape, as float32, or in x's 16-bit format for a bfloat16 or
        float16 x (``dtype``: "bfloat16" for bfloat16 words as uint16 or int16; a float16 array is float16 by
        default; see StreamEngine.start); identical at every rank.

        ``out``: a C-contiguous array of x.size elements (float32, or 16-bit for a 16-bit x) to write the result
        into and return (x itself for an in-place allreduce, as torch.distributed does); reusing one across calls
        avoids allocating and page-faulting a tensor-sized result every time. ``sent``: a float32 array of x.size
        elements that receives what this rank put on the wire, decoded (before the mean's division)."""
        return self._run(x, op, out, sent, scatter=False, dtype=dtype)

    def reduce_scatter(self, x: np.ndarray, op: str = "sum", out: np.ndarray | None = None, *,
                       dtype: str | None = None) -> np.ndarray:
        """This rank's shard of the sum (or mean) of x over all ranks: of the x.size elements (a multiple of the
        world size; any shape, flattened), the x.size / world_size from rank * x.size / world_size, as a flat
        float32 array. Bit for bit the allreduce of x restricted to the shard; the aggregator sends each chunk's
        sum only to the ranks whose shards it overlaps (docs/protocol.md, "Reduce-scatter"). ``out``: a
        C-contiguous array of the shard's size (float32, or 16-bit for a 16-bit x) to write it into and return.
        ``dtype``: as allreduce's."""
        return self._run(x, op, out, None, scatter=True, dtype=dtype)

    def _run(self, x: np.ndarray, op: str, out: np.ndarray | None, sent: np.ndarray | None, *,
             scatter: bool, dtype: str | None = None) -> np.ndarray:
        with self._busy:
            arr = self._prepare(x, op, out, sent, scatter, dtype)
            self._loop(None)
            return self._finish(arr, out, scatter)

    def _loop(self, tend: Callable[[float, Callable[[Burst], None]], float] | None) -> None:
        while not self.engine.done:
            wait = self._wait()
            if tend is not None:
                wait = min(wait, tend(time.monotonic(), self._send))
            if wait > 0:
                self._poll.poll(wait * 1000)
            self._step()

    def run_engine(self, start: Callable[[float], Burst],
                   tend: Callable[[float, Callable[[Burst], None]], float]) -> None:
        """Run one allreduce that ``start(now)`` begins on ``self.engine`` (returning its first datagrams) to
        completion, for a driver of the engine's own (worker.gpu: a precoded allreduce). ``tend(now, send)`` is
        called before each wait: it does the driver's work between the engine's calls, passes the datagrams those
        calls return to ``send``, and returns how long the worker may wait (seconds) before calling it again.
        Raises AllreduceTimeout as allreduce does."""
        with self._busy:
            if self._closed:
                raise RuntimeError(f"{self._who()}: the worker is closed")
            self._begin(start)
            self._loop(tend)
            self.session.unwatch_progress()

    async def allreduce_async(self, x: np.ndarray, op: str = "sum", out: np.ndarray | None = None, *,
                              sent: np.ndarray | None = None, dtype: str | None = None) -> np.ndarray:
        """allreduce on the running asyncio event loop (other tasks run while waiting for results)."""
        return await self._run_async(x, op, out, sent, scatter=False, dtype=dtype)

    async def reduce_scatter_async(self, x: np.ndarray, op: str = "sum", out: np.ndarray | None = None, *,
                                   dtype: str | None = None) -> np.ndarray:
        """reduce_scatter on the running asyncio event loop."""
        return await self._run_async(x, op, out, None, scatter=True, dtype=dtype)

    async def _run_async(self, x: np.ndarray, op: str, out: np.ndarray | None, sent: np.ndarray | None, *,
                         scatter: bool, dtype: str | None) -> np.ndarray:
        loop = asyncio.get_running_loop()
        readable = asyncio.Event()
        for rx in self._inputs:
            loop.add_reader(rx.fileno(), readable.set)
        self._busy.acquire()  # held only for moments by the keepalive thread, so the loop barely waits
        try:
            arr = self._prepare(x, op, out, sent, scatter, dtype)
            while not self.engine.done:
                if (wait := self._wait()) > 0:
                    try:
                        await asyncio.wait_for(readable.wait(), wait)
                    except asyncio.TimeoutError:
                        pass
                readable.clear()
                self._step()
            return self._finish(arr, out, scatter)
        finally:
            self._busy.release()
            for rx in self._inputs:
                loop.remove_reader(rx.fileno())

    def _timeout_message(self) -> str:
        done, chunks = self.engine.progress
        base = (f"{self._who()}: allreduce #{self.engine.allreduce_seq} made no progress for {self.timeout} s "
                f"({done}/{chunks} chunks done, {len(self.engine.pending_slots())} slots waiting)")
        self.session.request_stats(time.monotonic())
        stats = self._control((StatsAnswered,))
        missing, silent = stats.missing, stats.silent
        if missing is None:
            return base + f"; the aggregator {self._aggregator_name()} did not answer a statistics request"
        if silent is None:
            return base + (f"; the aggregator no longer knows job {self.job} (torn down after its --idle-timeout, "
                           f"or restarted): create the Worker again to rejoin")
        if not missing:
            return base + "; the aggregator holds no incomplete round for this job (results lost?)"
        silence = ", ".join(f"rank {r} silent {silent.get(str(r), '?')} s" for r in missing)
        return base + f"; waiting for ranks {missing} ({silence})"

    def counters(self) -> dict[str, int]:
        """Packets, retransmissions and drops seen by this worker."""
        return self.engine.counters()

    def __repr__(self) -> str:
        return (f"Worker({self._aggregator_name()}, job={self.job}, rank={self.rank}/{self.world_size}, "
                f"{self.codec_name})")
