"""The aggregator's host mode (docs/protocol.md, "Host mode"): the data path of jobs whose codec no switch can sum
(protocol.codecs.host: variable-length packages, per-package codebooks, sparse indices). It keeps what the burst
kernel keeps, with the same semantics (aggregator.slots: slots of two shadow sets, round keys, contributors
bitmaps and counts, the stored result re-sent to a retransmitting rank, else its PENDING, membership, the
DATA/RESULT MAC, the results multicast group, the counters), but where the kernel adds integer codes, a set here
holds each rank's decoded contribution; when all n are in, the codec combines them in rank order and its result
package goes out. So the result is a pure function of the contributions, bit-identical at every rank whatever the
loss, duplication or order of the packets. Python per packet; a codec's decode and combine are its Numba kernels
(protocol.codecs.host).

``HostModeDataPath`` is what an aggregator core runs by default: the burst kernel for switch-codec jobs and a
``HostDataPath`` for host-codec jobs, behind the one DataPath interface (aggregator.datapath).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
from numba import njit

from intml.aggregator.counters import CoreCounters
from intml.aggregator.datapath import (
    Placed,
    RoundState,
    Slots,
    allocate,
    group_of,
    one_tenant_per_id,
    wire_job,
)
from intml.aggregator.kernel import KernelDataPath, read_only
from intml.aggregator.slots import pending
from intml.protocol.burst import Burst
from intml.protocol.codecs.host import HostCodec
from intml.protocol.job import MAX_WORLD, JobParams
from intml.protocol.packet import HDR, O_JOB, O_MAGIC, O_TYPE, O_VERSION, round_key, round_order
from intml.protocol.siphash import TAG_SIZE, key_words, put_tag, tag_ok
from intml.protocol.stats import (
    COMPLETIONS,
    CONTRIBUTIONS,
    DROP_BAD_EXP,
    DROP_BAD_MAC,
    DROP_BAD_OWNER,
    DROP_BAD_PACKAGE,
    DROP_CODEC,
    DROP_COUNT,
    DROP_DUPLICATE_INCOMPLETE,
    DROP_RANK,
    DROP_SHADOW,
    DROP_SLOT,
    DROP_STALE,
    DROP_UNREGISTERED,
    PACKETS_IN,
    PACKETS_OUT,
    RESULTS_RESENT,
    RETRANSMISSIONS,
)
from intml.protocol.wire import (
    HEADER,
    MAGIC,
    MAX_DATAGRAM,
    NO_EXP,
    OWNERS_SHIFT,
    PENDING_SIZE,
    RANK_MASK,
    VERSION,
    MsgType,
    marked_stored,
    pack,
)


@njit(cache=True)
def round_event(allreduce, chunk, current):
    """The round key of a DATA packet of (allreduce, chunk), and where it stands against a set holding round
    ``current``: -1, 0 or 1 (packet.round_order; compiled once, not per process)."""
    key = round_key(allreduce, chunk)
    return key, round_order(key, current)


@njit(cache=True)
def pending_answer(datagram, have, data_mac, k0, k1):
    """The PENDING that answers DATA ``datagram`` (uint8) of a round that has the ranks ``have``: the burst kernel's
    bytes (aggregator.slots.pending), with the job's tag if ``data_mac``."""
    q = np.zeros(PENDING_SIZE + TAG_SIZE, np.uint8)
    return q[:pending(q, datagram, have, data_mac, k0, k1)]


@dataclass
class HostJob:
    """A host-codec job as its data path holds it."""

    index: int  # its job table entry (the counters' row)
    rows: range
    group: int  # its results group's address key (0: unicast)
    params: JobParams
    codec: HostCodec
    slots: Slots
    mac_key: tuple[np.uint64, np.uint64] | None  # (k0, k1) of its data key, with data_mac
    members: np.ndarray = field(default_factory=lambda: np.zeros(MAX_WORLD, np.uint64))
    last_seen: np.ndarray = field(default_factory=lambda: np.zeros(MAX_WORLD))


class HostDataPath:
    """The slots of the host-codec jobs of a core whose job table and slot rows are ``counters``' (shared with the
    kernel's: ``allocate`` takes entries and rows from it). ``results_group``, ``name``: as KernelDataPath's.

    Per slot row and shadow set: its round key, contributors bitmap and count (RoundState), its round's element
    count, and either each contributor's decoded values (filling) or the RESULT datagram (complete)."""

    marks = False  # a complete slot's RESULT is stored and sent again

    def __init__(self, counters: CoreCounters, *, results_group: tuple[int, int] | None = None,
                 name: str = "this aggregator core") -> None:
        self.counters = counters
        self.results_group, self.name = results_group, name
        rows = counters.rows
        self.round_key = np.full((rows, 2), -1, np.int64)
        self.bitmap = np.zeros((rows, 2), np.uint64)
        self.count = np.zeros((rows, 2), np.int64)
        self.elements = np.zeros((rows, 2), np.int64)
        self.decoded: dict[tuple[int, int], dict[int, np.ndarray]] = {}  # (row, set) -> rank -> values, filling
        self.result: dict[tuple[int, int], bytes] = {}  # (row, set) -> its RESULT datagram, complete
        self.jobs: dict[int, HostJob] = {}  # by job key (aggregator.datapath.job_key)

    # ---- aggregator.datapath.DataPath's job management ---------------------------------------------------------
    def place(self, job: int, params: JobParams, slots: Slots, data_key: bytes, now: float) -> Placed | str:
        found = allocate(self.counters, job, len(slots.of(params.pool_size)), self.name)
        if isinstance(found, str):
            return found
        j, rows = found
        self._clear(rows)
        words = tuple(np.uint64(w) for w in key_words(data_key))  # typed as the kernels' keys are
        placed = HostJob(j, rows, group_of(self.results_group, j), params, params.host_codec, slots,
                         words if params.data_mac else None)
        placed.last_seen[:] = now
        self.jobs[job] = placed
        return Placed(j, rows, placed.group)

    def seat(self, job: int, rank: int, addr: int, now: float) -> None:
        placed = self.jobs[job]
        placed.members[rank] = addr
        placed.last_seen[rank] = now

    def remove(self, job: int) -> None:
        rows = self.jobs.pop(job).rows
        self._clear(rows)
        self.counters.row_used[rows.start:rows.stop] = False

    def round_state(self, job: int) -> RoundState:
        span = slice(self.jobs[job].rows.start, self.jobs[job].rows.stop)
        return RoundState(*(read_only(a[span]) for a in (self.round_key, self.bitmap, self.count)))

    def last_seen(self, job: int) -> np.ndarray:
        return read_only(self.jobs[job].last_seen)

    def _clear(self, rows: range) -> None:
        """Empty the rows' sets: no round of an earlier job may show."""
        self.round_key[rows.start:rows.stop] = -1
        self.bitmap[rows.start:rows.stop] = 0
        self.count[rows.start:rows.stop] = 0
        for row in rows:
            for x in (0, 1):
                self.decoded.pop((row, x), None)
                self.result.pop((row, x), None)

    # ---- DATA -------------------------------------------------------------------------------------------------
    def selects(self, rx: Burst) -> np.ndarray:
        """The indices in ``rx`` of the whole DATA datagrams that name one of this path's jobs by their wire id."""
        n = rx.count
        data, length = rx.data[:n], rx.length[:n]
        whole = (length >= HDR) & (data[:, O_TYPE] == MsgType.DATA) & (data[:, O_VERSION] == VERSION)
        whole &= (data[:, O_MAGIC].astype(np.int64) << 8 | data[:, O_MAGIC + 1]) == MAGIC
        ids = data[:, O_JOB:O_JOB + 4].astype(np.int64) @ np.array([1 << 24, 1 << 16, 1 << 8, 1], np.int64)
        return np.flatnonzero(whole & np.isin(ids, [wire_job(k) for k in self.jobs]))

    def handle(self, datagram: bytes, src: int, now: float) -> list[tuple[bytes, int]]:
        """One DATA datagram of a host job (``selects``) from address key ``src`` at ``now``: through the slot's
        set as the kernel's stages do (aggregator.slots.process_burst), counted by reason when dropped, and in the
        core's packets_in as the kernel counts every datagram. Returns the RESULT (or PENDING) datagrams to send,
        with their destinations."""
        self.counters.core_stats[PACKETS_IN] += 1
        h = dict(zip(HEADER.names, np.frombuffer(datagram, HEADER, count=1)[0].item()))  # Python ints, read once
        rank, owners = h["rank"] & RANK_MASK, h["rank"] >> OWNERS_SHIFT
        placed = self._find(h["job"], rank, src)
        st = self.counters.stats[placed.index]
        st[PACKETS_IN] += 1
        length = len(datagram)
        if placed.mac_key is not None:
            if not tag_ok(np.frombuffer(datagram, np.uint8), length, *placed.mac_key):
                st[DROP_BAD_MAC] += 1
                return []
            length -= TAG_SIZE
        params = placed.params
        slot, count, chunk, x = h["slot"], h["count"], h["chunk"], h["shadow"]
        reason = _validate(placed, rank, src, slot, h["codec"], count, chunk, x, h["exp"],
                           h["next_exp"], owners)
        if reason not in (DROP_RANK, DROP_UNREGISTERED):
            placed.last_seen[rank] = now  # any packet of a member, retransmissions too, keeps the job alive
        if reason:
            st[reason] += 1
            return []
        row, bit = placed.rows.start + slot // placed.slots.stride, 1 << rank
        key, order = round_event(h["allreduce"], chunk, int(self.round_key[row, x]))
        bitmap = int(self.bitmap[row, x])
        order = 1 if bitmap == 0 else int(order)  # an empty set takes any round
        if order < 0:
            st[DROP_STALE] += 1
            return []
        n = params.world_size
        if order == 0 and bitmap & bit:  # a retransmission: the result again if the round is complete, else its
            # PENDING with the ranks the round has (as the kernel answers: protocol.wire)
            st[RETRANSMISSIONS] += 1
            st[PACKETS_OUT] += 1
            if self.count[row, x] < n:
                st[DROP_DUPLICATE_INCOMPLETE] += 1
                k0, k1 = placed.mac_key or (np.uint64(0), np.uint64(0))
                answer = pending_answer(np.frombuffer(datagram, np.uint8), np.uint64(bitmap),
                                        placed.mac_key is not None, k0, k1)
                return [(answer.tobytes(), int(placed.members[rank]))]
            st[RESULTS_RESENT] += 1
            return [(marked_stored(self.result[row, x]), int(placed.members[rank]))]
        if order == 0 and count != self.elements[row, x]:
            st[DROP_COUNT] += 1
            return []
        try:  # the codec's decode returns count float32 values or raises MalformedPackage (its contract)
            values = placed.codec.decode(datagram[HDR:length], count)
        except Exception:  # noqa: BLE001 - a codec breaking its contract on a hostile package must not stop the core
            values = None
        if not isinstance(values, np.ndarray) or values.shape != (count,) or values.dtype != np.float32:
            st[DROP_BAD_PACKAGE] += 1
            return []
        if order > 0:  # a newer round opens the set; the set's old round is over at every rank
            self.round_key[row, x], self.bitmap[row, x], self.count[row, x] = key, 0, 0
            self.elements[row, x] = count
            self.result.pop((row, x), None)
            self.decoded[row, x] = {}
        self.decoded[row, x][rank] = values
        self.bitmap[row, x] |= np.uint64(bit)
        self.count[row, x] += 1
        st[CONTRIBUTIONS] += 1
        if self.count[row, x] < n:
            return []
        return self._complete(placed, row, x, h, count)

    def _find(self, job_id: int, rank: int, src: int) -> HostJob:
        """The job of id ``job_id`` whose seat of ``rank`` is ``src``, else the first of that id (which counts the
        drop), as the kernel's _find_job."""
        named = [placed for key, placed in self.jobs.items() if wire_job(key) == job_id]
        return next((p for p in named if rank < MAX_WORLD and p.members[rank] == src), named[0])

    def _complete(self, placed: HostJob, row: int, x: int, h: dict[str, int], count: int) -> list[tuple[bytes, int]]:
        """The round of (row, set x) has every contribution: combine them in rank order, store the RESULT datagram
        (the same bytes for every rank and every re-send) and send it to every rank."""
        st = self.counters.stats[placed.index]
        contributions = self.decoded.pop((row, x))
        codec = placed.codec
        package = codec.encode_result(codec.combine([contributions[r] for r in range(placed.params.world_size)]))
        header = {name: h[name] for name in ("job", "allreduce", "chunk", "slot", "shadow")}
        datagram = pack({**header, "type": MsgType.RESULT, "rank": 0, "count": count, "codec": h["codec"],
                         "exp": NO_EXP, "next_exp": NO_EXP}, package + bytes(TAG_SIZE if placed.mac_key else 0))
        if len(datagram) > MAX_DATAGRAM:
            st[DROP_BAD_PACKAGE] += 1  # the codec made a result no datagram holds: the ranks time out on it
            return []
        if placed.mac_key is not None:  # tagged once, here, as the kernel does
            buf = np.frombuffer(datagram, np.uint8).copy()
            put_tag(buf, len(datagram) - TAG_SIZE, *placed.mac_key)
            datagram = buf.tobytes()
        self.result[row, x] = datagram
        st[COMPLETIONS] += 1
        if placed.group:  # one datagram to the job's multicast group reaches every rank
            dests = [placed.group]
        else:
            dests = [int(a) for a in placed.members[:placed.params.world_size]]
        st[PACKETS_OUT] += len(dests)
        return [(datagram, dest) for dest in dests]


def _validate(placed: HostJob, rank: int, src: int, slot: int, codec: int, count: int, chunk: int, shadow: int,
              exp: int, next_exp: int, owners: int) -> int:
    """The checks of a host DATA packet against its job, in the kernel's order (aggregator.slots.validate): 0 or
    the statistic of the drop reason. A host round has no exponents, no owners and no bootstrap chunk."""
    params = placed.params
    if rank >= params.world_size:
        return DROP_RANK
    if int(placed.members[rank]) != src:
        return DROP_UNREGISTERED
    if slot >= params.pool_size or slot % placed.slots.stride != placed.slots.offset:
        return DROP_SLOT
    if codec != params.codec:
        return DROP_CODEC
    if not 0 < count <= params.packet_elements or chunk < 0:
        return DROP_COUNT
    if shadow > 1:
        return DROP_SHADOW
    if exp != NO_EXP or next_exp != NO_EXP:
        return DROP_BAD_EXP
    if owners:
        return DROP_BAD_OWNER
    return 0


class HostModeDataPath(KernelDataPath):
    """An aggregator core's data path: the burst kernel (options as KernelDataPath's) for switch-codec jobs, and a
    HostDataPath (``host``) on the same job table, slot rows and counters for host-codec jobs. The job a DATA
    datagram names routes it (``HostDataPath.selects``): a burst without host-job DATA goes to the kernel as it is;
    otherwise the kernel gets a burst of the other datagrams and the host path then handles its own, in order. A job
    id runs in one mode at a time (the kernel would count another mode's DATA)."""

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        self.host = HostDataPath(self.counters, results_group=self.results_group, name=self.name)

    def refuse(self, job: int, params: JobParams, slots: Slots, rank: int) -> str | None:
        if params.host_codec is None:
            return one_tenant_per_id(self.host.jobs, job, f"{self.name}'s host mode") or super().refuse(
                job, params, slots, rank)
        return one_tenant_per_id(self.placed, job, f"{self.name}'s burst kernel")

    def place(self, job: int, params: JobParams, slots: Slots, data_key: bytes, now: float) -> Placed | str:
        if params.host_codec is None:
            return super().place(job, params, slots, data_key, now)
        return self.host.place(job, params, slots, data_key, now)

    def seat(self, job: int, rank: int, addr: int, now: float) -> None:
        if job in self.host.jobs:
            self.host.seat(job, rank, addr, now)
        else:
            super().seat(job, rank, addr, now)

    def remove(self, job: int) -> None:
        if job in self.host.jobs:
            self.host.remove(job)
        else:
            super().remove(job)

    def round_state(self, job: int) -> RoundState:
        return self.host.round_state(job) if job in self.host.jobs else super().round_state(job)

    def last_seen(self, job: int) -> np.ndarray:
        return self.host.last_seen(job) if job in self.host.jobs else super().last_seen(job)

    def process(self, rx: Burst, now: float) -> tuple[Burst, np.ndarray]:
        rows = self.host.selects(rx) if self.host.jobs else np.zeros(0, np.int64)
        if rows.size == 0:
            return super().process(rx, now)
        others = np.setdiff1d(np.arange(rx.count), rows)
        out, control = super().process(rows_of_burst(rx, others), now)
        results = out.datagrams()
        for i in rows.tolist():
            results += self.host.handle(rx.data[i, :rx.length[i]].tobytes(), int(rx.addr[i]), now)
        merged = Burst.rows_of(len(results), max((len(d) for d, _ in results), default=HDR))
        merged.fill(results)
        return merged, others[control]


def rows_of_burst(rx: Burst, rows: np.ndarray) -> Burst:
    """A receive burst of rows ``rows`` of ``rx``, in that order (their bytes copied, up to the longest's length)."""
    lengths = rx.length[rows]
    width = max(int(lengths.max(initial=0)), 1)
    burst = Burst.rows_of(rows.size, width)
    burst.data[:rows.size] = rx.data[rows, :width]
    burst.length[:rows.size], burst.addr[:rows.size], burst.count = lengths, rx.addr[rows], rows.size
    return burst
