"""A TCP-like reliable byte stream on the packet-level engine, for the baselines that run over TCP (Gloo's ring, the
parameter server): segments of at most one MSS go through the same links, queues and losses as intml's datagrams.

Reno-style congestion control (RFC 5681) with Linux's loss recovery, SACK and RACK-TLP, simplified:
* an initial window of ``INITIAL_WINDOW`` segments (Linux's IW10), slow start until ``ssthresh``, then congestion
  avoidance (one MSS per window of acknowledged data);
* SACK (RFC 2018): every acknowledgement carries up to ``SACK_BLOCKS`` = 3 blocks of the receiver's out-of-order
  data, the most recently changed first (Linux with timestamps has room for 3); the sender's scoreboard keeps
  every block it was told of (until the cumulative acknowledgement passes it; no reneging, no D-SACK);
* loss detection by RACK (RFC 8985): a segment is lost once a segment sent after it (by send time, then sequence)
  has been delivered and RACK.rtt + a reordering window has passed since it was sent. The window is a quarter of
  the minimum RTT, and 0 once ``DUPTHRESH`` segments' worth is SACKed or during recovery (Linux's
  tcp_rack_reo_wnd when no reordering has been seen: this network never reorders). With a window of 0 a hole
  below DupThresh SACKed segments is lost at once, which is RFC 6675's IsLost. Send times are exact (the
  acknowledgement echoes the send time and end of the segment that caused it, as timestamps let Linux do), so a
  lost retransmission is detected like any other loss, one RACK.rtt after it was sent, without the timer;
* recovery (RFC 6675): on the first loss, ssthresh = max(flight / 2, 2 MSS) and cwnd = ssthresh, once per window
  (until the highest byte sent at its start is acknowledged). Throughout, the sender sends while pipe (bytes sent
  and neither acknowledged, SACKed nor marked lost) leaves room in cwnd: the lost segments first, lowest first,
  then new data; outside recovery this is Linux's in-flight test, so SACKed segments let new ones out (Limited
  Transmit without a count). Not modelled: Linux's PRR (cwnd drops to ssthresh at once) and CUBIC;
* tail loss probes (RFC 8985): with data outstanding, no loss known and no SACK on the scoreboard, a probe timer
  PTO = 2 SRTT + ``TLP_SLACK`` (Linux's TCP_TIMEOUT_MIN, 2 jiffies at HZ = 1000), plus ``MIN_RTO`` when a single
  segment is out (the peer may delay its acknowledgement), at most the RTO; on expiry the sender sends one new
  segment if it has one (whatever cwnd says, as Linux), else resends its last one, to draw SACK feedback. One
  probe per tail; a probe whose acknowledgement shows it repaired a loss (it advances the cumulative
  acknowledgement with the probe's own echo) halves the window as a recovery would;
* the retransmission timer as the last resort (RFC 6298: smoothed RTT and variance, exponential backoff), at least
  ``MIN_RTO`` = 200 ms (Linux's TCP_RTO_MIN) and 1 s before the first sample; on expiry the window falls to one
  segment, every segment not SACKed is marked lost and resent in slow start (Linux's CA_Loss). RTT samples come
  from the echoed send times of acknowledgements of new data (RFC 7323 timestamps), retransmissions included.
Segments keep their boundaries when resent. Not modelled: delayed acknowledgements (the receiver acknowledges
every segment), the receive window (the application reads at once), Nagle, pacing.

Sizes: the MSS is the MTU less IPv4 (20) and TCP with timestamps (32) bytes; ``len(segment)`` is its IP payload
less the 28 bytes ``Link`` adds for IPv4 + UDP, so that a segment of d data bytes takes d + 66 bytes on the wire
(IPv4, TCP with timestamps, Ethernet), the ``sim.models`` flow model's overhead; a SACK option adds 4 + 8 bytes a
block (two NOPs, kind, length).
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Callable

from intml.sim.engine import Datagram, Simulator
from intml.sim.models import TCP_IP
from intml.sim.network import IP_UDP, Link

INITIAL_WINDOW = 10  # segments
MIN_RTO = 0.2  # s
INITIAL_RTO = 1.0  # s
MAX_RTO = 60.0  # s
TLP_SLACK = 2e-3  # s added to 2 SRTT in the probe timeout
TCP_HEADER = TCP_IP - IP_UDP  # a segment's bytes beyond its data, as Link counts them
DUPTHRESH = 3  # segments
SACK_BLOCKS = 3
QUEUE_TIME = 1e-3  # s of the link's rate a host's queue holds (TCP small queues: about 1 ms of the pacing rate)
SACKED, LOST = 1, 2  # a sent segment's flags on the scoreboard


def mss(mtu: int) -> int:
    """Data bytes in one full segment."""
    return mtu - TCP_IP


class Segment:
    """A data segment (``size`` > 0 bytes from ``seq``, sent at ``ts``) or an acknowledgement (``size`` 0) of
    ``flow``: cumulative to ``ack``, with ``sack`` blocks ((start, end) pairs), echoing the send time ``ts`` and the
    end ``seq`` of the data segment that caused it."""

    __slots__ = ("flow", "seq", "size", "ack", "ts", "sack")

    def __init__(self, flow: int, seq: int, size: int, ack: int, ts: float,
                 sack: tuple[tuple[int, int], ...] = ()) -> None:
        self.flow, self.seq, self.size, self.ack, self.ts, self.sack = flow, seq, size, ack, ts, sack

    def __len__(self) -> int:
        return self.size + TCP_HEADER + (4 + 8 * len(self.sack) if self.sack else 0)


class Flow:
    """One direction of a connection: the sender's state at host ``src``, the receiver's at ``dst``."""

    def __init__(self, sim: Simulator, ident: int, src: TcpHost, dst: TcpHost, mss: int, min_rto: float) -> None:
        self.sim, self.id, self.src, self.dst, self.mss, self.min_rto = sim, ident, src, dst, mss, min_rto
        # sender
        self.limit = 0  # bytes the application has handed over
        self.una = self.nxt = 0
        self.cwnd = INITIAL_WINDOW * mss
        self.ssthresh = float("inf")
        self.scoreboard: deque[list] = deque()  # [seq, end, sent at, flags] of each segment from una to nxt
        self.sacked = self.lost = 0  # bytes on the scoreboard SACKed, marked lost (and not resent since)
        self.recover: int | None = None  # in recovery until this byte is acknowledged
        self.after_rto = False  # the recovery is the timer's (slow start), not a fast one (cwnd held)
        self.rack = (-1.0, 0)  # (sent at, end) of the latest-sent segment known delivered
        self.rack_rtt = 0.0
        self.min_rtt = float("inf")
        self.probe: tuple[float, bool] | None = None  # an unanswered tail loss probe: (sent at, a resend)
        self.srtt: float | None = None
        self.rttvar = 0.0
        self.rto = INITIAL_RTO
        self.rto_at: float | None = None  # the retransmission timer's deadline
        self.deadline: float | None = None  # the one timer event that counts, of ``timer`` kind
        self.timer = ""
        self.retransmits = self.timeouts = self.probes = 0
        # receiver
        self.rcv_nxt = 0
        self.ooo: dict[int, int] = {}  # start -> end of the disjoint ranges held beyond a hole, latest change last
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
    def pipe(self) -> int:
        """Bytes in the network by the scoreboard's reckoning (RFC 6675)."""
        return self.nxt - self.una - self.sacked - self.lost

    def _push(self, now: float) -> None:
        """Send what cwnd and the host's queue let out: lost segments first, then new data."""
        out = []
        room = self.src.room(now)
        pipe = self.pipe()
        lost = (s for s in self.scoreboard if s[3] & LOST) if self.lost else iter(())
        resend = next(lost, None)
        while resend is not None or self.nxt < self.limit:
            size = resend[1] - resend[0] if resend is not None else min(self.mss, self.limit - self.nxt)
            if pipe + size > self.cwnd:  # whole segments only (no silly windows)
                break
            if room <= 0:  # the host's queue is full: wait in the socket until it drains
                self.src.wait(self, now)
                break
            if resend is not None:
                out.append(self._resend(resend, now))
                resend = next(lost, None)
            else:
                out.append(self._new(size, now))
            pipe += size
            room -= size + TCP_HEADER + self.src.uplink.overhead
        if out:
            self.src.send(out, now)
            if self.rto_at is None:
                self.rto_at = now + self.rto
            self._arm(now)

    def _new(self, size: int, now: float) -> Datagram:
        self.scoreboard.append([self.nxt, self.nxt + size, now, 0])
        self.nxt += size
        return (Segment(self.id, self.nxt - size, size, 0, now), self.src.addr, self.dst.addr)

    def _resend(self, s: list, now: float) -> Datagram:
        if s[3] & LOST:
            s[3] &= ~LOST
            self.lost -= s[1] - s[0]
        s[2] = now
        self.retransmits += 1
        return (Segment(self.id, s[0], s[1] - s[0], 0, now), self.src.addr, self.dst.addr)

    def _arm(self, now: float) -> None:
        """Set the one timer: RACK's reordering wait, else a tail loss probe, else the retransmission timer."""
        if self.una >= self.nxt:
            self.deadline, self.rto_at = None, None
            return
        when, kind = self.rto_at, "rto"
        rack_at = self._rack_wait()
        if rack_at is not None:
            when, kind = max(rack_at, now), "rack"
        elif (self.probe is None and self.recover is None and not self.sacked and not self.lost
              and self.srtt is not None):
            one = len(self.scoreboard) == 1
            pto = now + min(2 * self.srtt + (MIN_RTO if one else TLP_SLACK), self.rto)
            if pto <= when:  # a probe rather than the timer when both are due (one segment out)
                when, kind = pto, "tlp"
        if when != self.deadline or kind != self.timer:
            self.deadline, self.timer = when, kind
            self.sim.at(when, self._expire, when)

    def _expire(self, deadline: float) -> None:
        if self.deadline != deadline:  # re-armed or stopped since
            return
        now = self.sim.now
        self.deadline = None
        if self.timer == "rack":
            self._detect(now)
        elif self.timer == "tlp":
            self._send_probe(now)
        else:
            self._timeout(now)
        self._push(now)
        self._arm(now)

    def _timeout(self, now: float) -> None:
        self.timeouts += 1
        self._reduce()
        self.cwnd = self.mss
        for s in self.scoreboard:
            if not s[3]:
                s[3] = LOST
                self.lost += s[1] - s[0]
        self.recover, self.after_rto, self.probe = self.nxt, True, None
        self.rto = min(2 * self.rto, MAX_RTO)
        self.rto_at = now + self.rto  # backed off (even if the host's queue holds the resend back)

    def _send_probe(self, now: float) -> None:
        self.probes += 1
        resend = self.nxt >= self.limit
        if resend:
            datagram = self._resend(self.scoreboard[-1], now)
        else:
            datagram = self._new(min(self.mss, self.limit - self.nxt), now)
        self.probe = (now, resend)
        self.src.send([datagram], now)
        self.rto_at = now + self.rto

    def on_ack(self, ack: int, sack: tuple[tuple[int, int], ...], echo: float, echo_end: int, now: float) -> None:
        """An acknowledgement to ``ack`` with ``sack`` blocks, caused by the segment sent at ``echo`` ending at
        ``echo_end``."""
        advanced = ack > self.una
        if (echo, echo_end) > self.rack:  # RACK: the latest-sent segment known delivered
            self.rack, self.rack_rtt = (echo, echo_end), now - echo
        self.min_rtt = min(self.min_rtt, now - echo)
        if self.probe is not None and self.probe[0] == echo:  # the probe's answer
            if advanced and self.probe[1] and self.recover is None:  # it repaired a lost tail
                self._reduce()
            self.probe = None
        if advanced:
            acked = ack - self.una
            board = self.scoreboard
            while board and board[0][1] <= ack:
                s = board.popleft()
                if s[3] & SACKED:
                    self.sacked -= s[1] - s[0]
                elif s[3] & LOST:
                    self.lost -= s[1] - s[0]
            self.una = ack
            self._sample(now - echo)
            if self.recover is not None and ack >= self.recover:  # the recovery ends
                if not self.after_rto:
                    self.cwnd = self.ssthresh
                self.recover, self.after_rto = None, False
            elif self.recover is None or self.after_rto:
                if self.cwnd < self.ssthresh:
                    self.cwnd += min(acked, self.mss)
                else:
                    self.cwnd += max(self.mss * self.mss // self.cwnd, 1)
            self.rto_at = now + self.rto if self.una < self.nxt else None
        if sack:
            self._mark_sacked(sack)
        if self.sacked or self.recover is not None:
            self._detect(now)
        self._push(now)
        self._arm(now)

    def _mark_sacked(self, blocks: tuple[tuple[int, int], ...]) -> None:
        for start, end in blocks:
            if end <= self.una:
                continue
            for s in self.scoreboard:
                if s[0] >= end:
                    break
                if s[0] >= start and s[1] <= end and not s[3] & SACKED:
                    if s[3] & LOST:
                        self.lost -= s[1] - s[0]
                    s[3] = SACKED
                    self.sacked += s[1] - s[0]

    def _reorder_window(self) -> float:
        if self.recover is not None or self.sacked >= DUPTHRESH * self.mss:
            return 0.0
        return min(self.min_rtt / 4, self.srtt or 0.0)

    def _detect(self, now: float) -> None:
        """RACK: mark lost each segment sent before the latest delivered one, RACK.rtt + the window ago; on the
        first loss, start a recovery."""
        wait = self.rack_rtt + self._reorder_window()
        found = False
        for s in self.scoreboard:  # in sequence order, not send order (resends)
            if not s[3] and (s[2], s[1]) < self.rack and s[2] + wait <= now:
                s[3] = LOST
                self.lost += s[1] - s[0]
                found = True
        if found and self.recover is None:
            self._reduce()
            self.recover, self.probe = self.nxt, None

    def _rack_wait(self) -> float | None:
        """When RACK's reordering window will next mark a segment lost (None: no candidate)."""
        if not self.sacked and self.recover is None:
            return None
        wait = self.rack_rtt + self._reorder_window()
        first = None
        for s in self.scoreboard:
            if not s[3] and (s[2], s[1]) < self.rack:
                first = s[2] + wait if first is None else min(first, s[2] + wait)
        return first

    def _reduce(self) -> None:
        """Halve the window (Reno): ssthresh and cwnd to half the flight, at least two segments."""
        self.ssthresh = max((self.nxt - self.una) // 2, 2 * self.mss)
        self.cwnd = self.ssthresh

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
        ooo = self.ooo
        if seq <= self.rcv_nxt < end:
            self.rcv_nxt = end
            # absorb the held ranges the new data reaches
            while ooo and (joined := [s for s in ooo if s <= self.rcv_nxt]):
                self.rcv_nxt = max(self.rcv_nxt, *(ooo.pop(s) for s in joined))
        elif seq > self.rcv_nxt:  # merge into the held ranges; the changed range goes last (the newest)
            start, stop = seq, end
            for s in [s for s, e in ooo.items() if s <= stop and e >= start]:
                e = ooo.pop(s)
                start, stop = min(start, s), max(stop, e)
            ooo[start] = stop
        blocks = tuple((s, ooo[s]) for s in list(ooo)[:-SACK_BLOCKS - 1:-1])
        self.dst.send([(Segment(self.id, end, 0, self.rcv_nxt, ts, blocks), self.dst.addr, self.src.addr)], now)
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
                flow.on_ack(segment.ack, segment.sack, segment.ts, segment.seq, now)


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
