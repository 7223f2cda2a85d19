"""The worker's control plane, sans-I/O: joining a job on every aggregator core, leaving it, the no-progress
deadline of an allreduce, and asking the cores which ranks a stuck allreduce waits for.

Like aioquic's ``QuicConnection`` it owns no socket, clock or thread: the driver calls ``connect(now)``, feeds the
control datagrams it receives to ``receive(datagram, addr, now)``, sends ``datagrams_to_send(now)``, calls
``handle_timer(now)`` once ``get_timer()`` is due (None: no timer), and reads what happened from
``next_event()``. Aggregator core i listens on the address key ``aggregator + i`` (the next port). The data plane
(results, chunks) is ``worker.engine.StreamEngine``'s.

Joining a core is a handshake (docs/protocol.md, "Control plane authentication"): a JOIN with a fresh client nonce,
the core's CHALLENGE (a cookie), the JOIN again with the cookie and a MAC proving the token, then the JOIN_ACK,
accepted only with a good MAC under the session key both sides derive. LEAVE and STATS carry MACs under it.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable

import numpy as np

from intml.protocol import keys, wire
from intml.protocol.job import JobParams, WorkerTimers
from intml.protocol.packet import HDR
from intml.protocol.siphash import key_words
from intml.protocol.wire import MsgType

JOIN_RESEND = 0.2  # seconds between JOIN retransmissions
STATS_WAIT = 0.5  # seconds to wait for the cores' answers to a statistics request
STATS_REQUEST_SIZE = 512  # bytes: a reply may be 3 times its request; 1536 bytes hold a 64-rank job's silences


@dataclasses.dataclass(frozen=True)
class CoreJoined:
    """Core ``core`` acknowledged the JOIN; ``ack``: the JOIN_ACK's fields (cores, group, group_port, ...)."""

    core: int
    ack: dict[str, int]


@dataclasses.dataclass(frozen=True)
class JobJoined:
    """Every core acknowledged: the job's data plane has ``cores`` cores and multicasts results to ``groups``
    (the distinct address keys the cores named; empty without multicast). ``data_keys``: the job's DATA/RESULT
    MAC keys, core c's in row c ((cores, 2) uint64, for StreamEngine). Where this rank resumes (a rank joining
    a job its peers have run, e.g. after a crash): ``allreduce``, the number of its next allreduce, and
    ``shadow_sets``, each slot's next shadow set ((pool_size,) int64)."""

    cores: int
    groups: list[int]
    data_keys: np.ndarray
    allreduce: int
    shadow_sets: np.ndarray

    def __eq__(self, other: object) -> bool:  # arrays compare by value
        return isinstance(other, JobJoined) and (self.cores, self.groups, self.allreduce) == (
            other.cores, other.groups, other.allreduce) and np.array_equal(self.data_keys, other.data_keys) \
            and np.array_equal(self.shadow_sets, other.shadow_sets)


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

    def __init__(self, *, job: int, rank: int, params: JobParams, token: str, aggregator: int,
                 timeout: float = WorkerTimers.timeout, connect_timeout: float | None = None,
                 random_bytes: Callable[[int], bytes] = os.urandom) -> None:
        """``token``: the job's shared secret (it never travels; a JOIN proves it). ``random_bytes``: the source
        of the client nonces (injectable for deterministic tests)."""
        self.job, self.rank, self.params = job, rank, params
        self.aggregator = aggregator
        self.timeout = timeout  # an allreduce that makes no progress this long: NoProgress
        self.connect_timeout = timeout if connect_timeout is None else connect_timeout  # a core silent to JOIN
        self._token_key = keys.token_key(token)
        self._random = random_bytes
        self._fields = dict(world_size=params.world_size, packet_elements=params.packet_elements,
                            pool_size=params.pool_size, codec=int(params.codec), seed=params.seed, flags=params.flags)
        self._nonce: dict[int, bytes] = {}  # core -> client nonce of the JOIN in progress
        self._cookie: dict[int, bytes] = {}  # core -> the cookie of its CHALLENGE
        self.sessions: dict[int, bytes] = {}  # core -> session key, once it acknowledged
        self.cores: int | None = None  # known from core 0's JOIN_ACK
        self.acks: dict[int, dict[str, int]] = {}
        self._job_nonces: dict[int, bytes] = {}
        self._sets = np.zeros(params.pool_size, np.int64)
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
        self._start_joining(0, now)

    def _start_joining(self, core: int, now: float) -> None:
        self._nonce[core] = self._random(keys.NONCE_SIZE)
        self._cookie[core] = bytes(keys.MAC_SIZE)
        self._joining[core] = [now + self.connect_timeout, now]

    def _join_datagram(self, core: int) -> bytes:
        """The JOIN to core: with no cookie yet, the first round; else proved with a MAC under the token key."""
        cookie = self._cookie[core]
        datagram = wire.pack_join({"type": int(MsgType.JOIN), "job": self.job, "rank": self.rank},
                                  {**self._fields, "nonce": self._nonce[core], "cookie": cookie})
        return keys.seal(self._token_key, datagram, wire.JOIN_MAC) if any(cookie) else datagram

    def _challenge(self, core: int, datagram: bytes, now: float) -> None:
        header, body = wire.unpack_challenge(datagram)
        if (int(header["job"]), int(header["rank"])) != (self.job, self.rank) or bytes(body["nonce"]) != \
                self._nonce[core]:
            return  # not for this JOIN
        self._cookie[core] = bytes(body["cookie"])
        self._joining[core][1] = now  # the proved JOIN goes out at once

    def _ack(self, core: int, datagram: bytes, now: float) -> None:
        header, body, bitmap = wire.unpack_join(datagram)
        nonce, cookie = self._nonce[core], self._cookie[core]
        if (bytes(body["nonce"]), bytes(body["cookie"])) != (nonce, cookie) or not any(cookie):
            return  # not an answer to this JOIN's proof
        session = keys.session_key(self._token_key, self.job, self.rank, nonce, cookie)
        if not keys.verify(session, datagram, wire.JOIN_MAC) or int(header["rank"]) != self.rank:
            return  # forged: the JOIN is sent again
        ack = {name: int(body[name]) for name in body.dtype.names if body.dtype.fields[name][0].kind != "V"}
        del self._joining[core]
        self.sessions[core] = session
        self.acks[core] = ack
        self._job_nonces[core] = bytes(body["job_nonce"])
        bits = np.unpackbits(np.frombuffer(bitmap, np.uint8), count=self.params.pool_size, bitorder="little")
        self._sets |= bits.astype(np.int64)  # each core sets the bits of its own slots only
        self._events.append(CoreJoined(core, ack))
        if core == 0:
            self.cores = ack["cores"]
            for other in range(1, self.cores):
                self._start_joining(other, now)
        if self.joined:
            groups = {a["group"] << 16 | a["group_port"] for a in self.acks.values() if a["group"]}
            data_keys = np.array([key_words(keys.data_key(self._token_key, self.job, self._job_nonces[c]))
                                  for c in range(self.cores)], np.uint64).reshape(self.cores, 2)
            self._events.append(JobJoined(self.cores, sorted(groups), data_keys,
                                          max(a["allreduce"] for a in self.acks.values()), self._sets.copy()))

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

    def sealed(self, typ: MsgType, core: int, padding: int = 0) -> bytes:
        """A LEAVE or STATS_REQUEST to core: ``padding`` zero bytes, then the MAC under the core's session key."""
        datagram = wire.pack({"type": int(typ), "job": self.job, "rank": self.rank}, bytes(padding + keys.MAC_SIZE))
        return keys.seal(self.sessions[core], datagram, len(datagram) - keys.MAC_SIZE)

    def request_stats(self, now: float) -> None:
        """Ask every core joined for the job's incomplete rounds; StatsAnswered once all answered or after
        STATS_WAIT."""
        padding = STATS_REQUEST_SIZE - HDR - keys.MAC_SIZE
        self._stats_waiting = set(self.sessions)
        self._out += [(self.sealed(MsgType.STATS_REQUEST, core, padding), self.core_addr(core))
                      for core in sorted(self._stats_waiting)]
        self._stats_deadline = now + STATS_WAIT
        self._missing, self._silent, self._answered = set(), None, False

    def _stats_reply(self, core: int, datagram: bytes) -> None:
        """A core's STATS_REPLY (its MAC checked), or its ERROR: it does not know the job."""
        if datagram[wire.OFFSETS["type"]] == MsgType.STATS_REPLY:
            if not keys.verify(self.sessions[core], datagram, len(datagram) - keys.MAC_SIZE):
                return  # forged
            try:
                job = json.loads(datagram[HDR:-keys.MAC_SIZE])
            except ValueError:
                job = {}  # cut to fit a short request: it answered, with nothing to say
            self._silent = {**(self._silent or {}), **job.get("silent_s", {})}
            self._missing.update(job.get("missing", []))
        self._stats_waiting.discard(core)
        self._answered = True
        if not self._stats_waiting:
            self._stats_done()

    def _stats_done(self) -> None:
        self._stats_deadline = None
        self._stats_waiting = set()
        self._events.append(StatsAnswered(sorted(self._missing) if self._answered else None, self._silent))

    # ---- leaving --------------------------------------------------------------------------------------------
    def leave(self) -> None:
        """Queue a LEAVE to every core that acknowledged the JOIN, also after a join that failed on another core
        (the aggregator frees the job's slots when every rank has left)."""
        self._joining.clear()
        self._progress_deadline = self._stats_deadline = None
        self._out += [(self.sealed(MsgType.LEAVE, core), self.core_addr(core)) for core in sorted(self.sessions)]
        self.sessions.clear()

    # ---- the sans-I/O interface -----------------------------------------------------------------------------
    def receive(self, datagram: bytes, addr: int, now: float) -> None:
        """A control datagram from ``addr``; results and datagrams from elsewhere than the cores are ignored."""
        core = addr - self.aggregator
        if len(datagram) < HDR or not 0 <= core < (self.cores or 1):
            return
        typ = datagram[wire.OFFSETS["type"]]
        if core in self._joining:
            try:
                if typ == MsgType.CHALLENGE:
                    self._challenge(core, datagram, now)
                elif typ == MsgType.JOIN_ACK:
                    self._ack(core, datagram, now)
            except ValueError:
                pass  # malformed: the JOIN is sent again
            if typ == MsgType.ERROR:
                self._stop_joining(JoinRefused(core, datagram[HDR:].decode(errors="replace")))
        elif typ in (MsgType.STATS_REPLY, MsgType.ERROR) and core in self._stats_waiting:
            self._stats_reply(core, datagram)

    def datagrams_to_send(self, now: float) -> list[tuple[bytes, int]]:
        """Owned (datagram, address key) pairs to send now: queued requests and JOINs due (again)."""
        for core, due in self._joining.items():
            if due[1] <= now:
                self._out.append((self._join_datagram(core), self.core_addr(core)))
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
