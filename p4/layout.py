"""The switch pipeline's layout: every constant, register, table, action and bridged field that the P4 program
(p4/*.p4, written by p4.generate) and its Python model (p4.model) share, derived from ``intml.protocol`` where
the protocol defines the number. The names here are stable: the generator renders them as they are.

Passes. A DATA packet of ``count`` elements takes ``passes(count) = max(1, ceil(count / LANES_PER_PASS))``
passes through the pipeline (v1model ``recirculate_preserving_field_list`` between them, carrying ``BRIDGED``).
Pass p handles lanes [p * LANES_PER_PASS, (p + 1) * LANES_PER_PASS) of the payload with the same
LANES_PER_PASS register arrays, indexed by ``lane_index(slot_index, p)``: each array holds MAX_PASSES entries per
(row, shadow set), as SwitchML folds its passes into the register index. A packet of at most LANES_PER_PASS
elements takes one pass.

Pass 0 alone judges the packet: header, job, membership, slot, codec, length, shadow, exponent range, then
*every* lane of the payload (``lane_ok``: stateless compares, MAX_LANES of them, generated; no register is
touched), and only then reads and writes the slot's state (round key, bitmap, count, exponents, elements) and the
lanes of pass 0. So a packet with an invalid code in any pass is dropped (``drop_invalid_code``) before any
register changes, as the aggregator core drops it. Later passes only add (or, on a re-send, read) their lanes.

C_nat decode and its bound. A lane's code becomes ±2**k in the slot's unit through the 256-entry exact table
``cnat_decode`` (one per lane of a pass: a table is applied once per control path). Which k a DATA code may hold
depends on the chunk's exponent and s(n) (protocol.arith.data_k_max): the exact table ``data_bound`` keyed by
(value bits s(n), exp) gives ``k_limit = data_k_max + 1`` (0: only the code 0, an all-zero chunk) and
``k_finite`` (the largest result k that decodes to a finite float32, clamped to the 6-bit field). A code passes
iff it is 0, or has the NONZERO bit and k < k_limit (``lane_ok``). An int32 lane passes iff it lies in
[-value_limit, value_limit], value_limit = 2**s(n) from the job table.

C_nat encode (only on the completing contribution; int32 mode stores and sends the sums). Per lane, the leading
one b of |sum| comes from the 32-entry ternary table ``leading_one`` (entry b: value 1 << b, mask
0xFFFFFFFF << b; no entry matches 0, whose default action gives the code 0); its action ``encode_b<b>`` (constant
shifts only) rounds up iff the top b bits of the lane's random word are below the remainder |sum| - 2**b
(protocol.arith._sum_code, probability remainder / 2**b), then writes sign | NONZERO | k into ``lane_code``, the
8-bit result register every re-send reads. A lane with k > k_finite counts ``saturated_elements``.

Reduce-scatter (docs/protocol.md, "Reduce-scatter"). The parser splits the wire's 16-bit ``rank`` into two 8-bit
fields, ``owners`` (the high byte: the chunk's owners code, 0 = every rank) and ``rank`` (the low byte); the wire is
unchanged. Pass 0 drops a code whose last owner is >= n (``drop_bad_owner``, after the exponent range); the round
keeps its opener's code in ``round_owners``, and an add with another code is ``drop_bad_owner`` (after the
exponent and element count). A completion of a round with owners leaves through the job's rank group
(``RANK_GROUP_BASE + job_index + 1``: one replica per rank, even for a job with a results group: each rank must
learn that the round completed), a re-send through the requester's port; in egress each replica whose rank is
not among the round's owners is truncated to the RESULT header with count 0 (the header-only completion).

Slot state. ``slot_index = 2 * row + shadow``; every pass of a packet keeps its own state, in registers indexed
by ``lane_index(slot_index, pass_no)`` as the lanes are, and decides again: a pass never trusts what an earlier
pass decided, since another packet's passes may have run in between (on BMv2 each egress port has its thread), and
a packet lost between passes leaves later passes without its bit, so its retransmission adds exactly the passes it
missed. The result leaves at the last pass if every pass put the round's result into the packet (``all_in``);
otherwise the round is complete and the ranks' retransmissions read it. The state is EMPTY (bitmap
0), COMPLETE (count = n) or FILLING; the event is OLDER / SAME_NEW_RANK / SAME_KNOWN_RANK / NEWER
(aggregator.slots' codes: serial-number order on the allreduce, then chunk + 2**31 unsigned, then the rank's
bit); the exact table ``next_step`` maps (state, event) to the action, its entries written from
protocol.slot_reference.TRANSITIONS.

Jobs. ``job_table`` (job id → job index and parameters, action per codec: its constant width), ``membership``
((job index, rank, source address key) → the worker's bit; a miss with rank < n is an unregistered source),
``slot_table`` ((job index, slot) → row; a miss is a slot out of range: slots of other cores, or beyond the pool,
have no entry, so no modulo is needed). Results leave through the v1model multicast group ``job_index + 1`` with
one replica per rank (egress_rid = rank) or one replica (GROUP_RID) for the job's results group (a round with owners:
the rank group above); ``egress_dest``
((job index, rid) → destination address key) rewrites the destination. A re-send goes to ``egress_dest``
(job index, rank) alone.

Control datagrams (JOIN, LEAVE, STATS_REQUEST) go to the CPU port through the control meter: two GCRA buckets
kept as theoretical arrival times in nanoseconds (``control_source_tat`` indexed by the Fibonacci hash's top
bits of the source address key, ``control_core_tat``), their intervals and tolerances set by the controller in
the keyless table ``control_limits``. The aggregator core's per-received-burst cap has no switch counterpart (a
switch sees no bursts); the model's driver applies it per received burst.

Counters are the aggregator core's statistics (protocol.stats.STAT_NAMES): ``job_counter`` indexed by
``job_index * N_STATS + stat``, ``core_counter`` by ``stat``.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from intml.protocol import reference
from intml.protocol.cnat import K_MAX, K_MASK, NONZERO, SIGN
from intml.protocol.codec import Codec
from intml.protocol.job import (
    AGGREGATOR_MAX_JOBS,
    AGGREGATOR_SLOTS,
    CONTROL_SOURCE_BUCKETS,
    MAX_WORLD,
)
from intml.protocol.slot_reference import COMPLETE, EMPTY, FILLING, TRANSITIONS
from intml.protocol.stats import N_STATS, NEWER, OLDER, SAME_KNOWN_RANK, SAME_NEW_RANK, STAT_NAMES
from intml.protocol.wire import (
    HAVE_SIZE,
    CONGESTED,
    HEADER_FIELDS,
    HEADER_SIZE,
    MAGIC,
    MARK_FRACTION,
    NO_EXP,
    STORED,
    VERSION,
    MsgType,
)

# ---- sizes ---------------------------------------------------------------------------------------------------
LANES_PER_PASS = 64  # elements one pass aggregates: SwitchML's 32 processors x 2 values
MAX_PAYLOAD_BYTES = 1024  # the largest payload the switch parses: 1 KB of lanes
MAX_LANES = {codec: MAX_PAYLOAD_BYTES // codec.bytes_per_element for codec in Codec}  # 1024 codes, 256 int32
MAX_PASSES = math.ceil(max(MAX_LANES.values()) / LANES_PER_PASS)  # 16
ROWS = AGGREGATOR_SLOTS  # slot rows of the switch (the aggregator core's default table)
SETS = 2  # shadow sets per row
SLOT_ENTRIES = ROWS * SETS  # entries of each per-(row, set) register
LANE_ENTRIES = SLOT_ENTRIES * MAX_PASSES  # entries of each per-lane register array
MAX_JOBS = AGGREGATOR_MAX_JOBS
MEMBER_ENTRIES = MAX_JOBS * MAX_WORLD
GROUP_RID = 0xFFFF  # the replica id of a job's results group (ranks use rid = rank < MAX_WORLD)
RANK_GROUP_BASE = AGGREGATOR_MAX_JOBS  # mcast_grp RANK_GROUP_BASE + job index + 1: a replica per rank
ADDR_BITS = 48  # an address key: IPv4 << 16 | UDP port (protocol.address)
TIMESTAMP_BITS = 48  # v1model's ingress_global_timestamp, microseconds
VALUE_BITS = tuple(sorted({reference.value_bits(n) for n in range(1, MAX_WORLD + 1)}))  # s(n) of every world
DATA_K_MAX = max(VALUE_BITS)  # the largest k a DATA code may ever hold (s(1) = 30)
EXPONENTS = (NO_EXP, *range(reference.EXP_MIN, reference.EXP_MAX + 1))  # the exp values data_bound keys on
HASH_MULTIPLIER = 0x9E3779B97F4A7C15  # the control meter's Fibonacci hash (aggregator.slots.source_bucket)
BUCKET_SHIFT = 64 - (CONTROL_SOURCE_BUCKETS.bit_length() - 1)
FLAG_BITS = 2  # a lane's non-finite flags (docs/arithmetic.md, "Non-finite values"): +Inf, -Inf; both: NaN
FLAG_CODES = range(1, 1 << FLAG_BITS)  # C_nat: the codes 0x01-0x03 carry a lane's flags (the NONZERO bit clear)
NONFINITE_WORD = 1 << 31  # int32 mode: the word INT32_MIN + flags carries a lane's flags (its top 30 bits are these)
NEAREST_WORD = 2**31 - 1  # the fixed random word of nearest rounding (protocol.arith.sum_to_codes_kernel)
# The congestion mark (docs/window.md): a RESULT copy that finds its egress queue at MARK_DEPTH packets or more leaves
# with CONGESTED set in its shadow byte. The software aggregator's rule, a quarter of the buffer, in packets of
# BMv2's egress queue (simple_switch: 64 packets per port): room for a round trip's results before it drops.
EGRESS_QUEUE_PACKETS = 64
MARK_DEPTH = EGRESS_QUEUE_PACKETS // MARK_FRACTION

# ---- the next-step table's codes -----------------------------------------------------------------------------
STATE_CODES = {EMPTY: 0, FILLING: 1, COMPLETE: 2}
EVENT_CODES = {"OLDER": OLDER, "SAME_NEW_RANK": SAME_NEW_RANK, "SAME_KNOWN_RANK": SAME_KNOWN_RANK, "NEWER": NEWER}
STATE_BITS = 2
EVENT_BITS = 2
# the pass-0 decision carried to later passes (bridged ``step``)
STEP_NONE, STEP_OPEN, STEP_ADD, STEP_RESEND = 0, 1, 2, 3
STEP_BITS = 2
NEXT_STEP_ACTIONS = tuple(dict.fromkeys(TRANSITIONS.values()))  # open, add, drop_stale, ... (the action names)

# ---- drop reasons: the statistic each is counted under -------------------------------------------------------
STAT = {name: index for index, name in enumerate(STAT_NAMES)}
DROP_CODES = {name: index for name, index in STAT.items() if name.startswith("drop_")}
CORE_SCOPE = ("drop_truncated", "drop_short", "drop_bad_magic", "drop_bad_version", "drop_unknown_type",
              "drop_unknown_job", "drop_control_rate")  # counted in core_counter; the rest per job


# ---- registers -----------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Register:
    """A register array: ``entries`` cells of ``width`` bits. ``lanes`` > 0: one array per lane of a pass,
    named ``<name>_<lane>``."""

    name: str
    entries: int
    width: int
    lanes: int = 0
    doc: str = ""


REGISTERS = (
    Register("round_key", LANE_ENTRIES, 64, doc="allreduce << 32 | (chunk + 2**31) of the set's round"),
    Register("worker_bitmap", LANE_ENTRIES, MAX_WORLD, doc="bit r: rank r contributed to the round; 0: EMPTY"),
    Register("worker_count", LANE_ENTRIES, 8, doc="contributions to the round (n: COMPLETE)"),
    Register("round_exp", LANE_ENTRIES, 8, doc="the round's agreed exponent (int8 bits)"),
    Register("round_next_exp", LANE_ENTRIES, 8, doc="max of the contributions' next_exp (int8 bits)"),
    Register("round_elements", LANE_ENTRIES, 16, doc="the round's element count"),
    Register("round_owners", LANE_ENTRIES, 8, doc="the round's owners code (0: every rank)"),
    Register("lane_sum", LANE_ENTRIES, 32, LANES_PER_PASS, doc="the lane's 32-bit sum (int32 mode: the result)"),
    Register("lane_code", LANE_ENTRIES, 8, LANES_PER_PASS, doc="C_nat: the lane's result code, for re-sends"),
    Register("lane_flags", LANE_ENTRIES, FLAG_BITS, LANES_PER_PASS,
             doc="the lane's non-finite flags, ORed over the contributions (1: +Inf, 2: -Inf, 3: NaN)"),
    Register("member_seen", MEMBER_ENTRIES, TIMESTAMP_BITS, doc="last packet of (job index, rank), microseconds"),
    Register("member_mac", MEMBER_ENTRIES, 48,
             doc="(job index, rank)'s Ethernet address, from its packets: each result copy's destination"),
    Register("control_source_tat", CONTROL_SOURCE_BUCKETS, 64, doc="GCRA TAT of a source-hash bucket, ns"),
    Register("control_core_tat", 1, 64, doc="GCRA TAT of the core's bucket, ns"),
)
REGISTER = {r.name: r for r in REGISTERS}

COUNTERS = {"job_counter": MAX_JOBS * N_STATS, "core_counter": N_STATS}  # name -> cells (packets, or elements)


# ---- tables --------------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Key:
    field: str  # a header field (hdr.intml.<name>), a metadata field (meta.<name>) or a lane's (lane.<name>)
    width: int
    match: str = "exact"


@dataclasses.dataclass(frozen=True)
class Action:
    name: str
    params: tuple[tuple[str, int], ...] = ()  # (name, width)


@dataclasses.dataclass(frozen=True)
class Table:
    """A match-action table. ``lanes`` > 0: one copy per lane of a pass, named ``<name>_<lane>`` (same entries).
    ``const``: the generator writes its entries into the .p4 (``const entries``); else the controller does."""

    name: str
    keys: tuple[Key, ...]
    actions: tuple[Action, ...]
    default: str
    size: int
    const: bool
    lanes: int = 0


JOB_PARAMS = (("job_index", 8), ("world", 8), ("value_bits", 8), ("pool", 16), ("packet_elements", 16),
              ("value_limit", 32), ("group", ADDR_BITS), ("seed", 64), ("nearest", 1))
DATA_BOUND_ENTRIES = len(VALUE_BITS) * len(EXPONENTS)
ENCODE_ACTIONS = tuple(Action(f"encode_b{b}") for b in range(32))

TABLES = (
    Table("job_table", (Key("hdr.intml.job", 32),),
          (Action("set_job_cnat8", JOB_PARAMS), Action("set_job_int32", JOB_PARAMS), Action("unknown_job")),
          "unknown_job", MAX_JOBS, const=False),
    Table("membership", (Key("meta.job_index", 8), Key("hdr.intml.rank", 8), Key("meta.src_addr", ADDR_BITS)),
          (Action("set_worker", (("worker_bit", MAX_WORLD),)), Action("not_member")),
          "not_member", MEMBER_ENTRIES, const=False),
    Table("slot_table", (Key("meta.job_index", 8), Key("hdr.intml.slot", 16)),
          (Action("set_row", (("row", 16),)), Action("slot_out_of_range")),
          "slot_out_of_range", ROWS, const=False),
    Table("data_bound", (Key("meta.value_bits", 8), Key("hdr.intml.exp", 8)),
          (Action("set_bound", (("k_limit", 8), ("k_finite", 8))), Action("no_bound")),
          "no_bound", DATA_BOUND_ENTRIES, const=True),
    Table("next_step", (Key("meta.state", STATE_BITS), Key("meta.event", EVENT_BITS)),
          tuple(Action(a) for a in NEXT_STEP_ACTIONS), "drop_stale", len(TRANSITIONS), const=True),
    Table("cnat_decode", (Key("lane.code", 8),),
          (Action("decode", (("value", 32),)), Action("invalid_code")),
          "invalid_code", 256, const=True, lanes=LANES_PER_PASS),
    Table("leading_one", (Key("lane.magnitude", 32, "ternary"),),
          (*ENCODE_ACTIONS, Action("encode_zero")), "encode_zero", 32, const=True, lanes=LANES_PER_PASS),
    Table("egress_dest", (Key("meta.job_index", 8), Key("meta.rid", 16)),
          (Action("set_dest", (("addr", ADDR_BITS),)), Action("no_dest")),
          "no_dest", MEMBER_ENTRIES + MAX_JOBS, const=False),
    Table("control_limits", (),
          (Action("set_limits", (("source_interval", 64), ("source_tolerance", 64), ("core_interval", 64),
                                 ("core_tolerance", 64))),),
          "set_limits", 1, const=False),
)
TABLE = {t.name: t for t in TABLES}
MULTICAST_GROUPS = 2 * MAX_JOBS  # v1model mcast_grp: job index + 1, and the rank groups; replicas by the controller


# ---- bridged metadata (carried across recirculations) --------------------------------------------------------
BRIDGED = (
    ("pass_no", 8),  # this pass's number, 0 first
    ("step", STEP_BITS),  # this pass's decision: STEP_OPEN / STEP_ADD (contribute), STEP_RESEND or STEP_NONE
    ("completes", 1),  # this pass's contribution completes the pass's round: encode and store the result
    ("job_index", 8),
    ("rank", 8),  # the sender's rank (a re-send's destination)
    ("owners", 8),  # the round's owners code: which replicas carry the payload
    ("slot_index", 16),  # 2 * row + shadow
    ("elements", 16),  # the round's element count (the result's count and its passes)
    ("exp", 8),  # the round's exponent and next_exp, for the RESULT header
    ("next_exp", 8),
    ("k_finite", 8),  # from data_bound: result lanes with k above it count saturated_elements
    ("all_in", 1),  # every pass so far put the round's result into the packet (completed it, or read it)
)


# ---- the wire, as the parser sees it -------------------------------------------------------------------------
RANK_SPLIT = (("owners", 8, False), ("rank", 8, False))  # the wire's u16 rank: owners code (high byte), rank
INTML_HEADER = tuple(field for name, code, _ in HEADER_FIELDS for field in
                     (RANK_SPLIT if name == "rank" else [(name, 8 * int(code[-1]), code[-2] == "i")]))
# (field, bits, signed), wire order
HEADER_BYTES = HEADER_SIZE
CONTROL_TYPES = (int(MsgType.JOIN), int(MsgType.LEAVE), int(MsgType.STATS_REQUEST))
CONSTANTS = {  # what every .p4 file may name (``#define`` / ``const``), with its value
    "MAGIC": MAGIC, "VERSION": VERSION, "TYPE_DATA": int(MsgType.DATA), "TYPE_RESULT": int(MsgType.RESULT), "TYPE_PENDING": int(MsgType.PENDING),
    "TYPE_JOIN": int(MsgType.JOIN), "TYPE_LEAVE": int(MsgType.LEAVE), "TYPE_STATS_REQUEST": int(MsgType.STATS_REQUEST),
    "CODEC_CNAT8": int(Codec.CNAT8), "CODEC_INT32": int(Codec.INT32), "NO_EXP": NO_EXP,
    "EXP_MIN": reference.EXP_MIN, "EXP_MAX": reference.EXP_MAX, "HEADER_BYTES": HEADER_SIZE,
    "HAVE_BYTES": HAVE_SIZE, "LANES_PER_PASS": LANES_PER_PASS, "MAX_PASSES": MAX_PASSES,
    "MAX_PAYLOAD_BYTES": MAX_PAYLOAD_BYTES,
    "MAX_LANES_CNAT8": MAX_LANES[Codec.CNAT8], "MAX_LANES_INT32": MAX_LANES[Codec.INT32],
    "ROWS": ROWS, "SLOT_ENTRIES": SLOT_ENTRIES, "LANE_ENTRIES": LANE_ENTRIES, "MAX_JOBS": MAX_JOBS,
    "MAX_WORLD": MAX_WORLD, "N_STATS": N_STATS, "GROUP_RID": GROUP_RID, "RANK_GROUP_BASE": RANK_GROUP_BASE, "SIGN": SIGN, "NONZERO": NONZERO,
    "K_MASK": K_MASK, "K_MAX": K_MAX, "NONFINITE_WORD": NONFINITE_WORD, "NEAREST_WORD": NEAREST_WORD,
    "MARK_DEPTH": MARK_DEPTH, "CONGESTED": CONGESTED, "STORED": STORED,
    "CONTROL_SOURCE_BUCKETS": CONTROL_SOURCE_BUCKETS, "BUCKET_SHIFT": BUCKET_SHIFT,
    "STEP_NONE": STEP_NONE, "STEP_OPEN": STEP_OPEN, "STEP_ADD": STEP_ADD, "STEP_RESEND": STEP_RESEND,
    **{f"STATE_{s}": c for s, c in STATE_CODES.items()}, **{f"EVENT_{e}": c for e, c in EVENT_CODES.items()},
    **{f"STAT_{name.upper()}": index for name, index in STAT.items()},
}


def passes(count: int) -> int:
    """Passes a packet of ``count`` elements takes (one at least: the judging pass)."""
    return max(1, -(-count // LANES_PER_PASS))


def lane_index(slot_index: int, pass_no: int) -> int:
    """The cell of a (row, set)'s lanes of pass ``pass_no`` in every per-lane register array."""
    return slot_index * MAX_PASSES + pass_no


def lane_ok(code: int | np.ndarray, k_limit: int) -> bool | np.ndarray:
    """A C_nat lane (or each of an array of lanes) passes the pass-0 check: code 0, or the NONZERO bit and
    k < k_limit."""
    return (code == 0) | (((code & NONZERO) != 0) & ((code & K_MASK) < k_limit))


def refusal(codec: int, packet_elements: int, data_mac: bool) -> str | None:
    """One line on why the P4 pipeline cannot take a job with these JOIN parameters, or None."""
    if data_mac:
        return ("JOIN refused: the P4 switch (--engine p4model) cannot check a SipHash tag per packet at line "
                "rate; join without data_mac, or use the kernel engine")
    limit = MAX_LANES.get(Codec(codec)) if codec in tuple(Codec) else None
    if limit is not None and packet_elements > limit:
        return (f"JOIN refused: the P4 switch (--engine p4model) parses at most {MAX_PAYLOAD_BYTES} payload bytes, "
                f"{limit} {Codec(codec).name.lower()} elements per packet; got {packet_elements}")
    return None
