"""Packet-level TCP baselines on one switch: Gloo's ring allreduce and a sharded parameter server (seed 004), their
segments through the same links, queues and losses as intml's datagrams (``sim.tcp``), so that they can be set
beside intml under loss. Each rank's software latency per message received (through the kernel and Gloo) is
``alpha``, as the flow models' per step (``sim.models``), which these are checked against where both run.

* Ring (reduce-scatter, then allgather): Gloo's (``_ring``): segments of at most 1 MB, two in flight each way, each
  sent only once the receiver's ready notice is in, every message of a pair of ranks on its one connection; a
  rank goes on ``alpha`` after each segment it receives.
* Parameter server: ``servers`` shards (None: colocated, one on each rank, which keeps its own shard's part local);
  every rank pushes its part of each shard, and a shard's server sends the summed shard back to every rank piece
  by piece (``piece`` bytes) once every rank's piece is in, so pushes and pulls overlap on the full-duplex links.
Connections persist across ``rounds`` allreduces (their windows too); each allreduce starts when the last rank has
the previous one's result.
"""

from __future__ import annotations

import time
from collections import deque
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
GLOO_SEGMENT = 1 << 20  # bytes: the most one send or receive of Gloo's ring carries (kMaxSegmentSize)
PREAMBLE = 48  # bytes before each message of Gloo's TCP transport (its Op preamble: six 8-byte fields)


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
    app_bytes: int  # bytes the ranks handed to TCP, on all connections (data and the collective's own messages)
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
                     queue_drops=sum(lk.stats.queue_drops for lk in links),
                     app_bytes=sum(f.limit for f in net.flows), packet_events=sim.packet_events,
                     wall=time.perf_counter() - wall)


def gloo_segments(total: int, workers: int, element: int = 4) -> tuple[int, int]:
    """(segments, bytes per segment) of Gloo's ring for a ``total``-byte tensor (gloo/allreduce.cc): at most
    ``GLOO_SEGMENT`` bytes each, at least two per rank, a multiple of ``workers`` in all."""
    most = element * max(1, GLOO_SEGMENT // element)
    count = max(-(-total // most), 2 * workers)
    count += -count % workers
    per = -(-total // count)
    return count, -(-per // element) * element


def _ring(sim: Simulator, net: Network, run: TcpRun, servers: int,
          rank_done: Callable[[float], None]) -> Callable[[float], None]:
    """Gloo's ring as gloo/allreduce.cc runs it on its TCP transport. Returns the round's starter.

    The tensor is cut into segments (``gloo_segments``). Each phase, reduce-scatter then allgather, has segments
    - segments / n iterations (+ 2 that only wait); at iteration i rank r first waits for iteration i - 2's
    segment, then posts a receive of one segment from r + 1 and a send of one to r - 1: two segments in flight
    each way. The transport is a rendezvous: a receive sends the peer a ready notice, and the data leaves only
    once that notice is in (a send announces itself too); each message carries a ``PREAMBLE``. All messages
    between two ranks share the pair's one TCP connection, in order, so at n = 2, where r + 1 and r - 1 are the
    same rank, a ready notice waits behind the data its rank is sending the other way (a segment is about 1 MB)
    and behind every hole in it; at n > 2 the notices have a direction of their own."""
    n = run.workers
    total = 4 * run.elements
    count, size = gloo_segments(total, n)
    per_rank, iterations = count // n, count - count // n
    span = count * size

    def lengths(r: int, i: int, phase: int) -> tuple[int, int]:
        """(send, receive) bytes of rank r's iteration i (0 where the segment lies beyond the tensor): reduce-
        scatter sends segment (r + 1) per_rank + i and receives the one per_rank further; allgather one chunk
        earlier."""
        send = ((r + 1 - phase) * per_rank + i) * size % span
        recv = (send + per_rank * size) % span
        return max(0, min(size, total - send)), max(0, min(size, total - recv))

    flows: dict[tuple[int, int], Flow] = {}
    for r in range(n):  # one connection per neighbouring pair, a flow each way
        for peer in sorted({(r - 1) % n, (r + 1) % n}):
            flows[r, peer] = net.flow(r, peer)
    state: list[_RingRank] = []

    def message(src: int, dst: int, nbytes: int, then: Callable[[float], None] | None = None) -> None:
        f = flows[src, dst]
        f.write(nbytes, sim.now)
        if then is not None:
            f.when_received(f.limit, then)

    end = 2 * (iterations + 2)

    def advance(r: int, st: _RingRank) -> None:
        """Run rank r's iterations as far as its receives and sends let it (``st``: the round's state, so that a
        wake-up left over from the last round does nothing)."""
        if st.step == end:
            return
        while st.step < end:
            phase, i = divmod(st.step, iterations + 2)
            if i >= 2 and (st.received < st.posted[st.step - 2] or st.written < st.posted_sends[st.step - 2]):
                return  # iteration i - 2's receive is not in, or its send not yet handed to TCP
            send = recv = 0
            if i < iterations:
                send, recv = lengths(r, i, phase)
                if recv:
                    message(r, (r + 1) % n, PREAMBLE, lambda now, q=(r + 1) % n: granted(q))
                if send:
                    message(r, (r - 1) % n, PREAMBLE)  # the send notice
                    st.sends.append(send)
                    release(r)
            st.posted.append((st.posted[-1] if st.posted else 0) + (recv > 0))
            st.posted_sends.append((st.posted_sends[-1] if st.posted_sends else 0) + (send > 0))
            st.step += 1
        rank_done(sim.now)

    def granted(q: int) -> None:
        """Rank q - 1's ready notice is in at rank q."""
        state[q].grants += 1
        release(q)

    def release(q: int) -> None:
        """Send rank q's posted segments that rank q - 1 is ready for."""
        st = state[q]
        while st.grants and st.sends:
            st.grants -= 1
            message(q, (q - 1) % n, PREAMBLE + st.sends.popleft(), lambda now, d=(q - 1) % n: received(d, now))
            st.written += 1
            sim.at(sim.now, advance, q, st)

    def received(r: int, now: float) -> None:
        state[r].received += 1
        sim.at(now + run.alpha, advance, r, state[r])

    def start(now: float) -> None:
        state[:] = [_RingRank() for _ in range(n)]
        for r in range(n):
            sim.at(now + run.alpha, advance, r, state[r])
    return start


class _RingRank:
    """A rank's progress through one ring allreduce."""

    def __init__(self) -> None:
        self.step = 0  # iterations done, over both phases
        self.posted: list[int] = []  # receives posted up to each iteration
        self.received = 0  # receives complete
        self.posted_sends: list[int] = []  # sends posted up to each iteration
        self.written = 0  # sends handed to TCP
        self.grants = 0  # ready notices from r - 1 not yet used
        self.sends: deque[int] = deque()  # bytes of each posted send still waiting for its notice


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
