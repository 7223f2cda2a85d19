"""The switch's data plane as one Numba kernel per burst: the slot table, bitmaps, counts, exponent agreement,
32-bit integer sums and result encoding. Sans-I/O: it reads a burst of received datagrams (numpy arrays) and
describes the datagrams to send in another, pointing at the results it stores; no sockets, no clock (``now`` is an
argument). The kernel is split into the stages a switch pipeline (and a P4 program) has: validate (header),
control admission (token buckets: source_bucket, conforms), authenticate (the optional tag of a job with
data_mac), validate (against the job, then the payload), classify, bitmap and count (open_round,
bitmap_and_count), contribute, complete and emit; docs/protocol.md ("Slot state table") and
protocol.slot_reference hold the state machine they implement.

Slot semantics (SwitchML; docs/protocol.md, "Slots" and "Slot state table")

* Each job owns ``pool`` slots; slot s lives on the job's core ``s % stride`` (of the cores of every aggregator the
  job uses) at row ``row_base + s // stride``: this core holds the slots with ``s % stride == offset``.
  Each row has two shadow sets; a worker alternates sets on consecutive uses of a slot over the job's whole life.
* A set holds one *round*: the use of the slot by one chunk of one allreduce, identified by
  ``round_key = allreduce << 32 | (chunk + 2**31)``, which grows with every use of the slot (allreduces compare
  in 32-bit serial number order, so the order survives their wrap: packet.round_order). A DATA packet with
  a key older than the set's round is stale (a delayed duplicate) and is dropped; a newer key opens a new round,
  which is safe because a worker can only use a set again after every worker received the result of the round
  in between (self-clocking), so nobody still needs the old result. Storing the key is our one addition to
  SwitchML's state: its bitmap alone cannot tell a delayed duplicate from a new round.
* The first contribution writes the accumulators (no zeroing); later ones add. Every contribution must agree on
  the chunk's exponent and element count.
* A packet whose rank bit is already set is a retransmission: never added twice; if the round is complete the
  result goes back to that worker alone, else a PENDING does (the ranks the round has: protocol.wire).
* When the count reaches n the result goes to all n workers (one datagram per worker, or one to the job's
  multicast group) and is kept for retransmissions.
* Reduce-scatter (docs/protocol.md, "Reduce-scatter"): a round opened with an owners code (the high byte of the
  rank field) sends its result to its owners and, to every other rank, its header-only completion (the header
  with count 0, and its tag), stored at the end of the set's result row; each by unicast, re-sends alike.

Every check happens before any state changes, so a malformed packet is counted by reason and dropped and never
changes a sum or stalls a slot. With the job's data_mac, a DATA packet is HDR + width * count + TAG_SIZE bytes: the
tag (protocol.siphash) is checked first, and every RESULT carries one, computed once when its round completes and
stored with it, so a re-sent result carries the same bytes.
"""

from __future__ import annotations

from collections import namedtuple

import numpy as np
from numba import njit

from intml.protocol import codecs
from intml.protocol.arith import NO_EXP, switch_stream
from intml.protocol.codec import Codec
from intml.protocol.packet import (
    HDR,
    O_JOB,
    O_MAGIC,
    O_RANK,
    O_SHADOW,
    O_TYPE,
    O_VERSION,
    element_fields,
    get_u16,
    get_u32,
    owner_range,
    put_header,
    put_pending,
    round_order,
)
from intml.protocol.job import CONTROL_SOURCE_BUCKETS, MAX_WORLD, ControlLimits
from intml.protocol.rng import derive_key
from intml.protocol.siphash import TAG_SIZE, put_tag, tag_ok
from intml.protocol.stats import (
    COMPLETIONS,
    CONTRIBUTIONS,
    DROP_BAD_EXP,
    DROP_BAD_MAC,
    DROP_BAD_MAGIC,
    DROP_BAD_OWNER,
    DROP_BAD_VERSION,
    DROP_CODEC,
    DROP_CONTROL_RATE,
    DROP_COUNT,
    DROP_DUPLICATE_INCOMPLETE,
    DROP_EXP_MISMATCH,
    DROP_INVALID_CODE,
    DROP_RANK,
    DROP_SHADOW,
    DROP_SHORT,
    DROP_SLOT,
    DROP_STALE,
    DROP_TRUNCATED,
    DROP_UNKNOWN_JOB,
    DROP_UNKNOWN_TYPE,
    DROP_UNREGISTERED,
    NEWER,
    NONFINITE,
    N_STATS,
    OLDER,
    PACKETS_IN,
    PACKETS_OUT,
    RESULTS_RESENT,
    RETRANSMISSIONS,
    SAME_KNOWN_RANK,
    SAME_NEW_RANK,
    SATURATED,
)
from intml.protocol.wire import MAGIC, OWNERS_SHIFT, RANK_MASK, STORED, VERSION, MsgType, element_datagram_size

CONTROL = -1  # validate_header's verdict for a JOIN, LEAVE or STATS_REQUEST: the control plane answers it

# Job table: one row per job slot of this core; arrays so the kernel can read them.
Jobs = namedtuple(
    "Jobs",
    "job_id active world value_bits packet_elements pool codec seed row_base members group last_seen stats core_stats "
    "data_mac mac_key stride offset stochastic",
)
# Slot table: one row per slot of every job on this core, two shadow sets each. A completed set keeps its result
# as the whole datagram (header, payload and any tag) that goes to every worker and to every re-send, and, for a
# round with owners (a reduce-scatter chunk), its header-only completion in the row's last COMPLETION_SIZE bytes.
# A set's non-finite lanes (docs/arithmetic.md, "Non-finite values"): `flags` holds each lane's OR of its
# contributions' flags, valid only while `nonfinite` is set (a round's first non-finite contribution clears them),
# so finite rounds never touch it.
Table = namedtuple("Table", "round_key bitmap count exp next_exp elements owners acc result result_len flags "
                            "nonfinite")
COMPLETION_SIZE = HDR + TAG_SIZE  # room for a header-only completion and its tag
# Scratch of one process_burst call (see there). group_of[row, set] is the set's group in the current burst, or -1
# outside a call; a group is one round of one set: its contributions are a linked list (head, next) of received
# packet indices; `emits` marks a group some output points at, `spilled` the spill row its result was copied to
# (-1: none), `done` a group already aggregated. An event is a result to send: to one rank (a re-send) or, with
# rank -1, to all (a completion).
Batch = namedtuple("Batch", "group_of row shadow job head first complete emits done spilled packet next "
                            "event_group event_rank rows")


# Control admission: GCRA token buckets, each kept as its theoretical arrival time (TAT, seconds on
# the caller's clock): one per source-address hash, and the core's. interval: seconds per token (source, core);
# tolerance: (burst - 1) * interval (source, core); per_burst: control datagrams one call may hand to Python.
Limiter = namedtuple("Limiter", "source_tat core_tat interval tolerance per_burst")
_HASH = np.uint64(0x9E3779B97F4A7C15)  # 2**64 / golden ratio: Fibonacci hashing
_BUCKET_SHIFT = np.uint64(64 - (CONTROL_SOURCE_BUCKETS.bit_length() - 1))


def new_limiter(limits: ControlLimits) -> Limiter:
    """Full buckets (TAT -inf: no datagram seen yet)."""
    interval = np.array([1.0 / limits.source_rate, 1.0 / limits.global_rate])
    bursts = np.array([limits.source_burst, limits.global_burst])
    return Limiter(source_tat=np.full(CONTROL_SOURCE_BUCKETS, -np.inf), core_tat=np.full(1, -np.inf),
                   interval=interval, tolerance=interval * (bursts - 1), per_burst=np.int64(limits.per_burst))


@njit(inline="always")
def source_bucket(addr):
    """The bucket of a source address key: the top bits of its Fibonacci hash (sources may share a bucket)."""
    return np.int64((np.uint64(addr) * _HASH) >> _BUCKET_SHIFT)


@njit(inline="always")
def conforms(tat, now, tolerance):
    """GCRA: a bucket whose TAT is `tat` has a token at `now`."""
    return max(tat, now) - now <= tolerance


@njit(inline="always")
def admit_control(lim, control, n_ctl, i, addr, now, core_stats):
    """Control admission of received datagram i, a control datagram from ``addr``: within the burst's share
    (``n_ctl`` listed so far), its source's bucket and the core's, it is listed in ``control`` and both buckets pay
    a token; else it is counted as drop_control_rate. Returns the new count listed."""
    k = source_bucket(addr)
    if n_ctl < lim.per_burst and conforms(lim.source_tat[k], now, lim.tolerance[0]) \
            and conforms(lim.core_tat[0], now, lim.tolerance[1]):
        lim.source_tat[k] = max(lim.source_tat[k], now) + lim.interval[0]
        lim.core_tat[0] = max(lim.core_tat[0], now) + lim.interval[1]
        control[n_ctl] = i
        return n_ctl + 1
    core_stats[DROP_CONTROL_RATE] += 1
    return n_ctl


def new_jobs(capacity: int) -> Jobs:
    return Jobs(
        job_id=np.zeros(capacity, np.int64),
        active=np.zeros(capacity, np.bool_),
        world=np.zeros(capacity, np.int64),
        value_bits=np.zeros(capacity, np.int64),
        packet_elements=np.zeros(capacity, np.int64),
        pool=np.zeros(capacity, np.int64),
        codec=np.zeros(capacity, np.int64),
        seed=np.zeros(capacity, np.uint64),
        row_base=np.zeros(capacity, np.int64),
        members=np.zeros((capacity, MAX_WORLD), np.uint64),
        group=np.zeros(capacity, np.uint64),  # address key of the job's results multicast group, 0 = unicast
        last_seen=np.zeros((capacity, MAX_WORLD), np.float64),
        stats=np.zeros((capacity, N_STATS), np.int64),
        core_stats=np.zeros(N_STATS, np.int64),
        data_mac=np.zeros(capacity, np.bool_),  # the job's DATA and RESULT datagrams end in a SipHash tag
        mac_key=np.zeros((capacity, 2), np.uint64),  # its data key (k0, k1), set with data_mac at registration
        stride=np.ones(capacity, np.int64),  # the job's cores, on all its aggregators
        offset=np.zeros(capacity, np.int64),  # this core's index among them: it holds slots s % stride == offset
        stochastic=np.ones(capacity, np.bool_),  # the re-encode rounds stochastically, else to nearest (JOIN flags)
    )


def place_job(jobs: Jobs, table: Table, j: int, rows: range, *, world: int, value_bits: int, packet_elements: int,
              pool: int, codec: int, seed: int, stride: int = 1, offset: int = 0, nearest: bool = False) -> None:
    """Job index j's parameters, as the kernel reads them, on the slot rows ``rows`` (emptied: a fresh job must
    not see a previous job's rounds), with no members yet. The caller sets the rest (group, MAC) and then marks
    the job active."""
    jobs.world[j] = world
    jobs.value_bits[j] = value_bits
    jobs.packet_elements[j] = packet_elements
    jobs.pool[j] = pool
    jobs.codec[j] = codec
    jobs.seed[j] = np.uint64(seed)
    jobs.row_base[j] = rows.start
    jobs.members[j] = 0
    jobs.stride[j], jobs.offset[j] = stride, offset
    jobs.stochastic[j] = not nearest
    table.round_key[rows.start:rows.stop] = -1
    table.count[rows.start:rows.stop] = 0
    table.bitmap[rows.start:rows.stop] = 0


def result_width(max_elements: int) -> int:
    """Bytes of the largest RESULT datagram (int32 codes and a tag)."""
    return element_datagram_size(Codec.INT32, max_elements, data_mac=True)


def row_width(max_elements: int) -> int:
    """Bytes of one stored result row: the largest result, then room for its header-only completion."""
    return result_width(max_elements) + COMPLETION_SIZE


def new_table(rows: int, max_elements: int, result: np.ndarray) -> Table:
    """``result``: the (rows, 2, row_width) block the stored results live in (the core's output memory)."""
    return Table(
        round_key=np.full((rows, 2), -1, np.int64),
        bitmap=np.zeros((rows, 2), np.uint64),
        count=np.zeros((rows, 2), np.int64),
        exp=np.zeros((rows, 2), np.int64),
        next_exp=np.zeros((rows, 2), np.int64),
        elements=np.zeros((rows, 2), np.int64),
        owners=np.zeros((rows, 2), np.int64),
        acc=np.zeros((rows, 2, max_elements), np.int32),
        result=result,
        result_len=np.zeros((rows, 2), np.int64),
        flags=np.zeros((rows, 2, max_elements), np.uint8),
        nonfinite=np.zeros((rows, 2), np.bool_),
    )


def new_batch(rows: int, burst: int) -> Batch:
    """Scratch for bursts of up to `burst` datagrams over a table of `rows` rows."""
    return Batch(np.full((rows, 2), -1, np.int64), *(np.zeros(burst, np.int64) for _ in range(5)),
                 *(np.zeros(burst, np.bool_) for _ in range(3)), np.full(burst, -1, np.int64),
                 *(np.zeros(burst, np.int64) for _ in range(4)), np.zeros(MAX_WORLD, np.int64))


@njit(inline="always")
def _find_job(active, job_ids, members, job_id, rank, src):
    """The active job of id ``job_id`` whose seat of ``rank`` is ``src`` (two tenants' jobs may share an id; an
    address holds a rank of at most one of them), else the first of that id (it counts the drop), else -1."""
    first = -1
    for j in range(active.size):
        if active[j] and job_ids[j] == job_id:
            if members[j, rank] == src:
                return j
            if first < 0:
                first = j
    return first


# ---- the steps every tier's kernel starts with (process_burst here, aggregator.tiers' leaf_burst and spine_burst):
# header_verdict, then lookup_job for what the tier aggregates, then validate, classify and complete.
OTHER_LEVEL = -2  # header_verdict: the datagram type another level of a fabric sends this one (aggregator.tiers)


@njit(inline="always")
def header_verdict(length, p, other_level_type, core_stats):
    """A received datagram, counted in the core's packets_in: validate_header's verdict (0: DATA, CONTROL, or a
    drop reason, which the caller counts), OTHER_LEVEL for ``other_level_type`` (a leaf: its spine's RESULT; a
    spine: a leaf's PARTIAL; one core: none, MsgType.DATA)."""
    core_stats[PACKETS_IN] += 1
    reason = validate_header(length, get_u16(p, O_MAGIC), p[O_VERSION], p[O_TYPE])
    return OTHER_LEVEL if reason == DROP_UNKNOWN_TYPE and p[O_TYPE] == other_level_type else reason


@njit(inline="always")
def lookup_job(jobs, p, src):
    """The index of the active job a datagram from address key ``src`` names (_find_job), else -1. The caller
    counts either (the core's drop_unknown_job, the job's packets_in): counted here, in branches, the counts cost
    process_burst 10-20% more time per packet (reference counting of the job table's arrays; measured with the
    same stream, alternating)."""
    return _find_job(jobs.active, jobs.job_id, jobs.members, get_u32(p, O_JOB),
                     min(get_u16(p, O_RANK) & RANK_MASK, MAX_WORLD - 1), src)


# ---- the pipeline's stages, in packet order ------------------------------------------------------------------
# A stage inlined into the kernel's loop takes scalars (and at most the packet) or has no branches: an inlined
# function that branches over the tables' arrays costs reference counting on every packet (measured: it doubled
# the kernel's time on a recorded stream).


@njit(inline="always")
def validate_header(length, magic, version, typ):
    """The checks before the job is known. Returns 0 for a DATA packet, CONTROL for a control datagram, else
    the statistic of the drop reason (counted per core)."""
    if length < 0:
        return DROP_TRUNCATED
    if length < HDR:
        return DROP_SHORT
    if magic != MAGIC:
        return DROP_BAD_MAGIC
    if version != VERSION:
        return DROP_BAD_VERSION
    if typ != MsgType.DATA:
        if typ == MsgType.JOIN or typ == MsgType.LEAVE or typ == MsgType.STATS_REQUEST:
            return CONTROL
        return DROP_UNKNOWN_TYPE
    return 0


@njit(inline="always")
def authenticate(p, length, data_mac, k0, k1):
    """The first check against the job, before any other (so that nothing unauthenticated is counted under another
    reason or keeps a member alive): a job with data_mac takes a DATA packet only if it ends in the SipHash tag
    of its header and payload under the job's key. Returns the length of the datagram without its tag, or -1 to
    drop it (DROP_BAD_MAC)."""
    if not data_mac:
        return length
    return length - TAG_SIZE if tag_ok(p, length, k0, k1) else -1


@njit(inline="always")
def validate(length, rank, world, src, member, slot, pool, offset, stride, codec, job_codec, count, packet_elements,
             shadow, exp, next_exp, owners):
    """The checks of a DATA packet against its job, in the parser's order (``member``: the address the rank
    joined from, read only when rank < world). Returns 0 or the statistic of the drop reason."""
    if rank >= world:
        return DROP_RANK
    if member != src:
        return DROP_UNREGISTERED
    if slot >= pool or slot % stride != offset:
        return DROP_SLOT
    if codec != job_codec:
        return DROP_CODEC
    if count > packet_elements or length != HDR + codecs.width(codec) * count:
        return DROP_COUNT
    if shadow > 1:
        return DROP_SHADOW
    lo, hi = codecs.exp_range(codec)
    if (exp != NO_EXP and (exp < lo or exp > hi)) or (next_exp != NO_EXP and (next_exp < lo or next_exp > hi)):
        return DROP_BAD_EXP
    if owner_range(owners, world)[1] >= world:
        return DROP_BAD_OWNER
    return 0


@njit(inline="always")
def classify(current, bitmap, key, bit):
    """Where a packet of round `key` from the rank of `bit` stands against a set of round `current` with
    `bitmap`: OLDER, SAME_NEW_RANK, SAME_KNOWN_RANK or NEWER. An empty bitmap is an EMPTY set (every round
    opened has its first contribution's bit), which any round opens."""
    if bitmap == 0:
        return NEWER
    order = round_order(key, current)
    if order < 0:
        return OLDER
    if order > 0:
        return NEWER
    return SAME_KNOWN_RANK if bitmap & bit else SAME_NEW_RANK


@njit(inline="always")
def payload_ok(p, codec, count, exp, vbits):
    """Every value fits the round (the codec's check: C_nat codes within [floor, exp], int32 values within
    +-2**s(n))."""
    return codecs.check_payload(codec, p[HDR:HDR + codecs.width(codec) * count], exp, vbits)


@njit(inline="always")
def _new_group(b, n_groups, row, x, j, first):
    b.group_of[row, x] = n_groups
    b.row[n_groups] = row
    b.shadow[n_groups] = x
    b.job[n_groups] = j
    b.head[n_groups] = -1
    b.first[n_groups] = first
    b.complete[n_groups] = False
    b.emits[n_groups] = False
    b.done[n_groups] = False
    b.spilled[n_groups] = -1
    return n_groups


@njit(inline="always")
def open_round(table, row, x, key, exp, count, next_exp, owners):
    """Set x of `row` takes the round `key`: empty bitmap and count; the first contribution will write the
    accumulators (no zeroing)."""
    table.round_key[row, x] = key
    table.bitmap[row, x] = 0
    table.count[row, x] = 0
    table.exp[row, x] = exp
    table.elements[row, x] = count
    table.next_exp[row, x] = next_exp
    table.owners[row, x] = owners
    table.nonfinite[row, x] = False


@njit(inline="always")
def payload_verdict(p, codec, count, exp, vbits):
    """0 if the payload passes the codec's check, 1 if it passes only with non-finite lanes (take_nonfinite, once
    its set is known), else DROP_INVALID_CODE. Nothing changes before the packet is accepted, and nothing is
    allocated (process_burst runs without Numba's runtime)."""
    if payload_ok(p, codec, count, exp, vbits):
        return 0
    return 1 if nonfinite_ok(p, codec, count, exp, vbits) else DROP_INVALID_CODE


@njit(inline="always")
def nonfinite_ok(p, codec, count, exp, vbits):
    return codecs.check_nonfinite(codec, p[HDR:HDR + codecs.width(codec) * count], exp, vbits)


@njit(inline="always")
def set_flags(table, row, x, count):
    """The flags of (row, set x) for a contribution with non-finite lanes to OR into (cleared by the round's first
    such contribution)."""
    flags = table.flags[row, x, :count]
    if not table.nonfinite[row, x]:
        flags[:] = 0
        table.nonfinite[row, x] = True
    return flags


@njit(inline="always")
def take_nonfinite(table, row, x, p, codec, count, exp, vbits):
    """OR a contribution's non-finite lanes into its set's flags and zero them in the packet, which is then added
    as finite."""
    codecs.take_nonfinite(codec, p[HDR:HDR + codecs.width(codec) * count], exp, vbits, set_flags(table, row, x, count))


@njit(inline="always")
def put_nonfinite(table, row, x, payload, codec, count):
    """The set's result payload with its non-finite lanes; returns their count."""
    if not table.nonfinite[row, x]:
        return 0
    return codecs.put_nonfinite(codec, payload, table.flags[row, x, :count])


@njit(inline="always")
def bitmap_and_count(table, b, g, row, x, i, n_contrib, bit):
    """Record packet i as a contribution to (row, set x), in group g: set the rank's bit, count it and link
    the packet into the group (its values are added in phase 2)."""
    b.packet[n_contrib] = i
    b.next[n_contrib] = b.head[g]
    b.head[g] = n_contrib
    table.bitmap[row, x] |= bit
    table.count[row, x] += 1


@njit(inline="always")
def contribute(jobs, table, b, g, rx_data):
    """Phase 2 for one set: add this burst's contributions to its accumulators in one pass (the first
    contribution of a round writes them)."""
    row, x, j = b.row[g], b.shadow[g], b.job[g]
    count = table.elements[row, x]
    acc = table.acc[row, x, :count]
    k = 0
    m = b.head[g]
    while m >= 0:
        b.rows[k] = b.packet[m]
        k += 1
        m = b.next[m]
    if k and count:
        codecs.add_payloads(jobs.codec[j], rx_data, b.rows, k, HDR, acc, table.exp[row, x], jobs.value_bits[j],
                            b.first[g])


@njit(inline="always")
def complete(jobs, table, b, g):
    """Write a completed round's result datagram into its set: the same bytes for every worker and every
    re-send (C_nat re-encodes the sum with the switch's random stream); and, for a round with owners, its
    header-only completion at the end of the row."""
    row, x, j = b.row[g], b.shadow[g], b.job[g]
    count = table.elements[row, x]
    codec = jobs.codec[j]
    acc = table.acc[row, x, :count]
    key = table.round_key[row, x]
    allreduce = (key >> 32) & 0xFFFFFFFF  # the key is signed once allreduce >= 2**31
    chunk = (key & 0xFFFFFFFF) - (np.int64(1) << 31)
    slot = (row - jobs.row_base[j]) * jobs.stride[j] + jobs.offset[j]
    p = table.result[row, x]
    owners = table.owners[row, x] << OWNERS_SHIFT  # the RESULT's rank field
    put_header(p, MsgType.RESULT, jobs.job_id[j], allreduce, chunk, owners, slot, count, codec, x, table.exp[row, x],
               table.next_exp[row, x])
    size = codecs.width(codec) * count
    if count:
        key_switch = derive_key(jobs.seed[j], switch_stream(allreduce))
        jobs.stats[j, SATURATED] += codecs.encode_result(codec, acc, p[HDR:HDR + size], key_switch,
                                                         np.uint64(chunk * jobs.packet_elements[j]),
                                                         table.exp[row, x], jobs.value_bits[j], jobs.stochastic[j])
        jobs.stats[j, NONFINITE] += put_nonfinite(table, row, x, p[HDR:HDR + size], codec, count)
    length = HDR + size
    if jobs.data_mac[j]:  # tagged once, here: every copy and every re-send of the result carries the same bytes
        length = put_tag(p, length, jobs.mac_key[j, 0], jobs.mac_key[j, 1])
    table.result_len[row, x] = length
    if owners:
        q = p[p.size - COMPLETION_SIZE:]
        put_header(q, MsgType.RESULT, jobs.job_id[j], allreduce, chunk, owners, slot, 0, codec, x, table.exp[row, x],
                   table.next_exp[row, x])
        if jobs.data_mac[j]:
            put_tag(q, HDR, jobs.mac_key[j, 0], jobs.mac_key[j, 1])


@njit(inline="always")
def _finish(jobs, table, b, g, rx_data):
    contribute(jobs, table, b, g, rx_data)
    if b.complete[g]:
        complete(jobs, table, b, g)
    b.done[g] = True


@njit(inline="always")
def pending(q, p, have, data_mac, k0, k1):
    """Write into q the PENDING answering DATA p, whose round has the ranks ``have`` (protocol.packet.put_pending),
    with the job's tag; returns its length."""
    length = put_pending(q, p, have)
    return put_tag(q, length, k0, k1) if data_mac else length


@njit(inline="always")
def bytes_for(res, size, data_mac, rank, world):
    """The bytes of the stored result row `res` (its first `size` bytes are the result) that rank `rank` gets, as
    (offset, size): the result if the round has no owners or the rank is one, else the row's header-only
    completion."""
    first, last = owner_range(np.int64(res[O_RANK]), world)  # the high byte of the result's rank field
    if first <= rank <= last:
        return 0, size
    return res.size - COMPLETION_SIZE, HDR + TAG_SIZE if data_mac else HDR


@njit(inline="always")
def emit_to(res, size, data_mac, rank, world, dest, out_ptr, out_len, out_addr, n_out):
    """Queue the bytes of the stored result row `res` that rank `rank` gets (bytes_for) for it at `dest`."""
    lo, size = bytes_for(res, size, data_mac, rank, world)
    return emit(res.ctypes.data + lo, size, dest, out_ptr, out_len, out_addr, n_out)


@njit(inline="always")
def emit_stored(res, size, data_mac, rank, world, dest, q, out_ptr, out_len, out_addr, n_out):
    """As emit_to, but from a copy in row `q` with the STORED mark (protocol.wire): a re-send. The row itself may go
    out unmarked to other ranks in the same burst."""
    lo, size = bytes_for(res, size, data_mac, rank, world)
    for c in range(size):  # a loop, not a slice: see process_burst
        q[c] = res[lo + c]
    q[O_SHADOW] |= STORED
    return emit(q.ctypes.data, size, dest, out_ptr, out_len, out_addr, n_out)


@njit(inline="always")
def emit(src, size, dest, out_ptr, out_len, out_addr, n_out):
    """Queue `size` bytes at address `src` (a stored result or its spilled copy) for `dest`: nothing is copied."""
    out_ptr[n_out] = src
    out_len[n_out] = size
    out_addr[n_out] = dest
    return n_out + 1


@njit(cache=True, nogil=True, boundscheck=False, _nrt=False)
def process_burst(rx_data, rx_len, rx_addr, n_rx, now, job_arrays, table_arrays, batch_arrays,
                  spill, spill_len, out_ptr, out_len, out_addr, control, limiter):
    """Handle received datagrams 0..n_rx-1. Returns (datagrams written to out, control datagrams listed in
    `control`: those the control admission let through, at most `limiter`'s per_burst; the others are counted
    as drop_control_rate and cost nothing more). `out` needs room for n_rx * MAX_WORLD entries (each packet
    completes at most one round), spill for n_rx rows (each packet takes at most one: a result spilled, the
    PENDING that answers it, with its output's event naming the row as -1 - row, or its re-sent result's marked
    copy, emit_stored).

    Two phases. Phase 1 walks the packets in order through validate, classify and bitmap_and_count: it makes
    every decision, and a packet's data is only checked, not added. Phase 2 then adds each set's contributions
    in one pass over its accumulators (contribute), re-encodes the sets that completed (complete), and emits
    the results in the order phase 1 decided them. Integer addition commutes, so the sums, and everything sent,
    are those of handling the packets one by one; but a slot's accumulators are read and written once per
    burst, not once per worker.

    A packet that opens a new round in a set with work in this burst (only a misbehaving or badly delayed
    sender does that) first finishes the set's old round, and copies its result to a spill row if an output
    points at it: the new round may complete in this burst too and overwrite the stored result, and every
    output must stay valid until the core's next call.

    The tables come in as plain tuples, which Numba types in C, and are rebuilt as namedtuples here: a
    namedtuple argument costs ~40 us of typing per call on Numba's Python path.

    It runs without Numba's runtime (``_nrt=False``): it allocates nothing, and the runtime's atomic reference
    counts on every array view and table field it takes were a third of its time (docs/benchmarks.md, "Where an
    aggregator core's time goes"). Its copies are therefore loops: a slice assignment may allocate a temporary."""
    jobs = Jobs(*job_arrays)
    table = Table(*table_arrays)
    b = Batch(*batch_arrays)
    lim = Limiter(*limiter)
    cs = jobs.core_stats
    n_ctl = 0
    n_groups = 0
    n_contrib = 0
    n_events = 0
    n_spill = 0
    for i in range(n_rx):
        p = rx_data[i]
        length = rx_len[i]
        reason = header_verdict(length, p, MsgType.DATA, cs)
        if reason == CONTROL:
            n_ctl = admit_control(lim, control, n_ctl, i, rx_addr[i], now, cs)
            continue
        if reason:
            cs[reason] += 1
            continue
        j = lookup_job(jobs, p, rx_addr[i])
        if j < 0:
            cs[DROP_UNKNOWN_JOB] += 1
            continue
        st = jobs.stats[j]
        st[PACKETS_IN] += 1
        length = authenticate(p, length, jobs.data_mac[j], jobs.mac_key[j, 0], jobs.mac_key[j, 1])
        if length < 0:
            st[DROP_BAD_MAC] += 1
            continue
        n = jobs.world[j]
        rank, owners, slot, count, codec, x, exp, next_exp, key = element_fields(p)
        reason = validate(length, rank, n, rx_addr[i], jobs.members[j, min(rank, MAX_WORLD - 1)], slot, jobs.pool[j],
                          jobs.offset[j], jobs.stride[j], codec, jobs.codec[j], count, jobs.packet_elements[j], x, exp,
                          next_exp, owners)
        if reason != DROP_RANK and reason != DROP_UNREGISTERED:
            jobs.last_seen[j, rank] = now  # any packet of a member, retransmissions too, keeps the job alive
        if reason:
            st[reason] += 1
            continue
        row = jobs.row_base[j] + slot // jobs.stride[j]
        bit = np.uint64(1) << np.uint64(rank)
        event = classify(table.round_key[row, x], table.bitmap[row, x], key, bit)
        # The branches below are protocol.slot_reference.TRANSITIONS, action by action (docs/protocol.md).
        if event == OLDER:  # (FILLING or COMPLETE, OLDER): DROP_STALE
            st[DROP_STALE] += 1
            continue
        g = b.group_of[row, x]
        if event == SAME_KNOWN_RANK:
            st[RETRANSMISSIONS] += 1
            if table.count[row, x] == n:  # (COMPLETE, SAME_KNOWN_RANK): RESEND; (FILLING, ...): DROP_DUPLICATE
                if g < 0:
                    g = _new_group(b, n_groups, row, x, j, False)
                    n_groups += 1
                b.emits[g] = True
                b.event_group[n_events] = g
                b.event_rank[n_events] = rank
                n_events += 1
                st[RESULTS_RESENT] += 1
            else:  # answered with a PENDING, written in a spill row as it stands now
                st[DROP_DUPLICATE_INCOMPLETE] += 1
                q = spill[n_spill]
                spill_len[n_spill] = pending(q, p, table.bitmap[row, x], jobs.data_mac[j], jobs.mac_key[j, 0],
                                             jobs.mac_key[j, 1])
                b.event_group[n_events] = -1 - n_spill
                b.event_rank[n_events] = j * MAX_WORLD + rank
                n_events += 1
                n_spill += 1
            continue
        if event == SAME_NEW_RANK and (exp != table.exp[row, x] or count != table.elements[row, x]
                                       or owners != table.owners[row, x]):
            st[DROP_EXP_MISMATCH if exp != table.exp[row, x] else DROP_COUNT if count != table.elements[row, x]
               else DROP_BAD_OWNER] += 1
            continue
        verdict = payload_verdict(p, jobs.codec[j], count, exp, jobs.value_bits[j])
        if verdict > 1:
            st[verdict] += 1
            continue
        if event == NEWER and g >= 0:  # the set's old round ends here: finish it before the new one opens
            _finish(jobs, table, b, g, rx_data)
            if b.emits[g]:
                size, cut = table.result_len[row, x], spill.shape[1] - COMPLETION_SIZE
                for c in range(size):  # loops, not slices: see the docstring
                    spill[n_spill, c] = table.result[row, x, c]
                for c in range(cut, spill.shape[1]):  # the header-only completion
                    spill[n_spill, c] = table.result[row, x, c]
                spill_len[n_spill] = size
                b.spilled[g] = n_spill
                n_spill += 1
            b.group_of[row, x] = -1
            g = -1
        if event == NEWER:  # (any state, NEWER): OPEN
            open_round(table, row, x, key, exp, count, next_exp, owners)
        else:  # (FILLING, SAME_NEW_RANK): ADD
            table.next_exp[row, x] = max(table.next_exp[row, x], next_exp)
        if g < 0:
            g = _new_group(b, n_groups, row, x, j, table.count[row, x] == 0)
            n_groups += 1
        if verdict:
            take_nonfinite(table, row, x, p, jobs.codec[j], count, exp, jobs.value_bits[j])
        bitmap_and_count(table, b, g, row, x, i, n_contrib, bit)
        n_contrib += 1
        st[CONTRIBUTIONS] += 1
        if table.count[row, x] == n:
            b.complete[g] = True
            b.emits[g] = True
            b.event_group[n_events] = g
            b.event_rank[n_events] = -1
            n_events += 1
            st[COMPLETIONS] += 1

    for g in range(n_groups):
        if not b.done[g]:
            _finish(jobs, table, b, g, rx_data)
        b.group_of[b.row[g], b.shadow[g]] = -1
    n_out = 0
    for e in range(n_events):
        g = b.event_group[e]
        if g < 0:  # a PENDING in spill row -1 - g, to one rank of one job
            j, rank = divmod(b.event_rank[e], MAX_WORLD)
            n_out = emit(spill[-1 - g].ctypes.data, spill_len[-1 - g], jobs.members[j, rank], out_ptr, out_len,
                         out_addr, n_out)
            jobs.stats[j, PACKETS_OUT] += 1
            continue
        j = b.job[g]
        k = b.spilled[g]
        if k >= 0:
            res, size = spill[k], spill_len[k]
        else:
            res, size = table.result[b.row[g], b.shadow[g]], table.result_len[b.row[g], b.shadow[g]]
        rank = b.event_rank[e]
        first = n_out
        n, data_mac = jobs.world[j], jobs.data_mac[j]
        if rank >= 0:  # a re-send, in the spill row its DATA did not take
            n_out = emit_stored(res, size, data_mac, rank, n, jobs.members[j, rank], spill[n_spill], out_ptr, out_len,
                                out_addr, n_out)
            n_spill += 1
        elif jobs.group[j] and res[O_RANK] == 0:  # one datagram to the job's multicast group reaches every worker
            n_out = emit(res.ctypes.data, size, jobs.group[j], out_ptr, out_len, out_addr, n_out)
        else:
            for r in range(n):
                n_out = emit_to(res, size, data_mac, r, n, jobs.members[j, r], out_ptr, out_len, out_addr, n_out)
        jobs.stats[j, PACKETS_OUT] += n_out - first
    return n_out, n_ctl
