"""The P4-structured pipeline model: the switch program of p4/*.p4 executed in Python, packet by packet and
pass by pass, from the same tables (p4.entries), registers (p4.layout's widths) and bridged metadata. It is the
executable counterpart of the .p4 files, held bit for bit to the aggregator core (protocol.slot_reference and
the Numba kernel, tests/p4/test_p4_model.py).

Sans-I/O, like the cores: ``receive(datagram, addr, now)`` takes one datagram (None: truncated on receive) and
returns the datagrams to send, ``(bytes, address key)``, in order; control datagrams the meter admits are listed
in ``control`` for the control plane (the switch's CPU port). Counters are the aggregator core's statistics
(protocol.stats.STAT_NAMES), per job index and per core.

Non-finite lanes (docs/arithmetic.md, "Non-finite values"), as the .p4 program: a pass's check also admits the
non-finite codes 0x01-0x03 (int32: the reserved words INT32_MIN + 1..3); such a lane adds 0 and its flags (the
code, or the word - INT32_MIN) go into the per-lane 2-bit register ``lane_flags`` (written on open, ORed on add);
the completing pass emits a lane with flags as its flags' code (int32: word) in place of the re-encoded sum, and
counts it (nonfinite_elements). A job with ``nearest`` re-encodes with the fixed word NEAREST_WORD in place of the
random one (nearest, ties away from zero), as the kernel does.

``receive`` runs a packet's passes back to back; ``enter`` yields after each pass, so that a test can interleave
the passes of several packets (as BMv2's egress threads do: each egress port has its own) or drop a packet
between passes (a full queue). Every pass decides against its own (row, set, pass) state, as a switch must, so
neither changes a round's result: an interleaved completion sends nothing and the ranks' retransmissions read
the complete round; a packet lost between passes is repaired by its retransmission, which adds exactly the passes
that lack its rank.
"""

from __future__ import annotations

from collections import namedtuple
from collections.abc import Iterable, Iterator
from typing import NamedTuple

import numpy as np

from intml.p4.entries import Entry, limit_entries
from intml.p4.extern import RandomSource
from intml.p4.layout import (
    BRIDGED,
    BUCKET_SHIFT,
    CONTROL_TYPES,
    COUNTERS,
    EVENT_CODES,
    HASH_MULTIPLIER,
    JOB_PARAMS,
    LANES_PER_PASS,
    MARK_DEPTH,
    MAX_JOBS,
    MAX_WORLD,
    N_STATS,
    NEAREST_WORD,
    RANK_GROUP_BASE,
    NONZERO,
    SIGN,
    STAT,
    STATE_CODES,
    STEP_ADD,
    STEP_NONE,
    STEP_OPEN,
    STEP_RESEND,
    lane_index,
    lane_ok,
    passes,
)
from intml.p4.tables import Registers, Tables
from intml.protocol.codec import Codec
from intml.protocol.job import ControlLimits
from intml.protocol.packet import owner_range
from intml.protocol.reference import EXP_MAX, EXP_MIN, INT32_NONFINITE
from intml.protocol.slot_reference import ADD, COMPLETE, DROP_DUPLICATE, DROP_STALE, EMPTY, FILLING, OPEN, RESEND
from intml.protocol.stats import STAT_NAMES
from intml.protocol.wire import (
    CONGESTED,
    HAVE_SIZE,
    HEADER,
    HEADER_SIZE,
    MAGIC,
    NO_EXP,
    OWNERS_SHIFT,
    RANK_MASK,
    STORED,
    VERSION,
    MsgType,
)

JOB_TABLES = ("job_table", "membership", "slot_table", "multicast_group", "egress_dest")
ENCODE_B = {f"encode_b{b}": b for b in range(32)}
_STEP_OF = {OPEN: STEP_OPEN, ADD: STEP_ADD, RESEND: STEP_RESEND}
_U32 = 0xFFFFFFFF


Bridged = namedtuple("Bridged", [name for name, _ in BRIDGED])  # the metadata a recirculation carries
Sent = list[tuple[bytes, int]]  # datagrams out, (bytes, destination address key)


class JobHit(NamedTuple):
    """The job table's hit: its action's parameters (layout.JOB_PARAMS) and the codec's lane width."""

    job_index: int
    world: int
    value_bits: int
    pool: int
    packet_elements: int
    value_limit: int
    group: int
    seed: int
    nearest: int
    codec: Codec
    width: int


assert JobHit._fields[:len(JOB_PARAMS)] == tuple(name for name, _ in JOB_PARAMS)


def _int8(bits: int) -> int:
    return bits - 256 if bits & 0x80 else bits


def _serial_event(key: int, current: int) -> str:
    """OLDER, SAME or NEWER: the allreduces in 32-bit serial number order, then chunk + 2**31 unsigned."""
    ahead = ((key >> 32) - (current >> 32)) & _U32
    if ahead:
        return "NEWER" if ahead < 1 << 31 else "OLDER"
    low, cur = key & _U32, current & _U32
    return "NEWER" if low > cur else "OLDER" if low < cur else "SAME"


def _flags_of(lanes: np.ndarray) -> np.ndarray:
    """Each lane's non-finite flags (0: finite): a cnat8 code 0x01-0x03, or an int32 word INT32_MIN + 1..3."""
    if lanes.dtype == np.uint8:
        return np.where((lanes >= 1) & (lanes <= 3), lanes, 0).astype(np.uint8)
    offset = lanes.astype(np.int64) - INT32_NONFINITE
    return np.where((offset >= 1) & (offset <= 3), offset, 0).astype(np.uint8)


class PipelineModel:
    """One switch pipeline (an aggregator core's share of the slots). ``job_counter``/``core_counter``: the
    counter arrays to count into, (jobs, N_STATS) and (N_STATS,) (default: its own)."""

    def __init__(self, random: RandomSource, control_limits: ControlLimits = ControlLimits(),
                 job_counter: np.ndarray | None = None, core_counter: np.ndarray | None = None) -> None:
        self.random = random
        self.tables = Tables()
        self.registers = Registers()
        self.job_counter = np.zeros((MAX_JOBS, N_STATS), np.int64) if job_counter is None else job_counter
        self.core_counter = np.zeros(N_STATS, np.int64) if core_counter is None else core_counter
        assert self.job_counter.size <= COUNTERS["job_counter"] and self.core_counter.size == COUNTERS["core_counter"]
        self.per_burst = control_limits.per_burst  # the driver's cap per received burst (no switch counterpart)
        self.in_burst = 0
        self.control: list[tuple[bytes, int]] = []
        self.last_passes = 0  # the passes the last packet took
        self.tables.install(limit_entries(control_limits))

    # ---- the controller's side ---------------------------------------------------------------------------
    def install(self, entries: Iterable[Entry]) -> None:
        self.tables.install(list(entries))

    def replace_job_entries(self, entries: Iterable[Entry]) -> None:
        """Every job's entries at once (the controller's full view after a JOIN, LEAVE or teardown)."""
        self.tables.clear(JOB_TABLES)
        self.tables.install(list(entries))

    def clear_job(self, index: int, rows: range) -> None:
        """A new job at job index ``index`` on ``rows``: no round in either set of its rows (the aggregator
        core's registration does the same), no packet seen from its ranks."""
        cells = self.registers.cells
        cells["member_seen"][index * MAX_WORLD:(index + 1) * MAX_WORLD] = 0
        index = slice(lane_index(2 * rows.start, 0), lane_index(2 * rows.stop, 0))  # both sets, every pass
        cells["round_key"][index] = np.uint64(2**64 - 1)
        cells["worker_bitmap"][index] = 0
        cells["worker_count"][index] = 0

    def slot_cells(self, name: str, slots: int) -> np.ndarray:
        """A per-(row, set, pass) register's pass-0 cells of the first ``slots`` (row, set)s, by slot index: where
        a round opens first (what the control plane reads as the slot's state)."""
        return self.registers.cells[name][lane_index(0, 0):lane_index(slots, 0):lane_index(1, 0)]

    def counters(self, job_index: int | None = None) -> dict[str, int]:
        """The counters by name (protocol.stats.STAT_NAMES): a job index's, or the core's."""
        cells = self.core_counter if job_index is None else self.job_counter[job_index]
        return dict(zip(STAT_NAMES, cells.tolist()))

    def new_burst(self) -> None:
        """The next datagrams are another received burst (the driver's per-burst control cap restarts)."""
        self.in_burst = 0

    # ---- the packet path -----------------------------------------------------------------------------------
    def receive(self, datagram: bytes | None, addr: int, now: float, queue_depth: int = 0) -> Sent:
        """The packet's passes back to back: the datagrams it sends."""
        return next(sent for sent in self.enter(datagram, addr, now, queue_depth) if sent is not None)

    def enter(self, datagram: bytes | None, addr: int, now: float, queue_depth: int = 0) -> Iterator[Sent | None]:
        """The packet's passes, one per ``next``: None after a pass that recirculates, then the datagrams it sends
        (possibly none) after its last. Interleave several packets' iterators to run their passes as a switch's
        threads may; drop one between passes by no longer advancing it. ``queue_depth``: the packets ahead of its
        result copies in their egress queue (v1model's ``enq_qdepth``); from MARK_DEPTH on, they are marked."""
        self.last_passes = 1
        core = self.core_counter
        core[STAT["packets_in"]] += 1
        reason, h = self._parse(datagram)
        if reason == "control":
            if self._meter(addr, now):
                self.control.append((datagram, addr))
            else:
                core[STAT["drop_control_rate"]] += 1
            yield []
            return
        if reason:
            core[STAT[reason]] += 1
            yield []
            return
        action, params = self.tables.lookup("job_table", (h["job"],))
        if action == "unknown_job":
            core[STAT["drop_unknown_job"]] += 1
            yield []
            return
        job = JobHit(*params, *((Codec.CNAT8, 1) if action == "set_job_cnat8" else (Codec.INT32, 4)))
        counter = self.job_counter[job.job_index]
        counter[STAT["packets_in"]] += 1
        reason, row = self._check(h, addr, len(datagram), job, now)
        if reason:
            counter[STAT[reason]] += 1
            yield []
            return
        yield from self._slot(h, datagram, job, 2 * row + h["shadow"], queue_depth)

    @staticmethod
    def _parse(datagram: bytes | None) -> tuple[str, dict]:
        """The parser and header validation: "" for DATA, "control", or a core drop reason."""
        if datagram is None:
            return "drop_truncated", {}
        if len(datagram) < HEADER_SIZE:
            return "drop_short", {}
        rec = np.frombuffer(datagram, HEADER, count=1)[0]
        h = {name: int(rec[name]) for name in HEADER.names}
        h["owners"], h["rank"] = h["rank"] >> OWNERS_SHIFT, h["rank"] & RANK_MASK  # the parser's two 8-bit fields
        if h["magic"] != MAGIC:
            return "drop_bad_magic", h
        if h["version"] != VERSION:
            return "drop_bad_version", h
        if h["type"] != MsgType.DATA:
            return ("control" if h["type"] in CONTROL_TYPES else "drop_unknown_type"), h
        return "", h

    def _meter(self, addr: int, now: float) -> bool:
        """The control meter: the driver's per-burst cap, then the GCRA buckets of the source's hash and of the
        core, in nanoseconds (a token at t iff max(TAT, t) - t <= tolerance; taking it adds the interval)."""
        _, (source_interval, source_tolerance, core_interval, core_tolerance) = self.tables.lookup("control_limits", ())
        t = round(now * 1e9)
        bucket = (addr * HASH_MULTIPLIER & (2**64 - 1)) >> BUCKET_SHIFT
        regs = self.registers
        source, core = max(regs.read("control_source_tat", bucket), t), max(regs.read("control_core_tat", 0), t)
        if self.in_burst >= self.per_burst or source - t > source_tolerance or core - t > core_tolerance:
            return False
        regs.write("control_source_tat", bucket, source + source_interval)
        regs.write("control_core_tat", 0, core + core_interval)
        self.in_burst += 1
        return True

    def _check(self, h: dict, addr: int, length: int, job: JobHit, now: float) -> tuple[str, int]:
        """Membership, slot, codec, length, shadow and exponent range: (drop reason or "", row)."""
        rank = h["rank"]
        if rank >= job.world:
            return "drop_rank_out_of_range", 0
        if self.tables.lookup("membership", (job.job_index, rank, addr))[0] == "not_member":
            return "drop_unregistered_source", 0
        self.registers.write("member_seen", job.job_index * MAX_WORLD + rank, round(now * 1e6))
        action, params = self.tables.lookup("slot_table", (job.job_index, h["slot"]))
        if action == "slot_out_of_range":
            return "drop_slot_out_of_range", 0
        if h["codec"] != job.codec:
            return "drop_wrong_codec", 0
        if h["count"] > job.packet_elements or length != HEADER_SIZE + job.width * h["count"]:
            return "drop_wrong_count", 0
        if h["shadow"] > 1:
            return "drop_bad_shadow", 0
        if any(e != NO_EXP and not EXP_MIN <= e <= EXP_MAX for e in (h["exp"], h["next_exp"])):
            return "drop_bad_exponent", 0
        if owner_range(h["owners"], job.world)[1] >= job.world:
            return "drop_bad_owner", 0
        return "", params[0]

    def _lanes_ok(self, payload: bytes, job: JobHit, exp: int, pass_no: int) -> bool:
        """LaneCheck: this pass's lanes, before any register is written."""
        lo = pass_no * LANES_PER_PASS * job.width
        chunk = payload[lo:lo + LANES_PER_PASS * job.width]
        if job.codec == Codec.INT32:
            values = np.frombuffer(chunk, ">i4")
            return bool(np.all((values >= -job.value_limit) & (values <= job.value_limit) | (_flags_of(values) > 0)))
        action, (k_limit, _) = self.tables.lookup("data_bound", (job.value_bits, exp & 0xFF))
        codes = np.frombuffer(chunk, np.uint8)
        return action == "set_bound" and bool((lane_ok(codes, k_limit) | (_flags_of(codes) > 0)).all())

    def _slot(self, h: dict, datagram: bytes, job: JobHit, slot_index: int, queue_depth: int) -> Iterator[Sent | None]:
        """The packet's passes: each decides against its own (row, set, pass) state, then runs its lanes; None
        after a pass that recirculates, the datagrams sent (or []) after the last one."""
        bridged = Bridged(pass_no=0, step=STEP_NONE, completes=False, job_index=job.job_index, rank=h["rank"],
                          owners=0, slot_index=slot_index, elements=0, exp=0, next_exp=0, k_finite=0, all_in=True)
        out = bytearray(HEADER_SIZE + job.width * h["count"])
        while True:
            bridged, action, reason, have = self._state(h, datagram[HEADER_SIZE:], job, bridged)
            if reason:
                self.job_counter[job.job_index][STAT[reason]] += 1
                yield []
                return
            out = self._pass(bridged, h, job, datagram[HEADER_SIZE:], out)
            if bridged.pass_no + 1 < passes(bridged.elements):
                self.last_passes += 1
                yield None  # egress recirculates it
                bridged = bridged._replace(pass_no=bridged.pass_no + 1)
                continue
            yield self._forward(bridged, action, h, job, out, queue_depth, datagram, have)
            return

    def _state(self, h: dict, payload: bytes, job: JobHit, bridged: Bridged) -> tuple[Bridged, str, str, int]:
        """WorkerBitmap, WorkerCounter, NextStep, Exponent and LaneCheck for this pass: (bridged, the next_step
        action, a drop reason or "", the pass's bitmap as read: a PENDING's ``have``). A duplicate of this pass goes on to the next one without touching it (its
        rank may be missing from a later pass: a packet lost between passes)."""
        regs, world, cell = self.registers, job.world, lane_index(bridged.slot_index, bridged.pass_no)
        key = h["allreduce"] << 32 | ((h["chunk"] + (1 << 31)) & _U32)
        bit = 1 << h["rank"]
        bitmap, count = regs.read("worker_bitmap", cell), regs.read("worker_count", cell)
        state = EMPTY if bitmap == 0 else COMPLETE if count == world else FILLING
        order = "NEWER" if bitmap == 0 else _serial_event(key, regs.read("round_key", cell))
        event = order if order != "SAME" else "SAME_KNOWN_RANK" if bitmap & bit else "SAME_NEW_RANK"
        action, _ = self.tables.lookup("next_step", (STATE_CODES[state], EVENT_CODES[event]))
        if action == DROP_STALE:
            return bridged, action, "drop_stale", bitmap
        exp = h["exp"]
        if action == ADD:
            mismatch = ("drop_exponent_mismatch" if exp != _int8(regs.read("round_exp", cell))
                        else "drop_wrong_count" if h["count"] != regs.read("round_elements", cell)
                        else "drop_bad_owner" if h["owners"] != regs.read("round_owners", cell) else "")
            if mismatch:
                return bridged, action, mismatch, bitmap
        if action in (OPEN, ADD) and not self._lanes_ok(payload, job, exp, bridged.pass_no):
            return bridged, action, "drop_invalid_code", bitmap
        completes = False
        if action == OPEN:
            regs.write("round_key", cell, key)
            regs.write("round_exp", cell, exp)
            regs.write("round_elements", cell, h["count"])
            regs.write("round_next_exp", cell, h["next_exp"])
            regs.write("round_owners", cell, h["owners"])
            bitmap, count = 0, 0
        elif action == ADD:
            regs.write("round_next_exp", cell, max(_int8(regs.read("round_next_exp", cell)), h["next_exp"]))
        if action in (OPEN, ADD):
            regs.write("worker_bitmap", cell, bitmap | bit)
            regs.write("worker_count", cell, count + 1)
            completes = count + 1 == world
        round_exp = regs.read("round_exp", cell)
        _, (_, k_finite) = self.tables.lookup("data_bound", (job.value_bits, round_exp))
        step = _STEP_OF.get(action, STEP_NONE)
        return bridged._replace(
            step=step, completes=completes, owners=regs.read("round_owners", cell),
            elements=regs.read("round_elements", cell), exp=_int8(round_exp),
            next_exp=_int8(regs.read("round_next_exp", cell)), k_finite=k_finite,
            all_in=bridged.all_in and (completes or step == STEP_RESEND)), action, "", bitmap

    def _forward(self, bridged: Bridged, action: str, h: dict, job: JobHit, out: bytearray, queue_depth: int,
                 datagram: bytes, have: int) -> Sent:
        """The last pass's end: the packet's statistics by its last decision, then the result (a completion or a
        re-send whose every pass put the round's result into the packet), a duplicate's PENDING (the last pass's
        bitmap: Forward's), or nothing."""
        counter = self.job_counter[job.job_index]
        if action in (DROP_DUPLICATE, RESEND):
            counter[STAT["retransmissions"]] += 1
            if action == DROP_DUPLICATE:
                counter[STAT["drop_duplicate_incomplete"]] += 1
                return self._pending(bridged, job, datagram, have)
        else:
            counter[STAT["contributions"]] += 1
            counter[STAT["completions"]] += bridged.completes
        if not bridged.all_in:
            return []  # consumed; or the result is complete in every pass, and retransmissions read it
        if action == RESEND:
            counter[STAT["results_resent"]] += 1
        return self._egress(bridged, h, job, out, queue_depth)

    def _pass(self, bridged: Bridged, h: dict, job: JobHit, payload: bytes, out: bytearray) -> bytearray:
        """One pass over lanes [pass_no * LANES_PER_PASS, ...): add (or write) them into lane_sum and, on the
        contribution that completes this pass's round, re-encode the new sums into lane_code; a re-send reads the
        stored result. The lanes of the result go into ``out``'s payload (resized to the round's elements)."""
        if len(out) != HEADER_SIZE + job.width * bridged.elements:
            out = out[:HEADER_SIZE + job.width * bridged.elements].ljust(HEADER_SIZE + job.width * bridged.elements,
                                                                         b"\0")
        lo = bridged.pass_no * LANES_PER_PASS
        n = min(LANES_PER_PASS, bridged.elements - lo)
        if n <= 0 or bridged.step == STEP_NONE:
            return out
        cell = lane_index(bridged.slot_index, bridged.pass_no)
        sums, codes, flags = (self.registers.cells[name] for name in ("lane_sum", "lane_code", "lane_flags"))
        codec, width = job.codec, job.width
        if bridged.step in (STEP_OPEN, STEP_ADD):
            if codec == Codec.INT32:
                words = np.frombuffer(payload, ">i4", n, width * lo).astype(np.int32)
                lane = _flags_of(words)
                values = np.where(lane > 0, 0, words).astype(np.int32).view(np.uint32)
            else:
                raw = np.frombuffer(payload, np.uint8, n, lo)
                lane = _flags_of(raw)
                hit, values = self.tables.decode(np.where(lane > 0, 0, raw).astype(np.uint8))
                assert hit.all()  # this pass checked its lanes
            new = values if bridged.step == STEP_OPEN else sums[:n, cell] + values  # uint32: wraps as the register
            sums[:n, cell] = new
            flags[:n, cell] = lane if bridged.step == STEP_OPEN else flags[:n, cell] | lane
            if bridged.completes:
                self.job_counter[job.job_index][STAT["nonfinite_elements"]] += int(np.count_nonzero(flags[:n, cell]))
            if bridged.completes and codec == Codec.CNAT8:
                index = (h["chunk"] * job.packet_elements + lo) % (1 << 64)
                encoded = self._encode(new, job, h["allreduce"], index, bridged.k_finite)
                codes[:n, cell] = np.where(flags[:n, cell] > 0, flags[:n, cell], encoded)
        if codec == Codec.INT32:
            lane = flags[:n, cell].astype(np.int64)
            lanes = np.where(lane > 0, INT32_NONFINITE + lane, sums[:n, cell].view(np.int32)).astype(">i4").tobytes()
        else:
            lanes = codes[:n, cell].tobytes()
        out[HEADER_SIZE + width * lo:HEADER_SIZE + width * (lo + n)] = lanes
        return out

    def _encode(self, sums: np.ndarray, job: JobHit, allreduce: int, index: int, k_finite: int) -> np.ndarray:
        """cnat_encode: per lane, the leading one b of |sum| (leading_one), then encode_b<b>: round up iff the top
        b bits of the lane's random word (nearest: NEAREST_WORD) are below the remainder under the leading one."""
        negative = (sums >> np.uint32(31)).astype(np.uint8)
        magnitude = np.where(negative, (~sums + np.uint32(1)), sums).astype(np.uint32)
        words = (np.full(sums.size, NEAREST_WORD, np.uint32) if job.nearest
                 else self.random.words(job.seed, allreduce, index, sums.size))
        counter = self.job_counter[job.job_index]
        out = np.zeros(sums.size, np.uint8)
        for lane, action in enumerate(self.tables.leading_one(magnitude)):
            b = ENCODE_B.get(action)
            if b is None:  # encode_zero
                continue
            remainder = int(magnitude[lane]) & ((1 << b) - 1)
            k = b + (b > 0 and int(words[lane]) >> (32 - b) < remainder)
            counter[STAT["saturated_elements"]] += k > k_finite
            out[lane] = negative[lane] * SIGN | NONZERO | k
        return out

    def _pending(self, bridged: Bridged, job: JobHit, datagram: bytes, have: int) -> Sent:
        """Forward's and the egress's PENDING: the DATA's header with type PENDING and count 0, then ``have``, cut
        there (truncate), back to the one rank; never marked (the mark is a RESULT's)."""
        rec = np.frombuffer(datagram[:HEADER_SIZE], HEADER).copy()
        rec["type"], rec["count"] = int(MsgType.PENDING), 0
        action, dest = self.tables.lookup("egress_dest", (bridged.job_index, bridged.rank))
        if action != "set_dest":
            return []
        self.job_counter[bridged.job_index][STAT["packets_out"]] += 1
        return [(rec.tobytes() + have.to_bytes(HAVE_SIZE, "big"), dest[0])]

    def _egress(self, bridged: Bridged, h: dict, job: JobHit, out: bytearray, queue_depth: int) -> Sent:
        """The RESULT header, then the copies: every replica of the job's multicast group (a completion; a round
        with owners: the job's rank group) or the one rank (a re-send), each destination from egress_dest; a
        replica whose rank is not among the round's owners is truncated to the header with count 0. Every copy
        carries the congestion mark if ``queue_depth`` >= MARK_DEPTH, and a re-send the STORED mark."""
        rec = np.zeros(1, HEADER)
        fields = {"magic": MAGIC, "version": VERSION, "type": int(MsgType.RESULT), "job": h["job"],
                  "allreduce": h["allreduce"], "chunk": h["chunk"], "rank": bridged.owners << OWNERS_SHIFT,
                  "slot": h["slot"], "count": bridged.elements, "codec": int(job.codec),
                  "shadow": h["shadow"] | (CONGESTED if queue_depth >= MARK_DEPTH else 0)
                  | (STORED if bridged.step == STEP_RESEND else 0),
                  "exp": bridged.exp, "next_exp": bridged.next_exp}
        for name, value in fields.items():
            rec[name] = value
        out[:HEADER_SIZE] = rec.tobytes()
        result = bytes(out)
        rec["count"] = 0
        completion = rec.tobytes()  # egress: count = 0, then truncate to the headers
        index = bridged.job_index
        group = index + 1 + (RANK_GROUP_BASE if bridged.owners else 0)
        rids = (bridged.rank,) if bridged.step == STEP_RESEND else self.tables.groups.get(group, ())
        first, last = owner_range(bridged.owners, job.world)
        sent = []
        for rid in rids:
            action, dest = self.tables.lookup("egress_dest", (index, rid))
            if action == "set_dest":
                sent.append((result if not bridged.owners or first <= rid <= last else completion, dest[0]))
        self.job_counter[index][STAT["packets_out"]] += len(sent)
        return sent
