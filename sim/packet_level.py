"""Packet-level runs of intml (cnat8, or int32: SwitchML's arithmetic) on one switch: n hosts, each on its own
link pair to the switch, the real aggregator core in it (its data path the Numba kernel, or the P4 pipeline model:
``engine``), the real worker engines and sessions on the hosts. With ``racks`` > 1, a two-level leaf-spine
instead: each rack's hosts on a leaf switch with a leaf core (``leaf_core``), each leaf on its own link pair to
a spine switch with the ``SpineCore`` (aggregator.leafspine); the ranks join their leaf.
Every rank joins through the simulated network, then the ranks run ``rounds`` allreduces, each starting together
once the last rank has the previous result (the testbed's barrier)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace

import numpy as np

from intml.aggregator.core import AggregatorCore
from intml.aggregator.leafspine import SpineCore, leaf_core
from intml.p4 import layout
from intml.p4.engine import p4model_core
from intml.protocol import codecs, reference
from intml.protocol.job import AGGREGATOR_SLOTS, CODEC_NAMES, MAX_WORLD, JobParams, WorkerTimers
from intml.protocol.packet import HDR
from intml.protocol.partial import partial_size
from intml.protocol.wire import MARK_FRACTION, element_datagram_size
from intml.sim.costs import FREE_HOST, HOST_COSTS, KERNEL_FORWARD, SOFTWARE_AGGREGATOR, HostCosts, asic
from intml.sim.engine import Simulator
from intml.sim.host import WorkerHost
from intml.sim.models import largest_packet, largest_partial
from intml.sim.network import CoreAggregator, Link, Machine, Receiver, Switch

HOST_IP = 0x0A000000  # 10.0.0.(rank + 1)
HOST_PORT = 5000
AGG_ADDR = (0x0A000101 << 16) | 48879  # 10.0.1.1, the aggregator's core 0
LEAF_IP = 0x0A000200  # 10.0.2.(leaf + 1), a leaf's aggregator
SPINE_ADDR = (0x0A000301 << 16) | 48879  # 10.0.3.1, the spine's aggregator
GROUP = (0xEFFF2A00, 48880)  # 239.255.42.0: results by multicast, as the testbed's default
TOKEN = "intml-sim"
ENGINES = ("kernel", "p4model")
JOB = 1


@dataclass
class PacketRun:
    """One packet-level scenario: n hosts on a single switch."""

    workers: int = 4
    elements: int = 1_000_000
    codec: str = "cnat8"
    rate: float = 10e9  # bit/s, every link
    delay: float = 1e-6  # one-way propagation per link, s
    mtu: int = 1500
    queue_bytes: int = 1 << 20
    loss: float = 0.0  # per link direction
    ecn_bytes: int | None = None
    rx_queue: int | None = None  # the datagrams that may wait for the aggregator (its socket's buffer); None: any
    mark_depth: int | None = None  # results of a burst read from this many waiting datagrams are marked congested
    # (aggregator.congestion; docs/window.md); None: never
    asic_marks: bool = True  # an ASIC's egress ports mark the results that find a quarter of their queue full
    downlink_rate: float | None = None  # bit/s of the switch's links to the hosts (None: ``rate``)
    downlink_queue: int | None = None  # bytes of the switch's egress queue to each host (None: ``queue_bytes``)
    packet_elements: int | None = None  # default: the largest for the MTU
    pool: int = 64
    rounds: int = 1
    seed: int = 1
    switch: str = "asic"  # or "software": the testbed's aggregator process and its CPU costs
    engine: str = "kernel"  # the switch's data path: the Numba burst kernel, or "p4model": the P4 pipeline model
    passes: int = 0  # asic: pipeline passes per aggregated packet (recirculations + 1); 0: the engine's (p4model:
    # the P4 program's passes for the packet size, p4.layout.passes; kernel: 1)
    slots: int = AGGREGATOR_SLOTS  # the switch's slot memory, in rows (a job's pool must fit)
    host_costs: bool = True  # charge the hosts' CPU (sim.costs); False: free hosts
    multicast: bool = True
    inputs: str = "distinct"  # or "shared": one input array for every rank (large runs, less memory)
    rto: float = WorkerTimers.rto
    min_rto: float = WorkerTimers.min_rto
    check: bool = False  # compare every rank's result with protocol.reference
    nonfinite: int = 0  # > 0: that many elements of each rank's input become NaN, +Inf or -Inf (seeded)
    rounding: str = "stochastic"  # C_nat's, at the workers and the switch; "nearest": deterministic (docs/rounding.md)
    cpus: int = 0  # > 0: one machine of that many CPUs runs every rank and the software aggregator, each sender
    # paying the kernel's forwarding per datagram copy (the netns testbed); 0: every host its own CPU, no forwarding
    forward_cost: float = KERNEL_FORWARD  # CPU seconds per datagram copy sent, with cpus
    racks: int = 1  # > 1: a leaf-spine of that many racks (ranks split in order, sizes differing by at most 1)
    uplink_rate: float | None = None  # bit/s of each leaf's link to the spine (None: ``rate``)
    uplink_mtu: int | None = None  # (None: ``mtu``)
    uplink_loss: float | None = None  # per direction (None: ``loss``)
    uplink_queue: int | None = None  # bytes of each leaf-spine link's queue, either direction (None: ``queue_bytes``)
    leaf_hold: float = 0.0  # seconds a leaf's re-sent partial answers its rack's other duplicates (add_route's hold)

    def __post_init__(self) -> None:
        if self.engine not in ENGINES:
            raise ValueError(f"engine must be one of {', '.join(ENGINES)}, got {self.engine!r}")
        if not 1 <= self.racks <= self.workers:
            raise ValueError(f"racks must be in [1, workers = {self.workers}], got {self.racks}")
        if self.racks > 1 and (self.engine, self.switch, self.cpus) != ("kernel", "asic", 0):
            raise ValueError("a leaf-spine runs the kernel engine on ASIC switches, with a CPU per host")
        codec = CODEC_NAMES[self.codec]
        if self.packet_elements is None:
            self.packet_elements = largest_packet(codecs.BY_ID[codec].WIDTH, self.mtu)
            if self.racks > 1:  # a rack's partial sums, 4 bytes each, must fit one datagram on the uplink
                self.packet_elements = min(self.packet_elements, largest_partial(self.uplink_mtu or self.mtu))
            if self.engine == "p4model":  # what the switch's parser takes
                self.packet_elements = min(self.packet_elements, layout.MAX_LANES[codec])
        if self.passes == 0:
            self.passes = layout.passes(self.packet_elements) if self.engine == "p4model" else 1


@dataclass
class PacketResult:
    times: list[float]  # seconds per allreduce
    retransmissions: int
    lost: int
    queue_drops: int
    events: int
    packet_events: int
    wall: float  # seconds of real time, setup (inputs, compilation) included
    loop: float  # of which in the event loop
    exact: bool | None = None  # every rank's result equals protocol.reference's, if checked
    counters: dict = field(default_factory=dict)
    cpu_seconds: dict = field(default_factory=dict)  # CPU work charged: hosts (all), software aggregator
    loop_cpu: float = 0.0  # seconds of this process's CPU time in the event loop (the machine may be shared)
    rx_drops: int = 0  # datagrams the aggregator's full receive queue dropped (``rx_queue``)
    windows: list[float] = field(default_factory=list)  # each rank's send window at the end, in slots
    results_marked: int = 0  # results the switches' egress ports marked (``asic_marks``)
    partials_marked: int = 0  # partials the leaves' ports up to the spine marked (``asic_marks``)


def simulate(run: PacketRun) -> PacketResult:
    """Run the scenario; deterministic in ``run`` (its seed drives the inputs, the losses and the nonces)."""
    wall = time.perf_counter()
    sim = Simulator()
    n = run.workers
    params = JobParams.of(world_size=n, codec=run.codec, packet_elements=run.packet_elements, pool_size=run.pool,
                          seed=run.seed, nearest=run.rounding == "nearest")
    machine = Machine(run.cpus) if run.cpus else None
    software = run.switch == "software"
    forward = run.forward_cost if machine else 0.0
    if run.racks > 1:
        topology = leaf_spine(sim, run, params)
    else:
        secret = np.random.default_rng([run.seed, 7])
        kind = p4model_core if run.engine == "p4model" else AggregatorCore
        core = kind(rows=run.slots, max_elements=max(run.packet_elements, 1), tokens=[TOKEN],
                    results_group=GROUP if run.multicast else None, random_bytes=lambda k: secret.bytes(k))
        switch_costs = replace(SOFTWARE_AGGREGATOR, forward=forward) if software else asic(run.passes)
        switch = Switch(sim, CoreAggregator([core], [AGG_ADDR], _rx_width(params), codecs.BY_ID[params.codec].WIDTH),
                        switch_costs, machine if software else None, rx_queue=run.rx_queue,
                        mark_depth=run.mark_depth)
        topology = Topology(edge=[switch] * n, aggregator=[AGG_ADDR] * n, switches=[switch])
    costs: HostCosts = replace(HOST_COSTS[run.codec] if run.host_costs else FREE_HOST, forward=forward)
    timers = WorkerTimers(rto=run.rto, min_rto=run.min_rto)
    joined: list[WorkerHost] = []
    finished: list[float] = []
    times: list[float] = []
    rng = np.random.default_rng(run.seed)
    if run.inputs == "shared":
        xs = [rng.standard_normal(run.elements, dtype=np.float32)] * n
        outs = [np.empty(run.elements, np.float32)] * n
    else:
        xs = [rng.standard_normal(run.elements, dtype=np.float32) for _ in range(n)]
        outs = [np.empty(run.elements, np.float32) for _ in range(n)]
    for x in {id(x): x for x in xs}.values() if run.nonfinite else ():  # each distinct input once
        where = rng.choice(run.elements, min(run.nonfinite, run.elements), replace=False)
        x[where] = rng.choice(np.array([np.nan, np.inf, -np.inf], np.float32), where.size)
    state = {"start": 0.0, "round": 0}

    def start_round(now: float) -> None:
        state["start"] = now
        finished.clear()
        for h in hosts:
            h.start(xs[h.rank], outs[h.rank], now)

    def on_joined(host: WorkerHost) -> None:
        joined.append(host)
        if len(joined) == n:
            for g in host.groups:  # each edge switch replicates to its own hosts
                for edge in set(topology.edge):
                    edge.groups[g] = [h.addr for h in hosts if topology.edge[h.rank] is edge]
            start_round(sim.now)

    def on_done(host: WorkerHost, now: float) -> None:
        finished.append(now)
        if len(finished) == n:
            end = max(finished)
            times.append(end - state["start"])
            state["round"] += 1
            if state["round"] < run.rounds:
                sim.at(end, start_round, end)

    # the ranks' receive bursts (rows of the engine's largest datagram), shared: a multicast result burst is copied
    # once for all of them
    receiver = Receiver(max(HDR, element_datagram_size(params.codec, run.packet_elements, False)), shared=True)
    hosts = []
    for r in range(n):
        addr = ((HOST_IP + r + 1) << 16) | HOST_PORT
        h = WorkerHost(sim, rank=r, addr=addr, job=JOB, params=params, token=TOKEN, aggregator=topology.aggregator[r],
                       costs=costs, timers=timers, on_joined=on_joined, on_done=on_done, nonce_seed=run.seed * 1000 + r,
                       machine=machine, receiver=receiver)
        link = dict(rate=run.rate, delay=run.delay, mtu=run.mtu, queue_bytes=run.queue_bytes, loss=run.loss,
                    ecn_bytes=run.ecn_bytes)
        h.uplink = Link(sim, topology.edge[r], seed=link_seed(run.seed, r, 0), **link)
        down = run.downlink_queue or run.queue_bytes
        topology.edge[r].attach(addr, Link(sim, h, seed=link_seed(run.seed, r, 1), **dict(
            link, rate=run.downlink_rate or run.rate, queue_bytes=down, mark_bytes=mark_bytes(run, down))))
        hosts.append(h)
    for h in hosts:
        h.connect(0.0)
    loop, loop_cpu = time.perf_counter(), time.process_time()
    sim.run(stop=lambda: len(times) == run.rounds)
    loop_cpu = time.process_time() - loop_cpu
    if len(times) < run.rounds:
        stuck = [f"rank {h.rank}: " + ("joining" if h.engine is None else f"{h.engine.progress} chunks")
                 for h in hosts if h.engine is None or h.running]
        raise RuntimeError(f"the simulation ran out of events after {len(times)} of {run.rounds} allreduces "
                           f"at t = {sim.now:.6g} s ({'; '.join(stuck)})")
    links = [h.uplink for h in hosts] + [link for sw in topology.switches for link in sw.ports.values()]
    counters = {k: sum(h.engine.counters()[k] for h in hosts) for k in hosts[0].engine.counters()}
    result = PacketResult(
        times=times, retransmissions=counters["retransmissions"] + counters["fast_retransmissions"],
        lost=sum(link.stats.lost for link in links), queue_drops=sum(link.stats.queue_drops for link in links),
        events=sim.events, packet_events=sim.packet_events, wall=time.perf_counter() - wall,
        loop=time.perf_counter() - loop, counters=counters,
        cpu_seconds={"hosts": sum(h.cpu.busy for h in hosts),
                     "aggregator": topology.switches[0].cpu.busy if software else 0.0},
        loop_cpu=loop_cpu, rx_drops=sum(sw.rx_drops for sw in topology.switches),
        windows=[h.engine.send_window for h in hosts], results_marked=sum(link.stats.results_marked for link in links),
        partials_marked=sum(link.stats.partials_marked for link in links))
    if run.check:
        expected = reference.allreduce(xs, codec=run.codec, seed=run.seed, allreduce_seq=run.rounds - 1,
                                       packet_elements=run.packet_elements, rounding=run.rounding)
        result.exact = all(np.array_equal(o.view(np.uint32), expected.view(np.uint32)) for o in outs)
    return result


@dataclass
class Topology:
    """Where the hosts attach: rank r's edge switch (its link's far end) and the aggregator address it joins;
    every switch (their ports are every link but the hosts' uplinks)."""

    edge: list[Switch]
    aggregator: list[int]
    switches: list[Switch]


def _rx_width(params: JobParams) -> int:
    """Receive rows for a switch's aggregator: the job's largest DATA or RESULT, with room to spare."""
    return element_datagram_size(params.codec, params.packet_elements, False) + 256


def rack_ranks(workers: int, racks: int) -> list[range]:
    """The ranks of each rack: in order, rack sizes differing by at most one."""
    return [range(k * workers // racks, (k + 1) * workers // racks) for k in range(racks)]


def leaf_spine(sim: Simulator, run: PacketRun, params: JobParams) -> Topology:
    """``run.racks`` leaf switches, each with a leaf core routed to the spine switch's SpineCore over its own link
    pair (``uplink_*``), the job installed at the spine and routed at each leaf as the fabric's controller would."""
    spine_core = SpineCore(rows=run.slots, max_elements=run.packet_elements)
    spine = Switch(sim, CoreAggregator([spine_core], [SPINE_ADDR], partial_size(run.packet_elements) + 256, 4),
                   asic(run.passes))
    queue = run.uplink_queue or run.queue_bytes
    uplink = dict(rate=run.uplink_rate or run.rate, delay=run.delay, mtu=run.uplink_mtu or run.mtu,
                  queue_bytes=queue, loss=run.loss if run.uplink_loss is None else run.uplink_loss,
                  ecn_bytes=run.ecn_bytes, mark_bytes=mark_bytes(run, queue))
    edge, aggregator, switches, leaves = [], [], [spine], []
    for k, ranks in enumerate(rack_ranks(run.workers, run.racks)):
        secret = np.random.default_rng([run.seed, 7, k])
        core = leaf_core(rows=run.slots, max_elements=run.packet_elements, tokens=[TOKEN],
                        results_group=GROUP if run.multicast else None, random_bytes=lambda b, s=secret: s.bytes(b))
        addr = ((LEAF_IP + k + 1) << 16) | 48879
        core.datapath.add_route(JOB, leaf=k, ranks=ranks, spine=SPINE_ADDR, hold=run.leaf_hold)
        leaf = Switch(sim, CoreAggregator([core], [addr], _rx_width(params), codecs.BY_ID[params.codec].WIDTH),
                      asic(run.passes))
        # the leaf's port up marks its partials, which the spine echoes; the spine's port down marks its results
        leaf.attach(SPINE_ADDR, Link(sim, spine, seed=link_seed(run.seed, MAX_WORLD + k, 0), **uplink))
        spine.attach(addr, Link(sim, leaf, seed=link_seed(run.seed, MAX_WORLD + k, 1), **uplink))
        edge += [leaf] * len(ranks)
        aggregator += [addr] * len(ranks)
        switches.append(leaf)
        leaves.append((addr, ranks))
    spine_core.install(JOB, params, leaves)
    return Topology(edge, aggregator, switches)


def mark_bytes(run: PacketRun, queue_bytes: int) -> int | None:
    """An ASIC switch's egress port of ``queue_bytes`` marks the results (a leaf's port up, the partials) that find
    a quarter of it full, the software aggregator's rule (aggregator.congestion) on the port's queue, as the P4
    program's egress does; a software aggregator's are the kernel's, which do not mark."""
    return queue_bytes // MARK_FRACTION if run.switch == "asic" and run.asic_marks else None


def link_seed(seed: int, rank: int, direction: int) -> int:
    return (seed * 1_000_003 + rank) * 2 + direction
