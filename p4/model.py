"""The P4-structured pipeline model: the switch program of p4/*.p4 executed in Python, packet by packet and
pass by pass, from the same tables (p4.entries), registers (p4.layout's widths) and bridged metadata. It is the
executable counterpart of the .p4 files, held bit for bit to the aggregator core (protocol.slot_reference and
the Numba kernel, tests/p4/test_p4_model.py).

Sans-I/O, like the cores: ``receive(datagram, addr, now)`` takes one datagram (None: truncated on receive) and
returns the datagrams to send, ``(bytes, address key)``, in order; control datagrams the meter admits are listed
in ``control`` for the control plane (the switch's CPU port). Counters are the aggregator core's statistics
(protocol.stats.STAT_NAMES), per job index and per core.

Non-finite lanes (docs/arithmetic.md, "Non-finite values") follow the switch rule the .p4 program is to gain: the
pass-0 check also admits the non-finite codes 0x01-0x03 (int32: the reserved words INT32_MIN + 1..3); such a lane
adds 0 and its flags (the code, or the word - INT32_MIN) go into a per-lane 2-bit register, ``lane_flags`` here
(written on open, ORed on add); the completing pass emits a lane with flags as its flags' code (int32: word) in
place of the re-encoded sum, and counts it (nonfinite_elements).

A packet's passes run back to back here; on a switch other packets' passes interleave. Pass p touches only
the lanes of pass p, and recirculation keeps packets in order, so each pass sees the packets in the order pass 0
did, and the sums and results are the same.
"""

from __future__ import annotations

from collections import namedtuple
from collections.abc import Iterable
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
    MAX_JOBS,
    MAX_WORLD,
    N_STATS,
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
from intml.protocol.wire import HEADER, HEADER_SIZE, MAGIC, NO_EXP, OWNERS_SHIFT, RANK_MASK, VERSION, MsgType

JOB_TABLES = ("job_table", "membership", "slot_table", "multicast_group", "egress_dest")
ENCODE_B = {f"encode_b{b}": b for b in range(32)}
_STEP_OF = {OPEN: STEP_OPEN, ADD: STEP_ADD, RESEND: STEP_RESEND}
_U32 = 0xFFFFFFFF


Bridged = namedtuple("Bridged", [name for name, _ in BRIDGED])  # the metadata a recirculation carries


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
        # the lane_flags register the program is to gain: (lanes, cells) as lane_code's
        self.lane_flags = np.zeros_like(self.registers.cells["lane_code"])
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
        for x in (0, 1):
            index = slice(2 * rows.start + x, 2 * rows.stop, 2)
            cells["round_key"][index] = np.uint64(2**64 - 1)
            cells["worker_bitmap"][index] = 0
            cells["worker_count"][index] = 0

    def counters(self, job_index: int | None = None) -> dict[str, int]:
        """The counters by name (protocol.stats.STAT_NAMES): a job index's, or the core's."""
        cells = self.core_counter if job_index is None else self.job_counter[job_index]
        return dict(zip(STAT_NAMES, cells.tolist()))

    def new_burst(self) -> None:
        """The next datagrams are another received burst (the driver's per-burst control cap restarts)."""
        self.in_burst = 0

    # ---- the packet path -----------------------------------------------------------------------------------
    def receive(self, datagram: bytes | None, addr: int, now: float) -> list[tuple[bytes, int]]:
        self.last_passes = 1
        core = self.core_counter
        core[STAT["packets_in"]] += 1
        reason, h = self._parse(datagram)
        if reason == "control":
            if self._meter(addr, now):
                self.control.append((datagram, addr))
            else:
                core[STAT["drop_control_rate"]] += 1
            return []
        if reason:
            core[STAT[reason]] += 1
            return []
        action, params = self.tables.lookup("job_table", (h["job"],))
        if action == "unknown_job":
            core[STAT["drop_unknown_job"]] += 1
            return []
        job = JobHit(*params, *((Codec.CNAT8, 1) if action == "set_job_cnat8" else (Codec.INT32, 4)))
        counter = self.job_counter[job.job_index]
        counter[STAT["packets_in"]] += 1
        reason, row = self._check(h, addr, len(datagram), job, now)
        if reason:
            counter[STAT[reason]] += 1
            return []
        return self._slot(h, datagram, job, 2 * row + h["shadow"])

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

    def _lanes_ok(self, payload: bytes, job: JobHit, exp: int) -> bool:
        """Pass 0's check of every lane, before any register is written."""
        if job.codec == Codec.INT32:
            values = np.frombuffer(payload, ">i4")
            return bool(np.all((values >= -job.value_limit) & (values <= job.value_limit) | (_flags_of(values) > 0)))
        action, (k_limit, _) = self.tables.lookup("data_bound", (job.value_bits, exp & 0xFF))
        codes = np.frombuffer(payload, np.uint8)
        return action == "set_bound" and bool((lane_ok(codes, k_limit) | (_flags_of(codes) > 0)).all())

    def _slot(self, h: dict, datagram: bytes, job: JobHit, slot_index: int) -> list[tuple[bytes, int]]:
        """The slot's state (pass 0), then the lanes, pass by pass, then the result's egress."""
        regs, counter, world = self.registers, self.job_counter[job.job_index], job.world
        key = h["allreduce"] << 32 | ((h["chunk"] + (1 << 31)) & _U32)
        bit = 1 << h["rank"]
        bitmap, count = regs.read("worker_bitmap", slot_index), regs.read("worker_count", slot_index)
        state = EMPTY if bitmap == 0 else COMPLETE if count == world else FILLING
        order = "NEWER" if bitmap == 0 else _serial_event(key, regs.read("round_key", slot_index))
        event = order if order != "SAME" else "SAME_KNOWN_RANK" if bitmap & bit else "SAME_NEW_RANK"
        action, _ = self.tables.lookup("next_step", (STATE_CODES[state], EVENT_CODES[event]))
        if action == DROP_STALE:
            counter[STAT["drop_stale"]] += 1
            return []
        if action in (DROP_DUPLICATE, RESEND):
            counter[STAT["retransmissions"]] += 1
            if action == DROP_DUPLICATE:
                counter[STAT["drop_duplicate_incomplete"]] += 1
                return []
            counter[STAT["results_resent"]] += 1
        exp = h["exp"]
        if action == ADD:
            mismatch = ("drop_exponent_mismatch" if exp != _int8(regs.read("round_exp", slot_index))
                        else "drop_wrong_count" if h["count"] != regs.read("round_elements", slot_index)
                        else "drop_bad_owner" if h["owners"] != regs.read("round_owners", slot_index) else "")
            if mismatch:
                counter[STAT[mismatch]] += 1
                return []
        payload = datagram[HEADER_SIZE:]
        if action != RESEND and not self._lanes_ok(payload, job, exp):
            counter[STAT["drop_invalid_code"]] += 1
            return []
        completes = False
        if action == OPEN:
            regs.write("round_key", slot_index, key)
            regs.write("round_exp", slot_index, exp)
            regs.write("round_elements", slot_index, h["count"])
            regs.write("round_next_exp", slot_index, h["next_exp"])
            regs.write("round_owners", slot_index, h["owners"])
            bitmap, count = 0, 0
        elif action == ADD:
            regs.write("round_next_exp", slot_index, max(_int8(regs.read("round_next_exp", slot_index)),
                                                         h["next_exp"]))
        if action in (OPEN, ADD):
            regs.write("worker_bitmap", slot_index, bitmap | bit)
            regs.write("worker_count", slot_index, count + 1)
            counter[STAT["contributions"]] += 1
            completes = count + 1 == world
            if completes:
                counter[STAT["completions"]] += 1
        round_exp = regs.read("round_exp", slot_index)
        _, (_, k_finite) = self.tables.lookup("data_bound", (job.value_bits, round_exp))
        bridged = Bridged(pass_no=0, step=_STEP_OF.get(action, STEP_NONE), completes=completes,
                          job_index=job.job_index, rank=h["rank"], owners=regs.read("round_owners", slot_index),
                          slot_index=slot_index, elements=regs.read("round_elements", slot_index),
                          exp=_int8(round_exp), next_exp=_int8(regs.read("round_next_exp", slot_index)),
                          k_finite=k_finite)
        out = bytearray(HEADER_SIZE + job.width * bridged.elements)
        self.last_passes = passes(bridged.elements)
        for pass_no in range(self.last_passes):  # pass 0, then a recirculation per further pass
            self._pass(bridged._replace(pass_no=pass_no), h, job, payload, out)
        if bridged.step != STEP_RESEND and not completes:
            return []  # consumed
        return self._egress(bridged, h, job, out)

    def _pass(self, bridged: Bridged, h: dict, job: JobHit, payload: bytes, out: bytearray) -> None:
        """One pass over lanes [pass_no * LANES_PER_PASS, ...): add (or write) them into lane_sum and, on the
        completing contribution, re-encode the new sums into lane_code; a re-send reads the stored result.
        The lanes of the result go into ``out``'s payload."""
        lo = bridged.pass_no * LANES_PER_PASS
        n = min(LANES_PER_PASS, bridged.elements - lo)
        if n <= 0:
            return
        cell = lane_index(bridged.slot_index, bridged.pass_no)
        sums, codes = self.registers.cells["lane_sum"], self.registers.cells["lane_code"]
        codec, width = job.codec, job.width
        flags = self.lane_flags
        if bridged.step in (STEP_OPEN, STEP_ADD):
            if codec == Codec.INT32:
                words = np.frombuffer(payload, ">i4", n, width * lo).astype(np.int32)
                lane = _flags_of(words)
                values = np.where(lane > 0, 0, words).astype(np.int32).view(np.uint32)
            else:
                raw = np.frombuffer(payload, np.uint8, n, lo)
                lane = _flags_of(raw)
                hit, values = self.tables.decode(np.where(lane > 0, 0, raw).astype(np.uint8))
                assert hit.all()  # pass 0 checked every lane
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

    def _encode(self, sums: np.ndarray, job: JobHit, allreduce: int, index: int, k_finite: int) -> np.ndarray:
        """cnat_encode: per lane, the leading one b of |sum| (leading_one), then encode_b<b>: round up iff the top
        b bits of the lane's random word are below the remainder under the leading one."""
        negative = (sums >> np.uint32(31)).astype(np.uint8)
        magnitude = np.where(negative, (~sums + np.uint32(1)), sums).astype(np.uint32)
        words = self.random.words(job.seed, allreduce, index, sums.size)
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

    def _egress(self, bridged: Bridged, h: dict, job: JobHit, out: bytearray) -> list[tuple[bytes, int]]:
        """The RESULT header, then the copies: every replica of the job's multicast group (a completion; a round
        with owners: the job's rank group) or the one rank (a re-send), each destination from egress_dest; a
        replica whose rank is not among the round's owners is truncated to the header with count 0."""
        rec = np.zeros(1, HEADER)
        fields = {"magic": MAGIC, "version": VERSION, "type": int(MsgType.RESULT), "job": h["job"],
                  "allreduce": h["allreduce"], "chunk": h["chunk"], "rank": bridged.owners << OWNERS_SHIFT,
                  "slot": h["slot"], "count": bridged.elements, "codec": int(job.codec), "shadow": h["shadow"],
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
