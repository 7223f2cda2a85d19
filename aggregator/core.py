"""The aggregator's sans-I/O core for one data-plane core: the control plane (join handshake, membership,
teardown, statistics) over the data path it is constructed with (aggregator.datapath: the burst kernel of
aggregator.kernel by default). It owns no socket and reads no clock: the driver hands it a Burst of received
datagrams and the time, and sends the Burst it gets back (the data path's results, valid until the core's next
call), then the control replies of take_replies.

Control plane (docs/protocol.md, "Control plane" and "Control plane authentication"; keys: protocol.keys)
    JOIN, first round (client nonce, no cookie): answered with a CHALLENGE carrying a stateless cookie for the
    sender's address, job, rank and nonce; nothing is kept, and the CHALLENGE is smaller than the JOIN.
    JOIN with the cookie and a proof (a MAC under the token key): the cookie must be this core's for the sender
    (current or previous epoch), the proof must verify under one of the core's tokens. Each token is a tenant
    with its own job ids (docs/protocol.md, "Tenants"): the JOIN joins, or creates, the job of its id of the
    token that proves it, and two tokens' jobs of one id are two jobs, keyed (tenant, job id) (datapath.job_key).
    Only then is anything reserved: the first proved JOIN of a job registers it
    (rows of this core's slot table, its job nonce and data key); later ones must carry the same parameters. A
    rank proving the job's token from a new address takes its seat (a restarted rank): the old binding is
    replaced, and the JOIN_ACK tells it the allreduce to use next and each of this core's slots' next shadow set.
    A cookie proved once is remembered until it expires: a JOIN carrying it again is taken only as a repeat (its
    JOIN_ACK was lost) while the seat it won is still held, so a replayed JOIN cannot revive a finished job,
    rebind a seat, or bring back a job nonce (each registration mixes in the core's count of them).
    An address holds at most one rank of a job, and a rank of at most one of the jobs of an id (the data path
    tells two tenants' jobs of one id apart by it). Replies: JOIN_ACK (the parameters, ``cores``, the multicast
    group, the resume point, MAC'd under the rank's session key) or ERROR with a one-line reason. A sender that
    has not proved the token learns only that (``UNPROVED``), counted as ``drop_bad_mac``; refusals after the
    proof name the parameter or the limit, counted as ``drop_refused_join``.
    LEAVE (MAC'd under the session key, from the rank's address): the rank is done; when every joined rank has
    left, the job is torn down and its rows freed. Others are counted (``drop_leave_non_member``,
    ``drop_bad_mac``) and ignored. A job idle (no accepted packet, no join, no member's keepalive) for
    ``idle_timeout`` seconds is torn down too: its ranks are gone. A job's final counters, and when and why it
    ended (``leave``, ``idle``, ``evicted``), stay in a bounded history of the last ``job_history`` finished jobs.
    Keepalive, a STATS_REQUEST of a header and a MAC only (MAC'd likewise, from a member): the job is not idle;
    no reply. Workers send one every third of the ``idle_timeout`` their JOIN_ACK states while no allreduce
    runs, so that a job lives as long as its ranks do.
    STATS_REQUEST (MAC'd likewise, from a member, whose request also keeps the job alive): a STATS_REPLY with that
    job's counters, how long each rank has been silent and the ranks its incomplete rounds miss, MAC'd, cut to at
    most MAX_REPLY_RATIO times the request. With rank OPERATOR_RANK and a MAC under one of the core's tokens: the
    statistics of every job of that token's tenant (job id 0xFFFFFFFF) or of one, its finished jobs' history, and
    the core's counters (every event on the core, aggregator.counters). No member addresses, no seeds, to anyone.
    A member's request for a job this core does not know gets a short ERROR (if not larger than the request);
    anything else gets no reply (``drop_bad_mac``). An operator's request carries a sequence number under its
    MAC, and each is answered once (a replay is not fresh). No reply to a sender that has proved nothing is larger
    than its request.
"""

from __future__ import annotations

import json
import os
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from intml.aggregator.counters import END_REASONS, EVICTED, IDLE, LEAVE
from intml.aggregator.datapath import DataPath, Slots, job_key, job_name, tenant_of, wire_job
from intml.aggregator.host import HostModeDataPath
from intml.protocol import keys, wire
from intml.protocol.address import addr_of, format_addr
from intml.protocol.burst import Burst
from intml.protocol.job import (
    AGGREGATOR_IDLE_TIMEOUT,
    AGGREGATOR_JOB_HISTORY,
    AGGREGATOR_MAX_POOL,
    MAX_WORLD,
    JobParams,
)
from intml.protocol.packet import HDR, round_order
from intml.protocol.stats import (
    DROP_BAD_CONTROL,
    DROP_BAD_MAC,
    DROP_LEAVE_NON_MEMBER,
    DROP_REFUSED_JOIN,
    N_STATS,
    SEND_FAILED,
    STAT_NAMES,
)
from intml.protocol.wire import MsgType

ALL_JOBS = 0xFFFFFFFF
OPERATOR_RANK = 0xFFFF  # a STATS_REQUEST's rank for the operator's view, MAC'd under one of the core's tokens
MAX_PENDING_LISTED = 32  # keeps a STATS_REPLY well inside one datagram
MAX_REPLY_RATIO = 3  # no STATS_REPLY is larger than this many times its request (no amplification)
# no longer than the smallest JOIN's payload: an ERROR to an unproved sender is never larger than its request
UNPROVED = "JOIN refused: the token is wrong, or the aggregator lacks it (--token-file / INTML_TOKEN)"
OPERATOR_SEQ = 8  # bytes: an operator's STATS_REQUEST starts its padding with a u64 sequence number
# every rank must agree (first_core, total_cores: on the layout of the job's slots over its aggregators)
JOB_PARAMS = ("world_size", "packet_elements", "pool_size", "codec", "codec_param", "seed", "flags", "first_core",
              "total_cores")


@dataclass
class JobInfo:
    """The control plane's view of a job; the data path holds its own (its entry ``index``, its slot ``rows``)."""

    index: int
    params: JobParams
    first_core: int  # of this aggregator, among the job's total_cores (slots.stride)
    slots: Slots
    rows: range
    group: int  # the results group's address key (0: unicast)
    joined_at: float
    token_key: bytes  # of the token that created the job (its tenant): only it can join
    job_nonce: bytes
    incarnation: int  # the core's count of registrations when this one was made
    left: set[int] = field(default_factory=set)
    sessions: dict[int, bytes] = field(default_factory=dict)  # rank -> session key of its current incarnation
    alive_at: float = float("-inf")  # a member's latest keepalive (or other STATS_REQUEST)
    members: dict[int, int] = field(default_factory=dict)  # rank -> the address key it joined from

    def view(self) -> dict[str, int]:
        """The parameters as the JOIN states them (statistics, refusals)."""
        p = self.params
        return {"world_size": p.world_size, "packet_elements": p.packet_elements, "pool_size": p.pool_size,
                "codec": int(p.codec), "codec_param": p.codec_param, "seed": p.seed, "flags": p.flags,
                "first_core": self.first_core, "total_cores": self.slots.stride}


class AggregatorCore:
    """One data-plane core: slots s with s % cores == core of each job (s % total_cores == first_core + core for
    a job spread over several aggregators), and the control plane for its share of each job."""

    def __init__(self, datapath: DataPath | None = None, *, core: int = 0, cores: int = 1,
                 idle_timeout: float = AGGREGATOR_IDLE_TIMEOUT, max_pool: int = AGGREGATOR_MAX_POOL,
                 tokens: Iterable[str] = ("",), random_bytes: Callable[[int], bytes] = os.urandom,
                 job_history: int = AGGREGATOR_JOB_HISTORY, tenant_max_jobs: int | None = None,
                 tenant_max_slots: int | None = None, **kernel: Any) -> None:
        """``datapath``: what moves the DATA (aggregator.datapath); by default the burst kernel with the host mode
        beside it (aggregator.host.HostModeDataPath), built from ``kernel``, aggregator.kernel.KernelDataPath's
        options (rows, max_elements, max_jobs, burst, results_group, control_limits, counters). ``tokens``: the
        tokens a new job may be created with (the default, only the empty token, is the open mode).
        ``random_bytes``: the source of the core's cookie secret (injectable for deterministic tests). ``job_history``:
        how many finished jobs the statistics keep. ``max_pool``: the most slots a job may have. ``tenant_max_jobs``,
        ``tenant_max_slots``: the jobs and slot rows the jobs of one token may hold on this core at once (None: no quota
        but the core's), so that one tenant cannot take the table from the others."""
        if not 0 <= core < cores:
            raise ValueError(f"core must be in [0, {cores}), got {core}")
        if datapath is not None and kernel:
            raise TypeError(f"options of the kernel data path with a data path of its own: {sorted(kernel)}")
        self.datapath = HostModeDataPath(name=f"aggregator core {core}", **kernel) if datapath is None else datapath
        self.counters = self.datapath.counters
        self.max_elements = self.datapath.max_elements
        self.marks = self.datapath.marks  # the driver keeps the data path's own congestion marks (DataPath.marks)
        # an address holds at most one rank of a job, so that one holder of the token cannot stand in for a whole
        # job; tests that run several ranks from one address clear it
        self.one_rank_per_address = True
        self.core, self.cores = core, cores
        self.max_pool = max_pool
        self.tenant_max_jobs, self.tenant_max_slots = tenant_max_jobs, tenant_max_slots
        self.idle_timeout = idle_timeout
        self._token_keys = list(dict.fromkeys(keys.token_key(t) for t in tokens))
        if not self._token_keys:
            raise ValueError("an aggregator core needs at least one token (the open mode's is \"\")")
        self._secret = random_bytes(keys.KEY_SIZE)  # keys the cookies; never leaves the core
        self._incarnations = 0  # jobs registered so far: each job nonce mixes in its own
        # cookie -> (expiry, the job's incarnation) of every accepted JOIN whose cookie is still valid
        self._used_cookies: dict[bytes, tuple[float, int]] = {}
        self._operator_seq: dict[bytes, int] = {}  # token key -> the last operator request's sequence number answered
        self.info: dict[int, JobInfo] = {}  # by job key (datapath.job_key: the job id for tenant 0)
        self.history: deque[dict] = deque(maxlen=job_history)  # finished jobs, oldest first
        self._control_in: list[tuple[bytes, int, float]] = []  # admitted control datagrams not yet handled

    # ---- data plane -------------------------------------------------------------------------------------
    def receive(self, rx: Burst, now: float) -> Burst:
        """Handle the ``rx.count`` datagrams of a receive burst (one with rows of its own, ``Burst.rows_of``).
        Returns the data path's output burst: the RESULT datagrams to send, in order; they stay valid until the
        core's next call. The control datagrams the data path admitted are copied out and handled by
        ``take_replies``, so that no result waits for control work."""
        out, control = self.datapath.process(rx, now)
        for i in control.tolist():
            self._control_in.append((bytes(rx.data[i, : rx.length[i]]), int(rx.addr[i]), now))
        return out

    def count_send_failures(self, n: int) -> None:
        """The driver reports `n` datagrams the kernel refused to send (skipped; the others went out)."""
        self.counters.core_stats[SEND_FAILED] += n

    def take_replies(self) -> list[tuple[bytes, int]]:
        """Handle the control datagrams admitted since the last call, oldest first (each at the time it was
        received); returns their replies (datagram, destination address key). The driver calls it once the
        results are sent: this is the control plane's work, off the data path."""
        pending, self._control_in = self._control_in, []
        replies = []
        for datagram, addr, now in pending:
            reply = self.handle_control(datagram, addr, now)
            if reply is not None:
                replies.append((reply, addr))
        return replies

    # ---- control plane ----------------------------------------------------------------------------------
    def handle_control(self, datagram: bytes, addr: int, now: float) -> bytes | None:
        """Answer one JOIN, LEAVE or STATS_REQUEST datagram (already checked for magic and version)."""
        typ = datagram[wire.OFFSETS["type"]]
        try:
            if typ == MsgType.JOIN:
                return self._join(datagram, addr, now)
            header, _ = wire.unpack(datagram)
            if typ == MsgType.LEAVE:
                self._leave(datagram, int(header["job"]), int(header["rank"]), addr, now)
                return None
            return self._stats_reply(datagram, int(header["job"]), int(header["rank"]), addr, now)
        except ValueError as exc:  # a malformed JOIN, LEAVE or STATS_REQUEST: counted, answered, no state change
            self.counters.core_stats[DROP_BAD_CONTROL] += 1
            return _error(0, str(exc), len(datagram))  # from anyone: no larger than the request

    def _refuse(self, stat: int, job_id: int, message: str) -> bytes:
        self.counters.core_stats[stat] += 1
        return _error(job_id, message)

    def _join(self, datagram: bytes, addr: int, now: float) -> bytes:
        header, payload, _ = wire.unpack_join(datagram)
        job_id, rank = int(header["job"]), int(header["rank"])
        nonce, cookie = bytes(payload["nonce"]), bytes(payload["cookie"])
        if not any(cookie):  # the first round: a stateless challenge
            return self._challenge(job_id, rank, nonce, addr, now)
        if not keys.cookie_valid(self._secret, addr, job_id, rank, nonce, cookie, now):
            # expired, or replayed from another address: a fresh challenge for this sender, nothing else
            self.counters.core_stats[DROP_BAD_MAC] += 1
            return self._challenge(job_id, rank, nonce, addr, now)
        # the token that proves the JOIN is its tenant, whose job of this id it joins (or creates)
        tenant = next((t for t, k in enumerate(self._token_keys) if keys.verify(k, datagram, wire.JOIN_MAC)), None)
        key = None if tenant is None else job_key(tenant, job_id)
        info = None if key is None else self.info.get(key)
        if not self._fresh_cookie(cookie, job_id, rank, nonce, info, now):
            # a replayed JOIN whose seat is gone (left, rebound, or its job ended): a challenge, nothing else
            self.counters.core_stats[DROP_BAD_MAC] += 1
            return self._challenge(job_id, rank, nonce, addr, now)
        if key is None:
            return self._refuse(DROP_BAD_MAC, job_id, UNPROVED)
        # proved: from here on the sender is a holder of the job's token
        token_key = self._token_keys[tenant]
        fields = {name: int(payload[name]) for name in JOB_PARAMS}
        job = self._job_of(fields, rank)
        if isinstance(job, str):
            return self._refuse(DROP_REFUSED_JOIN, job_id, job)
        params, first_core, slots = job
        problem = self.datapath.refuse(key, params, slots, rank)
        if problem:
            return self._refuse(DROP_REFUSED_JOIN, job_id, problem)
        if info is None:
            self._incarnations += 1
            info = self._place(key, params, first_core, slots, now, token_key,
                               keys.job_nonce(self._secret, nonce, cookie, self._incarnations))
            if isinstance(info, str):  # the limit that was hit
                return self._refuse(DROP_REFUSED_JOIN, job_id, info)
        elif (info.params, info.first_core, info.slots) != job:
            fields["total_cores"] = slots.stride  # the same layout, stated either way
            differing = ", ".join(f"{k}={fields[k]} (job has {v})" for k, v in info.view().items() if fields[k] != v)
            return self._refuse(DROP_REFUSED_JOIN, job_id,
                                f"job {job_id} already exists with other parameters: {differing}")
        others = [r for r, a in sorted(info.members.items()) if a == addr and r != rank]
        if others and self.one_rank_per_address:
            host, port = addr_of(addr)
            return self._refuse(DROP_REFUSED_JOIN, job_id,
                                f"{host}:{port} already holds rank {others[0]} of job {job_id}; each rank must join "
                                f"from its own address")
        if self._seated(job_id, rank, addr) not in (None, key):  # the data path would not know whose DATA it is
            host, port = addr_of(addr)
            return self._refuse(DROP_REFUSED_JOIN, job_id,
                                f"{host}:{port} already holds rank {rank} of another token's job {job_id}; join from "
                                f"another address")
        info.members[rank] = addr  # a restarted rank's new address replaces its old one
        self.datapath.seat(key, rank, addr, now)
        info.left.discard(rank)
        session = info.sessions[rank] = keys.session_key(token_key, job_id, rank, nonce, cookie)
        self._used_cookies.setdefault(cookie, (keys.cookie_expiry(now), info.incarnation))
        group = info.group
        allreduce, sets = self._resume_point(key, info)
        ack = wire.pack_join({**_reply_header(job_id, MsgType.JOIN_ACK), "rank": rank},
                             {**info.view(), "cores": self.cores, "group": group >> 16, "group_port": group & 0xFFFF,
                              "allreduce": allreduce, "nonce": nonce, "cookie": cookie, "job_nonce": info.job_nonce,
                              "idle_timeout": min(round(self.idle_timeout * 1000), 0xFFFFFFFF)},
                             sets)
        return keys.seal(session, ack, wire.JOIN_MAC)

    def _fresh_cookie(self, cookie: bytes, job_id: int, rank: int, nonce: bytes, info: JobInfo | None,
                      now: float) -> bool:
        """Whether a valid cookie may be used: never used by an accepted JOIN, or used by one whose seat this
        JOIN would repeat (same job incarnation, and the rank's session is still the one this cookie gave). The
        cookie already binds the address, job, rank and nonce."""
        used = self._used_cookies
        while used and next(iter(used.values()))[0] <= now:  # oldest first: expiry grows with insertion
            del used[next(iter(used))]
        entry = used.get(cookie)
        if entry is None:
            return True
        return (info is not None and info.incarnation == entry[1]
                and info.sessions.get(rank) == keys.session_key(info.token_key, job_id, rank, nonce, cookie))

    def _challenge(self, job_id: int, rank: int, nonce: bytes, addr: int, now: float) -> bytes:
        """A CHALLENGE for this sender: a fresh cookie, and this aggregator's cores (for the job's layout)."""
        cookie = keys.cookie(self._secret, addr, job_id, rank, nonce, keys.epoch(now))
        return wire.pack_challenge(job_id, rank, nonce, cookie, self.cores)

    def _resume_point(self, key: int, info: JobInfo) -> tuple[int, bytes]:
        """Where a rank joining now starts: the allreduce its peers are in (one of whose rounds here still waits)
        or the next one, and the slot bitmap of each of this core's slots' next shadow set: the set of a round
        that waits for contributions, else the other set than the slot's last round (0 for an unused slot).
        Rounds compare in serial number order (packet.round_order), as the kernel's do; a set holds a round
        iff its bitmap is not empty."""
        round_key, bitmap, count = self.datapath.round_state(key)
        used = bitmap != 0
        last = np.array([int(u[1] and (not u[0] or round_order(int(k[1]), int(k[0])) > 0))
                         for k, u in zip(round_key, used)], np.int64)
        local = np.arange(last.size)
        held = used[local, last]
        last_key = round_key[local, last]
        newest = None
        for key in last_key[held]:
            newest = int(key) if newest is None or round_order(int(key), newest) > 0 else newest
        allreduce = 0 if newest is None else newest >> 32 & 0xFFFFFFFF
        waiting = held & (last_key >> 32 & 0xFFFFFFFF == allreduce) & (count[local, last] < info.params.world_size)
        if newest is not None and not waiting.any():
            allreduce = (allreduce + 1) & 0xFFFFFFFF
        sets = np.where(waiting, last, np.where(held, 1 - last, 0))
        bits = np.zeros(info.params.pool_size, np.uint8)
        bits[local * info.slots.stride + info.slots.offset] = sets
        return allreduce, np.packbits(bits, bitorder="little").tobytes()

    def _job_of(self, p: dict[str, int], rank: int) -> tuple[JobParams, int, Slots] | str:
        """The JOIN's fields as the job's parameters, this aggregator's first core among the job's and this
        core's share of the slots; or one line on what is wrong with them."""
        try:
            params = JobParams(**{k: p[k] for k in ("world_size", "packet_elements", "pool_size", "codec",
                                                    "codec_param", "seed")},
                               data_mac=bool(p["flags"] & wire.FLAG_DATA_MAC),
                               nearest=bool(p["flags"] & wire.FLAG_NEAREST))
            problem = params.problem(self.max_elements)
        except ValueError as exc:
            return str(exc)
        if problem is None and p["flags"] & ~(wire.FLAG_DATA_MAC | wire.FLAG_NEAREST):
            problem = f"unknown JOIN flags 0x{p['flags']:02x}"
        if problem is None and rank >= p["world_size"]:
            problem = f"rank {rank} is out of range for world size {p['world_size']}"
        if problem is None and p["first_core"] + self.cores > (p["total_cores"] or self.cores):
            problem = (f"this aggregator's {self.cores} cores from core {p['first_core']} do not fit the job's "
                       f"{p['total_cores']} cores: every worker must list the same aggregators in the same order")
        if problem:
            return problem
        return params, p["first_core"], Slots(p["total_cores"] or self.cores, p["first_core"] + self.core)

    def _place(self, key: int, params: JobParams, first_core: int, slots: Slots, now: float, token_key: bytes,
               job_nonce: bytes) -> JobInfo | str:
        """A new job (its key, aggregator.datapath.job_key) placed on the data path and live, or one line naming
        the limit that refuses it."""
        if params.pool_size > self.max_pool:
            return (f"pool size {params.pool_size} exceeds this aggregator's maximum of {self.max_pool} slots per "
                    f"job (intml-aggregator --max-pool)")
        quota = self._quota(token_key, len(range(slots.offset, params.pool_size, slots.stride)))
        if quota:
            return quota
        job_id = wire_job(key)
        placed = self.datapath.place(key, params, slots, keys.data_key(token_key, job_id, job_nonce), now)
        if isinstance(placed, str):
            return placed
        self.counters.start_job(placed.index, job_id, tenant_of(key))  # the data path handles its DATA from here
        info = JobInfo(placed.index, params, first_core, slots, placed.rows, placed.group, now, token_key, job_nonce,
                       self._incarnations)
        self.info[key] = info
        return info

    def _quota(self, token_key: bytes, rows: int) -> str | None:
        """The tenant quota a new job of ``rows`` slot rows here would exceed for its token (one line), or None."""
        held = [info for info in self.info.values() if info.token_key == token_key]
        if self.tenant_max_jobs is not None and len(held) >= self.tenant_max_jobs:
            return (f"this token's jobs already hold its quota of {self.tenant_max_jobs} jobs on aggregator core "
                    f"{self.core} (intml-aggregator --tenant-max-jobs); wait for one to leave")
        used = sum(len(info.rows) for info in held)
        if self.tenant_max_slots is not None and used + rows > self.tenant_max_slots:
            return (f"this token's jobs hold {used} slot rows on aggregator core {self.core} and this one needs "
                    f"{rows} more: over its quota of {self.tenant_max_slots} (intml-aggregator --tenant-max-slots)")
        return None

    def _seated(self, job_id: int, rank: int, addr: int) -> int | None:
        """The key of the job of id ``job_id`` (of any tenant) whose rank ``rank`` sits at ``addr``, or None."""
        return next((k for k, info in self.info.items() if wire_job(k) == job_id and info.members.get(rank) == addr),
                    None)

    def _session(self, datagram: bytes, job_id: int, rank: int, addr: int, stranger: int) -> int | None:
        """The key of the job of a LEAVE or STATS_REQUEST from its rank's address with a good MAC under the rank's
        session key; else None, counted as ``stranger`` (``addr`` holds no such rank) or ``drop_bad_mac``."""
        key = self._seated(job_id, rank, addr) if rank < MAX_WORLD else None
        if key is None:
            self.counters.core_stats[stranger] += 1
            return None
        session = self.info[key].sessions.get(rank)
        if session is None or not keys.verify(session, datagram, len(datagram) - keys.MAC_SIZE):
            self.counters.core_stats[DROP_BAD_MAC] += 1
            return None
        return key

    def _leave(self, datagram: bytes, job_id: int, rank: int, addr: int, now: float) -> None:
        key = self._session(datagram, job_id, rank, addr, DROP_LEAVE_NON_MEMBER)
        if key is None:
            return
        info = self.info[key]
        info.left.add(rank)
        del info.sessions[rank]  # a replay of this LEAVE finds no key
        if set(info.members) <= info.left:
            self.teardown(key, now, LEAVE)

    def teardown(self, job: int, now: float | None = None, reason: str = EVICTED) -> None:
        """End a job (its key, aggregator.datapath.job_key: its id for tenant 0): free its entry and rows, and keep
        its final counters in the history. ``reason``: one of END_REASONS (``evicted`` when the driver ends it);
        ``now``: when (default: its last activity)."""
        info = self.info.pop(job)
        ended = self._last_activity(job, info) if now is None else now
        final = self.counters.end_job(info.index, reason)
        self.datapath.remove(job)
        self.history.append({"job": wire_job(job), "tenant": tenant_of(job), "params": info.view(), "ended": reason,
                             "ended_at": ended, "lasted_s": round(ended - info.joined_at, 3),
                             "counters": _nonzero(final)})

    def _last_activity(self, key: int, info: JobInfo) -> float:
        """The job's join, the latest packet of any member or a member's latest keepalive, whichever is later."""
        return max(info.joined_at, float(self.datapath.last_seen(key).max()), info.alive_at)

    def handle_timer(self, now: float) -> list[int]:
        """Tear down jobs idle for longer than idle_timeout; returns their keys (aggregator.datapath.job_key)."""
        idle = [key for key, info in self.info.items() if now - self._last_activity(key, info) >= self.idle_timeout]
        for key in idle:
            self.teardown(key, now, IDLE)
        return idle

    def get_timer(self) -> float | None:
        """When handle_timer next has something to do, or None without jobs."""
        if not self.info:
            return None
        return min(self._last_activity(key, info) for key, info in self.info.items()) + self.idle_timeout

    # ---- statistics -------------------------------------------------------------------------------------
    def stats(self, now: float, job_id: int = ALL_JOBS, tenant: int | None = None) -> dict:
        """The statistics of every job (or of ``job_id``), the finished jobs' history (newest first), how many
        jobs ended for each reason, and the core's counters (docs/protocol.md, "STATS_REQUEST and STATS_REPLY").
        With ``tenant``, of that tenant's jobs only, named by their ids; else of every tenant's, named by
        aggregator.datapath.job_name (``5@1``: tenant 1's job 5)."""
        jobs = {}
        for key, info in self.info.items():
            jid = wire_job(key)
            if job_id not in (ALL_JOBS, jid) or tenant not in (None, tenant_of(key)):
                continue
            n = info.params.world_size
            members = {r: format_addr(a) for r, a in sorted(info.members.items())}
            _, bitmaps, counts = self.datapath.round_state(key)
            stride, offset = info.slots.stride, info.slots.offset
            seen = self.datapath.last_seen(key)
            waiting = np.nonzero((counts > 0) & (counts < n))
            pending = [
                {"slot": int(r) * stride + offset, "shadow": int(x),
                 "missing_ranks": [k for k in range(n) if not int(bitmaps[r, x]) >> k & 1]}
                for r, x in list(zip(*waiting))[:MAX_PENDING_LISTED]
            ]
            jobs[str(jid) if tenant is not None else job_name(key)] = {
                "tenant": tenant_of(key),
                "params": info.view(),
                "members": members,
                "silent_s": {r: round(now - float(seen[r]), 3) for r in members},
                "left": sorted(info.left),
                "pending": pending,
                "pending_total": int(waiting[0].size),
                "counters": dict(zip(STAT_NAMES, self.counters.job(info.index).tolist())),
            }
        finished = [{**{k: v for k, v in past.items() if k != "ended_at"},
                     "ended_s_ago": round(now - past["ended_at"], 3)}
                    for past in reversed(self.history)
                    if job_id in (ALL_JOBS, past["job"]) and tenant in (None, past["tenant"])]
        return {"core": self.core, "cores": self.cores, "jobs": jobs, "finished": finished,
                "finished_total": dict(zip(END_REASONS, self.counters.finished.tolist())),
                "core_counters": dict(zip(STAT_NAMES, self.counters.totals().tolist()))}

    def _stats_reply(self, datagram: bytes, job_id: int, rank: int, addr: int, now: float) -> bytes | None:
        """Statistics for a credential, MAC'd under it and cut to at most MAX_REPLY_RATIO times the request: a
        member's (its session key) of its own job, an operator's (rank OPERATOR_RANK, any of the core's tokens)
        of every job of its token (its tenant's). Never member addresses or seeds. None (no reply) to anyone
        else."""
        if rank == OPERATOR_RANK:
            tenant = next((t for t, k in enumerate(self._token_keys)
                           if keys.verify(k, datagram, len(datagram) - keys.MAC_SIZE)), None)
            key = None if tenant is None else self._token_keys[tenant]
            seq = int.from_bytes(datagram[HDR:HDR + OPERATOR_SEQ], "big")
            if (key is None or len(datagram) < HDR + OPERATOR_SEQ + keys.MAC_SIZE
                    or seq <= self._operator_seq.get(key, 0)):  # a forgery, or a replay: not fresh
                self.counters.core_stats[DROP_BAD_MAC] += 1
                return None
            self._operator_seq[key] = seq
            reply, cuts = self._operator_view(now, job_id, tenant)
        else:
            if job_id != ALL_JOBS and all(wire_job(k) != job_id for k in self.info):
                # anyone may learn this (job ids are in DATA packets)
                error = _error(job_id, f"job {job_id} unknown")
                return error if len(error) <= len(datagram) else None
            job = self._session(datagram, job_id, rank, addr, DROP_BAD_MAC)
            if job is None:
                return None
            info = self.info[job]
            info.alive_at = now  # a member proved it is alive: the job is not idle
            if len(datagram) == HDR + keys.MAC_SIZE:
                return None  # a keepalive: nothing to answer
            key = info.sessions[rank]
            reply, cuts = self._member_view(job, now)
        body = _fit(reply, cuts, MAX_REPLY_RATIO * len(datagram) - HDR - keys.MAC_SIZE)
        out = wire.pack({**_reply_header(job_id, MsgType.STATS_REPLY), "rank": rank}, body + bytes(keys.MAC_SIZE))
        return keys.seal(key, out, len(out) - keys.MAC_SIZE)

    def _member_view(self, key: int, now: float) -> tuple[dict, list[Callable[[dict], object]]]:
        """A member's statistics of its job (its key; what WorkerSession.request_stats needs first), and the cuts
        that shorten it, least needed first."""
        job = self.stats(now, wire_job(key), tenant_of(key))["jobs"][str(wire_job(key))]
        missing = sorted({r for round_ in job["pending"] for r in round_["missing_ranks"]})
        reply = {"core": self.core, "missing": missing, "pending_total": job["pending_total"], "left": job["left"],
                 "silent_s": job["silent_s"], "counters": {k: v for k, v in job["counters"].items() if v}}
        cuts = [lambda r: r.pop("counters"),
                lambda r: r.update(silent_s={k: v for k, v in r["silent_s"].items() if k in missing}),
                lambda r: r.pop("silent_s"), lambda r: r.pop("missing")]
        return reply, cuts

    def _operator_view(self, now: float, job_id: int, tenant: int) -> tuple[dict, list[Callable[[dict], object]]]:
        """The statistics of every job of ``tenant`` (or of its ``job_id``) and of the core, without member
        addresses or seeds, and the cuts that shorten it."""
        reply = self.stats(now, job_id, tenant)
        for job in [*reply["jobs"].values(), *reply["finished"]]:
            job.pop("members", None)
            job["params"] = {k: v for k, v in job["params"].items() if k != "seed"}

        def drop(*names: str) -> Callable[[dict], None]:
            return lambda r: [job.pop(n, None) for job in r["jobs"].values() for n in names]

        return reply, [lambda r: r.pop("finished"), drop("pending"), drop("silent_s", "left"), drop("counters"),
                       lambda r: r.pop("jobs")]


def _fit(reply: dict, cuts: list[Callable[[dict], object]], budget: int) -> bytes:
    """``reply`` as JSON of at most ``budget`` bytes: the cuts applied in order until it fits (then it says
    ``"truncated": true``), or just that."""
    body = json.dumps(reply).encode()
    for cut in cuts:
        if len(body) <= budget:
            return body
        cut(reply)
        reply["truncated"] = True
        body = json.dumps(reply).encode()
    return body if len(body) <= budget else b'{"truncated": true}'[:max(0, budget)]


def _nonzero(counters: np.ndarray) -> dict[str, int]:
    return {name: v for name, v in zip(STAT_NAMES, counters.tolist()) if v}


def _reply_header(job_id: int, typ: MsgType) -> dict:
    return {"type": int(typ), "job": job_id}


def _error(job_id: int, message: str, limit: int | None = None) -> bytes | None:
    """An ERROR with this one-line message; with ``limit``, cut to at most that many bytes (None if not even the
    header fits)."""
    text = message.encode()
    if limit is not None:
        if limit < HDR:
            return None
        text = text[:limit - HDR].decode(errors="ignore").encode()  # whole characters only
    return wire.pack(_reply_header(job_id, MsgType.ERROR), text)


def operator_request(token: str, seq: int, job: int = ALL_JOBS, size: int = 512) -> bytes:
    """An operator's STATS_REQUEST of ``size`` bytes under ``token``: its sequence number ``seq`` (u64, greater
    than any the core answered before under that token: time.time_ns() serves), zero padding, the MAC. A core
    answers each sequence number once, so a captured request replayed gets nothing."""
    body = seq.to_bytes(OPERATOR_SEQ, "big") + bytes(size - HDR - OPERATOR_SEQ)
    request = wire.pack({**_reply_header(job, MsgType.STATS_REQUEST), "rank": OPERATOR_RANK}, body)
    return keys.seal(keys.token_key(token), request, len(request) - keys.MAC_SIZE)


assert N_STATS == len(STAT_NAMES)
