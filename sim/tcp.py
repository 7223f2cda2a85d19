"""A TCP-like reliable byte stream on the packet-level engine, for the baselines that run over TCP (Gloo's ring, the
parameter server): segments of at most one MSS go through the same links, queues and losses as intml's datagrams.

Reno-style congestion control (RFC 5681) with NewReno's partial acknowledgements (RFC 6582):
* an initial window of ``INITIAL_WINDOW`` segments (Linux's IW10), slow start until ``ssthresh``, then congestion
  avoidance (one MSS per window of acknowledged data);
* fast retransmit on the third duplicate acknowledgement, fast recovery (ssthresh = flight / 2, the window
  inflated by each duplicate), a partial acknowledgement retransmitting the next hole; Limited Transmit (RFC
  3042: a new segment on each of the first two duplicates);
* a retransmission timer per flow (RFC 6298: smoothed RTT and variance, exponential backoff), at least
  ``MIN_RTO`` = 200 ms (Linux's TCP_RTO_MIN) and 1 s before the first sample; on expiry the window falls to one
  segment and the flow goes back to its first unacknowledged byte. RTT samples come from timestamps (RFC 7323,
  on in Linux): every acknowledgement of new data echoes the send time of the segment that caused it, so
  retransmissions are timed too and a backed-off timer recovers at the next acknowledgement.
Not modelled: delayed and selective acknowledgements (the receiver acknowledges every segment cumulatively),
RACK and tail loss probes (Linux has both: a lost tail or a lost retransmission waits for the timer here, so
under loss this TCP is slower than Linux's), the receive window (the application reads at once), Nagle, pacing.

Sizes: the MSS is the MTU less IPv4 (20) and TCP with timestamps (32) bytes; ``len(segment)`` is its IP payload
less the 28 bytes ``Link`` adds for IPv4 + UDP, so that a segment of d data bytes takes d + 66 bytes on the wire
(IPv4, TCP with timestamps, Ethernet), the ``sim.models`` flow model's overhead.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable

from intml.sim.engine import Datagram, Simulator
from intml.sim.models import TCP_IP
from intml.sim.network import IP_UDP, Link

INITIAL_WINDOW = 10  # segments
MIN_RTO = 0.2  # s
INITIAL_RTO = 1.0  # s
MAX_RTO = 60.0  # s
TCP_HEADER = TCP_IP - IP_UDP  # a segment's bytes beyond its data, as Link counts them
DUPACKS = 3
QUEUE_TIME = 1e-3  # s of the link's rate a host's queue holds (TCP small queues: about 1 ms of the pacing rate)


def mss(mtu: int) -> int:
    """Data bytes in one full segment."""
    return mtu - TCP_IP


class Segment:
    """A data segment (``size`` > 0 bytes from ``seq``) or an acknowledgement (``size`` 0, ``ack``) of ``flow``;
    ``ts``: a data segment's send time, echoed by the acknowledgement it causes."""

    __slots__ = ("flow", "seq", "size", "ack", "ts")

    def __init__(self, flow: int, seq: int, size: int, ack: int, ts: float) -> None:
        self.flow, self.seq, self.size, self.ack, self.ts = flow, seq, size, ack, ts

    def __len__(self) -> int:
        return self.size + TCP_HEADER


class Flow:
    """One direction of a connection: the sender's state at host ``src``, the receiver's at ``dst``."""

    def __init__(self, sim: Simulator, ident: int, src: TcpHost, dst: TcpHost, mss: int, min_rto: float) -> None:
        self.sim, self.id, self.src, self.dst, self.mss, self.min_rto = sim, ident, src, dst, mss, min_rto
        # sender
        self.limit = 0  # bytes the application has handed over
        self.una = self.nxt = 0
        self.cwnd = INITIAL_WINDOW * mss
        self.ssthresh = float("inf")
        self.dupacks = 0
        self.recover: int | None = None  # fast recovery until this byte is acknowledged
        self.srtt: float | None = None
        self.rttvar = 0.0
        self.rto = INITIAL_RTO
        self.deadline: float | None = None
        self.highest = 0  # the highest byte ever sent: below it, a send is a retransmission
        self.retransmits = self.timeouts = 0
        # receiver
        self.rcv_nxt = 0
        self.ooo: dict[int, int] = {}  # seq -> end of segments received beyond a hole
        self.watches: list[tuple[int, int, Callable[[float], None]]] = []  # (offset, order, callback) heap
        self._order = 0

    # ---- the application -----------------------------------------------------------------------------
    def write(self, nbytes: int, now: float) -> None:
        """Queue ``nbytes`` more bytes to send."""
        self.limit += nbytes
        self._push(now)

    def when_received(self, offset: int, fn: Callable[[float], None]) -> None:
        """Call ``fn(now)`` once the receiver has every byte before ``offset``, in order."""
        if self.rcv_nxt >= offset:
            fn(self.sim.now)
            return
        heapq.heappush(self.watches, (offset, self._order, fn))
        self._order += 1

    # ---- the sender ----------------------------------------------------------------------------------
    def _push(self, now: float, extra: int = 0) -> None:
        """Send what the window (``cwnd`` + ``extra`` bytes) and the host's queue let out."""
        out = []
        room = self.src.room(now)
        window = self.cwnd + extra
        while self.nxt < self.limit and self.nxt - self.una < window:
            size = min(self.mss, self.limit - self.nxt, max(window - (self.nxt - self.una), 0))
            if size < min(self.mss, self.limit - self.nxt):  # send only whole segments (no silly windows)
                break
            if room <= 0:  # the host's queue is full: wait in the socket until it drains
                self.src.wait(self, now)
                break
            out.append(self._segment(self.nxt, size, now))
            self.nxt += size
            room -= size + TCP_HEADER + self.src.uplink.overhead
        if out:
            self.src.send(out, now)
            if self.deadline is None:
                self._arm(now)

    def _segment(self, seq: int, size: int, now: float) -> Datagram:
        if seq < self.highest:
            self.retransmits += 1
        else:
            self.highest = seq + size
        return (Segment(self.id, seq, size, 0, now), self.src.addr, self.dst.addr)

    def _arm(self, now: float) -> None:
        self.deadline = now + self.rto
        self.sim.at(self.deadline, self._expire, self.deadline)

    def _expire(self, deadline: float) -> None:
        if self.deadline != deadline:  # re-armed or stopped since
            return
        now = self.sim.now
        self.timeouts += 1
        self.ssthresh = max((self.nxt - self.una) // 2, 2 * self.mss)
        self.cwnd = self.mss
        self.recover, self.dupacks = None, 0
        self.rto = min(2 * self.rto, MAX_RTO)
        self.nxt = self.una  # go back to the first unacknowledged byte
        self.deadline = None
        self._push(now)

    def on_ack(self, ack: int, echo: float, now: float) -> None:
        if ack > self.una:
            acked = ack - self.una
            self.una = ack
            if self.nxt < ack:  # acknowledged beyond what a go-back resend had reached
                self.nxt = ack
            self._sample(now - echo)
            if self.recover is not None:
                if ack >= self.recover:  # full acknowledgement: recovery ends
                    self.cwnd, self.recover = self.ssthresh, None
                else:  # partial: the next hole is lost too; deflate by what was acknowledged
                    self.src.send([self._segment(ack, min(self.mss, self.highest - ack), now)], now)
                    self.cwnd = max(self.cwnd - acked + self.mss, self.mss)
            elif self.cwnd < self.ssthresh:
                self.cwnd += min(acked, self.mss)
            else:
                self.cwnd += max(self.mss * self.mss // self.cwnd, 1)
            self.dupacks = 0
            self.deadline = None
            if self.una < self.highest:
                self._arm(now)
        elif ack == self.una and self.una < self.highest:
            self.dupacks += 1
            if self.recover is None and self.dupacks == DUPACKS:
                flight = self.highest - self.una
                self.ssthresh = max(flight // 2, 2 * self.mss)
                self.cwnd = self.ssthresh + DUPACKS * self.mss
                self.recover = self.highest
                self.src.send([self._segment(ack, min(self.mss, self.highest - ack), now)], now)
                self.deadline = None
                self._arm(now)
            elif self.recover is not None:
                self.cwnd += self.mss
        # Limited Transmit (RFC 3042): the first two duplicates each let one new segment out beyond the window,
        # so that a small window still gets its three duplicates
        self._push(now, self.dupacks * self.mss if self.recover is None and self.dupacks < DUPACKS else 0)

    def _sample(self, rtt: float) -> None:
        if self.srtt is None:
            self.srtt, self.rttvar = rtt, rtt / 2
        else:
            self.rttvar = 0.75 * self.rttvar + 0.25 * abs(self.srtt - rtt)
            self.srtt = 0.875 * self.srtt + 0.125 * rtt
        self.rto = min(max(self.min_rto, self.srtt + 4 * self.rttvar), MAX_RTO)

    # ---- the receiver --------------------------------------------------------------------------------
    def on_data(self, seq: int, size: int, ts: float, now: float) -> None:
        end = seq + size
        if seq <= self.rcv_nxt < end:
            self.rcv_nxt = end
            # absorb what was held beyond the hole (a resent segment may end inside a held one: segment
            # boundaries move when a flow goes back and its data has grown since)
            while self.ooo and (joined := [s for s in self.ooo if s <= self.rcv_nxt]):
                self.rcv_nxt = max(self.rcv_nxt, *(self.ooo.pop(s) for s in joined))
        elif seq > self.rcv_nxt:
            self.ooo[seq] = max(end, self.ooo.get(seq, 0))
        self.dst.send([(Segment(self.id, 0, 0, self.rcv_nxt, ts), self.dst.addr, self.src.addr)], now)
        watches = self.watches
        while watches and watches[0][0] <= self.rcv_nxt:
            heapq.heappop(watches)[2](now)


class TcpHost:
    """A host that sends and receives segments of its flows on ``uplink`` (set by the topology). Its queue to the
    wire holds at most ``QUEUE_TIME`` of the link's rate (at least two full segments): Linux's TCP small queues,
    which keep segments in the socket (not yet sent, so not timed) rather than in the qdisc; a flow that finds
    it full waits until it has half drained."""

    def __init__(self, sim: Simulator, addr: int) -> None:
        self.sim, self.addr = sim, addr
        self.uplink: Link | None = None
        self.flows: dict[int, Flow] = {}  # by id, both the ones it sends and the ones it receives
        self.waiting: dict[Flow, None] = {}  # flows held back by a full queue, in order
        self._wake_at: float | None = None

    def limit(self) -> float:
        """The queue's bytes."""
        return max(QUEUE_TIME / self.uplink.byte_time, 2 * (self.uplink.mtu + self.uplink.overhead))

    def room(self, now: float) -> float:
        """Bytes the queue takes now."""
        return self.limit() - max(self.uplink.busy_until - now, 0.0) / self.uplink.byte_time

    def wait(self, flow: Flow, now: float) -> None:
        self.waiting[flow] = None
        if self._wake_at is None:
            self._wake_at = max(now, self.uplink.busy_until - self.limit() / 2 * self.uplink.byte_time)
            self.sim.at(self._wake_at, self._wake)

    def _wake(self) -> None:
        self._wake_at = None
        flows, self.waiting = list(self.waiting), {}
        for flow in flows:
            flow._push(self.sim.now)

    def send(self, datagrams: list[Datagram], now: float) -> None:
        self.uplink.send_many(datagrams, now)

    def arrive(self, datagrams: list[Datagram], now: float) -> None:
        for segment, _, _ in datagrams:
            flow = self.flows[segment.flow]
            if segment.size:
                flow.on_data(segment.seq, segment.size, segment.ts, now)
            else:
                flow.on_ack(segment.ack, segment.ts, now)


class Network:
    """TCP hosts on one switch (``sim.network.Switch``, no aggregator): flows between any two of them."""

    def __init__(self, sim: Simulator, switch, hosts: list[TcpHost], mtu: int, min_rto: float = MIN_RTO) -> None:
        self.sim, self.switch, self.hosts, self.mss, self.min_rto = sim, switch, hosts, mss(mtu), min_rto
        self.flows: list[Flow] = []

    def flow(self, src: int, dst: int) -> Flow:
        """A new flow from host ``src`` to host ``dst`` (indices)."""
        f = Flow(self.sim, len(self.flows), self.hosts[src], self.hosts[dst], self.mss, self.min_rto)
        self.flows.append(f)
        self.hosts[src].flows[f.id] = f
        self.hosts[dst].flows[f.id] = f
        return f
