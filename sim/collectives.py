"""Packet-level TCP baselines on one switch: Gloo's ring allreduce and a sharded parameter server (seed 004), their
segments through the same links, queues and losses as intml's datagrams (``sim.tcp``), so that they can be set
beside intml under loss. Each rank's software latency per message (a send through the kernel and Gloo) is
``alpha``, as in the flow models (``sim.models``), which these are checked against where both run.

* Ring (reduce-scatter, then allgather): the tensor in n chunks; at each of 2(n-1) steps rank r sends one chunk to
  rank r+1 on its connection, and starts the next step ``alpha`` after the previous step's chunk from rank r-1
  is in (Gloo's ring: each step's send depends on the previous receive).
* Parameter server: ``servers`` shards (None: colocated, one on each rank, which keeps its own shard's part local);
  every rank pushes its part of each shard, and a shard's server sends the summed shard back to every rank piece
  by piece (``piece`` bytes) once every rank's piece is in, so pushes and pulls overlap on the full-duplex links.
Connections persist across ``rounds`` allreduces (their windows too); each allreduce starts when the last rank has
the previous one's result.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from intml.sim.costs import ASIC
from intml.sim.engine import Simulator
from intml.sim.network import Link, Switch
from intml.sim.packet_level import HOST_IP, HOST_PORT, link_seed
from intml.sim.tcp import MIN_RTO, Flow, Network, TcpHost

ALGORITHMS = ("ring", "ps-colocated", "ps-dedicated")
SENDER_QUEUE = 1 << 62  # bytes: unbounded


@dataclass
class TcpRun:
    workers: int = 4
    elements: int = 1_000_000  # float32
    algorithm: str = "ring"
    rate: float = 10e9
    delay: float = 1e-6
    mtu: int = 1500
    queue_bytes: int = 1 << 20
    loss: float = 0.0
    alpha: float = 20e-6
    servers: int | None = None  # ps-dedicated: default max(1, workers // 4), as sim.models
    piece: int = 1 << 16  # bytes per parameter-server piece (a server sums and returns each as soon as it is in)
    min_rto: float = MIN_RTO
    congestion: str = "reno"  # or "bbr" (sim.tcp.CONGESTION)
    rounds: int = 1
    seed: int = 1

    def __post_init__(self) -> None:
        if self.algorithm not in ALGORITHMS:
            raise ValueError(f"algorithm must be one of {', '.join(ALGORITHMS)}, got {self.algorithm!r}")
        if self.workers < 2:
            raise ValueError(f"a TCP collective needs at least 2 workers, got {self.workers}")
        if self.algorithm == "ps-dedicated" and self.servers is None:
            self.servers = max(1, self.workers // 4)


@dataclass
class TcpResult:
    times: list[float]
    retransmissions: int
    timeouts: int
    lost: int
    queue_drops: int
    packet_events: int
    wall: float


def _split(total: int, parts: int) -> list[int]:
    """``total`` elements in ``parts`` near-equal parts (numpy.array_split's sizes)."""
    return [len(a) for a in np.array_split(np.empty(total, np.uint8), parts)]


def simulate_tcp(run: TcpRun) -> TcpResult:
    wall = time.perf_counter()
    sim = Simulator()
    n = run.workers
    servers = 0 if run.algorithm != "ps-dedicated" else run.servers
    switch = Switch(sim, None, ASIC)
    hosts = [TcpHost(sim, ((HOST_IP + i + 1) << 16) | HOST_PORT) for i in range(n + servers)]
    for i, h in enumerate(hosts):
        link = dict(rate=run.rate, delay=run.delay, mtu=run.mtu, loss=run.loss)
        # a sender's own queue never drops: TcpHost keeps it short (TCP small queues)
        h.uplink = Link(sim, switch, seed=link_seed(run.seed, i, 0), queue_bytes=SENDER_QUEUE, **link)
        switch.attach(h.addr, Link(sim, h, seed=link_seed(run.seed, i, 1), queue_bytes=run.queue_bytes, **link))
    net = Network(sim, switch, hosts, run.mtu, run.min_rto, run.congestion)
    times: list[float] = []
    state = {"start": 0.0, "done": 0}

    def rank_done(now: float) -> None:
        state["done"] += 1
        if state["done"] == n:
            times.append(now - state["start"])
            if len(times) < run.rounds:
                begin(now)

    start_round = (_ring if run.algorithm == "ring" else _parameter_server)(sim, net, run, servers, rank_done)

    def begin(now: float) -> None:
        state["start"], state["done"] = now, 0
        start_round(now)

    sim.at(0.0, begin, 0.0)
    sim.run(stop=lambda: len(times) == run.rounds)
    if len(times) < run.rounds:
        raise RuntimeError(f"the TCP {run.algorithm} ran out of events after {len(times)} of {run.rounds} "
                           f"allreduces at t = {sim.now:.6g} s")
    links = [h.uplink for h in hosts] + list(switch.ports.values())
    return TcpResult(times=times, retransmissions=sum(f.retransmits for f in net.flows),
                     timeouts=sum(f.timeouts for f in net.flows), lost=sum(lk.stats.lost for lk in links),
                     queue_drops=sum(lk.stats.queue_drops for lk in links), packet_events=sim.packet_events,
                     wall=time.perf_counter() - wall)


def _ring(sim: Simulator, net: Network, run: TcpRun, servers: int,
          rank_done: Callable[[float], None]) -> Callable[[float], None]:
    """Rank r sends on flow r (to r + 1) and receives on flow r - 1. Returns the round's starter."""
    n = run.workers
    chunk = [4 * e for e in _split(run.elements, n)]
    steps = 2 * (n - 1)
    # the chunk rank r sends at step k: reduce-scatter (r - k), then allgather (r + 1 - (k - (n - 1)))
    sends = [[chunk[(r - k) % n if k < n - 1 else (r + 1 - (k - n + 1)) % n] for k in range(steps)]
             for r in range(n)]
    flows = [net.flow(r, (r + 1) % n) for r in range(n)]
    base = [0] * n  # bytes each flow carried in earlier rounds

    def send_step(r: int, k: int) -> None:
        flows[r].write(sends[r][k], sim.now)
        left = (r - 1) % n  # the step's chunk from the left neighbour
        flows[left].when_received(base[left] + sum(sends[left][:k + 1]), lambda now: received(r, k, now))

    def received(r: int, k: int, now: float) -> None:
        if k + 1 < steps:
            sim.at(now + run.alpha, send_step, r, k + 1)
        else:
            rank_done(now)

    def start(now: float) -> None:
        for r in range(n):
            base[r] = flows[r].limit
        for r in range(n):
            sim.at(now + run.alpha, send_step, r, 0)
    return start


def _parameter_server(sim: Simulator, net: Network, run: TcpRun, servers: int,
                      rank_done: Callable[[float], None]) -> Callable[[float], None]:
    """Shard s lives on host s (colocated) or host n + s (dedicated). Returns the round's starter."""
    n = run.workers
    k = servers or n
    host_of = [s if not servers else n + s for s in range(k)]
    shard = [4 * e for e in _split(run.elements, k)]
    pieces = [[min(run.piece, b - o) for o in range(0, b, run.piece)] for b in shard]
    push: dict[tuple[int, int], Flow] = {}
    pull: dict[tuple[int, int], Flow] = {}
    for s in range(k):
        for w in range(n):
            if host_of[s] != w:
                push[w, s] = net.flow(w, host_of[s])
                pull[s, w] = net.flow(host_of[s], w)
    remote = [[w for w in range(n) if host_of[s] != w] for s in range(k)]

    def start(now: float) -> None:
        base = {key: f.limit for key, f in push.items()}
        got = [[0] * len(pieces[s]) for s in range(k)]
        left = [sum(1 for s in range(k) if host_of[s] != w) for w in range(n)]  # remote shards each rank awaits

        def piece_in(s: int, j: int, now: float) -> None:
            got[s][j] += 1
            if got[s][j] == len(remote[s]):  # every rank's part of the piece is summed: send it back
                sim.at(now + run.alpha, send_back, s, j)

        def send_back(s: int, j: int) -> None:
            for w in remote[s]:
                f = pull[s, w]
                f.write(pieces[s][j], sim.now)
                if j == len(pieces[s]) - 1:
                    f.when_received(f.limit, lambda now, w=w: shard_back(w, now))

        def shard_back(w: int, now: float) -> None:
            left[w] -= 1
            if left[w] == 0:
                rank_done(now)

        def push_all() -> None:
            t = sim.now
            for (w, s), f in push.items():
                f.write(shard[s], t)
                offset = base[w, s]
                for j, size in enumerate(pieces[s]):
                    offset += size
                    f.when_received(offset, lambda now, s=s, j=j: piece_in(s, j, now))
            for w in range(n):
                if left[w] == 0:  # a single colocated shard: nothing to wait for
                    rank_done(t)
        sim.at(now + run.alpha, push_all)
    return start
