"""Two-level aggregation (leaf-spine; docs/protocol.md, "Leaf-spine") as two Numba burst kernels over the slot
table of aggregator.slots, built from its pipeline stages: ``leaf_burst`` for a rack's switch, ``spine_burst``
for the switch above the leaves. Sans-I/O, as process_burst: bursts of numpy arrays in, datagram descriptors out.

* A leaf's round completes when its rack's ranks (``Routes.quorum`` of them, the ranks of ``Routes.rack``) have
  contributed. It does not re-encode: it writes the round's int32 accumulators as one PARTIAL datagram
  (protocol.partial) with the rack's largest next-exponent proposal and its contributors bitmap, keeps it in the
  set's result row and sends it to the spine. The spine's RESULT for that round replaces it there and goes to
  every rank of the rack (or the job's multicast group).
* The spine treats each leaf as a rank: a set completes when every leaf's PARTIAL has arrived; the partials add
  as int32 (exact: each contribution is bounded by 2**s(n), n the job's whole world), and the total is re-encoded
  by slots.complete, as one switch does, so the result is the one-switch result bit for bit. It goes to every
  leaf and is kept for re-sends.
* Congestion (docs/window.md): a PARTIAL may carry the CONGESTED mark in its shadow byte, set by a deep queue on
  the leaf's port up. The spine echoes it, as a TCP receiver echoes ECN: a round's result leaves for the leaves
  marked if any of the round's partials came marked, and a stored result re-sent in answer to a marked partial
  leaves marked. A leaf passes a marked RESULT on to its ranks, whose send windows shrink. Stored partials and
  results stay unmarked: a re-send carries only the marks of the queues it meets.
* Losses (SwitchML's shadow sets, one level up): a rank's retransmission into a leaf set whose rack is complete
  gets the stored RESULT if the spine's came, else makes the leaf send its stored PARTIAL again (once for the rack's
  duplicates within its route's hold, if it has one: resend_partial); into one whose
  rack is incomplete, the PENDING with the rack's ranks the set has (protocol.wire), as one switch answers; the spine
  answers a PARTIAL it already holds with its stored RESULT if the set is complete (a lost result), else drops it.
  A stored RESULT sent again carries the STORED mark (protocol.wire), and a leaf passes the spine's on.
  A set is reused only after every rank had its previous round's result, so a stored PARTIAL is never needed
  once its set opens a new round.

Every output is copied once into a staging row (``stage``: one per received datagram) and the descriptors point
there, so a set that changes later in the same burst cannot change what was already queued.
"""

from __future__ import annotations

from collections import namedtuple

import numpy as np
from numba import njit

from intml.aggregator.slots import (
    CONTROL,
    OTHER_LEVEL,
    Batch,
    Jobs,
    Limiter,
    Table,
    admit_control,
    classify,
    complete,
    emit,
    header_verdict,
    lookup_job,
    open_round,
    payload_verdict,
    set_flags,
    take_nonfinite,
    validate,
)
from intml.protocol import codecs
from intml.protocol.codecs import int32
from intml.protocol.packet import HDR, O_SHADOW, O_TYPE, element_fields, put_pending, round_order
from intml.protocol.partial import SUM_WIDTH, contributors, partial_size, put_partial, sums_in_bounds
from intml.protocol.job import MAX_WORLD
from intml.protocol.stats import (
    COMPLETIONS,
    CONTRIBUTIONS,
    DROP_BAD_EXP,
    DROP_BAD_OWNER,
    DROP_CODEC,
    DROP_COUNT,
    DROP_DUPLICATE_INCOMPLETE,
    DROP_DUPLICATE_RESENT,
    DROP_EXP_MISMATCH,
    DROP_INVALID_CODE,
    DROP_RANK,
    DROP_SHADOW,
    DROP_SLOT,
    DROP_STALE,
    DROP_UNKNOWN_JOB,
    DROP_UNKNOWN_TYPE,
    DROP_UNREGISTERED,
    NEWER,
    OLDER,
    PACKETS_IN,
    PACKETS_OUT,
    RESULTS_RESENT,
    RETRANSMISSIONS,
    SAME_KNOWN_RANK,
    SAME_NEW_RANK,
)
from intml.protocol.wire import CONGESTED, MARKS, NO_EXP, STORED, MsgType

# A leaf's view of each job (per job index): how many ranks its rack holds, which (bitmap), the spine's address
# key, the leaf's index at the spine, and ``hold``: how long a re-sent partial answers the rack's other duplicates
# (seconds). Per slot row and shadow set, when the set's stored partial last went up again (``resent_at``, the
# burst's ``now``) and for which ranks' duplicates (``asked``; 0: not since it first went up): see resend_partial.
Routes = namedtuple("Routes", "quorum rack spine leaf hold asked resent_at")
# The spine's view (per job index and leaf index): the leaf's rack bitmap and its size. The leaves' addresses are
# the job's members, and its world the number of leaves. Per slot row and shadow set, ``echo``: CONGESTED if a
# partial of the set's current round came marked, else 0.
Fabric = namedtuple("Fabric", "racks sizes echo")


def new_routes(capacity: int, rows: int) -> Routes:
    return Routes(quorum=np.zeros(capacity, np.int64), rack=np.zeros(capacity, np.uint64),
                  spine=np.zeros(capacity, np.uint64), leaf=np.zeros(capacity, np.int64),
                  hold=np.zeros(capacity, np.float64), asked=np.zeros((rows, 2), np.uint64),
                  resent_at=np.zeros((rows, 2), np.float64))


def new_fabric(capacity: int, rows: int) -> Fabric:
    return Fabric(racks=np.zeros((capacity, MAX_WORLD), np.uint64), sizes=np.zeros((capacity, MAX_WORLD), np.int64),
                  echo=np.zeros((rows, 2), np.uint8))


@njit(inline="always")
def stage_copy(stage, n_stage, src, size):
    """Copy a stored datagram's ``size`` bytes into staging row ``n_stage``; returns its address."""
    row = stage[n_stage]
    row[:size] = src[:size]
    return row.ctypes.data


@njit(inline="always")
def answer_retransmission(table, row, x, complete_at, dest, mark, st, stage, n_stage, out_ptr, out_len, out_addr,
                          n_out, p, pending):
    """A contribution ``p`` already in (row, x)'s round: if the round is complete at this level (``complete_at``
    contributions), the set's stored datagram again, to ``dest`` alone, with ``mark`` added to its shadow byte (a
    congestion mark to echo, or 0) and, on a RESULT, STORED (protocol.wire); else, if ``pending`` (a rank's DATA at
    a leaf), its PENDING with the ranks the round has, to ``dest``, or dropped (a leaf's PARTIAL at the spine).
    Returns (n_stage, n_out)."""
    st[RETRANSMISSIONS] += 1
    if table.count[row, x] != complete_at:
        st[DROP_DUPLICATE_INCOMPLETE] += 1
        if not pending:
            return n_stage, n_out
        q = stage[n_stage]
        n_out = emit(q.ctypes.data, put_pending(q, p, table.bitmap[row, x]), dest, out_ptr, out_len, out_addr, n_out)
        st[PACKETS_OUT] += 1
        return n_stage + 1, n_out
    size = table.result_len[row, x]
    src = stage_copy(stage, n_stage, table.result[row, x], size)
    stage[n_stage, O_SHADOW] |= mark | (STORED if stage[n_stage, O_TYPE] == MsgType.RESULT else 0)
    n_out = emit(src, size, dest, out_ptr, out_len, out_addr, n_out)
    st[RESULTS_RESENT] += 1
    st[PACKETS_OUT] += 1
    return n_stage + 1, n_out


@njit(inline="always")
def resend_partial(route, row, x, bit, now, hold):
    """Whether a rank's duplicate (``bit``) into (row, x), whose rack is complete and whose spine result has not
    come, sends the stored partial up again (docs/window.md, "One partial per wave of duplicates"): the first
    duplicate since the partial went up does, and then one a ``hold`` after the last re-send, or a rank's second
    since it (its own timer saying that re-send brought nothing). The others are dropped: the re-send answers
    them all, as the spine's result goes to the whole rack."""
    asked = route.asked[row, x]
    if asked != 0 and asked & bit == 0 and now < route.resent_at[row, x] + hold:
        route.asked[row, x] = asked | bit
        return False
    route.asked[row, x] = bit
    route.resent_at[row, x] = now
    return True


@njit(inline="always")
def take_contribution(table, row, x, event, key, exp, count, next_exp, bit):
    """(row, x) takes a checked contribution of round ``key`` from the sender of ``bit``: its round opens (NEWER)
    or the round's next exponent rises to the proposal; the bit is set and counted. Returns whether it is the
    round's first (which writes the accumulators: no zeroing); the caller adds its values."""
    if event == NEWER:
        open_round(table, row, x, key, exp, count, next_exp, 0)
    else:
        table.next_exp[row, x] = max(table.next_exp[row, x], next_exp)
    first = table.count[row, x] == 0
    table.bitmap[row, x] |= bit
    table.count[row, x] += 1
    return first


@njit(inline="always")
def agreement(exp, count, round_exp, round_count):
    """0 if a new contribution agrees with its round's exponent and element count, else the drop reason."""
    if exp != round_exp:
        return DROP_EXP_MISMATCH
    return DROP_COUNT if count != round_count else 0


@njit(cache=True, nogil=True, boundscheck=False)
def leaf_burst(rx_data, rx_len, rx_addr, n_rx, now, job_arrays, table_arrays, route_arrays, rows, stage,
               out_ptr, out_len, out_addr, control, limiter):
    """Handle received datagrams 0..n_rx-1 at a leaf: its ranks' DATA, the spine's RESULTs, and control
    datagrams (admitted as process_burst does, listed in ``control``). Returns (datagrams described in out_*,
    control datagrams listed). ``rows``: scratch of one int64; ``stage``: n_rx rows of the widest datagram;
    out_* need n_rx * MAX_WORLD entries."""
    jobs = Jobs(*job_arrays)
    table = Table(*table_arrays)
    route = Routes(*route_arrays)
    lim = Limiter(*limiter)
    cs = jobs.core_stats
    n_ctl = n_out = n_stage = 0
    for i in range(n_rx):
        p = rx_data[i]
        length = rx_len[i]
        verdict = header_verdict(length, p, MsgType.RESULT, cs)
        if verdict == CONTROL:
            n_ctl = admit_control(lim, control, n_ctl, i, rx_addr[i], now, cs)
            continue
        if verdict > 0:
            cs[verdict] += 1
            continue
        from_spine = verdict == OTHER_LEVEL
        j = lookup_job(jobs, p, rx_addr[i])
        if j < 0:
            cs[DROP_UNKNOWN_JOB] += 1
            continue
        st = jobs.stats[j]
        st[PACKETS_IN] += 1
        reason = 0
        rank, owners, slot, count, codec, x, exp, next_exp, key = element_fields(p)
        vbits = jobs.value_bits[j]
        if from_spine:  # the spine's RESULT of a round this rack completed: keep it and replicate it
            mark = x & MARKS  # a queue on the way from the spine marked it, or the spine re-sent it: on to the ranks
            x ^= mark
            if rx_addr[i] != route.spine[j]:
                reason = DROP_UNREGISTERED
            elif slot >= jobs.pool[j] or slot % jobs.stride[j] != jobs.offset[j]:
                reason = DROP_SLOT
            elif codec != jobs.codec[j]:
                reason = DROP_CODEC
            elif length != HDR + codecs.width(codec) * count:
                reason = DROP_COUNT
            elif x > 1:
                reason = DROP_SHADOW
            elif owners != 0:
                reason = DROP_BAD_OWNER
            if reason:
                st[reason] += 1
                continue
            row = jobs.row_base[j] + slot // jobs.stride[j]
            held = table.result[row, x]
            if table.bitmap[row, x] == 0 or round_order(key, table.round_key[row, x]) != 0 \
                    or table.count[row, x] != route.quorum[j] or held[O_TYPE] != MsgType.PARTIAL:
                st[DROP_STALE] += 1  # no round here waits for it: a duplicate, or a result of a round long gone
                continue
            reason = agreement(exp, count, table.exp[row, x], table.elements[row, x])
            if reason == 0 and not codecs.check_result(codec, p[HDR:length], exp, vbits):
                reason = DROP_INVALID_CODE
            if reason:
                st[reason] += 1
                continue
            held[:length] = p[:length]
            table.result_len[row, x] = length
            st[COMPLETIONS] += 1
            src = stage_copy(stage, n_stage, held, length)
            n_stage += 1
            held[O_SHADOW] = x  # the copies carry the mark; the stored result not: a re-send meets queues of its own
            first = n_out
            if jobs.group[j]:  # one datagram to the rack's multicast group
                n_out = emit(src, length, jobs.group[j], out_ptr, out_len, out_addr, n_out)
            else:
                for r in range(jobs.world[j]):
                    if route.rack[j] >> np.uint64(r) & np.uint64(1):
                        n_out = emit(src, length, jobs.members[j, r], out_ptr, out_len, out_addr, n_out)
            st[PACKETS_OUT] += n_out - first
            continue
        reason = validate(length, rank, jobs.world[j], rx_addr[i], jobs.members[j, min(rank, MAX_WORLD - 1)], slot,
                          jobs.pool[j], jobs.offset[j], jobs.stride[j], codec, jobs.codec[j], count,
                          jobs.packet_elements[j], x, exp, next_exp, owners)
        if reason != DROP_RANK and reason != DROP_UNREGISTERED:
            jobs.last_seen[j, rank] = now
        if reason == 0 and owners != 0:
            reason = DROP_BAD_OWNER  # a leaf aggregates allreduces only (no reduce-scatter owners)
        if reason:
            st[reason] += 1
            continue
        row = jobs.row_base[j] + slot // jobs.stride[j]
        bit = np.uint64(1) << np.uint64(rank)
        event = classify(table.round_key[row, x], table.bitmap[row, x], key, bit)
        if event == OLDER:
            st[DROP_STALE] += 1
            continue
        held = table.result[row, x]
        if event == SAME_KNOWN_RANK:  # a complete rack: the spine's result if it came, else the partial again;
            # an incomplete one: its PENDING to the rank
            complete = table.count[row, x] == route.quorum[j]
            if complete and held[O_TYPE] == MsgType.PARTIAL \
                    and not resend_partial(route, row, x, bit, now, route.hold[j]):
                st[RETRANSMISSIONS] += 1
                st[DROP_DUPLICATE_RESENT] += 1
                continue
            dest = route.spine[j] if complete and held[O_TYPE] != MsgType.RESULT else jobs.members[j, rank]
            n_stage, n_out = answer_retransmission(table, row, x, route.quorum[j], dest, 0, st, stage, n_stage,
                                                   out_ptr, out_len, out_addr, n_out, p, True)
            continue
        if event == SAME_NEW_RANK:
            reason = agreement(exp, count, table.exp[row, x], table.elements[row, x])
        verdict = payload_verdict(p, codec, count, exp, vbits) if reason == 0 else 0
        if reason or verdict > 1:
            st[reason or verdict] += 1
            continue
        first = take_contribution(table, row, x, event, key, exp, count, next_exp, bit)
        if verdict:
            take_nonfinite(table, row, x, p, codec, count, exp, vbits)
        st[CONTRIBUTIONS] += 1
        acc = table.acc[row, x, :count]
        if count:
            rows[0] = i
            codecs.add_payloads(codec, rx_data, rows, 1, HDR, acc, exp, vbits, first)
        if table.count[row, x] == route.quorum[j]:  # the rack is complete: its partial goes up
            size = put_partial(held, jobs.job_id[j], key >> 32 & 0xFFFFFFFF, (key & 0xFFFFFFFF) - (np.int64(1) << 31),
                               route.leaf[j], slot, codec, x, exp, table.next_exp[row, x], acc, table.bitmap[row, x])
            if table.nonfinite[row, x]:  # as int32 mode's reserved words, whatever the codec
                int32.put_nonfinite(held[HDR:HDR + SUM_WIDTH * count], table.flags[row, x, :count])
            table.result_len[row, x] = size
            route.asked[row, x] = 0
            n_out = emit(stage_copy(stage, n_stage, held, size), size, route.spine[j], out_ptr, out_len, out_addr,
                         n_out)
            n_stage += 1
            st[PACKETS_OUT] += 1
    return n_out, n_ctl


@njit(cache=True, nogil=True, boundscheck=False)
def spine_burst(rx_data, rx_len, rx_addr, n_rx, now, job_arrays, table_arrays, fabric_arrays, batch_arrays, rows,
                stage, out_ptr, out_len, out_addr):
    """Handle received datagrams 0..n_rx-1 at the spine: the leaves' PARTIALs (anything else is counted and
    dropped). A job's ``world`` is its number of leaves, ``members[j, l]`` leaf l's address, ``value_bits`` s(n)
    of the job's whole world. Returns the datagrams described in out_* (n_rx * MAX_WORLD entries; ``stage``:
    n_rx rows)."""
    jobs = Jobs(*job_arrays)
    table = Table(*table_arrays)
    fabric = Fabric(*fabric_arrays)
    b = Batch(*batch_arrays)
    cs = jobs.core_stats
    n_out = n_stage = 0
    for i in range(n_rx):
        p = rx_data[i]
        length = rx_len[i]
        verdict = header_verdict(length, p, MsgType.PARTIAL, cs)
        if verdict != OTHER_LEVEL:  # a spine takes PARTIALs only: DATA and control go to the ranks' leaves
            cs[verdict if verdict > 0 else DROP_UNKNOWN_TYPE] += 1
            continue
        j = lookup_job(jobs, p, rx_addr[i])
        if j < 0:
            cs[DROP_UNKNOWN_JOB] += 1
            continue
        st = jobs.stats[j]
        st[PACKETS_IN] += 1
        reason = 0
        leaf, owners, slot, count, codec, x, exp, next_exp, key = element_fields(p)
        mark = x & CONGESTED  # a deep queue on the leaf's port up (docs/window.md): echoed in the result
        x ^= mark
        lo, hi = codecs.exp_range(jobs.codec[j])
        if leaf >= jobs.world[j]:
            reason = DROP_RANK
        elif rx_addr[i] != jobs.members[j, leaf]:
            reason = DROP_UNREGISTERED  # not from the leaf of that index: unknown, or spoofed
        elif slot >= jobs.pool[j] or slot % jobs.stride[j] != jobs.offset[j]:
            reason = DROP_SLOT
        elif codec != jobs.codec[j]:
            reason = DROP_CODEC
        elif count > jobs.packet_elements[j] or length != partial_size(count) \
                or contributors(p, count) != fabric.racks[j, leaf]:
            reason = DROP_COUNT  # wrong size, or not exactly the leaf's rack summed
        elif x > 1:
            reason = DROP_SHADOW
        elif (exp != NO_EXP and not lo <= exp <= hi) or (next_exp != NO_EXP and not lo <= next_exp <= hi):
            reason = DROP_BAD_EXP
        elif owners != 0:
            reason = DROP_BAD_OWNER
        if reason != DROP_RANK and reason != DROP_UNREGISTERED:
            jobs.last_seen[j, leaf] = now
        if reason:
            st[reason] += 1
            continue
        row = jobs.row_base[j] + slot // jobs.stride[j]
        bit = np.uint64(1) << np.uint64(leaf)
        leaves = jobs.world[j]
        event = classify(table.round_key[row, x], table.bitmap[row, x], key, bit)
        if event == OLDER:
            st[DROP_STALE] += 1
            continue
        if event == SAME_KNOWN_RANK:  # if complete, the leaf lost the result: the stored one, to it alone
            n_stage, n_out = answer_retransmission(table, row, x, leaves, jobs.members[j, leaf], mark, st, stage,
                                                   n_stage, out_ptr, out_len, out_addr, n_out, p, False)
            continue
        vbits = jobs.value_bits[j]
        if event == SAME_NEW_RANK:
            reason = agreement(exp, count, table.exp[row, x], table.elements[row, x])
        limit = fabric.sizes[j, leaf] * codecs.contribution_bound(codec, exp, vbits)
        sums = p[HDR:HDR + SUM_WIDTH * count]
        nonfinite = False
        if reason == 0 and not sums_in_bounds(p, count, limit):  # or carries non-finite lanes as reserved words
            nonfinite = int32.take_words(sums.copy(), limit, np.zeros(count, np.uint8))
            reason = 0 if nonfinite else DROP_INVALID_CODE
        if reason:
            st[reason] += 1
            continue
        first = take_contribution(table, row, x, event, key, exp, count, next_exp, bit)
        fabric.echo[row, x] = mark if first else fabric.echo[row, x] | mark
        if nonfinite:
            int32.take_words(sums, limit, set_flags(table, row, x, count))
        st[CONTRIBUTIONS] += 1
        if count:  # partial sums are int32 whatever the job's codec
            rows[0] = i
            int32.add_payloads(rx_data, rows, 1, HDR, table.acc[row, x, :count], exp, vbits, first)
        if table.count[row, x] == leaves:  # every rack is in: re-encode the total, as one switch does
            b.row[0], b.shadow[0], b.job[0] = row, x, j
            complete(jobs, table, b, 0)
            st[COMPLETIONS] += 1
            size = table.result_len[row, x]
            src = stage_copy(stage, n_stage, table.result[row, x], size)
            stage[n_stage, O_SHADOW] |= fabric.echo[row, x]  # the copies echo the round's marks; the stored result not
            n_stage += 1
            for leaf_ in range(leaves):
                n_out = emit(src, size, jobs.members[j, leaf_], out_ptr, out_len, out_addr, n_out)
            st[PACKETS_OUT] += leaves
    return n_out
