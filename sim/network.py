"""Modelled parts of a network: links, a processor with a cost model, and the switch with an aggregator in it.

A ``Link`` is one direction of a cable: rate, propagation delay, MTU, a drop-tail queue in bytes, random loss
from its own seeded generator and optional ECN marking (counted: intml's UDP traffic does not react to it). A
switch ASIC's egress port marks instead (``mark_bytes``): a RESULT that finds that many bytes queued ahead of it
leaves with the congestion mark, as the P4 program's egress sets it from its queue depth, and so does a leaf's
PARTIAL on its way up to the spine, which echoes the mark in its result (aggregator.tiers; docs/window.md). A
datagram occupies the wire for (payload + ``overhead``) bytes at the link's rate; the overhead is the IPv4, UDP
and Ethernet headers, which the netns testbed's ``tc tbf`` also counts.

A ``Processor`` is a CPU that handles what reaches it in bursts: what arrives while it is busy waits and is taken
together when it is free (as recvmmsg does), and each burst costs what the owner's handler says. With a zero cost
model it handles each arrival at once.

The ``Switch`` forwards by destination address and hands the datagrams addressed to its aggregator to an
``Aggregator``: the real ``AggregatorCore``s (``CoreAggregator``) or, later, the P4 pipeline model; the switch
needs only that small interface. Multicast groups replicate a datagram to every member port. A software
aggregator's receive queue can be bounded (``rx_queue``: a socket's receive buffer, in datagrams; what does not fit
is dropped, ``rx_drops``), and the results of a burst read from ``mark_depth`` or more waiting datagrams carry the
congestion mark, as aggregator.dataplane marks them (aggregator.congestion; docs/window.md).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from intml.aggregator.congestion import mark_results
from intml.aggregator.core import AggregatorCore
from intml.protocol.burst import Burst
from intml.protocol.packet import HDR, O_MAGIC, O_SHADOW, O_TYPE
from intml.protocol.wire import CONGESTED, MAGIC, MsgType
from intml.sim.engine import Datagram, Node, Simulator
from intml.worker.costs import IP_UDP, WIRE_OVERHEAD  # a datagram's bytes beyond its payload, and those the MTU counts



class Machine:
    """``cpus`` CPUs shared by every ``Processor`` given it: the netns testbed, whose ranks, aggregator and kernel
    forwarding all run on one 2-core VM (the kernel's veth/tbf/routing work for a datagram runs in softirq context
    on the sending CPU: the sender's cost model charges it, ``HostCosts.forward``, ``SwitchCosts.forward``).
    Work is not preempted: a burst runs on the CPU free first, from when it is free."""

    def __init__(self, cpus: int) -> None:
        if cpus < 1:
            raise ValueError(f"a machine needs at least one CPU, got {cpus}")
        self.free = [0.0] * cpus
        self.busy = 0.0  # CPU-seconds of work done

    @property
    def free_at(self) -> float:
        """When the first CPU is free."""
        return min(self.free)

    def occupy(self, now: float, cost: float) -> float:
        """Run ``cost`` seconds of work on the CPU free first, not before ``now``; returns when it is done."""
        free = self.free
        i = free.index(min(free))
        free[i] = done = max(free[i], now) + cost
        self.busy += cost
        return done


@dataclass
class LinkStats:
    lost: int = 0
    queue_drops: int = 0
    too_big: int = 0
    ecn_marked: int = 0
    results_marked: int = 0  # RESULTs given the congestion mark (``mark_bytes``)
    partials_marked: int = 0  # PARTIALs given it (a leaf's port up to the spine)


_SHAPES: dict[tuple, tuple] = {}  # Link.shape: one tuple per distinct link model


class Link:
    """One direction of a link into ``node``. Calls to ``send`` come in nondecreasing time order (each link has
    one sender, whose clock only moves forward)."""

    def __init__(self, sim: Simulator, node: Node, *, rate: float, delay: float, mtu: int = 1500,
                 queue_bytes: int = 1 << 20, loss: float = 0.0, seed: int = 0, ecn_bytes: int | None = None,
                 overhead: int = WIRE_OVERHEAD, mark_bytes: int | None = None) -> None:
        if rate <= 0 or delay < 0 or not 0 <= loss < 1 or queue_bytes <= 0:
            raise ValueError(f"bad link: rate {rate}, delay {delay}, loss {loss}, queue {queue_bytes}")
        self.sim, self.node = sim, node
        self.byte_time = 8.0 / rate
        self.delay, self.mtu, self.queue_bytes, self.loss = delay, mtu, queue_bytes, loss
        self.ecn_bytes, self.overhead, self.mark_bytes = ecn_bytes, overhead, mark_bytes
        # what decides a send's outcome besides the queue (fan_out's test that links behave alike), one tuple for
        # all links alike, so that the test is mostly by identity
        shape = (self.byte_time, delay, mtu, queue_bytes, ecn_bytes, overhead, loss, mark_bytes)
        self.shape = _SHAPES.setdefault(shape, shape)
        self.random = random.Random(seed)
        self.busy_until = 0.0
        self.stats = LinkStats()
        self.sent = 0  # datagrams serialised (kept here, not in stats: the hot path)
        self.bytes = 0  # bytes on the wire, overhead included

    def send(self, datagram: Datagram, now: float) -> None:
        """Queue ``datagram`` at time ``now``: dropped if too big or the queue is full, else serialised after
        the queue, then lost with probability ``loss``, else delivered after the propagation delay."""
        self.send_many((datagram,), now)

    def send_many(self, datagrams: Sequence[Datagram], now: float) -> None:
        """``send`` each of ``datagrams`` at ``now``, in order (a host's burst), in one call."""
        longest, overhead, byte_time, queue_bytes, ecn_bytes, delay, mark_bytes = (
            self.mtu - IP_UDP, self.overhead, self.byte_time, self.queue_bytes, self.ecn_bytes, self.delay,
            self.mark_bytes)
        loss, draw, stats = self.loss, self.random.random, self.stats
        busy, sent, wire_bytes = self.busy_until, 0, 0
        times, passed = [], []
        at, keep = times.append, passed.append
        for datagram in datagrams:
            size = len(datagram[0])
            if size > longest:
                stats.too_big += 1
                continue
            wire = size + overhead
            if busy > now:
                backlog = (busy - now) / byte_time
                if backlog + wire > queue_bytes:
                    stats.queue_drops += 1
                    continue
                if ecn_bytes is not None and backlog > ecn_bytes:
                    stats.ecn_marked += 1
                if mark_bytes is not None and backlog >= mark_bytes:
                    datagram = marked(datagram, stats)
                busy += wire * byte_time
            else:
                busy = now + wire * byte_time
            sent += 1
            wire_bytes += wire
            if loss and draw() < loss:
                stats.lost += 1
                continue
            at(busy + delay)
            keep(datagram)
        self.busy_until = busy
        self.sent += sent
        self.bytes += wire_bytes
        if passed:
            self.sim.deliver_train(times, self.node, passed)


def fan_out(sim: Simulator, links: list[Link], datagram: Datagram, now: float) -> None:
    """``link.send(datagram, now)`` on every link of ``links``, in order, with the same outcome; a multicast
    result's replication. When the links share their parameters and are equally busy (a switch's ports to the
    members of a job, in step), the queue and serialisation are computed once and the arrivals are one call to
    ``sim.deliver_all``; each link still draws its own loss."""
    first = links[0]
    busy, shape = first.busy_until, first.shape
    for link in links:
        if link.busy_until != busy or (link.shape is not shape and link.shape != shape):
            for each in links:
                each.send(datagram, now)
            return
    size = len(datagram[0])
    if size + IP_UDP > first.mtu:
        for link in links:
            link.stats.too_big += 1
        return
    wire = size + first.overhead
    if busy > now:
        backlog = (busy - now) / first.byte_time
        if backlog + wire > first.queue_bytes:
            for link in links:
                link.stats.queue_drops += 1
            return
        if first.ecn_bytes is not None and backlog > first.ecn_bytes:
            for link in links:
                link.stats.ecn_marked += 1
        if first.mark_bytes is not None and backlog >= first.mark_bytes:
            for link in links:
                datagram = marked(datagram, link.stats)
        now = busy
    busy = now + wire * first.byte_time
    loss = first.loss
    for link in links:
        link.busy_until = busy
        link.sent += 1
        link.bytes += wire
    if loss:
        nodes = []
        for link in links:
            if link.random.random() < loss:
                link.stats.lost += 1
            else:
                nodes.append(link.node)
    else:
        nodes = [link.node for link in links]
    sim.deliver_all(busy + first.delay, nodes, datagram)


# the intml datagrams a switch's egress queue marks: results on their way to the ranks, partials on a leaf's way up
MARKED = frozenset((MsgType.RESULT, MsgType.PARTIAL))


def marked(datagram: Datagram, stats: LinkStats) -> Datagram:
    """``datagram`` with the congestion mark (protocol.wire.CONGESTED) if it is an intml RESULT or PARTIAL (counted
    in ``stats``), else ``datagram`` itself."""
    payload = datagram[0]
    if (len(payload) < HDR or payload[O_TYPE] not in MARKED
            or int.from_bytes(payload[O_MAGIC:O_MAGIC + 2], "big") != MAGIC):
        return datagram
    if payload[O_TYPE] == MsgType.RESULT:
        stats.results_marked += 1
    else:
        stats.partials_marked += 1
    if payload[O_SHADOW] & CONGESTED:
        return datagram
    copy = bytearray(payload)
    copy[O_SHADOW] |= CONGESTED
    return bytes(copy), datagram[1], datagram[2]


class Copier:
    """``burst.datagrams()`` for a core's output bursts, as the simulator's ``Datagram`` triples: owned copies of
    the first ``count`` datagrams, in order, from ``src``, with the same bounds check, but with the descriptors read
    as lists at once and the memory block's address and view looked up once per block (a core reuses its own;
    numpy scalar conversions and ``ctypes`` per call cost more than the copies on the simulator's hot path)."""

    def __init__(self) -> None:
        self._memory: np.ndarray | None = None
        self._base = self._end = 0
        self._view = memoryview(b"")

    def __call__(self, burst: Burst, src: int) -> list[Datagram]:
        k = burst.count
        if k == 0:
            return []
        if burst.memory is not self._memory:
            memory = self._memory = burst.memory
            flat = memory.reshape(-1).view(np.uint8)
            self._base, self._end, self._view = memory.ctypes.data, flat.size, memoryview(flat)
        base, end, view = self._base, self._end, self._view
        ptrs, sizes = burst.ptr[:k].tolist(), burst.length[:k].tolist()
        if min(ptrs) < base or max(ptrs) + max(sizes) > base + end:  # a bound for all at once
            for ptr, size in zip(ptrs, sizes):  # which may be too tight: the exact test
                if ptr < base or ptr + size > base + end:
                    raise ValueError("a datagram points outside its burst's memory")
        return [(view[ptr - base:ptr - base + size].tobytes(), src, dst)
                for ptr, size, dst in zip(ptrs, sizes, burst.addr[:k].tolist())]


class Receiver:
    """Receive bursts for a core: ``fill`` puts datagrams into a burst's own rows, as ``Burst.fill`` does (the
    same rows, lengths and addresses). Datagrams of one length (a burst of data packets or of results) go into a
    burst whose rows are exactly that long, in one copy; any other mix through ``Burst.fill``."""

    def __init__(self, width: int, shared: bool = False) -> None:
        """``width``: the longest datagram a row holds (longer ones are truncated, as a socket's rows do).
        ``shared``: the receiver of every rank of a job, whose cores only read their receive bursts (the worker
        engine): a fill equal to the previous one (the same multicast results reaching the next rank) returns the
        same burst without copying."""
        self.width = width
        self._exact: dict[int, tuple[Burst, memoryview]] = {}
        self._any = Burst.rows_of(256, width)
        self._shared = shared
        self._last: tuple[list[Datagram], Burst] | None = None

    def fill(self, datagrams: Sequence[Datagram]) -> Burst:
        """``datagrams``: (payload, source address key, ...) tuples; the source goes into ``addr``."""
        if self._shared:
            items = list(datagrams)
            if self._last is not None and self._last[0] == items:  # the same tuples: compared by identity
                return self._last[1]
        k = len(datagrams)
        payloads = [d[0] for d in datagrams]
        size = max(map(len, payloads))
        if size <= self.width and min(map(len, payloads)) == size:
            entry = self._exact.get(size)
            if entry is None or entry[0].rows < k:
                burst = Burst.rows_of(max(256, 2 * k), size)
                entry = self._exact[size] = (burst, memoryview(burst.data.reshape(-1)))
            rx, view = entry
            view[:k * size] = b"".join(payloads)
            rx.length[:k] = size
            rx.addr[:k] = [d[1] for d in datagrams]
            rx.count = k
        else:
            if self._any.rows < k:
                self._any = Burst.rows_of(2 * k, self.width)
            rx = self._any
            rx.fill((d[0], d[1]) for d in datagrams)
        if self._shared:
            self._last = (items, rx)
        return rx


class Processor:
    """A CPU or a pipeline. ``handle(items, start)`` does the work and returns (cost in seconds, what to do when it
    is done: called with the finish time). ``merge``: a CPU takes everything that arrived while it was busy as one
    burst (recvmmsg); a pipeline (``merge=False``) takes one arrival instant's burst at a time, so each burst's
    output leaves after its own work, not after everything queued behind it."""

    def __init__(self, sim: Simulator, handle: Callable[[list, float], tuple[float, Callable[[float], None]]],
                 merge: bool = True, machine: Machine | None = None) -> None:
        """``machine``: the processor runs on one of its CPUs when one is free (None: a CPU of its own)."""
        self.sim, self.handle, self.merge, self.machine = sim, handle, merge, machine
        self.free_at = 0.0
        self.queue: list[list] = []  # bursts waiting, oldest first
        self.scheduled = False
        self.busy = 0.0  # seconds of work done

    def _ready_at(self) -> float:
        """When it can take its next burst: it is free, and so is a CPU of its machine."""
        return self.free_at if self.machine is None else max(self.free_at, self.machine.free_at)

    def submit(self, items: list, now: float) -> None:
        """``items`` (a list the processor may keep) arrived at ``now``."""
        self.queue.append(items)
        if self.scheduled:
            return
        ready = self._ready_at()
        if ready <= now:
            self._run(now)
        else:
            self.scheduled = True
            self.sim.at(ready, self._run_scheduled)

    def _run_scheduled(self) -> None:
        now = self.sim.now
        ready = self._ready_at()
        if ready > now:  # the machine's CPUs were taken meanwhile
            self.sim.at(ready, self._run_scheduled)
            return
        self.scheduled = False
        self._run(now)

    def _run(self, now: float) -> None:
        if self.merge:
            items = [item for burst in self.queue for item in burst] if len(self.queue) > 1 else self.queue[0]
            self.queue = []
        else:
            items = self.queue.pop(0)
        cost, then = self.handle(items, now)
        self.busy += cost
        self.free_at = now + cost if self.machine is None else self.machine.occupy(now, cost)
        then(self.free_at)
        if self.queue and not self.scheduled:
            self.scheduled = True
            self.sim.at(self._ready_at(), self._run_scheduled)


class Aggregator(Protocol):
    """What sits in the switch: the addresses it answers on, and a burst in, datagrams out."""

    addrs: list[int]

    def receive(self, datagrams: list[Datagram], now: float, congested: bool | None = None) -> list[Datagram]:
        """Handle a burst of datagrams addressed to it; returns those it sends (payload, its address, dest), their
        results' congestion mark set or cleared as ``congested`` says (None: left as the data path wrote them)."""

    def elements(self, datagrams: list[Datagram]) -> int:
        """The elements a burst carries (for the cost model)."""


def elements_of(payloads: list[bytes], width: int) -> int:
    """The elements a list of DATA or RESULT datagrams (no MAC) carries: their payload bytes over the codec's
    width (the cost model's count; no parsing per datagram)."""
    return (sum(map(len, payloads)) - HDR * len(payloads)) // width


class CoreAggregator:
    """The real ``AggregatorCore``s of one aggregator: core i listens on ``addrs[i]``."""

    def __init__(self, cores: list[AggregatorCore], addrs: list[int], width: int, element_width: int) -> None:
        """``width``: the largest datagram; ``element_width``: the job's bytes per element."""
        self.cores, self.addrs = cores, addrs
        self.element_width = element_width
        self.index = {a: i for i, a in enumerate(addrs)}
        self.width = width
        self._rx = [Receiver(width) for _ in cores]
        self._copy = [Copier() for _ in cores]

    def receive(self, datagrams: Sequence[Datagram], now: float, congested: bool | None = None) -> list[Datagram]:
        if len(self.cores) == 1:
            by_core = {0: datagrams}
        else:
            by_core: dict[int, list[Datagram]] = {}
            for d in datagrams:
                by_core.setdefault(self.index[d[2]], []).append(d)
        out: list[Datagram] = []
        for i in sorted(by_core):
            core, addr = self.cores[i], self.addrs[i]
            tx = core.receive(self._rx[i].fill(by_core[i]), now)
            if congested is not None:
                mark_results(tx, congested)
            out += self._copy[i](tx, addr)
            out += [(p, addr, dst) for p, dst in core.take_replies()]
        return out

    def elements(self, datagrams: list[Datagram]) -> int:
        return elements_of([d[0] for d in datagrams], self.element_width)


@dataclass(frozen=True)
class SwitchCosts:
    """The aggregator's processing cost: zero for a switch ASIC at line rate (only ``latency``), the calibrated
    software aggregator's for the testbed (see ``sim.costs``)."""

    latency: float = 1e-6  # pipeline latency, seconds
    per_packet: float = 0.0  # seconds per datagram handled by the aggregator
    per_element: float = 0.0  # seconds per element aggregated
    pipeline: bool = True  # a pipeline takes one arrival instant at a time; a CPU (False) all that waited
    forward: float = 0.0  # seconds per datagram copy sent: the kernel's forwarding (the netns testbed, sim.costs)


class Switch:
    """Ports (a downlink per attached address), multicast groups, and an aggregator behind its pipeline."""

    def __init__(self, sim: Simulator, aggregator: Aggregator | None, costs: SwitchCosts = SwitchCosts(),
                 machine: Machine | None = None, *, rx_queue: int | None = None,
                 mark_depth: int | None = None) -> None:
        """``aggregator``: None for a plain switch (TCP baselines); ``machine``: the aggregator's process shares
        that machine's CPUs (a software aggregator). ``rx_queue``: the datagrams that may wait for the aggregator
        (None: any number); ``mark_depth``: the results of a burst of that many datagrams or more are marked
        congested (None: never)."""
        self.sim, self.aggregator, self.costs = sim, aggregator, costs
        self.rx_queue, self.mark_depth = rx_queue, mark_depth
        self.rx_drops = 0
        self.ports: dict[int, Link] = {}
        self.groups: dict[int, list[int]] = {}
        self._fan: dict[int, tuple[list[int], list[Link]]] = {}
        self.agg_addrs = set(aggregator.addrs) if aggregator is not None else set()
        self.stray = 0
        self.cpu = Processor(sim, self._aggregate, merge=not costs.pipeline, machine=machine)

    def attach(self, addr: int, downlink: Link) -> None:
        self.ports[addr] = downlink

    def arrive(self, datagrams: Sequence[Datagram], now: float) -> None:
        agg = self.agg_addrs
        to_agg = [d for d in datagrams if d[2] in agg]
        if len(to_agg) < len(datagrams):
            at = now + self.costs.latency
            for d in datagrams:
                if d[2] not in agg:
                    self.forward(d, at)
        if to_agg and self.rx_queue is not None:
            room = self.rx_queue - sum(map(len, self.cpu.queue))
            self.rx_drops += max(0, len(to_agg) - room)
            to_agg = to_agg[:max(0, room)]
        if to_agg:
            self.cpu.submit(to_agg, now)

    def _aggregate(self, datagrams: list[Datagram], now: float) -> tuple[float, Callable[[float], None]]:
        c = self.costs
        cost = c.per_packet * len(datagrams) + (c.per_element * self.aggregator.elements(datagrams)
                                                if c.per_element else 0.0)
        depth = self.mark_depth
        out = (self.aggregator.receive(datagrams, now) if depth is None
               else self.aggregator.receive(datagrams, now, len(datagrams) >= depth))
        if c.forward:  # each copy a multicast group replicates crosses its own veth pair
            groups = self.groups
            cost += c.forward * sum(len(groups[d[2]]) if d[2] in groups else 1 for d in out)

        def send(done: float) -> None:
            for d in out:
                self.forward(d, done + c.latency)
        return cost, send

    def forward(self, datagram: Datagram, at: float) -> None:
        dst = datagram[2]
        link = self.ports.get(dst)
        if link is not None:
            link.send(datagram, at)
        elif dst in self.groups:
            members = self.groups[dst]
            cached = self._fan.get(dst)
            if cached is None or cached[0] is not members:  # the member ports, looked up once per group
                cached = self._fan[dst] = (members, [self.ports[m] for m in members])
            fan_out(self.sim, cached[1], datagram, at)
        else:
            self.stray += 1
