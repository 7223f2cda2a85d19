"""The aggregator's sans-I/O core for one data-plane core: the burst kernel (aggregator.slots) plus the control
plane (join handshake, membership, teardown, statistics). It owns no socket and reads no clock: the driver
hands it a Burst of received datagrams and the time, and sends the Burst it gets back, whose datagrams are the
core's stored results (zero copy, valid until the core's next call), then the control replies of take_replies.

Control plane
    JOIN (job id, rank, world size, packet elements, pool size, codec, seed, token): the first JOIN of a job
    registers it and gives it rows of this core's slot table; later JOINs must carry the same parameters and
    token. A rank is bound to the address it joined from; data from any other address is dropped, and an
    address holds at most one rank of a job. A repeated JOIN from the same address is answered again (the ACK
    may have been lost). Replies: JOIN_ACK (echoing the parameters, with ``cores``) or ERROR with a one-line
    reason. Refused JOINs and LEAVEs from non-members are counted per core.
    LEAVE: the rank is done; when every joined rank has left, the job is torn down and its rows freed.
    A job idle (no accepted packet, no join) for ``idle_timeout`` seconds is torn down too.
    STATS_REQUEST: a JSON STATS_REPLY with per-job counters, members, how long each rank has been silent and
    the rounds still waiting for contributions (with the missing ranks). Job id 0xFFFFFFFF asks for all jobs.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import numpy as np

from intml.aggregator.slots import (
    DROP_BAD_CONTROL,
    DROP_LEAVE_NON_MEMBER,
    DROP_REFUSED_JOIN,
    N_STATS,
    SEND_FAILED,
    STAT_NAMES,
    Jobs,
    Table,
    new_batch,
    new_jobs,
    new_limiter,
    new_table,
    process_burst,
    result_width,
)
from intml.protocol import wire
from intml.protocol.address import addr_of, format_addr
from intml.protocol.arith import value_bits
from intml.protocol.burst import Burst
from intml.protocol.job import (
    AGGREGATOR_IDLE_TIMEOUT,
    AGGREGATOR_MAX_ELEMENTS,
    AGGREGATOR_MAX_JOBS,
    AGGREGATOR_MAX_POOL,
    AGGREGATOR_SLOTS,
    BURST,
    MAX_WORLD,
    ControlLimits,
    JobParams,
)
from intml.protocol.packet import HDR
from intml.protocol.wire import MsgType

ALL_JOBS = 0xFFFFFFFF
MAX_PENDING_LISTED = 32  # keeps a STATS_REPLY well inside one datagram


@dataclass
class JobInfo:
    """Python-side bookkeeping of a job; the kernel's view is its row in Jobs."""

    index: int
    params: dict
    rows: range
    joined_at: float
    left: set[int] = field(default_factory=set)


class AggregatorCore:
    """One data-plane core: slots s with s % cores == core, and the control plane for its share of each job."""

    def __init__(self, *, core: int = 0, cores: int = 1, rows: int = AGGREGATOR_SLOTS,
                 max_elements: int = AGGREGATOR_MAX_ELEMENTS, max_jobs: int = AGGREGATOR_MAX_JOBS,
                 idle_timeout: float = AGGREGATOR_IDLE_TIMEOUT,
                 results_group: tuple[int, int] | None = None, burst: int = BURST,
                 allow_shared_address: bool = False, max_pool: int = AGGREGATOR_MAX_POOL,
                 control_limits: ControlLimits = ControlLimits(),
                 data_mac_key: tuple[int, int] | None = None) -> None:
        """``burst``: the most datagrams a receive burst is expected to hold (a larger one grows the output
        memory). ``results_group`` = (first IPv4 multicast group as an integer, UDP port): job slot j sends its results
        to group + j in one datagram per completion, as a switch's multicast replication does, instead of one
        datagram per worker; retransmitted results still go to the one worker that asked. ``allow_shared_address``
        (tests only) lets one address hold several ranks of a job; otherwise such a JOIN is refused, so that one
        holder of the token cannot stand in for a whole job. ``control_limits``: how many JOIN, LEAVE and
        STATS_REQUEST datagrams the kernel lets through to the control plane (the kernel's control admission). ``data_mac_key`` (tests only, until JOIN derives each
        job's data key): every job registered gets the DATA/RESULT MAC under this key (k0, k1)."""
        if not 0 <= core < cores:
            raise ValueError(f"core must be in [0, {cores}), got {core}")
        if results_group is not None and not (0xE0000000 <= results_group[0] <= 0xF0000000 - max_jobs
                                              and 0 < results_group[1] <= 0xFFFF):
            raise ValueError(f"results group must leave {max_jobs} IPv4 multicast groups (224.0.0.0/4) and a port")
        self.results_group = results_group
        self.allow_shared_address = allow_shared_address
        self.data_mac_key = data_mac_key
        self.core, self.cores = core, cores
        self.max_elements = max_elements
        self.max_pool = max_pool
        self.idle_timeout = idle_timeout
        self.jobs: Jobs = new_jobs(max_jobs)
        self.row_used = np.zeros(rows, np.bool_)
        self.info: dict[int, JobInfo] = {}
        self._limiter = tuple(new_limiter(control_limits))
        self._control_in: list[tuple[bytes, int, float]] = []  # admitted control datagrams not yet handled
        width = result_width(max_elements)
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
        out.count, n_ctl = process_burst(rx.data, rx.length, rx.addr, rx.count, now, self.core, self.cores,
                                         *self._tables, self._batch, self._spill, self._spill_len, out.ptr,
                                         out.length, out.addr, self._control, self._limiter)
        for i in self._control[:n_ctl].tolist():
            self._control_in.append((bytes(rx.data[i, : rx.length[i]]), int(rx.addr[i]), now))
        return out

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
                reply = self._join(datagram, addr, now)
                if reply[wire.OFFSETS["type"]] == MsgType.ERROR:
                    self.jobs.core_stats[DROP_REFUSED_JOIN] += 1
                return reply
            header, _ = wire.unpack(datagram)
            if typ == MsgType.LEAVE:
                self._leave(int(header["job"]), int(header["rank"]), addr)
                return None
            return self._stats_reply(int(header["job"]), now)
        except ValueError as exc:  # a malformed JOIN, LEAVE or STATS_REQUEST: counted, answered, no state change
            self.jobs.core_stats[DROP_BAD_CONTROL] += 1
            return _error(0, str(exc))

    def _join(self, datagram: bytes, addr: int, now: float) -> bytes:
        header, payload = wire.unpack_join(datagram)
        job_id, rank = int(header["job"]), int(header["rank"])
        params = {name: int(payload[name]) for name in ("world_size", "packet_elements", "pool_size", "codec",
                                                         "seed", "token")}
        problem = self._check_params(params, rank)
        if problem:
            return _error(job_id, problem)
        info = self.info.get(job_id)
        if info is None:
            info = self._register(job_id, params, now)
            if isinstance(info, str):  # the limit that was hit
                return _error(job_id, info)
        elif info.params != params:
            differing = ", ".join("token (the shared secret)" if k == "token" else f"{k}={params[k]} (job has {v})"
                                  for k, v in info.params.items() if params[k] != v)
            return _error(job_id, f"job {job_id} already exists with other parameters: {differing}")
        j = info.index
        bound = int(self.jobs.members[j, rank])
        if bound not in (0, addr):
            host, port = addr_of(bound)
            return _error(job_id, f"rank {rank} of job {job_id} is already joined from {host}:{port}")
        held = np.flatnonzero(self.jobs.members[j, : params["world_size"]] == np.uint64(addr))
        others = [int(r) for r in held if r != rank]
        if others and not self.allow_shared_address:
            host, port = addr_of(addr)
            return _error(job_id, f"{host}:{port} already holds rank {others[0]} of job {job_id}; each rank must "
                                  f"join from its own address")
        self.jobs.members[j, rank] = addr
        self.jobs.last_seen[j, rank] = now
        info.left.discard(rank)
        group = int(self.jobs.group[j])
        return wire.pack_join({**_reply_header(job_id, MsgType.JOIN_ACK), "rank": rank},
                              {**params, "cores": self.cores, "group": group >> 16, "group_port": group & 0xFFFF})

    def _check_params(self, p: dict, rank: int) -> str | None:
        try:
            problem = JobParams(**{k: p[k] for k in ("world_size", "packet_elements", "pool_size", "codec", "seed")}
                                ).problem(self.max_elements)
        except ValueError as exc:
            problem = str(exc)
        if problem is None and rank >= p["world_size"]:
            problem = f"rank {rank} is out of range for world size {p['world_size']}"
        return problem

    def _local_pool(self, pool: int) -> int:
        return len(range(self.core, pool, self.cores))

    def _register(self, job_id: int, params: dict, now: float) -> JobInfo | str:
        """A new job's table entry and slot rows, or one line naming the limit that refuses it."""
        if params["pool_size"] > self.max_pool:
            return (f"pool size {params['pool_size']} exceeds this aggregator's maximum of {self.max_pool} slots per "
                    f"job (intml-aggregator --max-pool)")
        free_jobs = np.flatnonzero(~self.jobs.active)
        if free_jobs.size == 0:
            return (f"aggregator core {self.core} already holds its maximum of {self.jobs.active.size} jobs "
                    f"(intml-aggregator --max-jobs); wait for a job to leave or use another aggregator")
        needed = self._local_pool(params["pool_size"])
        rows = _first_fit(self.row_used, needed)
        if rows is None:
            return (f"aggregator core {self.core} has no free slots for job {job_id}: its pool needs {needed} "
                    f"consecutive slot rows here and {int((~self.row_used).sum())} of {self.row_used.size} are free "
                    f"(intml-aggregator --slots); use a smaller pool or another aggregator")
        j = int(free_jobs[0])
        jobs, table = self.jobs, self.table
        jobs.job_id[j] = job_id
        jobs.world[j] = params["world_size"]
        jobs.value_bits[j] = value_bits(params["world_size"])
        jobs.packet_elements[j] = params["packet_elements"]
        jobs.pool[j] = params["pool_size"]
        jobs.codec[j] = params["codec"]
        jobs.seed[j] = np.uint64(params["seed"])
        jobs.row_base[j] = rows.start
        jobs.members[j] = 0
        jobs.group[j] = 0 if self.results_group is None else (self.results_group[0] + j) << 16 | self.results_group[1]
        jobs.last_seen[j] = now
        jobs.stats[j] = 0
        jobs.data_mac[j] = self.data_mac_key is not None
        jobs.mac_key[j] = self.data_mac_key or (0, 0)
        self.row_used[rows.start:rows.stop] = True
        table.round_key[rows.start:rows.stop] = -1  # a fresh job must not see a previous job's rounds
        table.count[rows.start:rows.stop] = 0
        table.bitmap[rows.start:rows.stop] = 0
        jobs.active[j] = True
        info = JobInfo(j, params, rows, now)
        self.info[job_id] = info
        return info

    def _leave(self, job_id: int, rank: int, addr: int) -> None:
        info = self.info.get(job_id)
        if info is None or rank >= MAX_WORLD or int(self.jobs.members[info.index, rank]) != addr:
            self.jobs.core_stats[DROP_LEAVE_NON_MEMBER] += 1
            return
        info.left.add(rank)
        joined = set(np.flatnonzero(self.jobs.members[info.index, : info.params["world_size"]]).tolist())
        if joined <= info.left:
            self.teardown(job_id)

    def teardown(self, job_id: int) -> None:
        info = self.info.pop(job_id)
        self.jobs.active[info.index] = False
        self.row_used[info.rows.start:info.rows.stop] = False

    def _last_activity(self, info: JobInfo) -> float:
        """The job's join or the latest packet of any member, whichever is later."""
        return max(info.joined_at, float(self.jobs.last_seen[info.index].max()))

    def handle_timer(self, now: float) -> list[int]:
        """Tear down jobs idle for longer than idle_timeout; returns their ids."""
        idle = [job_id for job_id, info in self.info.items()
                if now - self._last_activity(info) >= self.idle_timeout]
        for job_id in idle:
            self.teardown(job_id)
        return idle

    def get_timer(self) -> float | None:
        """When handle_timer next has something to do, or None without jobs."""
        if not self.info:
            return None
        return min(self._last_activity(info) for info in self.info.values()) + self.idle_timeout

    # ---- statistics -------------------------------------------------------------------------------------
    def stats(self, now: float, job_id: int = ALL_JOBS) -> dict:
        jobs = {}
        for jid, info in self.info.items():
            if job_id not in (ALL_JOBS, jid):
                continue
            j, n = info.index, info.params["world_size"]
            members = {r: format_addr(a) for r, a in enumerate(self.jobs.members[j, :n]) if a}
            rows = slice(info.rows.start, info.rows.stop)
            counts, bitmaps = self.table.count[rows], self.table.bitmap[rows]
            waiting = np.nonzero((counts > 0) & (counts < n))
            pending = [
                {"slot": int(r) * self.cores + self.core, "shadow": int(x),
                 "missing_ranks": [k for k in range(n) if not int(bitmaps[r, x]) >> k & 1]}
                for r, x in list(zip(*waiting))[:MAX_PENDING_LISTED]
            ]
            jobs[str(jid)] = {
                "params": {k: v for k, v in info.params.items() if k != "token"},
                "members": members,
                "silent_s": {r: round(now - float(self.jobs.last_seen[j, r]), 3) for r in members},
                "left": sorted(info.left),
                "pending": pending,
                "pending_total": int(waiting[0].size),
                "counters": dict(zip(STAT_NAMES, self.jobs.stats[j].tolist())),
            }
        return {"core": self.core, "cores": self.cores, "jobs": jobs,
                "core_counters": dict(zip(STAT_NAMES, self.jobs.core_stats.tolist()))}

    def _stats_reply(self, job_id: int, now: float) -> bytes:
        stats = self.stats(now, job_id)
        body = json.dumps(stats).encode()
        if HDR + len(body) > wire.MAX_DATAGRAM:  # many jobs: keep the counters, drop the per-rank detail
            for job in stats["jobs"].values():
                job.pop("members"), job.pop("silent_s"), job.pop("pending")
            stats["truncated"] = True
            body = json.dumps(stats).encode()[: wire.MAX_DATAGRAM - HDR]
        return wire.pack(_reply_header(job_id, MsgType.STATS_REPLY), body)


def _reply_header(job_id: int, typ: MsgType) -> dict:
    return {"type": int(typ), "job": job_id}


def _error(job_id: int, message: str) -> bytes:
    return wire.pack(_reply_header(job_id, MsgType.ERROR), message.encode())


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
