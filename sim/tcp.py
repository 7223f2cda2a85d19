"""A TCP-like reliable byte stream on the packet-level engine, for the baselines that run over TCP (Gloo's ring, the
parameter server): segments of at most one MSS go through the same links, queues and losses as intml's datagrams.

Linux's loss recovery, SACK and RACK-TLP, simplified, under one of two congestion controls (``CONGESTION``):
* Reno (RFC 5681, ``Reno``): an initial window of ``INITIAL_WINDOW`` segments (Linux's IW10), slow start until
  ``ssthresh``, then congestion avoidance (one MSS per window of acknowledged data); halved on loss (below);
* BBR v1 (``Bbr``), the testbed kernel's ``net.ipv4.tcp_congestion_control``: the window follows a bandwidth
  estimate from delivery-rate samples (Linux's tcp_rate.c: bytes delivered between a segment's send and its
  acknowledgement, over the longer of the send and acknowledgement intervals) times the min RTT, plus the TSO
  quantization budget; loss does not shrink it. Segments leave at the pacing rate in TSO bursts. Under 5% loss
  this keeps Gloo's windows at 13-18 segments on the testbed (``ss -ti``), where Reno's fall to a few segments
  and wait for 200 ms timeouts (the testbed set to Reno: 16-22 s per allreduce; with BBR 2.0-2.2 s);
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
* recovery (RFC 6675): on the first loss Reno sets ssthresh = max(flight / 2, 2 MSS) and cwnd = ssthresh, once per
  window (until the highest byte sent at its start is acknowledged); BBR conserves packets for a round trip.
  Throughout, the sender sends while pipe (bytes sent and neither acknowledged, SACKed nor marked lost) leaves
  room in cwnd: the lost segments first, lowest first, then new data; outside recovery this is Linux's in-flight
  test, so SACKed segments let new ones out (Limited Transmit without a count). Not modelled: Linux's PRR (cwnd
  drops to ssthresh at once) and CUBIC;
* Linux's timers count jiffies (``JIFFY`` = 4 ms: the testbed's kernel has CONFIG_HZ=250) and the RACK and probe
  timers add TCP_TIMEOUT_MIN, two jiffies (``TLP_SLACK``): RACK's reordering timer fires the longest remaining
  wait, rounded up to jiffies, + 8 ms after it is armed (tcp_rack_mark_lost);
* tail loss probes (RFC 8985): with data outstanding, no loss known and no SACK on the scoreboard, a probe timer
  PTO = 2 SRTT rounded up to jiffies + ``TLP_SLACK``, or + ``MIN_RTO`` when a single segment is out (the peer may
  delay its acknowledgement), at most the RTO; on expiry the sender sends one new segment if it has one
  (whatever cwnd says, as Linux), else resends its last one, to draw SACK feedback. One probe per tail; a probe
  whose acknowledgement shows it repaired a loss (it advances the cumulative acknowledgement with the probe's own
  echo) halves Reno's window as a recovery would;
* the retransmission timer as the last resort (RFC 6298: smoothed RTT and variance, exponential backoff), at least
  ``MIN_RTO`` = 200 ms (Linux's TCP_RTO_MIN) and 1 s before the first sample; on expiry the window falls to one
  segment (BBR's grows back to its target by what each acknowledgement delivers), every segment not SACKed is
  marked lost and resent (Linux's CA_Loss). RTT samples come from the echoed send times of acknowledgements of
  new data (RFC 7323 timestamps), retransmissions included.
Segments keep their boundaries when resent. Not modelled: delayed acknowledgements (the receiver acknowledges
every segment), the receive window (the application reads at once), Nagle, Reno pacing (Linux paces only BBR
without the fq qdisc).

Sizes: the MSS is the MTU less IPv4 (20) and TCP with timestamps (32) bytes; ``len(segment)`` is its IP payload
less the 28 bytes ``Link`` adds for IPv4 + UDP, so that a segment of d data bytes takes d + 66 bytes on the wire
(IPv4, TCP with timestamps, Ethernet), the ``sim.models`` flow model's overhead; a SACK option adds 4 + 8 bytes a
block (two NOPs, kind, length).
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from collections.abc import Callable

from intml.sim.engine import Datagram, Simulator
from intml.sim.network import IP_UDP, Link
from intml.worker.costs import TCP_IP

INITIAL_WINDOW = 10  # segments
MIN_RTO = 0.2  # s
INITIAL_RTO = 1.0  # s
MAX_RTO = 60.0  # s
JIFFY = 1 / 250  # s: Linux's timers count jiffies; the testbed's kernel has CONFIG_HZ=250
TLP_SLACK = 2 * JIFFY  # s: TCP_TIMEOUT_MIN, added to the probe and the reordering timers
TCP_HEADER = TCP_IP - IP_UDP  # a segment's bytes beyond its data, as Link counts them
DUPTHRESH = 3  # segments
SACK_BLOCKS = 3
QUEUE_TIME = 1e-3  # s of the link's rate a host's queue holds (TCP small queues: about 1 ms of the pacing rate)
SACKED, LOST = 1, 2  # a sent segment's flags on the scoreboard
# A scoreboard entry: [seq, end, sent at, flags, and at its send: delivered, the delivered time, app-limited, and the
# send time of the latest-sent segment then known delivered (the start of the send interval)]
CONGESTION = ("reno", "bbr")
# BBR v1 as Linux's tcp_bbr.c has it
HIGH_GAIN = 2.885  # 2 / ln 2: startup's pacing and cwnd gain
PROBE_BW_GAINS = (1.25, 0.75, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0)  # pacing gain of each phase of the ProbeBW cycle
PROBE_BW_CWND_GAIN = 2.0
BW_ROUNDS = 10  # round trips the max bandwidth filter spans
FULL_BW_GROWTH, FULL_BW_ROUNDS = 1.25, 3  # startup ends when the bandwidth grew less than 25% in 3 round trips
MIN_CWND = 4  # segments
PACING_MARGIN = 0.99  # BBR paces 1% below its estimate
TSO_AUTOSIZE = 1 / 1024  # s of the pacing rate in one TSO burst (sk_pacing_shift = 10), at most GSO_BYTES
GSO_BYTES = 65536 - 1 - 320  # GSO_LEGACY_MAX_SIZE - 1 - MAX_TCP_HEADER
MIN_TSO, MAX_TSO = 2, 127  # segments


def _jiffies(seconds: float) -> float:
    """``seconds`` rounded up to whole jiffies (usecs_to_jiffies)."""
    return math.ceil(seconds / JIFFY - 1e-9) * JIFFY


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

    def __init__(self, sim: Simulator, ident: int, src: TcpHost, dst: TcpHost, mss: int, min_rto: float,
                 congestion: str = "reno") -> None:
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
        # delivery rate estimation (draft-cheng-iccrg-delivery-rate-estimation, Linux's tcp_rate.c): bytes
        # delivered (cumulatively acknowledged or SACKed) and when the count last grew
        self.delivered = 0
        self.delivered_time = 0.0
        self.first_sent = 0.0  # the send time of the latest-sent segment known delivered
        self.next_send = 0.0  # pacing: when the next burst may leave
        self.pace_wake: float | None = None  # the pending pacing wake-up
        self.app_limited = 0  # nonzero: the application ran out of data; samples until this many are delivered
        self.newest: list | None = None  # per acknowledgement: the latest-sent segment it delivered
        self.newly_lost = 0  # per acknowledgement: bytes it let RACK mark lost
        self.cc = Reno(self) if congestion == "reno" else Bbr(self)
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
        """Send what cwnd, the pacing rate and the host's queue let out: lost segments first, then new data."""
        out = []
        room = self.src.room(now)
        pipe = self.pipe()
        lost = (s for s in self.scoreboard if s[3] & LOST) if self.lost else iter(())
        resend = next(lost, None)
        rate = self.cc.pacing_rate if self.cc.paces else 0.0
        burst, paced, held = self.cc.burst() if rate else 0, 0, False
        while resend is not None or self.nxt < self.limit:
            size = resend[1] - resend[0] if resend is not None else min(self.mss, self.limit - self.nxt)
            if pipe + size > self.cwnd:  # whole segments only (no silly windows)
                break
            if rate and (now < self.next_send or len(out) == burst):  # paced: one TSO burst per slot
                held = True
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
            paced += size + TCP_IP  # Linux paces the IP packet's length
        if paced and rate:
            self.next_send = max(self.next_send, now) + paced / rate
        if held:
            self._pace(now)
        if self.nxt >= self.limit and not self.lost and pipe < self.cwnd:
            self.app_limited = self.delivered + pipe or 1  # the gaps this leaves say nothing of the path
        if out:
            self.src.send(out, now)
            if self.rto_at is None:
                self.rto_at = now + self.rto
            self._arm(now)

    def _pace(self, now: float) -> None:
        """Come back when the pacing rate lets the next burst out."""
        if self.pace_wake is None or self.pace_wake <= now:
            self.pace_wake = self.next_send
            self.sim.at(self.next_send, self._push_later)

    def _push_later(self) -> None:
        self.pace_wake = None
        self._push(self.sim.now)

    def _new(self, size: int, now: float) -> Datagram:
        self.scoreboard.append([self.nxt, self.nxt + size, now, 0, 0, 0.0, 0, 0.0])
        self._stamp(self.scoreboard[-1], now)
        self.nxt += size
        return (Segment(self.id, self.nxt - size, size, 0, now), self.src.addr, self.dst.addr)

    def _resend(self, s: list, now: float) -> Datagram:
        if s[3] & LOST:
            s[3] &= ~LOST
            self.lost -= s[1] - s[0]
        s[2] = now
        self._stamp(s, now)
        self.retransmits += 1
        return (Segment(self.id, s[0], s[1] - s[0], 0, now), self.src.addr, self.dst.addr)

    def _stamp(self, s: list, now: float) -> None:
        """Record with a segment sent now the flow's delivery state, to measure the rate when it is delivered."""
        if self.una >= self.nxt:  # nothing in flight: the delivery clock starts now, not at the last delivery
            self.delivered_time = self.first_sent = now
        s[4], s[5], s[6], s[7] = self.delivered, self.delivered_time, self.app_limited, self.first_sent

    def _arm(self, now: float) -> None:
        """Set the one timer: RACK's reordering wait, else a tail loss probe, else the retransmission timer."""
        if self.una >= self.nxt:
            self.deadline, self.rto_at = None, None
            return
        when, kind = self.rto_at, "rto"
        rack_at = self._rack_wait()
        if rack_at is not None:
            when, kind = now + _jiffies(max(rack_at - now, 0.0)) + TLP_SLACK, "rack"  # tcp_rack_mark_lost
        elif (self.probe is None and self.recover is None and not self.sacked and not self.lost
              and self.srtt is not None):
            one = len(self.scoreboard) == 1
            pto = now + min(_jiffies(2 * self.srtt) + (MIN_RTO if one else TLP_SLACK), self.rto)
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
        self.cc.timeout()
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
        self.newest = None  # the latest-sent segment this acknowledgement delivers (its rate sample)
        before = self.delivered
        pipe = self.pipe()
        self.newly_lost = 0
        if (echo, echo_end) > self.rack:  # RACK: the latest-sent segment known delivered
            self.rack, self.rack_rtt = (echo, echo_end), now - echo
        self.min_rtt = min(self.min_rtt, now - echo)
        if self.probe is not None and self.probe[0] == echo:  # the probe's answer
            if advanced and self.probe[1] and self.recover is None:  # it repaired a lost tail
                self.cc.probe_repaired()
            self.probe = None
        if advanced:
            acked = ack - self.una
            board = self.scoreboard
            while board and board[0][1] <= ack:
                s = board.popleft()
                if s[3] & SACKED:
                    self.sacked -= s[1] - s[0]
                    continue
                if s[3] & LOST:
                    self.lost -= s[1] - s[0]
                self._deliver(s)
            self.una = ack
            self._sample(now - echo)
            if self.recover is not None and ack >= self.recover:  # the recovery ends
                self.cc.recovery_end()
                self.recover, self.after_rto = None, False
            elif self.recover is None or self.after_rto:
                self.cc.acked(acked)
            self.rto_at = now + self.rto if self.una < self.nxt else None
        if sack:
            self._mark_sacked(sack)
        if self.sacked or self.recover is not None:
            self._detect(now)
        if self.newest is not None:
            self.delivered_time, self.first_sent = now, self.newest[2]
            if self.app_limited and self.delivered > self.app_limited:
                self.app_limited = 0
            self.cc.sampled(self.delivered - before, pipe, now)
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
                    self._deliver(s)

    def _deliver(self, s: list) -> None:
        """Count a segment delivered (acknowledged or SACKed for the first time)."""
        self.delivered += s[1] - s[0]
        if self.newest is None or (s[2], s[1]) > (self.newest[2], self.newest[1]):
            self.newest = s

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
                self.newly_lost += s[1] - s[0]
                found = True
        if found and self.recover is None:
            self.cc.recovery_start()
            self.recover, self.probe = self.nxt, None

    def _rack_wait(self) -> float | None:
        """When RACK's reordering window will have passed for every candidate segment (None: no candidate); Linux
        arms its timer for the longest wait."""
        if not self.sacked and self.recover is None:
            return None
        wait = self.rack_rtt + self._reorder_window()
        first = None
        for s in self.scoreboard:
            if not s[3] and (s[2], s[1]) < self.rack:
                first = s[2] + wait if first is None else max(first, s[2] + wait)
        return first

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


class Reno:
    """RFC 5681's window: slow start, then one MSS per window; halved (to half the flight, at least two segments)
    once per recovery and when a probe repairs a tail; one segment after a timeout."""

    paces = False
    pacing_rate = 0.0

    def __init__(self, flow: Flow) -> None:
        self.flow = flow

    def _halve(self) -> None:
        f = self.flow
        f.ssthresh = max((f.nxt - f.una) // 2, 2 * f.mss)
        f.cwnd = f.ssthresh

    recovery_start = probe_repaired = _halve

    def timeout(self) -> None:
        self._halve()
        self.flow.cwnd = self.flow.mss

    def recovery_end(self) -> None:
        if not self.flow.after_rto:
            self.flow.cwnd = self.flow.ssthresh

    def acked(self, acked: int) -> None:
        """New data acknowledged outside a fast recovery."""
        f = self.flow
        if f.cwnd < f.ssthresh:
            f.cwnd += min(acked, f.mss)
        else:
            f.cwnd += max(f.mss * f.mss // f.cwnd, 1)

    def sampled(self, delivered: int, pipe: int, now: float) -> None:
        """Reno does not use rate samples."""


class Bbr:
    """BBR v1 as Linux's tcp_bbr.c, for the window only (the model does not pace): the bottleneck bandwidth is the
    largest delivery rate over ``BW_ROUNDS`` round trips; the window is a gain times bandwidth x min RTT, plus
    three TSO bursts of ``TSO_AUTOSIZE`` of the pacing rate (the quantization budget, which dominates at a small
    bandwidth-delay product), at least ``MIN_CWND`` segments. Startup (gain ``HIGH_GAIN``) until the bandwidth
    stops growing, Drain until the flight is down to one BDP, then ProbeBW's cycle of pacing gains (window gain
    2). Loss does not lower the estimate: a recovery keeps the flight (packet conservation, each acknowledgement
    releasing what it delivered) for one round trip, then the window grows back to the target, and the window from
    before the recovery is restored at its end; a timeout sets it to one segment, grown back the same way. Not
    modelled: pacing, ProbeRTT (runs here last seconds, its period is 10 s), long-term bandwidth sampling
    (policers), ack aggregation."""

    paces = True

    def __init__(self, flow: Flow) -> None:
        self.flow = flow
        self.mode = "startup"
        self.samples: deque[tuple[int, float]] = deque()  # (round, the round's largest rate) for the max filter
        self.bw = 0.0  # bytes/s
        self.round, self.next_round, self.round_start = 0, 0, False
        self.full_bw, self.full_bw_rounds, self.full = 0.0, 0, False
        self.phase, self.phase_start = 2, 0.0  # Linux starts the cycle in a random phase other than 1
        # Linux's initial pacing rate: the initial window per RTT (1 ms before a sample) at the high gain
        self.pacing_rate = HIGH_GAIN * INITIAL_WINDOW * flow.mss / 1e-3
        self.prior_cwnd = 0
        self.conservation = self.entering = False

    def pacing_gain(self) -> float:
        return {"startup": HIGH_GAIN, "drain": 1 / HIGH_GAIN}.get(self.mode, PROBE_BW_GAINS[self.phase])

    def bdp(self, gain: float) -> float:
        f = self.flow
        if f.min_rtt == float("inf"):
            return INITIAL_WINDOW * f.mss
        return gain * self.bw * f.min_rtt

    def burst(self) -> int:
        """Segments in one TSO burst (bbr_tso_segs_goal)."""
        nbytes = min(int(self.pacing_rate * TSO_AUTOSIZE), GSO_BYTES)
        return min(max(nbytes // self.flow.mss, MIN_TSO), MAX_TSO)

    def target(self) -> int:
        """The window BBR aims at, in bytes (bbr_inflight with the quantization budget)."""
        f = self.flow
        gain = HIGH_GAIN if self.mode in ("startup", "drain") else PROBE_BW_CWND_GAIN
        segments = -(-int(self.bdp(gain)) // f.mss) + 3 * self.burst()
        segments += segments & 1  # rounded up to even
        if self.mode == "probe_bw" and self.phase == 0:
            segments += 2
        return segments * f.mss

    def _save(self) -> None:
        f = self.flow
        self.prior_cwnd = f.cwnd if f.recover is None else max(self.prior_cwnd, f.cwnd)

    def recovery_start(self) -> None:
        self._save()
        self.entering = True

    def probe_repaired(self) -> None:
        """Linux lets BBR keep its window (ssthresh stays infinite)."""

    def timeout(self) -> None:
        self._save()
        self.flow.cwnd = self.flow.mss
        self.entering = self.conservation = False

    def recovery_end(self) -> None:
        self.flow.cwnd = max(self.flow.cwnd, self.prior_cwnd)
        self.conservation = False

    def acked(self, acked: int) -> None:
        """The window moves in ``sampled``."""

    def sampled(self, delivered: int, pipe: int, now: float) -> None:
        """An acknowledgement that delivered ``delivered`` bytes, with ``pipe`` bytes in flight before it."""
        f, s = self.flow, self.flow.newest
        self.round_start = s[4] >= self.next_round
        if self.round_start:
            self.round += 1
            self.next_round = f.delivered
            self.conservation = False
        # the longer of the send and the acknowledgement intervals: acknowledgements bunched behind data in a
        # queue would overestimate the rate (Linux's tcp_rate_gen)
        interval = max(s[2] - s[7], now - s[5])
        if interval >= f.min_rtt:  # shorter intervals overestimate (Linux discards them)
            rate = (f.delivered - s[4]) / interval
            if not s[6] or rate >= self.bw:
                if self.samples and self.samples[-1][0] == self.round:
                    rate = max(rate, self.samples.pop()[1])
                self.samples.append((self.round, rate))
        while self.samples and self.samples[0][0] <= self.round - BW_ROUNDS:
            self.samples.popleft()
        self.bw = max((r for _, r in self.samples), default=0.0)
        self._advance(pipe, now, limited=bool(s[6]))
        rate = self.pacing_gain() * self.bw * PACING_MARGIN
        if self.full or rate > self.pacing_rate:
            self.pacing_rate = rate
        self._window(delivered)

    def _advance(self, pipe: int, now: float, limited: bool) -> None:
        """The mode: startup until the bandwidth plateaus, drain, ProbeBW's phases (each at least a min RTT)."""
        f = self.flow
        if self.mode == "probe_bw":
            gain = PROBE_BW_GAINS[self.phase]
            long = now - self.phase_start > f.min_rtt
            if (long if gain == 1.0 else
                    long and (f.newly_lost or pipe >= self.bdp(gain)) if gain > 1.0 else
                    long or pipe <= self.bdp(1.0)):
                self.phase, self.phase_start = (self.phase + 1) % len(PROBE_BW_GAINS), now
        if not self.full and self.round_start and not limited:
            if self.bw >= self.full_bw * FULL_BW_GROWTH:
                self.full_bw, self.full_bw_rounds = self.bw, 0
            else:
                self.full_bw_rounds += 1
                self.full = self.full_bw_rounds >= FULL_BW_ROUNDS
        if self.mode == "startup" and self.full:
            self.mode = "drain"
        if self.mode == "drain" and f.pipe() <= self.bdp(1.0):
            self.mode, self.phase, self.phase_start = "probe_bw", 2, now

    def _window(self, delivered: int) -> None:
        f = self.flow
        cwnd = f.cwnd
        if f.newly_lost:
            cwnd = max(cwnd - f.newly_lost, f.mss)
        if self.entering:  # the first round of a recovery: packet conservation
            self.entering, self.conservation = False, True
            self.next_round = f.delivered
            cwnd = f.pipe() + delivered
        if self.conservation:
            f.cwnd = max(cwnd, f.pipe() + delivered)
            return
        target = self.target()
        if self.full:
            cwnd = min(cwnd + delivered, target)
        elif cwnd < target or f.delivered < INITIAL_WINDOW * f.mss:
            cwnd += delivered
        f.cwnd = max(cwnd, MIN_CWND * f.mss)


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

    def __init__(self, sim: Simulator, switch, hosts: list[TcpHost], mtu: int, min_rto: float = MIN_RTO,
                 congestion: str = "reno") -> None:
        if congestion not in CONGESTION:
            raise ValueError(f"congestion must be one of {', '.join(CONGESTION)}, got {congestion!r}")
        self.sim, self.switch, self.hosts, self.mss, self.min_rto = sim, switch, hosts, mss(mtu), min_rto
        self.congestion = congestion
        self.flows: list[Flow] = []

    def flow(self, src: int, dst: int) -> Flow:
        """A new flow from host ``src`` to host ``dst`` (indices)."""
        f = Flow(self.sim, len(self.flows), self.hosts[src], self.hosts[dst], self.mss, self.min_rto,
                 self.congestion)
        self.flows.append(f)
        self.hosts[src].flows[f.id] = f
        self.hosts[dst].flows[f.id] = f
        return f
