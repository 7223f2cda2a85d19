"""The switch's data plane as one Numba kernel per burst: the slot table, bitmaps, counts, exponent agreement,
32-bit integer sums and result encoding. Sans-I/O: it reads a burst of received datagrams (numpy arrays) and
writes the datagrams to send into another; no sockets, no clock (``now`` is an argument).

Slot semantics (SwitchML, DESIGN.md "Protocol semantics")

* Each job owns ``pool`` slots; slot s lives on data-plane core ``s % cores`` at row ``row_base + s // cores``.
  Each row has two shadow sets; a worker alternates sets on consecutive uses of a slot over the job's whole life.
* A set holds one *round*: the use of the slot by one chunk of one allreduce, identified by
  ``round_key = allreduce << 32 | (chunk + 2**31)``, which grows with every use of the slot. A DATA packet with
  a key older than the set's round is stale (a delayed duplicate) and is dropped; a newer key opens a new round,
  which is safe because a worker can only use a set again after every worker received the result of the round
  in between (self-clocking), so nobody still needs the old result. Storing the key is our one addition to
  SwitchML's state: its bitmap alone cannot tell a delayed duplicate from a new round.
* The first contribution writes the accumulators (no zeroing); later ones add. Every contribution must agree on
  the chunk's exponent and element count.
* A packet whose rank bit is already set is a retransmission: never added twice; if the round is complete the
  result goes back to that worker alone, else it is dropped.
* When the count reaches n the result goes to all n workers (one datagram per worker, or one to the job's
  multicast group) and is kept for retransmissions.

Every check happens before any state changes, so a malformed packet is counted by reason and dropped and never
changes a sum or stalls a slot.
"""

from __future__ import annotations

from collections import namedtuple

import numpy as np
from numba import njit

from intml.protocol.arith import (
    E_MAX,
    E_MIN,
    INT32_E_MAX,
    INT32_E_MIN,
    NO_EXP,
    add_fixed_rows,
    cnat_floor,
    sum_to_codes_kernel,
    switch_stream,
)
from intml.protocol.cnat import codes_in_range
from intml.protocol.lanes import load_be32, store_be32
from intml.protocol.packet import (
    HDR,
    O_ALLREDUCE,
    O_CHUNK,
    O_CODEC,
    O_COUNT,
    O_EXP,
    O_JOB,
    O_MAGIC,
    O_NEXT_EXP,
    O_RANK,
    O_SHADOW,
    O_SLOT,
    O_TYPE,
    O_VERSION,
    get_i8,
    get_i32,
    get_u16,
    get_u32,
    put_header,
    round_key,
)
from intml.protocol.rng import derive_key
from intml.protocol.wire import MAGIC, VERSION, Codec, MsgType

# Statistics, per job (and, for packets that name no known job, per core). The drop reasons are the malformed
# or foreign packets of DESIGN.md; "retransmissions" and "results_resent" are normal protocol events.
STAT_NAMES = (
    "packets_in",
    "packets_out",
    "contributions",
    "completions",
    "retransmissions",
    "results_resent",
    "saturated_elements",
    "drop_truncated",
    "drop_short",
    "drop_bad_magic",
    "drop_bad_version",
    "drop_unknown_type",
    "drop_unknown_job",
    "drop_unregistered_source",
    "drop_rank_out_of_range",
    "drop_slot_out_of_range",
    "drop_wrong_codec",
    "drop_wrong_count",
    "drop_bad_shadow",
    "drop_bad_exponent",
    "drop_exponent_mismatch",
    "drop_invalid_code",
    "drop_stale",
    "drop_duplicate_incomplete",
    "drop_bad_control",
)
(
    PACKETS_IN,
    PACKETS_OUT,
    CONTRIBUTIONS,
    COMPLETIONS,
    RETRANSMISSIONS,
    RESULTS_RESENT,
    SATURATED,
    DROP_TRUNCATED,
    DROP_SHORT,
    DROP_BAD_MAGIC,
    DROP_BAD_VERSION,
    DROP_UNKNOWN_TYPE,
    DROP_UNKNOWN_JOB,
    DROP_UNREGISTERED,
    DROP_RANK,
    DROP_SLOT,
    DROP_CODEC,
    DROP_COUNT,
    DROP_SHADOW,
    DROP_BAD_EXP,
    DROP_EXP_MISMATCH,
    DROP_INVALID_CODE,
    DROP_STALE,
    DROP_DUPLICATE_INCOMPLETE,
    DROP_BAD_CONTROL,  # counted by the control plane (aggregator.core), which parses JOIN/LEAVE/STATS
) = range(len(STAT_NAMES))
N_STATS = len(STAT_NAMES)
MAX_WORLD = 64  # one uint64 bitmap per set

CONTROL_TYPES = (int(MsgType.JOIN), int(MsgType.LEAVE), int(MsgType.STATS_REQUEST))

# Job table: one row per job slot of this core; arrays so the kernel can read them.
Jobs = namedtuple(
    "Jobs",
    "job_id active world value_bits packet_elements pool codec seed row_base members group last_seen stats core_stats",
)
# Slot table: one row per slot of every job on this core, two shadow sets each. A completed set keeps its result
# as the whole datagram (header and payload) that goes to every worker and to every re-send.
Table = namedtuple("Table", "round_key bitmap count exp next_exp elements acc result result_len")
# Scratch of one process_burst call (see there). group_of[row, set] is the set's group in the current burst, or -1
# outside a call; a group's contributions are a linked list (head, next) of received packet indices; an event is
# a result to send: to one rank (a re-send) or, with rank -1, to all (a completion).
Batch = namedtuple("Batch", "group_of row shadow job head first complete packet next event_group event_rank rows")


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
    )


def new_table(rows: int, max_elements: int) -> Table:
    return Table(
        round_key=np.full((rows, 2), -1, np.int64),
        bitmap=np.zeros((rows, 2), np.uint64),
        count=np.zeros((rows, 2), np.int64),
        exp=np.zeros((rows, 2), np.int64),
        next_exp=np.zeros((rows, 2), np.int64),
        elements=np.zeros((rows, 2), np.int64),
        acc=np.zeros((rows, 2, max_elements), np.int32),
        result=np.zeros((rows, 2, HDR + 4 * max_elements), np.uint8),
        result_len=np.zeros((rows, 2), np.int64),
    )


def new_batch(rows: int, burst: int) -> Batch:
    """Scratch for bursts of up to `burst` datagrams over a table of `rows` rows."""
    per_packet = [np.zeros(burst, np.int64) for _ in range(8)]
    return Batch(np.full((rows, 2), -1, np.int64), *per_packet[:4], np.zeros(burst, np.bool_),
                 np.zeros(burst, np.bool_), *per_packet[4:], np.zeros(MAX_WORLD, np.int64))


@njit(inline="always")
def _find_job(jobs, job_id):
    for j in range(jobs.active.size):
        if jobs.active[j] and jobs.job_id[j] == job_id:
            return j
    return -1


@njit(cache=True, nogil=True, boundscheck=False)
def _int32_ok(p, count, limit):
    """Every int32 value lies in [-limit, limit] (limit = 2**s(n) <= 2**30); a min/max reduction vectorises."""
    low = high = np.int32(0)
    for i in range(count):
        v = load_be32(p, HDR + 4 * i)
        low = min(low, v)
        high = max(high, v)
    return low >= -limit and high <= limit


@njit(cache=True, nogil=True, boundscheck=False)
def _int32_add(p, acc, count, first):
    for i in range(count):
        v = load_be32(p, HDR + 4 * i)
        acc[i] = v if first else np.int32(acc[i] + v)


@njit(inline="always")
def _new_group(b, n_groups, row, x, j, first):
    b.group_of[row, x] = n_groups
    b.row[n_groups] = row
    b.shadow[n_groups] = x
    b.job[n_groups] = j
    b.head[n_groups] = -1
    b.first[n_groups] = first
    b.complete[n_groups] = False
    return n_groups


@njit(cache=True, nogil=True, boundscheck=False)
def _aggregate(jobs, table, b, g, rx_data, core, cores):
    """Phase 2 for one set: add this burst's contributions to its accumulators; if the round completed, write
    its result datagram (the same bytes for every worker and every re-send)."""
    row, x, j = b.row[g], b.shadow[g], b.job[g]
    count = table.elements[row, x]
    codec = jobs.codec[j]
    acc = table.acc[row, x, :count]
    floor = cnat_floor(table.exp[row, x], jobs.value_bits[j])
    k = 0
    m = b.head[g]
    while m >= 0:
        b.rows[k] = b.packet[m]
        k += 1
        m = b.next[m]
    if k and count:
        if codec == Codec.CNAT8:
            add_fixed_rows(rx_data, b.rows, k, HDR, acc, floor, b.first[g])
        else:
            for t in range(k):
                _int32_add(rx_data[b.rows[t]], acc, count, b.first[g] and t == 0)
    if not b.complete[g]:
        return
    key = table.round_key[row, x]
    allreduce = key >> 32
    chunk = (key & 0xFFFFFFFF) - (np.int64(1) << 31)
    slot = (row - jobs.row_base[j]) * cores + core
    p = table.result[row, x]
    put_header(p, MsgType.RESULT, jobs.job_id[j], allreduce, chunk, 0, slot, count, codec, x, table.exp[row, x],
               table.next_exp[row, x])
    if codec == Codec.CNAT8:
        if count:
            key_switch = derive_key(jobs.seed[j], switch_stream(allreduce))
            jobs.stats[j, SATURATED] += sum_to_codes_kernel(acc, p[HDR:HDR + count], key_switch,
                                                           np.uint64(chunk * jobs.packet_elements[j]), floor)
        table.result_len[row, x] = HDR + count
    else:
        for i in range(count):
            store_be32(p, HDR + 4 * i, acc[i])
        table.result_len[row, x] = HDR + 4 * count


@njit(inline="always")
def _emit(jobs, table, j, row, x, dest, tx_ptr, tx_len, tx_addr, n_tx):
    """Queue the stored result of (row, set x) for address `dest`: the entry points at it, nothing is copied. It
    stays unchanged until the burst is sent, as no set opens a new round within one call (see process_burst)."""
    tx_ptr[n_tx] = table.result[row, x].ctypes.data
    tx_len[n_tx] = table.result_len[row, x]
    tx_addr[n_tx] = dest
    jobs.stats[j, PACKETS_OUT] += 1
    return n_tx + 1


@njit(cache=True, nogil=True, boundscheck=False)
def process_burst(rx_data, rx_len, rx_addr, start, n_rx, now, core, cores, job_arrays, table_arrays, batch_arrays,
                  tx_ptr, tx_len, tx_addr, control):
    """Handle received datagrams start..n_rx-1. Returns (next unhandled index, datagrams written to tx, control
    datagrams listed in `control`). Stops early when tx could not hold another completion's n results.

    Two phases. Phase 1 walks the packets in order and makes every decision: the checks, the round keys,
    bitmaps and counts, and which packets contribute to which set; a packet's data is only checked, not added.
    Phase 2 then adds each set's contributions in one pass over its accumulators, re-encodes the sets that
    completed, and writes the results in the order phase 1 decided them. Integer addition commutes, so the
    sums, and everything sent, are those of handling the packets one by one; but a slot's accumulators are
    read and written once per burst, not once per worker. A packet that would open a new round in a set that
    already has work in this burst ends phase 1 early (it is handled by the next call), so phase 2 never mixes
    two rounds of one set.

    The tables come in as plain tuples, which Numba types in C, and are rebuilt as namedtuples here: a
    namedtuple argument costs ~40 us of typing per call on Numba's Python path."""
    jobs = Jobs(*job_arrays)
    table = Table(*table_arrays)
    b = Batch(*batch_arrays)
    reserve = 1  # tx rows one more packet may need: a completion sends one result per worker
    for j in range(jobs.active.size):
        if jobs.active[j]:
            reserve = max(reserve, jobs.world[j])
    cs = jobs.core_stats
    n_ctl = 0
    n_groups = 0
    n_contrib = 0
    n_events = 0
    planned = 0
    i = start
    while i < n_rx:
        if planned + reserve > tx_len.size:
            break
        length = rx_len[i]
        p = rx_data[i]
        i += 1
        cs[PACKETS_IN] += 1
        if length < 0:
            cs[DROP_TRUNCATED] += 1
            continue
        if length < HDR:
            cs[DROP_SHORT] += 1
            continue
        if get_u16(p, O_MAGIC) != MAGIC:
            cs[DROP_BAD_MAGIC] += 1
            continue
        if p[O_VERSION] != VERSION:
            cs[DROP_BAD_VERSION] += 1
            continue
        typ = p[O_TYPE]
        if typ != MsgType.DATA:
            if typ == MsgType.JOIN or typ == MsgType.LEAVE or typ == MsgType.STATS_REQUEST:
                control[n_ctl] = i - 1
                n_ctl += 1
            else:
                cs[DROP_UNKNOWN_TYPE] += 1
            continue
        j = _find_job(jobs, get_u32(p, O_JOB))
        if j < 0:
            cs[DROP_UNKNOWN_JOB] += 1
            continue
        st = jobs.stats[j]
        st[PACKETS_IN] += 1
        rank = get_u16(p, O_RANK)
        n = jobs.world[j]
        if rank >= n:
            st[DROP_RANK] += 1
            continue
        if jobs.members[j, rank] != rx_addr[i - 1]:
            st[DROP_UNREGISTERED] += 1
            continue
        jobs.last_seen[j, rank] = now  # any packet of a member, retransmissions too, keeps the job alive
        slot = get_u16(p, O_SLOT)
        if slot >= jobs.pool[j] or slot % cores != core:
            st[DROP_SLOT] += 1
            continue
        codec = np.int64(p[O_CODEC])
        if codec != jobs.codec[j]:
            st[DROP_CODEC] += 1
            continue
        count = get_u16(p, O_COUNT)
        width = 1 if codec == Codec.CNAT8 else 4
        if count > jobs.packet_elements[j] or length != HDR + width * count:
            st[DROP_COUNT] += 1
            continue
        x = np.int64(p[O_SHADOW])
        if x > 1:
            st[DROP_SHADOW] += 1
            continue
        exp = get_i8(p, O_EXP)
        next_exp = get_i8(p, O_NEXT_EXP)
        lo, hi = (E_MIN, E_MAX) if codec == Codec.CNAT8 else (INT32_E_MIN, INT32_E_MAX)
        if (exp != NO_EXP and (exp < lo or exp > hi)) or (next_exp != NO_EXP and (next_exp < lo or next_exp > hi)):
            st[DROP_BAD_EXP] += 1
            continue
        allreduce = get_u32(p, O_ALLREDUCE)
        chunk = get_i32(p, O_CHUNK)
        key = round_key(allreduce, chunk)
        row = jobs.row_base[j] + slot // cores
        current = table.round_key[row, x]
        if key < current:
            st[DROP_STALE] += 1
            continue
        fresh = key > current
        g = b.group_of[row, x]
        if fresh and g >= 0:  # a new round in a set with work in this burst: finish the burst first
            i -= 1
            cs[PACKETS_IN] -= 1  # counted again when the next call takes the packet
            st[PACKETS_IN] -= 1
            break
        bit = np.uint64(1) << np.uint64(rank)
        if not fresh and table.bitmap[row, x] & bit:
            st[RETRANSMISSIONS] += 1
            if table.count[row, x] == n:
                if g < 0:
                    g = _new_group(b, n_groups, row, x, j, False)
                    n_groups += 1
                b.event_group[n_events] = g
                b.event_rank[n_events] = rank
                n_events += 1
                planned += 1
                st[RESULTS_RESENT] += 1
            else:
                st[DROP_DUPLICATE_INCOMPLETE] += 1
            continue
        if not fresh and (exp != table.exp[row, x] or count != table.elements[row, x]):
            st[DROP_EXP_MISMATCH if exp != table.exp[row, x] else DROP_COUNT] += 1
            continue
        vbits = jobs.value_bits[j]
        if codec == Codec.CNAT8:
            floor = cnat_floor(exp, vbits)
            ok = codes_in_range(p[HDR:HDR + count], floor, floor - 1 if exp == NO_EXP else exp)
        else:
            ok = _int32_ok(p, count, np.int64(1) << vbits)
        if not ok:
            st[DROP_INVALID_CODE] += 1
            continue
        # All checks passed: this packet contributes (its data is added in phase 2).
        if fresh:
            table.round_key[row, x] = key
            table.bitmap[row, x] = 0
            table.count[row, x] = 0
            table.exp[row, x] = exp
            table.elements[row, x] = count
            table.next_exp[row, x] = next_exp
        else:
            table.next_exp[row, x] = max(table.next_exp[row, x], next_exp)
        if g < 0:
            g = _new_group(b, n_groups, row, x, j, table.count[row, x] == 0)
            n_groups += 1
        b.packet[n_contrib] = i - 1
        b.next[n_contrib] = b.head[g]
        b.head[g] = n_contrib
        n_contrib += 1
        table.bitmap[row, x] |= bit
        table.count[row, x] += 1
        st[CONTRIBUTIONS] += 1
        if table.count[row, x] == n:
            b.complete[g] = True
            b.event_group[n_events] = g
            b.event_rank[n_events] = -1
            n_events += 1
            planned += n
            st[COMPLETIONS] += 1

    for g in range(n_groups):
        _aggregate(jobs, table, b, g, rx_data, core, cores)
        b.group_of[b.row[g], b.shadow[g]] = -1
    n_tx = 0
    for e in range(n_events):
        g = b.event_group[e]
        row, x, j = b.row[g], b.shadow[g], b.job[g]
        rank = b.event_rank[e]
        if rank >= 0:
            n_tx = _emit(jobs, table, j, row, x, jobs.members[j, rank], tx_ptr, tx_len, tx_addr, n_tx)
        elif jobs.group[j]:  # one datagram to the job's multicast group reaches every worker
            n_tx = _emit(jobs, table, j, row, x, jobs.group[j], tx_ptr, tx_len, tx_addr, n_tx)
        else:
            for r in range(jobs.world[j]):
                n_tx = _emit(jobs, table, j, row, x, jobs.members[j, r], tx_ptr, tx_len, tx_addr, n_tx)
    return i, n_tx, n_ctl
