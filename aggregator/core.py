"""The aggregator's sans-I/O core for one data-plane core: the burst kernel (aggregator.slots) plus the control
plane (join handshake, membership, teardown, statistics). It owns no socket and reads no clock: the driver
hands it a Burst of received datagrams and the time, and sends the Burst it gets back, whose datagrams are the
core's stored results (zero copy, valid until the core's next call), then the control replies of take_replies.

Control plane (docs/protocol.md, "Control plane" and "Control plane authentication"; keys: protocol.keys)
    JOIN, first round (client nonce, no cookie): answered with a CHALLENGE carrying a stateless cookie for the
    sender's address, job, rank and nonce; nothing is kept, and the CHALLENGE is smaller than the JOIN.
    JOIN with the cookie and a proof (a MAC under the token key): the cookie must be this core's for the sender
    (current or previous epoch), the proof must verify under the job's token (an existing job) or one of the
    core's tokens (a new job). Only then is anything reserved: the first proved JOIN of a job registers it
    (rows of this core's slot table, its job nonce and data key); later ones must carry the same parameters. A
    rank proving the job's token from a new address takes its seat (a restarted rank): the old binding is
    replaced, and the JOIN_ACK tells it the allreduce to use next and each of this core's slots' next shadow set.
    A cookie proved once is remembered until it expires: a JOIN carrying it again is taken only as a repeat (its
    JOIN_ACK was lost) while the seat it won is still held, so a replayed JOIN cannot revive a finished job,
    rebind a seat, or bring back a job nonce (each registration mixes in the core's count of them).
    An address holds at most one rank of a job. Replies: JOIN_ACK (the parameters, ``cores``, the multicast
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
    most MAX_REPLY_RATIO times the request. With rank OPERATOR_RANK and a MAC under one of the core's tokens: every
    job's statistics (job id 0xFFFFFFFF) or one job's, the finished jobs' history, and the core's counters (every
    event on the core, aggregator.counters). No member addresses, no seeds, to anyone. A member's request for a job
    this core does not know gets a short ERROR (if not larger than the request); anything else gets no reply
    (``drop_bad_mac``). An operator's request carries a sequence number under its MAC, and each is answered once
    (a replay is not fresh). No reply to a sender that has proved nothing is larger than its request.
"""

from __future__ import annotations

import json
import os
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import numpy as np

from intml.aggregator.counters import END_REASONS, EVICTED, IDLE, LEAVE, CoreCounters
from intml.aggregator.slots import (
    Jobs,
    Table,
    new_batch,
    new_jobs,
    new_limiter,
    new_table,
    place_job,
    process_burst,
    row_width,
)
from intml.protocol import keys, wire
from intml.protocol.address import addr_of, format_addr
from intml.protocol.arith import value_bits
from intml.protocol.burst import Burst
from intml.protocol.job import (
    AGGREGATOR_IDLE_TIMEOUT,
    AGGREGATOR_JOB_HISTORY,
    AGGREGATOR_MAX_ELEMENTS,
    AGGREGATOR_MAX_JOBS,
    AGGREGATOR_MAX_POOL,
    AGGREGATOR_SLOTS,
    BURST,
    MAX_WORLD,
    ControlLimits,
    JobParams,
)
from intml.protocol.packet import HDR, round_order
from intml.protocol.siphash import key_words
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
JOB_PARAMS = ("world_size", "packet_elements", "pool_size", "codec", "seed", "flags", "first_core", "total_cores")


@dataclass
class JobInfo:
    """Python-side bookkeeping of a job; the kernel's view is its row in Jobs."""

    index: int
    params: dict
    rows: range
    joined_at: float
    token_key: bytes  # of the token that created the job: only it can join
    job_nonce: bytes
    incarnation: int  # the core's count of registrations when this one was made
    left: set[int] = field(default_factory=set)
    sessions: dict[int, bytes] = field(default_factory=dict)  # rank -> session key of its current incarnation
    alive_at: float = float("-inf")  # a member's latest keepalive (or other STATS_REQUEST)


class AggregatorCore:
    """One data-plane core: slots s with s % cores == core of each job (s % total_cores == first_core + core for
    a job spread over several aggregators), and the control plane for its share of each job."""

    def __init__(self, *, core: int = 0, cores: int = 1, rows: int = AGGREGATOR_SLOTS,
                 max_elements: int = AGGREGATOR_MAX_ELEMENTS, max_jobs: int = AGGREGATOR_MAX_JOBS,
                 idle_timeout: float = AGGREGATOR_IDLE_TIMEOUT,
                 results_group: tuple[int, int] | None = None, burst: int = BURST,
                 allow_shared_address: bool = False, max_pool: int = AGGREGATOR_MAX_POOL,
                 control_limits: ControlLimits = ControlLimits(), tokens: Iterable[str] = ("",),
                 random_bytes: Callable[[int], bytes] = os.urandom, job_history: int = AGGREGATOR_JOB_HISTORY,
                 counters: CoreCounters | None = None, tenant_max_jobs: int | None = None,
                 tenant_max_slots: int | None = None) -> None:
        """``burst``: the most datagrams a receive burst is expected to hold (a larger one grows the output
        memory). ``results_group`` = (first IPv4 multicast group as an integer, UDP port): job slot j sends its results
        to group + j in one datagram per completion, as a switch's multicast replication does, instead of one
        datagram per worker; retransmitted results still go to the one worker that asked. ``allow_shared_address``
        (tests only) lets one address hold several ranks of a job; otherwise such a JOIN is refused, so that one
        holder of the token cannot stand in for a whole job. ``control_limits``: how many JOIN, LEAVE and
        STATS_REQUEST datagrams the kernel lets through to the control plane (the kernel's control admission).
        ``tokens``: the tokens a new job may be created with (the default, only the empty token, is the open
        mode). ``random_bytes``: the source of the core's cookie secret (injectable for deterministic tests).
        ``job_history``: how many finished jobs the statistics keep. ``counters``: the block the core keeps its
        counters and job table flags in (for a reader elsewhere, aggregator.metrics; a private one by default).
        ``tenant_max_jobs``, ``tenant_max_slots``: the jobs and slot rows the jobs of one token may hold on this
        core at once (None: no quota but the core's), so that one tenant cannot take the table from the others."""
        if not 0 <= core < cores:
            raise ValueError(f"core must be in [0, {cores}), got {core}")
        if results_group is not None and not (0xE0000000 <= results_group[0] <= 0xF0000000 - max_jobs
                                              and 0 < results_group[1] <= 0xFFFF):
            raise ValueError(f"results group must leave {max_jobs} IPv4 multicast groups (224.0.0.0/4) and a port")
        self.results_group = results_group
        self.allow_shared_address = allow_shared_address
        self.core, self.cores = core, cores
        self.max_elements = max_elements
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
        self.counters = CoreCounters(max_jobs, rows) if counters is None else counters
        if (self.counters.max_jobs, self.counters.rows) != (max_jobs, rows):
            raise ValueError(f"the counters block is for {self.counters.max_jobs} jobs and {self.counters.rows} rows, "
                             f"not {max_jobs} and {rows}")
        c = self.counters
        self.jobs: Jobs = new_jobs(max_jobs)._replace(job_id=c.job_id, active=c.active, stats=c.stats,
                                                       core_stats=c.core_stats)
        self.row_used = c.row_used
        self.info: dict[int, JobInfo] = {}
        self.history: deque[dict] = deque(maxlen=job_history)  # finished jobs, oldest first
        self._limiter = tuple(new_limiter(control_limits))
        self._control_in: list[tuple[bytes, int, float]] = []  # admitted control datagrams not yet handled
        width = row_width(max_elements)
        self.table: Table = new_table(rows, max_elements, np.zeros((rows, 2, width), np.uint8))
        self._grow(burst)

    def _grow(self, burst: int) -> None:
        """Size the output memory and the scratch for received bursts of up to `burst` datagrams. One block
        holds the stored results and `burst` spill rows, so the output Burst's datagrams all lie in its memory;
        the results already stored move along (only rows in use are copied: untouched pages stay unmapped)."""
        rows, _, width = self.table.result.shape
        memory = np.zeros((2 * rows + burst) * width, np.uint8)
        result = memory[: 2 * rows * width].reshape(rows, 2, width)
        result[self.row_used] = self.table.result[self.row_used]
        self.table = self.table._replace(result=result)
        self._spill = memory[2 * rows * width:].reshape(burst, width)
        self._spill_len = np.zeros(burst, np.int64)
        self._tables = (tuple(self.jobs), tuple(self.table))  # see process_burst on why tuples
        self._batch = tuple(new_batch(rows, burst))
        self._control = np.empty(burst, np.int64)
        self._out = Burst(memory, burst * MAX_WORLD)  # a completion sends up to MAX_WORLD results

    # ---- data plane -------------------------------------------------------------------------------------
    def receive(self, rx: Burst, now: float) -> Burst:
        """Handle the ``rx.count`` datagrams of a receive burst (one with rows of its own, ``Burst.rows_of``).
        Returns the core's output burst: the RESULT datagrams to send, in order, pointing at the core's stored
        results; they stay valid until the core's next call. The control datagrams the kernel admitted are copied
        out and handled by ``take_replies``, so that no result waits for control work."""
        if rx.data is None:
            raise ValueError("receive needs a burst with rows of its own (Burst.rows_of)")
        if self._control.size < rx.rows:
            self._grow(rx.rows)
        out = self._out
        out.count, n_ctl = self._data_path(rx, now, out)
        for i in self._control[:n_ctl].tolist():
            self._control_in.append((bytes(rx.data[i, : rx.length[i]]), int(rx.addr[i]), now))
        return out

    def _data_path(self, rx: Burst, now: float, out: Burst) -> tuple[int, int]:
        """Run the burst kernel: (datagrams described in ``out``, control datagrams listed in ``_control``)."""
        return process_burst(rx.data, rx.length, rx.addr, rx.count, now, *self._tables, self._batch, self._spill,
                             self._spill_len, out.ptr, out.length, out.addr, self._control, self._limiter)

    def count_send_failures(self, n: int) -> None:
        """The driver reports `n` datagrams the kernel refused to send (skipped; the others went out)."""
        self.jobs.core_stats[SEND_FAILED] += n

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
            self.jobs.core_stats[DROP_BAD_CONTROL] += 1
            return _error(0, str(exc), len(datagram))  # from anyone: no larger than the request

    def _refuse(self, stat: int, job_id: int, message: str) -> bytes:
        self.jobs.core_stats[stat] += 1
        return _error(job_id, message)

    def _join(self, datagram: bytes, addr: int, now: float) -> bytes:
        header, payload, _ = wire.unpack_join(datagram)
        job_id, rank = int(header["job"]), int(header["rank"])
        nonce, cookie = bytes(payload["nonce"]), bytes(payload["cookie"])
        if not any(cookie):  # the first round: a stateless challenge
            return self._challenge(job_id, rank, nonce, addr, now)
        if not keys.cookie_valid(self._secret, addr, job_id, rank, nonce, cookie, now):
            # expired, or replayed from another address: a fresh challenge for this sender, nothing else
            self.jobs.core_stats[DROP_BAD_MAC] += 1
            return self._challenge(job_id, rank, nonce, addr, now)
        info = self.info.get(job_id)
        if not self._fresh_cookie(cookie, job_id, rank, nonce, info, now):
            # a replayed JOIN whose seat is gone (left, rebound, or its job ended): a challenge, nothing else
            self.jobs.core_stats[DROP_BAD_MAC] += 1
            return self._challenge(job_id, rank, nonce, addr, now)
        token_key = next((k for k in ([info.token_key] if info else self._token_keys)
                          if keys.verify(k, datagram, wire.JOIN_MAC)), None)
        if token_key is None:
            return self._refuse(DROP_BAD_MAC, job_id, UNPROVED)
        # proved: from here on the sender is a holder of the job's token
        params = {name: int(payload[name]) for name in JOB_PARAMS}
        problem = self._check_params(params, rank) or self._admit(job_id, params, rank)
        if problem:
            return self._refuse(DROP_REFUSED_JOIN, job_id, problem)
        params["total_cores"] = params["total_cores"] or self.cores  # the same layout, stated either way
        if info is None:
            self._incarnations += 1
            info = self._register(job_id, params, now, token_key,
                                  keys.job_nonce(self._secret, nonce, cookie, self._incarnations))
            if isinstance(info, str):  # the limit that was hit
                return self._refuse(DROP_REFUSED_JOIN, job_id, info)
        elif info.params != params:
            differing = ", ".join(f"{k}={params[k]} (job has {v})" for k, v in info.params.items() if params[k] != v)
            return self._refuse(DROP_REFUSED_JOIN, job_id,
                                f"job {job_id} already exists with other parameters: {differing}")
        j = info.index
        held = np.flatnonzero(self.jobs.members[j, : params["world_size"]] == np.uint64(addr))
        others = [int(r) for r in held if r != rank]
        if others and not self.allow_shared_address:
            host, port = addr_of(addr)
            return self._refuse(DROP_REFUSED_JOIN, job_id,
                                f"{host}:{port} already holds rank {others[0]} of job {job_id}; each rank must join "
                                f"from its own address")
        self.jobs.members[j, rank] = addr  # a restarted rank's new address replaces its old one
        self.jobs.last_seen[j, rank] = now
        info.left.discard(rank)
        session = info.sessions[rank] = keys.session_key(token_key, job_id, rank, nonce, cookie)
        self._used_cookies.setdefault(cookie, (keys.cookie_expiry(now), info.incarnation))
        group = int(self.jobs.group[j])
        allreduce, sets = self._resume_point(info)
        ack = wire.pack_join({**_reply_header(job_id, MsgType.JOIN_ACK), "rank": rank},
                             {**params, "cores": self.cores, "group": group >> 16, "group_port": group & 0xFFFF,
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

    def _resume_point(self, info: JobInfo) -> tuple[int, bytes]:
        """Where a rank joining now starts: the allreduce its peers are in (one of whose rounds here still waits)
        or the next one, and the slot bitmap of each of this core's slots' next shadow set: the set of a round
        that waits for contributions, else the other set than the slot's last round (0 for an unused slot).
        Rounds compare in serial number order (packet.round_order), as the kernel's do; a set holds a round
        iff its bitmap is not empty."""
        rows = slice(info.rows.start, info.rows.stop)
        round_key, count, used = self.table.round_key[rows], self.table.count[rows], self.table.bitmap[rows] != 0
        last = np.array([int(u[1] and (not u[0] or round_order(int(k[1]), int(k[0])) > 0))
                         for k, u in zip(round_key, used)], np.int64)
        local = np.arange(last.size)
        held = used[local, last]
        last_key = round_key[local, last]
        newest = None
        for key in last_key[held]:
            newest = int(key) if newest is None or round_order(int(key), newest) > 0 else newest
        allreduce = 0 if newest is None else newest >> 32 & 0xFFFFFFFF
        waiting = held & (last_key >> 32 & 0xFFFFFFFF == allreduce) & (count[local, last] < info.params["world_size"])
        if newest is not None and not waiting.any():
            allreduce = (allreduce + 1) & 0xFFFFFFFF
        sets = np.where(waiting, last, np.where(held, 1 - last, 0))
        stride, offset = self.layout(info.params)
        bits = np.zeros(info.params["pool_size"], np.uint8)
        bits[local * stride + offset] = sets
        return allreduce, np.packbits(bits, bitorder="little").tobytes()

    def _check_params(self, p: dict, rank: int) -> str | None:
        try:
            problem = JobParams(**{k: p[k] for k in ("world_size", "packet_elements", "pool_size", "codec", "seed")},
                                data_mac=bool(p["flags"] & wire.FLAG_DATA_MAC),
                                nearest=bool(p["flags"] & wire.FLAG_NEAREST)).problem(self.max_elements)
        except ValueError as exc:
            problem = str(exc)
        if problem is None and p["flags"] & ~(wire.FLAG_DATA_MAC | wire.FLAG_NEAREST):
            problem = f"unknown JOIN flags 0x{p['flags']:02x}"
        if problem is None and rank >= p["world_size"]:
            problem = f"rank {rank} is out of range for world size {p['world_size']}"
        if problem is None and p["first_core"] + self.cores > (p["total_cores"] or self.cores):
            problem = (f"this aggregator's {self.cores} cores from core {p['first_core']} do not fit the job's "
                       f"{p['total_cores']} cores: every worker must list the same aggregators in the same order")
        return problem

    def _admit(self, job_id: int, params: dict, rank: int) -> str | None:
        """A mode's own refusal of a proved JOIN (one line), or None: every JOIN a plain core's checks pass."""
        return None

    def layout(self, params: dict) -> tuple[int, int]:
        """(stride, offset) of a job on this core: it holds the job's slots s with s % stride == offset."""
        return params["total_cores"], params["first_core"] + self.core


    def _register(self, job_id: int, params: dict, now: float, token_key: bytes,
                  job_nonce: bytes) -> JobInfo | str:
        """A new job's table entry and slot rows, or one line naming the limit that refuses it."""
        if params["pool_size"] > self.max_pool:
            return (f"pool size {params['pool_size']} exceeds this aggregator's maximum of {self.max_pool} slots per "
                    f"job (intml-aggregator --max-pool)")
        stride, offset = self.layout(params)
        needed = len(range(offset, params["pool_size"], stride))
        quota = self._quota(token_key, needed)
        if quota:
            return quota
        free_jobs = np.flatnonzero(~self.jobs.active)
        if free_jobs.size == 0:
            return (f"aggregator core {self.core} already holds its maximum of {self.jobs.active.size} jobs "
                    f"(intml-aggregator --max-jobs); wait for a job to leave or use another aggregator")
        rows = _first_fit(self.row_used, needed)
        if rows is None:
            return (f"aggregator core {self.core} has no free slots for job {job_id}: its pool needs {needed} "
                    f"consecutive slot rows here and {int((~self.row_used).sum())} of {self.row_used.size} are free "
                    f"(intml-aggregator --slots); use a smaller pool or another aggregator")
        j = int(free_jobs[0])
        jobs = self.jobs
        place_job(jobs, self.table, j, rows, world=params["world_size"], value_bits=value_bits(params["world_size"]),
                  packet_elements=params["packet_elements"], pool=params["pool_size"], codec=params["codec"],
                  seed=params["seed"], stride=stride, offset=offset,
                  nearest=bool(params["flags"] & wire.FLAG_NEAREST))
        jobs.group[j] = 0 if self.results_group is None else (self.results_group[0] + j) << 16 | self.results_group[1]
        jobs.last_seen[j] = now
        jobs.data_mac[j] = bool(params["flags"] & wire.FLAG_DATA_MAC)
        jobs.mac_key[j] = key_words(keys.data_key(token_key, job_id, job_nonce))
        self.row_used[rows.start:rows.stop] = True
        self.counters.start_job(j, job_id)  # sets the job's id, then marks it active: the kernel sees it from here
        info = JobInfo(j, params, rows, now, token_key, job_nonce, self._incarnations)
        self.info[job_id] = info
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

    def _session(self, datagram: bytes, job_id: int, rank: int, addr: int, stranger: int) -> JobInfo | None:
        """The job of a LEAVE or STATS_REQUEST from its rank's address with a good MAC under the rank's session
        key; else None, counted as ``stranger`` (``addr`` holds no such rank) or ``drop_bad_mac``."""
        info = self.info.get(job_id)
        if info is None or rank >= MAX_WORLD or int(self.jobs.members[info.index, rank]) != addr:
            self.jobs.core_stats[stranger] += 1
            return None
        session = info.sessions.get(rank)
        if session is None or not keys.verify(session, datagram, len(datagram) - keys.MAC_SIZE):
            self.jobs.core_stats[DROP_BAD_MAC] += 1
            return None
        return info

    def _leave(self, datagram: bytes, job_id: int, rank: int, addr: int, now: float) -> None:
        info = self._session(datagram, job_id, rank, addr, DROP_LEAVE_NON_MEMBER)
        if info is None:
            return
        info.left.add(rank)
        del info.sessions[rank]  # a replay of this LEAVE finds no key
        joined = set(np.flatnonzero(self.jobs.members[info.index, : info.params["world_size"]]).tolist())
        if joined <= info.left:
            self.teardown(job_id, now, LEAVE)

    def teardown(self, job_id: int, now: float | None = None, reason: str = EVICTED) -> None:
        """End a job: free its entry and rows, and keep its final counters in the history. ``reason``: one of
        END_REASONS (``evicted`` when the driver ends it); ``now``: when (default: its last activity)."""
        info = self.info.pop(job_id)
        ended = self._last_activity(info) if now is None else now
        final = self.counters.end_job(info.index, reason)
        self.row_used[info.rows.start:info.rows.stop] = False
        self.history.append({"job": job_id, "params": info.params, "ended": reason, "ended_at": ended,
                             "lasted_s": round(ended - info.joined_at, 3), "counters": _nonzero(final)})

    def _last_activity(self, info: JobInfo) -> float:
        """The job's join, the latest packet of any member or a member's latest keepalive, whichever is later."""
        return max(info.joined_at, float(self.jobs.last_seen[info.index].max()), info.alive_at)

    def handle_timer(self, now: float) -> list[int]:
        """Tear down jobs idle for longer than idle_timeout; returns their ids."""
        idle = [job_id for job_id, info in self.info.items()
                if now - self._last_activity(info) >= self.idle_timeout]
        for job_id in idle:
            self.teardown(job_id, now, IDLE)
        return idle

    def get_timer(self) -> float | None:
        """When handle_timer next has something to do, or None without jobs."""
        if not self.info:
            return None
        return min(self._last_activity(info) for info in self.info.values()) + self.idle_timeout

    # ---- statistics -------------------------------------------------------------------------------------
    def stats(self, now: float, job_id: int = ALL_JOBS) -> dict:
        """The statistics of every job (or of ``job_id``), the finished jobs' history (newest first), how many
        jobs ended for each reason, and the core's counters (docs/protocol.md, "STATS_REQUEST and STATS_REPLY")."""
        jobs = {}
        for jid, info in self.info.items():
            if job_id not in (ALL_JOBS, jid):
                continue
            j, n = info.index, info.params["world_size"]
            members = {r: format_addr(a) for r, a in enumerate(self.jobs.members[j, :n]) if a}
            rows = slice(info.rows.start, info.rows.stop)
            counts, bitmaps = self.table.count[rows], self.table.bitmap[rows]
            stride, offset = self.layout(info.params)
            waiting = np.nonzero((counts > 0) & (counts < n))
            pending = [
                {"slot": int(r) * stride + offset, "shadow": int(x),
                 "missing_ranks": [k for k in range(n) if not int(bitmaps[r, x]) >> k & 1]}
                for r, x in list(zip(*waiting))[:MAX_PENDING_LISTED]
            ]
            jobs[str(jid)] = {
                "params": info.params,
                "members": members,
                "silent_s": {r: round(now - float(self.jobs.last_seen[j, r]), 3) for r in members},
                "left": sorted(info.left),
                "pending": pending,
                "pending_total": int(waiting[0].size),
                "counters": dict(zip(STAT_NAMES, self.counters.job(j).tolist())),
            }
        finished = [{**{k: v for k, v in past.items() if k != "ended_at"},
                     "ended_s_ago": round(now - past["ended_at"], 3)}
                    for past in reversed(self.history) if job_id in (ALL_JOBS, past["job"])]
        return {"core": self.core, "cores": self.cores, "jobs": jobs, "finished": finished,
                "finished_total": dict(zip(END_REASONS, self.counters.finished.tolist())),
                "core_counters": dict(zip(STAT_NAMES, self.counters.totals().tolist()))}

    def _stats_reply(self, datagram: bytes, job_id: int, rank: int, addr: int, now: float) -> bytes | None:
        """Statistics for a credential, MAC'd under it and cut to at most MAX_REPLY_RATIO times the request: a
        member's (its session key) of its own job, an operator's (rank OPERATOR_RANK, any of the core's tokens)
        of every job. Never member addresses or seeds. None (no reply) to anyone else."""
        if rank == OPERATOR_RANK:
            key = next((k for k in self._token_keys if keys.verify(k, datagram, len(datagram) - keys.MAC_SIZE)), None)
            seq = int.from_bytes(datagram[HDR:HDR + OPERATOR_SEQ], "big")
            if (key is None or len(datagram) < HDR + OPERATOR_SEQ + keys.MAC_SIZE
                    or seq <= self._operator_seq.get(key, 0)):  # a forgery, or a replay: not fresh
                self.jobs.core_stats[DROP_BAD_MAC] += 1
                return None
            self._operator_seq[key] = seq
            reply, cuts = self._operator_view(now, job_id)
        else:
            if job_id not in self.info and job_id != ALL_JOBS:  # anyone may learn this (job ids are in DATA packets)
                error = _error(job_id, f"job {job_id} unknown")
                return error if len(error) <= len(datagram) else None
            info = self._session(datagram, job_id, rank, addr, DROP_BAD_MAC)
            if info is None:
                return None
            info.alive_at = now  # a member proved it is alive: the job is not idle
            if len(datagram) == HDR + keys.MAC_SIZE:
                return None  # a keepalive: nothing to answer
            key = info.sessions[rank]
            reply, cuts = self._member_view(job_id, now)
        body = _fit(reply, cuts, MAX_REPLY_RATIO * len(datagram) - HDR - keys.MAC_SIZE)
        out = wire.pack({**_reply_header(job_id, MsgType.STATS_REPLY), "rank": rank}, body + bytes(keys.MAC_SIZE))
        return keys.seal(key, out, len(out) - keys.MAC_SIZE)

    def _member_view(self, job_id: int, now: float) -> tuple[dict, list[Callable[[dict], object]]]:
        """A member's statistics of its job (what WorkerSession.request_stats needs first), and the cuts that
        shorten it, least needed first."""
        job = self.stats(now, job_id)["jobs"][str(job_id)]
        missing = sorted({r for round_ in job["pending"] for r in round_["missing_ranks"]})
        reply = {"core": self.core, "missing": missing, "pending_total": job["pending_total"], "left": job["left"],
                 "silent_s": job["silent_s"], "counters": {k: v for k, v in job["counters"].items() if v}}
        cuts = [lambda r: r.pop("counters"),
                lambda r: r.update(silent_s={k: v for k, v in r["silent_s"].items() if k in missing}),
                lambda r: r.pop("silent_s"), lambda r: r.pop("missing")]
        return reply, cuts

    def _operator_view(self, now: float, job_id: int) -> tuple[dict, list[Callable[[dict], object]]]:
        """The statistics of every job (or of ``job_id``) and of the core, without member addresses or seeds,
        and the cuts that shorten it."""
        reply = self.stats(now, job_id)
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


def _first_fit(used: np.ndarray, size: int) -> range | None:
    """The first run of `size` free rows (an empty range for a job with no slot on this core)."""
    if size == 0:
        return range(0, 0)
    run = 0
    for r in range(used.size):
        run = 0 if used[r] else run + 1
        if run == size:
            return range(r - size + 1, r + 1)
    return None


assert N_STATS == len(STAT_NAMES)
