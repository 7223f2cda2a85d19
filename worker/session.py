"""The worker's control plane, sans-I/O: joining a job on every aggregator core, leaving it, the no-progress
deadline of an allreduce, and asking the cores which ranks a stuck allreduce waits for.

Like aioquic's ``QuicConnection`` it owns no socket, clock or thread: the driver calls ``connect(now)``, feeds the
control datagrams it receives to ``receive(datagram, addr, now)``, sends ``datagrams_to_send(now)``, calls
``handle_timer(now)`` once ``get_timer()`` is due (None: no timer), and reads what happened from
``next_event()``. The data plane (results, chunks) is ``worker.engine.StreamEngine``'s.

A job may use several aggregators (endpoints), each with its own cores: core i of the endpoint at address key
``a`` listens on ``a + i`` (the next ports). The job's cores are those of every endpoint, in the order given, and
its slot s goes to the (s mod total)-th of them: each endpoint's JOIN states where its cores start (``first_core``)
and how many the job has (``total_cores``). So the session first asks core 0 of every endpoint (the handshake's
first round: each CHALLENGE says how many cores its aggregator has), lays the job out, then proves its JOIN on
every core.

Joining a core is a handshake (docs/protocol.md, "Control plane authentication"): a JOIN with a fresh client nonce,
the core's CHALLENGE (a cookie), the JOIN again with the cookie and a MAC proving the token, then the JOIN_ACK,
accepted only with a good MAC under the session key both sides derive. LEAVE and STATS carry MACs under it.

Keepalive: the cores tear down a job idle for their ``idle_timeout`` (each JOIN_ACK states it). Once joined, the
session queues a keepalive (a STATS_REQUEST of a header and a MAC: no reply) to every core when a third of the
shortest idle timeout has passed without an allreduce progressing, and again every third after; an allreduce
that progresses postpones it, so keepalives cost nothing while allreduces run. A driver keeps a paused rank's job
alive by calling ``handle_timer`` when ``get_timer`` says and sending what it queued.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable, Sequence

import numpy as np

from intml.protocol import keys, wire
from intml.protocol.job import MAX_CORES, JobParams, WorkerTimers
from intml.protocol.packet import HDR
from intml.protocol.siphash import key_words
from intml.protocol.wire import MsgType

JOIN_RESEND = 0.2  # seconds between JOIN retransmissions
STATS_WAIT = 0.5  # seconds to wait for the cores' answers to a statistics request
STATS_REQUEST_SIZE = 512  # bytes: a reply may be 3 times its request; 1536 bytes hold a 64-rank job's silences


@dataclasses.dataclass(frozen=True)
class CoreJoined:
    """The job's core ``core`` (counted over every endpoint, in order) acknowledged the JOIN; ``ack``: the
    JOIN_ACK's fields (cores, group, group_port, ...)."""

    core: int
    ack: dict[str, int]


@dataclasses.dataclass(frozen=True)
class JobJoined:
    """Every core acknowledged: the job's data plane has ``cores`` cores, at the address keys ``addrs`` (slot s
    goes to addrs[s % cores]), and multicasts results to ``groups`` (the distinct address keys the cores named;
    empty without multicast). ``data_keys``: the job's DATA/RESULT MAC keys, core c's in row c ((cores, 2)
    uint64, for StreamEngine). Where this rank resumes (a rank joining a job its peers have run, e.g. after a
    crash): ``allreduce``, the number of its next allreduce, and ``shadow_sets``, each slot's next shadow set
    ((pool_size,) int64)."""

    cores: int
    groups: list[int]
    data_keys: np.ndarray
    allreduce: int
    shadow_sets: np.ndarray
    addrs: list[int]

    def __eq__(self, other: object) -> bool:  # arrays compare by value
        return isinstance(other, JobJoined) and (self.cores, self.groups, self.allreduce, self.addrs) == (
            other.cores, other.groups, other.allreduce, other.addrs) \
            and np.array_equal(self.data_keys, other.data_keys) and np.array_equal(self.shadow_sets, other.shadow_sets)


@dataclasses.dataclass(frozen=True)
class JoinRefused:
    """The core at address key ``addr`` refused the JOIN with ``reason`` (or the endpoints cannot hold the job);
    the session stops joining."""

    addr: int
    reason: str


@dataclasses.dataclass(frozen=True)
class JoinTimedOut:
    """The core at address key ``addr`` did not answer the JOIN within the timeout; the session stops joining."""

    addr: int


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

    def __init__(self, *, job: int, rank: int, params: JobParams, token: str, aggregator: int | Sequence[int],
                 timeout: float = WorkerTimers.timeout, connect_timeout: float | None = None,
                 random_bytes: Callable[[int], bytes] = os.urandom) -> None:
        """``aggregator``: the address key of core 0 of each of the job's aggregators, in the job's order (every
        rank gives the same), or of the only one. ``token``: the job's shared secret (it never travels; a JOIN
        proves it). ``random_bytes``: the source of the client nonces (injectable for deterministic tests)."""
        self.job, self.rank, self.params = job, rank, params
        self.endpoints = [aggregator] if isinstance(aggregator, int) else list(aggregator)
        if not self.endpoints or len(set(self.endpoints)) != len(self.endpoints):
            raise ValueError(f"need one or more distinct aggregator addresses, got {self.endpoints}")
        self.timeout = timeout  # an allreduce that makes no progress this long: NoProgress
        self.connect_timeout = timeout if connect_timeout is None else connect_timeout  # a core silent to JOIN
        self._token_key = keys.token_key(token)
        self._random = random_bytes
        self._fields = dict(world_size=params.world_size, packet_elements=params.packet_elements,
                            pool_size=params.pool_size, codec=int(params.codec), seed=params.seed, flags=params.flags,
                            codec_param=params.codec_param)
        # by a core's address key:
        self._nonce: dict[int, bytes] = {}  # client nonce of the JOIN in progress
        self._cookie: dict[int, bytes] = {}  # the cookie of its CHALLENGE
        self.sessions: dict[int, bytes] = {}  # session key, once a proved JOIN went out (a LEAVE may be due)
        self.acks: dict[int, dict[str, int]] = {}
        self._job_nonces: dict[int, bytes] = {}
        self._joining: dict[int, list[float]] = {}  # [give up at, next JOIN at]
        self._endpoint_cores: dict[int, int] = {}  # endpoint -> its cores, from its core 0's CHALLENGE
        self.addrs: list[int] | None = None  # every core of the job in order, once all endpoints said how many
        self._place: dict[int, tuple[int, int, int]] = {}  # -> (index in addrs, its endpoint, the endpoint's first)
        self._sets = np.zeros(params.pool_size, np.int64)
        self._progress_deadline: float | None = None
        self.keepalive_every: float | None = None  # seconds; None until joined, or if no core has an idle timeout
        self._keepalive_due: float | None = None
        self._stats_deadline: float | None = None
        self._stats_waiting: set[int] = set()
        self._missing: set[int] = set()
        self._silent: dict[str, float] | None = None
        self._answered = False
        self._out: list[tuple[bytes, int]] = []
        self._events: list[Event] = []

    @property
    def cores(self) -> int | None:
        """The job's cores on all its aggregators; None until every aggregator said how many it has."""
        return None if self.addrs is None else len(self.addrs)

    @property
    def joined(self) -> bool:
        return self.addrs is not None and len(self.acks) == len(self.addrs)

    # ---- joining --------------------------------------------------------------------------------------------
    def connect(self, now: float) -> None:
        """Start joining: core 0 of every aggregator first, whose CHALLENGEs tell how many cores each has; then
        the others at once."""
        for endpoint in self.endpoints:
            self._start_joining(endpoint, now)

    def _start_joining(self, addr: int, now: float) -> None:
        self._nonce[addr] = self._random(keys.NONCE_SIZE)
        self._cookie[addr] = bytes(keys.MAC_SIZE)
        self._joining[addr] = [now + self.connect_timeout, now]

    def _join_datagram(self, addr: int) -> bytes:
        """The JOIN to a core: the first round until it sent a cookie and the job is laid out; then proved with a
        MAC under the token key, stating where the core's aggregator's cores start among the job's."""
        if self.addrs is None or not any(self._cookie[addr]):
            cookie, first, total = bytes(keys.MAC_SIZE), 0, 0
        else:
            cookie, first, total = self._cookie[addr], self._place[addr][2], len(self.addrs)
            # the core may accept it even if this session gives up before its JOIN_ACK: leave() must reach it
            self.sessions[addr] = keys.session_key(self._token_key, self.job, self.rank, self._nonce[addr], cookie)
        datagram = wire.pack_join({"type": int(MsgType.JOIN), "job": self.job, "rank": self.rank},
                                  {**self._fields, "nonce": self._nonce[addr], "cookie": cookie,
                                   "first_core": first, "total_cores": total})
        return keys.seal(self._token_key, datagram, wire.JOIN_MAC) if any(cookie) else datagram

    def _challenge(self, addr: int, datagram: bytes, now: float) -> None:
        header, body = wire.unpack_challenge(datagram)
        if (int(header["job"]), int(header["rank"])) != (self.job, self.rank) or bytes(body["nonce"]) != \
                self._nonce[addr]:
            return  # not for this JOIN
        self._cookie[addr] = bytes(body["cookie"])
        if self.addrs is not None:
            self._joining[addr][1] = now  # the proved JOIN goes out at once
        elif int(body["cores"]) > 0:  # core 0 of an endpoint: how many cores it has (the JOIN_ACK confirms it)
            self._endpoint_cores[addr] = int(body["cores"])
            if len(self._endpoint_cores) == len(self.endpoints):
                self._lay_out(now)

    def _lay_out(self, now: float) -> None:
        """Every endpoint said how many cores it has: the job's cores are theirs in order. Join them all (the
        endpoints' cores 0 have their cookies: their proved JOINs go out at once)."""
        addrs: list[int] = []
        for endpoint in self.endpoints:
            first = len(addrs)
            for c in range(self._endpoint_cores[endpoint]):
                self._place[endpoint + c] = (len(addrs), endpoint, first)
                addrs.append(endpoint + c)
        if len(self._place) != len(addrs) or len(addrs) > MAX_CORES:
            problem = "share ports" if len(self._place) != len(addrs) else f"have more than {MAX_CORES}"
            self._stop_joining(JoinRefused(self.endpoints[0], f"the aggregators' cores {problem}: {len(addrs)} "
                                                              f"cores at {len(self.endpoints)} addresses"))
            return
        self.addrs = addrs
        for addr in addrs:
            if addr in self._joining:
                self._joining[addr][1] = now
            else:
                self._start_joining(addr, now)

    def _ack(self, addr: int, datagram: bytes, now: float) -> None:
        header, body, bitmap = wire.unpack_join(datagram)
        nonce, cookie = self._nonce[addr], self._cookie[addr]
        if (bytes(body["nonce"]), bytes(body["cookie"])) != (nonce, cookie) or not any(cookie):
            return  # not an answer to this JOIN's proof
        session = self.sessions.get(addr)  # None: its proved JOIN has not gone out yet
        if session is None or not keys.verify(session, datagram, wire.JOIN_MAC) or int(header["rank"]) != self.rank:
            return  # forged: the JOIN is sent again
        ack = {name: int(body[name]) for name in body.dtype.names if body.dtype.fields[name][0].kind != "V"}
        del self._joining[addr]
        index, endpoint, _ = self._place[addr]
        if ack["cores"] != self._endpoint_cores[endpoint]:  # its CHALLENGE said otherwise (forged, or restarted)
            self._stop_joining(JoinRefused(addr, f"the aggregator has {ack['cores']} cores, not the "
                                                 f"{self._endpoint_cores[endpoint]} its CHALLENGE said; join again"))
            return
        self.acks[addr] = ack
        self._job_nonces[addr] = bytes(body["job_nonce"])
        bits = np.unpackbits(np.frombuffer(bitmap, np.uint8), count=self.params.pool_size, bitorder="little")
        self._sets |= bits.astype(np.int64)  # each core sets the bits of its own slots only
        self._events.append(CoreJoined(index, ack))
        if self.joined:
            idle = [a["idle_timeout"] for a in self.acks.values() if a["idle_timeout"]]
            if idle:
                self.keepalive_every = min(idle) / 3000
                self._keepalive_due = now + self.keepalive_every
            groups = {a["group"] << 16 | a["group_port"] for a in self.acks.values() if a["group"]}
            data_keys = np.array([key_words(keys.data_key(self._token_key, self.job, self._job_nonces[a]))
                                  for a in self.addrs], np.uint64).reshape(len(self.addrs), 2)
            self._events.append(JobJoined(len(self.addrs), sorted(groups), data_keys,
                                          max(a["allreduce"] for a in self.acks.values()), self._sets.copy(),
                                          list(self.addrs)))

    def _stop_joining(self, event: Event) -> None:
        self._joining.clear()
        self._events.append(event)

    # ---- allreduce progress ---------------------------------------------------------------------------------
    def watch_progress(self, now: float) -> None:
        """An allreduce began (or progressed) at ``now``: NoProgress unless it progresses again within the
        timeout. No keepalive is due while allreduces progress."""
        self._progress_deadline = now + self.timeout
        if self._keepalive_due is not None:
            self._keepalive_due = now + self.keepalive_every

    def unwatch_progress(self) -> None:
        """The allreduce ended."""
        self._progress_deadline = None

    def sealed(self, typ: MsgType, addr: int, padding: int = 0) -> bytes:
        """A LEAVE or STATS_REQUEST to the core at ``addr``: ``padding`` zero bytes, then the MAC under the core's
        session key."""
        datagram = wire.pack({"type": int(typ), "job": self.job, "rank": self.rank}, bytes(padding + keys.MAC_SIZE))
        return keys.seal(self.sessions[addr], datagram, len(datagram) - keys.MAC_SIZE)

    def request_stats(self, now: float) -> None:
        """Ask every core joined for the job's incomplete rounds; StatsAnswered once all answered or after
        STATS_WAIT."""
        padding = STATS_REQUEST_SIZE - HDR - keys.MAC_SIZE
        self._stats_waiting = set(self.sessions)
        self._out += [(self.sealed(MsgType.STATS_REQUEST, addr, padding), addr) for addr in sorted(self._stats_waiting)]
        self._stats_deadline = now + STATS_WAIT
        self._missing, self._silent, self._answered = set(), None, False

    def _stats_reply(self, addr: int, datagram: bytes) -> None:
        """A core's STATS_REPLY (its MAC checked), or its ERROR: it does not know the job."""
        if datagram[wire.OFFSETS["type"]] == MsgType.STATS_REPLY:
            if not keys.verify(self.sessions[addr], datagram, len(datagram) - keys.MAC_SIZE):
                return  # forged
            try:
                job = json.loads(datagram[HDR:-keys.MAC_SIZE])
            except ValueError:
                job = {}  # cut to fit a short request: it answered, with nothing to say
            self._silent = {**(self._silent or {}), **job.get("silent_s", {})}
            self._missing.update(job.get("missing", []))
        self._stats_waiting.discard(addr)
        self._answered = True
        if not self._stats_waiting:
            self._stats_done()

    def _stats_done(self) -> None:
        self._stats_deadline = None
        self._stats_waiting = set()
        self._events.append(StatsAnswered(sorted(self._missing) if self._answered else None, self._silent))

    # ---- leaving --------------------------------------------------------------------------------------------
    def leave(self) -> None:
        """Queue a LEAVE to every core that was sent a proved JOIN and did not refuse it, also after a join that
        failed on another core (the aggregator frees the job's slots when every rank has left)."""
        self._joining.clear()
        self._progress_deadline = self._stats_deadline = self._keepalive_due = None
        self._out += [(self.sealed(MsgType.LEAVE, addr), addr) for addr in sorted(self.sessions)]
        self.sessions.clear()

    # ---- the sans-I/O interface -----------------------------------------------------------------------------
    def receive(self, datagram: bytes, addr: int, now: float) -> None:
        """A control datagram from ``addr``; results and datagrams from elsewhere than the cores are ignored."""
        if len(datagram) < HDR:
            return
        typ = datagram[wire.OFFSETS["type"]]
        if addr in self._joining:
            try:
                if typ == MsgType.CHALLENGE:
                    self._challenge(addr, datagram, now)
                elif typ == MsgType.JOIN_ACK and self.addrs is not None:
                    self._ack(addr, datagram, now)
            except ValueError:
                pass  # malformed: the JOIN is sent again
            if typ == MsgType.ERROR:
                self.sessions.pop(addr, None)  # it refused: nothing to leave there
                self._stop_joining(JoinRefused(addr, datagram[HDR:].decode(errors="replace")))
        elif typ in (MsgType.STATS_REPLY, MsgType.ERROR) and addr in self._stats_waiting:
            self._stats_reply(addr, datagram)

    def datagrams_to_send(self, now: float) -> list[tuple[bytes, int]]:
        """Owned (datagram, address key) pairs to send now: queued requests and JOINs due (again)."""
        for addr, due in self._joining.items():
            if due[1] <= now:
                self._out.append((self._join_datagram(addr), addr))
                due[1] = now + JOIN_RESEND
        out, self._out = self._out, []
        return out

    def get_timer(self) -> float | None:
        """When handle_timer (or datagrams_to_send, for a JOIN's resend) is next due; None: no timer."""
        times = [t for due in self._joining.values() for t in due]
        times += [t for t in (self._progress_deadline, self._stats_deadline, self._keepalive_due) if t is not None]
        return min(times) if times else None

    def handle_timer(self, now: float) -> None:
        """Fire the deadlines due by ``now`` (JOIN resends and keepalives go out with the next
        datagrams_to_send)."""
        late = [addr for addr, due in self._joining.items() if due[0] <= now]
        if late:
            self._stop_joining(JoinTimedOut(late[0]))
        if self._stats_deadline is not None and self._stats_deadline <= now:
            self._stats_done()
        if self._progress_deadline is not None and self._progress_deadline <= now:
            self._progress_deadline = None
            self._events.append(NoProgress())
        if self._keepalive_due is not None and self._keepalive_due <= now:
            self._keepalive_due = now + self.keepalive_every
            self._out += [(self.sealed(MsgType.STATS_REQUEST, addr), addr) for addr in sorted(self.sessions)]

    def next_event(self) -> Event | None:
        """The oldest event not yet taken, or None."""
        return self._events.pop(0) if self._events else None
