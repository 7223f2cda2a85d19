"""`intml-testbed bench percore`: packets/s and elements/s of one aggregator core and of one worker, each beside a
raw anchor in the same run, with the same datagrams, burst sizes and offloads, so that the ratio to what the
kernel alone moves is visible.

Aggregator core: one data-plane process (``run_core``: DataPlane over uvloop, pinned to one CPU) serves a job that
WORLD Workers joined over the real handshake. Blaster processes (pinned to the other CPUs) send the ranks' DATA
datagrams of a recorded loss-free allreduce (``bench_mac.record``) from the ranks' own sockets, open loop, as fast
as the kernel takes them, pass after pass; each pass carries the next allreduce number, so that every round opens
and completes again and results go out. Each blaster owns a share of the slots and sends every rank's datagrams
of them a window at a time (at most a share of datagrams per rank), so that a round's contributions all come
before the next round of its shadow set. The anchors run the same driver with the core replaced by a ``Sink``
that drops each burst (recv only) or hands it back as its output, so that each datagram goes back to its sender
(recv + send, as the core sends a result per contribution); a fourth row runs the core's kernel alone on the same
stream from memory. Every receiver prints its counters each STATS_INTERVAL (the aggregator's
``--stats-interval``), stamped with its own clock and CPU time; rates are taken between the first line after WARMUP
and the last before the blasters stop (see ``_rates``), totals once the receiver has drained its socket.
Elements are counted as the datagrams the core added (the sinks: took) times the stream's mean elements per
datagram (its bootstrap datagrams carry none).

Figures are per second and per CPU second of the receiver: on a shared machine the core and the sinks get
different shares of their CPU, so the ratios to the anchors are taken per CPU second (what a datagram costs).
On loopback the kernel's receive work for a datagram runs on the sending CPU: the blasters pay for the path into
the receiver's socket queue, the receiver for the delivery of what it sends into the ranks' sockets.

Worker: one rank's StreamEngine through the same recorded allreduce with a socket set up as ``Worker`` sets up its
own. The rank's RESULT datagrams wait in its socket before the clock starts (sent there from the address the
engine takes as its aggregator); the rank takes them POOL at a time (each slot at most once a burst, as results
arrive self-clocked), and each ``engine.receive`` decodes them and encodes and packetises the next chunks, which
go out with ``BurstSocket.send``. The anchor takes the same datagrams in the same bursts and sends each burst
straight back; a third row runs the engine alone on the same bursts from memory. Time per packet (the thread's
CPU time) is split into the receive call, the engine and the send call.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import select
import signal
import socket
import statistics
import sys
import time
from collections import Counter
from multiprocessing.connection import Connection

import numpy as np

from intml.aggregator.core import AggregatorCore
from intml.aggregator.dataplane import run_core, warm_up
from intml.aggregator.slots import result_width
from intml.burstio.mmsg import BurstSocket, addr_key
from intml.protocol import wire
from intml.protocol.burst import Burst
from intml.protocol.job import BURST, CODEC_NAMES
from intml.testbed.bench_mac import POOL, WORLD, _addr, _bursts, _core, record
from intml.testbed.timing import emit
from intml.worker.api import Worker, rank_socket
from intml.worker.engine import StreamEngine

JOB = 1  # the job bench_mac.record runs (seed 1)
SEED = 1
STATS_INTERVAL = 0.1  # seconds between a receiver's counter lines
WARMUP = 0.5  # seconds the blasters send before the measured window opens
QUIET = 0.3  # seconds without a new count after the blasters stopped: the receiver has drained its socket
LOSS_TIMEOUT = 0.5  # seconds a worker waits for a datagram that should be in its socket already
CORE_VARIANTS = ("aggregator core", "sink: recv only (anchor)", "sink: recv + send back (anchor)",
                 "aggregator core alone (no sockets)")
WORKER_VARIANTS = ("raw: recv + send back (anchor)", "worker: recv + engine + send", "engine alone (no sockets)")
_fork = multiprocessing.get_context("fork")  # children inherit the bound sockets and the compiled kernels


def _pin(cpu: int) -> None:
    os.sched_setaffinity(0, {cpu})


def _bound() -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.bind(("127.0.0.1", 0))
    return sock


def _key(sock: socket.socket) -> int:
    return addr_key(*sock.getsockname())


def _rank_socket(rec: Recording) -> BurstSocket:
    """A rank's socket as Worker sets it up (its receive side matters: results and echoes land there)."""
    return rank_socket(_bound(), max(BURST, 2 * POOL), rec.datagram_size)


# ---- the recorded allreduce ---------------------------------------------------------------------------------


def _rows(datagrams: list[bytes]) -> Burst:
    rows = Burst.rows_of(len(datagrams), max(map(len, datagrams)))
    rows.fill((d, 0) for d in datagrams)
    return rows


def _headers(rows: Burst) -> np.ndarray:
    return np.ascontiguousarray(rows.data[:rows.count, :wire.HEADER_SIZE]).view(wire.HEADER).reshape(-1)


class Recording:
    """One loss-free allreduce of WORLD ranks (POOL slots, one core): every rank's DATA datagrams in the order the
    core took them, and rank 0's RESULT datagrams in the order the core sent them."""

    def __init__(self, codec: str, packet_elements: int, chunks: int) -> None:
        self.codec, self.packet_elements, self.chunks = codec, packet_elements, chunks
        stream = record(codec, packet_elements, chunks, False)
        self.data = _rows([d for d, _ in stream])
        head = _headers(self.data)
        self.rank, self.slot = head["rank"].astype(np.int64), head["slot"].astype(np.int64)
        per_rank = [head[["slot", "chunk"]][self.rank == r] for r in range(WORLD)]
        if any(not np.array_equal(per_rank[0], h) for h in per_rank):  # the blasters' windows rely on it
            raise RuntimeError("the ranks of the recording did not send their chunks in one order")
        self.elements_per_datagram = float(head["count"].mean())
        self.bursts = _bursts(stream)  # as a core takes them
        core, results = _core(codec, packet_elements, False), []
        for rx in self.bursts:  # the same stream through a fresh core: the same results, in order
            results += [d for d, dst in core.receive(rx, 0.0).datagrams() if dst == _addr(0)]
        self.results = _rows(results)
        self.rank0 = [d for (d, _), r in zip(stream, self.rank) if r == 0]

    @property
    def datagram_size(self) -> int:
        return self.data.data.shape[1]

    def windows(self, blaster: int, blasters: int, dest: int) -> tuple[list[np.ndarray], list[list[Burst]]]:
        """Blaster ``blaster``'s share (slots s with s mod blasters = blaster): per rank, the rows it sends (a copy
        it rewrites each pass) and its windows as Bursts over them, each at most a share of slots long."""
        share = self.slot % blasters == blaster
        width = min(BURST, int(np.unique(self.slot[share]).size))
        rows, windows = [], []
        for r in range(WORLD):
            mine = self.data.data[share & (self.rank == r)].copy()
            lengths = self.data.length[:self.data.count][share & (self.rank == r)]
            rank_windows = []
            for i in range(0, len(mine), width):
                k = min(width, len(mine) - i)
                window = Burst(mine, width)
                window.ptr[:k] = mine.ctypes.data + np.arange(i, i + k, dtype=np.uint64) * np.uint64(mine.shape[1])
                window.length[:k] = lengths[i:i + k]
                window.addr[:] = dest
                window.count = k
                rank_windows.append(window)
            rows.append(mine)
            windows.append(rank_windows)
        return rows, windows


# ---- aggregator core: receivers and blasters ----------------------------------------------------------------


class Sink:
    """What the anchors' DataPlane drives in place of an AggregatorCore: it takes each burst and drops it, or with
    ``echo`` returns it as its output burst, so that each datagram goes back to where it came from."""

    def __init__(self, max_elements: int, echo: bool) -> None:
        self.core, self.max_elements, self.echo = 0, max_elements, echo
        self.marks = False  # as the kernel's core: the driver sets or clears each RESULT's mark
        self.packets_in = self.packets_out = 0
        self._nothing = Burst.rows_of(1, 1)

    def receive(self, rx: Burst, now: float) -> Burst:
        self.packets_in += rx.count
        if not self.echo:
            return self._nothing
        self.packets_out += rx.count
        return rx

    def take_replies(self) -> list[tuple[bytes, int]]:
        return []

    def count_send_failures(self, n: int) -> None:
        pass

    def get_timer(self) -> float | None:
        return None

    def handle_timer(self, now: float) -> list[int]:
        return []

    def stats(self, now: float) -> dict:
        return {"core": 0, "jobs": {}, "core_counters": {"packets_in": self.packets_in,
                                                          "packets_out": self.packets_out}}


def _counts(stats: dict) -> dict[str, int]:
    """The figures of a receiver's counter line: the job's on the aggregator core, the sink's own otherwise."""
    counters = stats["jobs"][str(JOB)]["counters"] if stats["jobs"] else stats["core_counters"]
    out = {k: counters.get(k, 0) for k in ("packets_in", "contributions", "completions", "packets_out",
                                            "retransmissions", "results_resent", "drop_duplicate_incomplete")}
    out["dropped"] = sum(v for k, v in counters.items() if k.startswith("drop_"))
    return out


class _Stamped:
    """A receiver's stdout: each counter line goes out after the time and the process's CPU seconds (user and
    system; where the kernel does not account IRQ time apart, softirq work run in its context too) when it was
    printed, so that the figures do not depend on when a parent on a loaded machine gets to read it."""

    def __init__(self, fd: int) -> None:
        self._out = os.fdopen(fd, "w", buffering=1)

    def write(self, text: str) -> int:
        if text.startswith("{"):
            text = f"{time.monotonic()} {time.process_time()} {text}"
        return self._out.write(text)

    def flush(self) -> None:
        self._out.flush()


def _serve(core: AggregatorCore | Sink, sock: socket.socket, out_fd: int, cpu: int) -> None:
    """A receiver process: the data plane over ``core``, its counter lines on ``out_fd``."""
    _pin(cpu)
    sys.stdout = _Stamped(out_fd)
    run_core(core, sock, BURST, STATS_INTERVAL)


class Receiver:
    """A receiver process on 127.0.0.1 and the counter lines it printed, each with the time it printed it and the
    CPU seconds it had used by then."""

    def __init__(self, core: AggregatorCore | Sink, cpu: int) -> None:
        self.sock = _bound()
        self.port = self.sock.getsockname()[1]
        read, write = os.pipe()
        self.proc = _fork.Process(target=_serve, args=(core, self.sock, write, cpu), daemon=True)
        self.proc.start()
        os.close(write)
        self._pipe, self._partial = read, b""
        self.lines: list[tuple[float, float, dict[str, int]]] = []
        if not self.read(time.monotonic() + 30.0, until_line=True):
            self.stop()
            raise RuntimeError("the receiver process printed no counters within 30 s")

    def read(self, until: float, until_line: bool = False) -> bool:
        """Collect counter lines until the time ``until`` (or the first one, with ``until_line``)."""
        while (left := until - time.monotonic()) > 0:
            if not select.select([self._pipe], [], [], left)[0]:
                break
            chunk = os.read(self._pipe, 1 << 16)
            if not chunk:
                break
            *whole, self._partial = (self._partial + chunk).split(b"\n")
            for line in whole:
                t, cpu, stats = line.split(b" ", 2)
                self.lines.append((float(t), float(cpu), _counts(json.loads(stats))))
            if until_line and self.lines:
                return True
        return bool(self.lines)

    def drain(self, most: float) -> dict[str, int]:
        """Read until the counts stay unchanged for QUIET seconds (at most ``most`` seconds); the last counts."""
        deadline = time.monotonic() + most
        last = self.lines[-1][2]
        while time.monotonic() < deadline:
            self.read(time.monotonic() + QUIET)
            if self.lines[-1][2] == last:
                break
            last = self.lines[-1][2]
        return last

    def stop(self) -> None:
        if self.proc.is_alive():
            os.kill(self.proc.pid, signal.SIGINT)
        self.proc.join(timeout=5)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join()
        os.close(self._pipe)
        self.sock.close()


def _blast(socks: list[socket.socket], rows: list[np.ndarray], windows: list[list[Burst]], deadline: float,
           cpu: int, conn: Connection) -> None:
    """A blaster process: every rank's windows in turn, one sendmmsg call per rank and window (as the ranks'
    sockets send: GSO where the kernel has it), pass after pass until ``deadline``; sends the count it sent."""
    _pin(cpu)
    ios = [BurstSocket(s, burst=BURST, max_packet=r.shape[1], gro=False) for s, r in zip(socks, rows)]
    sent, allreduce = 0, 1
    field = slice(wire.HEADER.fields["allreduce"][1], wire.HEADER.fields["allreduce"][1] + 4)
    while time.monotonic() < deadline:
        number = np.frombuffer(allreduce.to_bytes(4, "big"), np.uint8)
        for r in rows:
            r[:, field] = number
        for per_rank in zip(*windows):
            for io, window in zip(ios, per_rank):
                sent += io.send(window)
        allreduce += 1
    conn.send(sent)


def _blaster_cpu(blaster: int, cpus: list[int]) -> int:
    """The CPU of a blaster: those the receiver (on the first) leaves, in turn; the receiver's on a single CPU."""
    return cpus[1 + blaster % (len(cpus) - 1)] if len(cpus) > 1 else cpus[0]


def _rates(lines: list[tuple[float, float, dict[str, int]]], start: float,
           stop: float) -> tuple[dict[str, float], float]:
    """Counts per second between the first line at or after ``start`` and the last at or before ``stop``, and the
    share of a CPU the receiver used meanwhile. An overloaded data plane prints late: while GRO reads are pending,
    each DataPlane.on_readable queues one more re-run of itself (call_soon) besides the reader's, so the queue of
    re-runs grows every loop iteration and the timers wait behind it. With fewer than two lines in the window, it
    runs on to the first line with the final counts (``lines`` ends drained): until then the receiver was still
    taking its backlog as fast as it could."""
    after = [line for line in lines if line[0] >= start]
    inside = [line for line in after if line[0] <= stop]
    if len(inside) < 2:
        inside = after[:1 + next((i for i, line in enumerate(after) if line[2] == lines[-1][2]), 0)]
    if len(inside) < 2:
        raise RuntimeError(f"fewer than two counter lines in the {stop - start:.2f} s window: run longer (--seconds)")
    (t0, cpu0, a), (t1, cpu1, b) = inside[0], inside[-1]
    return {k: (b[k] - a[k]) / (t1 - t0) for k in a}, (cpu1 - cpu0) / (t1 - t0)


def _absorb(rec: Recording, variant: str, seconds: float, cpus: list[int], blasters: int) -> dict:
    """One run of one receiver fed by the blasters: its rates in the window and its totals."""
    p, core = rec.packet_elements, variant == CORE_VARIANTS[0]
    receiver = Receiver(AggregatorCore(rows=POOL, max_elements=p, burst=BURST) if core
                        else Sink(p, echo=variant == CORE_VARIANTS[2]), cpus[0])
    socks, closers = [], []
    try:
        for r in range(WORLD):  # the job's ranks join the core; the sinks take any source
            if core:
                worker = Worker(f"127.0.0.1:{receiver.port}", job=JOB, rank=r, world_size=WORLD, codec=rec.codec,
                                packet_elements=p, pool_size=POOL, seed=SEED, timeout=10.0)
                sock, close = worker.io.sock, worker.close
            else:
                sock = _rank_socket(rec).sock
                close = sock.close
            socks.append(sock)
            closers.append(close)
        start = time.monotonic()
        deadline = start + WARMUP + seconds
        procs, conns = [], []
        for b in range(blasters):
            rows, windows = rec.windows(b, blasters, addr_key("127.0.0.1", receiver.port))
            mine, theirs = _fork.Pipe(duplex=False)
            procs.append(_fork.Process(target=_blast, args=(socks, rows, windows, deadline, _blaster_cpu(b, cpus),
                                                            theirs), daemon=True))
            conns.append(mine)
            procs[-1].start()
        receiver.read(deadline)
        sent = sum(c.recv() for c in conns)
        for proc in procs:
            proc.join()
        total = receiver.drain(most=10.0)
        rates, cpu = _rates(receiver.lines, start + WARMUP, deadline)
    finally:
        for close in closers:
            close()
        receiver.stop()
    return _row(rec, variant, sent / (WARMUP + seconds), rates, cpu, sent, total)


def _core_alone(rec: Recording, seconds: float) -> dict:
    """A core's kernel alone (AggregatorCore.receive, no sockets, no driver) on the recorded stream, in bursts as
    a core takes them: a fresh core per pass (its job joined outside the timing) until ``seconds`` have been timed.
    One pass takes about 10 ms, as long as the loopback backlog a socket variant leaves behind, whose softirq
    work lands on this thread: timed alone, one pass measured 0.18 M datagrams/s instead of 1.4 M."""
    total: Counter = Counter()
    timed = cpu = 0.0
    while timed < seconds:
        core = _core(rec.codec, rec.packet_elements, False)
        begin, cpu_begin = time.perf_counter(), time.thread_time()
        for rx in rec.bursts:
            core.receive(rx, 0.0)
        timed += time.perf_counter() - begin
        cpu += time.thread_time() - cpu_begin
        total.update(_counts(core.stats(0.0)))
    rates = {k: v / timed for k, v in total.items()}
    return _row(rec, CORE_VARIANTS[3], rates["packets_in"], rates, cpu / timed, total["packets_in"], dict(total))


def _row(rec: Recording, variant: str, offered: float, rates: dict[str, float], cpu: float, sent: int,
         total: dict[str, int]) -> dict:
    """A run's figures: rates per second and per CPU second of the receiver (``cpu``: the share of a CPU it used;
    elements: of the datagrams the core added, or the sink took) and totals."""
    absorbed = rates["packets_in"] if variant in CORE_VARIANTS[1:3] else rates["contributions"]
    return {"variant": variant, "offered_per_s": offered, "datagrams_per_s": rates["packets_in"],
            "elements_per_s": absorbed * rec.elements_per_datagram, "results_per_s": rates["packets_out"],
            "cpu_share": cpu, "datagrams_per_cpu_s": rates["packets_in"] / cpu,
            "elements_per_cpu_s": absorbed * rec.elements_per_datagram / cpu,
            "sent": sent, "received": total["packets_in"], "lost": sent - total["packets_in"],
            **{k: v for k, v in total.items() if k != "packets_in"}}


def _offloads(max_packet: int, **chosen: bool) -> str:
    """Which offloads a BurstSocket with these settings gets on this kernel (recvmmsg/sendmmsg always)."""
    with _bound() as sock:
        io = BurstSocket(sock, burst=1, max_packet=max_packet, **chosen)
        return "+".join(["mmsg"] + [name for name, on in (("gso", io.gso), ("gro", io.gro)) if on])


def core_rows(rec: Recording, seconds: float, repeats: int, blasters: int) -> tuple[list[dict], dict]:
    cpus = sorted(os.sched_getaffinity(0))
    runs: dict[str, list[dict]] = {v: [] for v in CORE_VARIANTS}
    for _ in range(repeats):  # the variants alternate, so that all see the same load on a shared machine
        for variant in CORE_VARIANTS:
            alone = variant == CORE_VARIANTS[3]
            runs[variant].append(_core_alone(rec, seconds) if alone else _absorb(rec, variant, seconds, cpus, blasters))
    rows = [_median_row(runs[v]) for v in CORE_VARIANTS]
    for row in rows:  # per CPU second: what each datagram costs the receiver's CPU, whether it kept up or idled
        row["ratio_to_sink"] = row["datagrams_per_cpu_s"] / rows[1]["datagrams_per_cpu_s"]
        row["ratio_to_echo"] = row["datagrams_per_cpu_s"] / rows[2]["datagrams_per_cpu_s"]
    setup = {"receiver_cpu": cpus[0], "blasters": blasters,
             "blaster_cpus": sorted({_blaster_cpu(b, cpus) for b in range(blasters)}),
             "receiver_offloads": _offloads(result_width(rec.packet_elements)),
             "blaster_offloads": _offloads(rec.datagram_size, gro=False)}
    return rows, setup


def _median_row(runs: list[dict]) -> dict:
    """Medians of the rates over repeats; the counts (sent, received, ...) of all repeats summed."""
    row = {"variant": runs[0]["variant"], "repeats": len(runs)}
    for key, value in runs[0].items():
        if key.endswith("_per_s") or key.endswith("_per_cpu_s") or key == "cpu_share":
            row[key] = statistics.median(r[key] for r in runs)
        elif isinstance(value, int):
            row[key] = sum(r[key] for r in runs)
    return row


# ---- worker ---------------------------------------------------------------------------------------------------


def _worker_input(rec: Recording) -> tuple[np.ndarray, np.ndarray]:
    """Rank 0's tensor in ``record`` (its first draw from default_rng(0); ``_worker_sockets`` checks that the
    engine's first datagrams are the recorded ones), and a result array already written once, as a training loop
    reuses one: the first touch of a fresh array's pages is not the engine's cost."""
    n = rec.chunks * rec.packet_elements
    return (np.random.default_rng(0).standard_normal(n) * 1e-3).astype(np.float32), np.zeros(n, np.float32)


def _engine(rec: Recording, agg: int) -> StreamEngine:
    return StreamEngine(job=JOB, rank=0, world_size=WORLD, codec=CODEC_NAMES[rec.codec],
                        packet_elements=rec.packet_elements, pool_size=POOL, seed=SEED, agg_addrs=[agg])


def _check_engine(rec: Recording, engine: StreamEngine) -> None:
    counters = engine.counters()
    bad = {k: v for k, v in counters.items() if v and k not in ("packets_out", "packets_in", "results")}
    if not engine.done or counters["packets_out"] != len(rec.rank0) or bad:
        raise RuntimeError(f"the worker did not replay the recorded allreduce: done={engine.done}, {counters}")


def _worker_sockets(rec: Recording, with_engine: bool) -> dict:
    """Rank 0 over sockets: its results wait in its socket; it takes them POOL at a time and sends what the
    engine returns (or, without the engine, each burst straight back). Wall and CPU seconds, and CPU seconds per
    phase (the thread's: time the scheduler gives other processes on a shared machine does not count)."""
    io, agg_sock = _rank_socket(rec), _bound()
    agg = BurstSocket(agg_sock, burst=BURST, max_packet=rec.results.data.shape[1])
    results = rec.results
    results.addr[:] = _key(io.sock)
    try:
        if agg.send(results) != results.count:
            raise RuntimeError("the results did not all go out to the worker's socket")
        engine = _engine(rec, _key(agg_sock)) if with_engine else None
        x, out = _worker_input(rec)
        phases = {"recv": 0.0, "engine": 0.0, "send": 0.0}
        clock, wall = time.thread_time, time.perf_counter
        taken = 0
        begin, begin_cpu = wall(), clock()
        last = begin
        if engine is not None:
            first = engine.start(x, begin, out)
            if [d for d, _ in first.datagrams()] != rec.rank0[:first.count]:
                raise RuntimeError("rank 0's engine does not send the recorded datagrams: another tensor?")
            io.send(first)
        while taken < results.count:
            a = clock()
            n = io.recv_burst(POOL)
            b = clock()
            phases["recv"] += b - a
            if n == 0:
                if wall() - last > LOSS_TIMEOUT:
                    raise RuntimeError(f"{results.count - taken} results missing from the worker's socket (its "
                                       f"buffer, {io.rcvbuf} bytes, too small?): fewer --packets")
                continue
            last, taken = wall(), taken + n
            reply = engine.receive(io.rx, last) if engine is not None else io.rx
            c = clock()
            io.send(reply)
            phases["engine"] += c - b
            phases["send"] += clock() - c
        seconds, cpu = wall() - begin, clock() - begin_cpu
        if engine is not None:
            _check_engine(rec, engine)
    finally:
        io.sock.close()
        agg_sock.close()
    return {"seconds": seconds, "cpu": cpu, **phases,
            "offloads": "+".join(["mmsg"] + ["gso"] * io.gso + ["gro"] * io.gro)}


def _engine_alone(rec: Recording, bursts: list[Burst]) -> dict:
    engine, (x, out) = _engine(rec, _addr(WORLD)), _worker_input(rec)
    begin, begin_cpu = time.perf_counter(), time.thread_time()
    engine.start(x, begin, out)
    for rx in bursts:
        engine.receive(rx, time.perf_counter())
    seconds, cpu = time.perf_counter() - begin, time.thread_time() - begin_cpu
    _check_engine(rec, engine)
    return {"seconds": seconds, "cpu": cpu, "recv": 0.0, "engine": cpu, "send": 0.0, "offloads": "none"}


def worker_rows(rec: Recording, repeats: int) -> tuple[list[dict], dict]:
    datagrams = rec.results.datagrams()
    bursts = [_rows([d for d, _ in datagrams[i:i + POOL]]) for i in range(0, len(datagrams), POOL)]
    for rx in bursts:
        rx.addr[:rx.count] = _addr(WORLD)  # the aggregator address the engine alone is given
    runs = {v: [] for v in WORKER_VARIANTS}
    _engine_alone(rec, bursts)  # compiles (or loads) the engine's kernels
    for _ in range(repeats):
        runs[WORKER_VARIANTS[0]].append(_worker_sockets(rec, with_engine=False))
        runs[WORKER_VARIANTS[1]].append(_worker_sockets(rec, with_engine=True))
        runs[WORKER_VARIANTS[2]].append(_engine_alone(rec, bursts))
    packets, elements = rec.results.count, rec.chunks * rec.packet_elements
    rows = []
    for variant, done in runs.items():
        seconds, cpu = (statistics.median(r[k] for r in done) for k in ("seconds", "cpu"))
        per_packet = {k: 1e6 * statistics.median(r[k] for r in done) / packets for k in ("recv", "engine", "send")}
        rows.append({"variant": variant, "packets_per_s": packets / seconds, "elements_per_s": elements / seconds,
                     "cpu_share": cpu / seconds, "packets_per_cpu_s": packets / cpu,
                     "elements_per_cpu_s": elements / cpu, **{f"{k}_us": v for k, v in per_packet.items()},
                     "offloads": done[0]["offloads"]})
    for row in rows:
        row["ratio_to_raw"] = row["packets_per_cpu_s"] / rows[0]["packets_per_cpu_s"]
    return rows, {"results_per_run": packets, "data_per_run": len(rec.rank0), "burst": POOL}


def run(sizes: list[tuple[str, int]], seconds: float, packets: int, repeats: int, blasters: int | None,
        as_json: bool) -> dict:
    cpus = sorted(os.sched_getaffinity(0))
    blasters = blasters or max(1, min(len(cpus) - 1, 4))
    warm_up(max(p for _, p in sizes), BURST)  # the data plane's kernels, once, before any receiver forks
    report = {"benchmark": "percore", "world": WORLD, "pool": POOL, "burst": BURST, "seconds": seconds,
              "warmup_s": WARMUP, "repeats": repeats, "packets_per_rank": packets, "cpus": len(cpus), "sizes": []}
    for codec, p in sizes:
        rec = Recording(codec, p, packets)
        core, core_setup = core_rows(rec, seconds, repeats, blasters)
        worker, worker_setup = worker_rows(rec, repeats)
        what = f"{codec}, {p} elements ({rec.datagram_size}-byte datagrams)"
        report["sizes"].append({"size": what, "codec": codec, "packet_elements": p,
                                "datagram_bytes": rec.datagram_size,
                                "elements_per_datagram": rec.elements_per_datagram,
                                "core": {**core_setup, "rows": core}, "worker": {**worker_setup, "rows": worker}})
        if not as_json:
            _tables(what, core, core_setup, worker, worker_setup)
    if as_json:
        print(json.dumps(report, indent=2))
    return report


def _tables(what: str, core: list[dict], core_setup: dict, worker: list[dict], worker_setup: dict) -> None:
    emit(core, False, f"{what}: one aggregator core vs sinks on the same blasters (medians; the ratios per CPU-s)",
         [("variant", "receiver", ""), ("offered_per_s", "offered/s", ",.0f"),
          ("datagrams_per_s", "datagrams/s", ",.0f"), ("results_per_s", "sent/s", ",.0f"), ("cpu_share", "CPU", ".2f"),
          ("datagrams_per_cpu_s", "datagrams/CPU-s", ",.0f"), ("elements_per_cpu_s", "elements/CPU-s", ".3e"),
          ("ratio_to_sink", "× recv", ".2f"), ("ratio_to_echo", "× echo", ".2f"), ("lost", "lost", ",d")],
         core_setup)
    print()
    emit(worker, False, f"{what}: one worker vs a raw recv + send back (medians; the ratio and µs per CPU-s)",
         [("variant", "path", ""), ("packets_per_s", "packets/s", ",.0f"), ("cpu_share", "CPU", ".2f"),
          ("packets_per_cpu_s", "packets/CPU-s", ",.0f"), ("elements_per_cpu_s", "elements/CPU-s", ".3e"),
          ("recv_us", "recv µs/pkt", ".3f"), ("engine_us", "engine µs/pkt", ".3f"),
          ("send_us", "send µs/pkt", ".3f"), ("ratio_to_raw", "× raw", ".2f"), ("offloads", "offloads", "")],
         worker_setup)
    print()
