"""The worker's control plane, sans-I/O: joining a job on every aggregator core, leaving it, the no-progress
deadline of an allreduce, and asking the cores which ranks a stuck allreduce waits for.

Like aioquic's ``QuicConnection`` it owns no socket, clock or thread: the driver calls ``connect(now)``, feeds the
control datagrams it receives to ``receive(datagram, addr, now)``, sends ``datagrams_to_send(now)``, calls
``handle_timer(now)`` once ``get_timer()`` is due (None: no timer), and reads what happened from
``next_event()``. Aggregator core i listens on the address key ``aggregator + i`` (the next port). The data plane
(results, chunks) is ``worker.engine.StreamEngine``'s.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json

from intml.protocol import wire
from intml.protocol.job import JobParams, WorkerTimers
from intml.protocol.packet import HDR
from intml.protocol.wire import MsgType

JOIN_RESEND = 0.2  # seconds between JOIN retransmissions
STATS_WAIT = 0.5  # seconds to wait for the cores' answers to a statistics request


def token_hash(token: str) -> int:
    """The 64-bit job token carried on the wire (the shared secret itself never is)."""
    return int.from_bytes(hashlib.blake2b(token.encode(), digest_size=8).digest(), "big")


@dataclasses.dataclass(frozen=True)
class CoreJoined:
    """Core ``core`` acknowledged the JOIN; ``ack``: the JOIN_ACK's fields (cores, group, group_port, ...)."""

    core: int
    ack: dict[str, int]


@dataclasses.dataclass(frozen=True)
class JobJoined:
    """Every core acknowledged: the job's data plane has ``cores`` cores and multicasts results to ``groups``
    (the distinct address keys the cores named; empty without multicast)."""

    cores: int
    groups: list[int]


@dataclasses.dataclass(frozen=True)
class JoinRefused:
    """Core ``core`` refused the JOIN with ``reason``; the session stops joining."""

    core: int
    reason: str


@dataclasses.dataclass(frozen=True)
class JoinTimedOut:
    """Core ``core`` did not answer the JOIN within the timeout; the session stops joining."""

    core: int


@dataclasses.dataclass(frozen=True)
class NoProgress:
    """The allreduce made no progress for the timeout."""


@dataclasses.dataclass(frozen=True)
class StatsAnswered:
    """The cores' answer to ``request_stats``: the union of the ranks their incomplete rounds of this job miss
    (None: no core answered) and how long each rank has been silent, by rank as a string (None: no core that
    answered knows the job)."""

    missing: list[int] | None
    silent: dict[str, float] | None


Event = CoreJoined | JobJoined | JoinRefused | JoinTimedOut | NoProgress | StatsAnswered


class WorkerSession:
    """One rank's membership in one job; see the module docstring."""

    def __init__(self, *, job: int, rank: int, params: JobParams, token: int, aggregator: int,
                 timeout: float = WorkerTimers.timeout, connect_timeout: float | None = None) -> None:
        self.job, self.rank, self.params = job, rank, params
        self.aggregator = aggregator
        self.timeout = timeout  # an allreduce that makes no progress this long: NoProgress
        self.connect_timeout = timeout if connect_timeout is None else connect_timeout  # a core silent to JOIN
        self._join = wire.pack_join({"type": int(MsgType.JOIN), "job": job, "rank": rank},
                                    dict(world_size=params.world_size, packet_elements=params.packet_elements,
                                         pool_size=params.pool_size, codec=int(params.codec), seed=params.seed,
                                         token=token))
        self.cores: int | None = None  # known from core 0's JOIN_ACK
        self.acks: dict[int, dict[str, int]] = {}
        self._joining: dict[int, list[float]] = {}  # core -> [give up at, next JOIN at]
        self._progress_deadline: float | None = None
        self._stats_deadline: float | None = None
        self._stats_waiting: set[int] = set()
        self._missing: set[int] = set()
        self._silent: dict[str, float] | None = None
        self._answered = False
        self._out: list[tuple[bytes, int]] = []
        self._events: list[Event] = []

    def core_addr(self, core: int) -> int:
        return self.aggregator + core

    @property
    def joined(self) -> bool:
        return self.cores is not None and len(self.acks) == self.cores

    # ---- joining --------------------------------------------------------------------------------------------
    def connect(self, now: float) -> None:
        """Start joining: core 0 first, which tells how many cores there are; then the others at once."""
        self._joining[0] = [now + self.connect_timeout, now]

    def _ack(self, core: int, datagram: bytes, now: float) -> None:
        body = wire.unpack_join(datagram)[1]
        ack = {name: int(body[name]) for name in body.dtype.names}
        del self._joining[core]
        self.acks[core] = ack
        self._events.append(CoreJoined(core, ack))
        if core == 0:
            self.cores = ack["cores"]
            for other in range(1, self.cores):
                self._joining[other] = [now + self.connect_timeout, now]
        if self.joined:
            groups = {a["group"] << 16 | a["group_port"] for a in self.acks.values() if a["group"]}
            self._events.append(JobJoined(self.cores, sorted(groups)))

    def _stop_joining(self, event: Event) -> None:
        self._joining.clear()
        self._events.append(event)

    # ---- allreduce progress ---------------------------------------------------------------------------------
    def watch_progress(self, now: float) -> None:
        """An allreduce began (or progressed) at ``now``: NoProgress unless it progresses again within the
        timeout."""
        self._progress_deadline = now + self.timeout

    def unwatch_progress(self) -> None:
        """The allreduce ended."""
        self._progress_deadline = None

    def request_stats(self, now: float) -> None:
        """Ask every core for the job's incomplete rounds; StatsAnswered once all answered or after STATS_WAIT."""
        request = wire.pack({"type": int(MsgType.STATS_REQUEST), "job": self.job, "rank": self.rank})
        self._stats_waiting = set(range(self.cores or 1))
        self._out += [(request, self.core_addr(core)) for core in sorted(self._stats_waiting)]
        self._stats_deadline = now + STATS_WAIT
        self._missing, self._silent, self._answered = set(), None, False

    def _stats_reply(self, core: int, datagram: bytes) -> None:
        self._stats_waiting.discard(core)
        self._answered = True
        job = json.loads(datagram[HDR:]).get("jobs", {}).get(str(self.job))
        if job:
            self._silent = {**(self._silent or {}), **job["silent_s"]}
            for round_ in job["pending"]:
                self._missing.update(round_["missing_ranks"])
        if not self._stats_waiting:
            self._stats_done()

    def _stats_done(self) -> None:
        self._stats_deadline = None
        self._stats_waiting = set()
        self._events.append(StatsAnswered(sorted(self._missing) if self._answered else None, self._silent))

    # ---- leaving --------------------------------------------------------------------------------------------
    def leave(self) -> None:
        """Queue a LEAVE to every core joined (the aggregator frees the job's slots when every rank has left)."""
        self._joining.clear()
        self._progress_deadline = self._stats_deadline = None
        leave = wire.pack({"type": int(MsgType.LEAVE), "job": self.job, "rank": self.rank})
        self._out += [(leave, self.core_addr(core)) for core in range(self.cores or 0)]

    # ---- the sans-I/O interface -----------------------------------------------------------------------------
    def receive(self, datagram: bytes, addr: int, now: float) -> None:
        """A control datagram from ``addr``; results and datagrams from elsewhere than the cores are ignored."""
        core = addr - self.aggregator
        if len(datagram) < HDR or not 0 <= core < (self.cores or 1):
            return
        typ = datagram[wire.OFFSETS["type"]]
        if core in self._joining:
            if typ == MsgType.JOIN_ACK:
                try:
                    self._ack(core, datagram, now)
                except ValueError:
                    pass  # malformed: the JOIN is sent again
            elif typ == MsgType.ERROR:
                self._stop_joining(JoinRefused(core, datagram[HDR:].decode(errors="replace")))
        elif typ == MsgType.STATS_REPLY and core in self._stats_waiting:
            self._stats_reply(core, datagram)

    def datagrams_to_send(self, now: float) -> list[tuple[bytes, int]]:
        """Owned (datagram, address key) pairs to send now: queued requests and JOINs due (again)."""
        for core, due in self._joining.items():
            if due[1] <= now:
                self._out.append((self._join, self.core_addr(core)))
                due[1] = now + JOIN_RESEND
        out, self._out = self._out, []
        return out

    def get_timer(self) -> float | None:
        """When handle_timer (or datagrams_to_send, for a JOIN's resend) is next due; None: no timer."""
        times = [t for due in self._joining.values() for t in due]
        times += [t for t in (self._progress_deadline, self._stats_deadline) if t is not None]
        return min(times) if times else None

    def handle_timer(self, now: float) -> None:
        """Fire the deadlines due by ``now`` (JOIN resends go out with the next datagrams_to_send)."""
        late = [core for core, due in self._joining.items() if due[0] <= now]
        if late:
            self._stop_joining(JoinTimedOut(min(late)))
        if self._stats_deadline is not None and self._stats_deadline <= now:
            self._stats_done()
        if self._progress_deadline is not None and self._progress_deadline <= now:
            self._progress_deadline = None
            self._events.append(NoProgress())

    def next_event(self) -> Event | None:
        """The oldest event not yet taken, or None."""
        return self._events.pop(0) if self._events else None
