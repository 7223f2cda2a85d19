"""The worker's sans-I/O streaming engine: chunking, the window of slots, exponent agreement, retransmission and
result decoding, as Numba kernels over bursts. No sockets, no clock: the driver passes received datagrams as a
``protocol.burst.Burst`` and ``now``, and sends the ``Burst`` the engine hands back, whose rows point at the
engine's stored datagrams (as aioquic's QuicConnection does, without the copies).

One allreduce of a flat float32 tensor of N elements, packet size P and pool size W:

* The tensor is cut into C = ceil(N / P) chunks; chunk c goes to slot c mod W' (W' = min(W, C)), so slot s
  carries chunks s, s + W', s + 2W', ... one at a time: the next is sent only when the previous result is back.
* Exponent agreement: slot s first sends a bootstrap chunk s - W' with no elements that carries this worker's
  exponent for chunk s; every DATA packet for chunk c carries the exponent for chunk c + W'. The result of each
  round carries the switch's maximum, the exponent every worker then encodes chunk c + W' against.
* Each use of a slot flips its shadow set; the parity persists over the job's life, so consecutive uses of a
  slot alternate sets across allreduces too, as the switch requires.
* A slot whose result is late is retransmitted (the stored datagram, byte for byte) by the retransmission
  policy, worker.retransmit: an adaptive RTO (RFC 6298, Karn's rule), fast retransmit after FAST_RETRANSMIT
  overtaking results, and probes of a silent aggregator core. Results that are duplicate, stale (another
  allreduce, chunk or shadow set), foreign (another job or source) or malformed are counted and dropped.
* With the job's DATA/RESULT MAC (``data_mac_keys``), every DATA datagram ends in a SipHash-2-4 tag under the data
  key of the core its slot lives on, and the result a slot waits for is taken only if its tag is valid: a forged
  or altered RESULT is counted (drop_bad_mac) and dropped, so it can make no rank diverge.
* cnat8: chunk c is encoded with the floor of its agreed exponent and random words keyed by
  (seed, worker_stream(allreduce, rank), element index); the result codes decode straight to float32. The
  tensor is read from memory once, a chunk at a time: when the packet of chunk c is built, chunk c + W' is
  read for its exponent proposal and encoded at that proposal's floor straight into the payload of the slot's
  other datagram buffer (protocol.arith.precode_chunk). Once its agreed floor is known, its codes are lowered
  to it, or encoded again only if one of its nonzero values lies below that floor, the one case where the
  floor changes which power of two a value rounds to.
  A NaN or an infinity goes on the wire as its non-finite code (docs/arithmetic.md, "Non-finite values") and is
  counted (nonfinite_elements); its chunk's exponent is that of its finite values.
  int32: chunk c is sent as rint(x * 2**(s - E)), the sum comes back as int32 and is scaled by 2**(E - s).
* Precoded cnat8 (``start_precoded``: a bucket encoded on a GPU, worker.gpu): the engine gets every chunk's codes at
  its own floor with its exponent proposal and low word, and never sees a float. A chunk's codes are copied into
  its datagram when it is sent and lowered as above; the two cases it cannot serve itself park the slot (no
  datagram, no timer) until the driver acts: codes not yet copied from the device (``codes_ready``), and a chunk
  that must be encoded again at its agreed floor (``reencode_requests``, then ``reencoded`` with the device's
  codes, exactly the ones the float path encodes). Result codes are written back over the codes, undecoded.
* Reduce-scatter (``start(..., scatter=True)``; docs/protocol.md, "Reduce-scatter"): the same rounds, with each
  chunk's owners (the ranks whose shards of N / n elements it overlaps) in its DATA packets. The output is this
  rank's shard: the engine decodes the part of each owned chunk that lies in it, and takes a header-only
  completion (count 0) of any other chunk as a result.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from intml.protocol import codecs
from intml.protocol.codec import Codec
from intml.protocol.cnat import kept_heads
from intml.protocol.codecs.cnat8 import encodes_again
from intml.protocol.arith import (
    NO_EXP,
    PRECODED,
    chunk_exponents_kernel,
    cnat_floor,
    precode_chunk,
    value_bits,
    worker_stream,
)
from intml.protocol.burst import Burst
from intml.protocol.half import FLOAT16, FLOAT32, format_of, narrow_kernel, widen_kernel
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
    get_u64,
    owner_range,
    owners_code,
    put_header,
)
from intml.protocol.job import WorkerTimers
from intml.protocol.rng import derive_key
from intml.protocol.siphash import put_tag, tag_ok
from intml.protocol.wire import (
    CONGESTED,
    MARKS,
    MAGIC,
    OWNERS_SHIFT,
    PENDING_SIZE,
    SHADOW_SET,
    STORED,
    TAG_SIZE,
    VERSION,
    MsgType,
    element_datagram_size,
)
from intml.worker.retransmit import (
    T_RTO,
    arm,
    disarm,
    fast_retransmit,
    answered,
    next_deadline,
    on_pending,
    needed,
    on_result,
    restart_silences,
    silence_state,
    timer_kernel,
    timing_state,
)
from intml.worker.state import (
    CONGESTION_MARKS,
    DROP_BAD_MAC,
    DROP_FOREIGN,
    DROP_MALFORMED,
    DROP_STALE,
    DROP_UNSENT,
    HELD,
    IDLE,
    NONFINITE,
    PACKETS_IN,
    PARKED,
    PENDINGS,
    P_ALLREDUCE,
    P_CHUNKS,
    P_CODEC,
    P_CORES,
    P_DONE,
    P_ELEMENTS,
    P_FORMAT,
    P_JOB,
    P_MEAN,
    P_OUT_LO,
    P_PKT,
    P_PRECODED,
    P_RANK,
    P_READY,
    P_SEED,
    P_SHARD,
    P_STOCHASTIC,
    P_VBITS,
    P_WINDOW,
    P_WORLD,
    PARAMS,
    RESULTS,
    SATURATED,
    SPURIOUS,
    STAT_NAMES,
    State,
    queue_slot,
)
from intml.worker.window import W_CWND, admitted, holds, on_bootstrap_mark, on_mark, window_state

EXACT = np.uint32(PRECODED | 0x7FFFFFFF)  # low word of codes encoded at their agreed floor (nothing underflows)


@njit(cache=True, nogil=True, boundscheck=False, _nrt=False)
def _chunk_count(st, c):
    pkt = st.params[P_PKT]
    return 0 if c < 0 else min(pkt, st.params[P_ELEMENTS] - c * pkt)


@njit(cache=True, nogil=True, boundscheck=False, _nrt=False)
def _owners(prm, c):
    """The owners code of chunk c: in a reduce-scatter, the ranks whose shards its elements overlap; else (and for
    a bootstrap chunk) ALL_OWNERS."""
    shard = prm[P_SHARD]
    if c < 0 or shard == 0:
        return 0
    lo = c * prm[P_PKT]
    hi = min(prm[P_ELEMENTS], lo + prm[P_PKT])
    return owners_code(lo // shard, (hi - 1) // shard)


@njit(inline="always")
def _worker_key(prm):
    """The key of this rank's random stream in the current allreduce."""
    return _worker_key_of(prm[P_SEED], prm[P_ALLREDUCE], prm[P_RANK])


@njit(cache=True, _nrt=False)
def _worker_key_of(seed, allreduce, rank):
    return derive_key(np.uint64(seed), worker_stream(allreduce, rank))


@njit(inline="always")
def _values(st, lo, hi):
    """Elements lo..hi (one chunk at most) of the input as float32: the input's own, or a 16-bit input's widened
    into the scratch, exactly."""
    fmt = st.params[P_FORMAT]
    if fmt == FLOAT32:
        return st.x[lo:hi]
    block = st.scratch[:hi - lo]
    widen_kernel(st.x16[lo:hi], block.view(np.uint32), fmt)
    return block


@njit(cache=True, nogil=True, boundscheck=False, _nrt=False)
def chunk_exponents16_kernel(x16, chunk_elements, lo, hi, out, fmt, scratch):
    """chunk_exponents_kernel of 16-bit x16, a chunk (scratch's size) widened at a time."""
    nonfinite = 0
    for c in range(out.size):
        start = c * chunk_elements
        block = scratch[:min(x16.size, start + chunk_elements) - start]
        widen_kernel(x16[start:start + block.size], block.view(np.uint32), fmt)
        nonfinite += chunk_exponents_kernel(block, chunk_elements, lo, hi, out[c:c + 1])
    return nonfinite


@njit(cache=True, nogil=True, boundscheck=False, _nrt=False)
def _precode(st, d):
    """cnat8: encode chunk d at its own floor (protocol.arith.precode_chunk) into the payload of the datagram
    buffer its slot will send it from, the one the slot's in-flight chunk does not use, and note its exponent
    proposal."""
    prm = st.params
    if not codecs.precodes(prm[P_CODEC]) or prm[P_PRECODED] or d >= prm[P_CHUNKS]:
        return  # (precoded: the driver gave every chunk's proposal and codes)
    s = d % prm[P_WINDOW]
    lo = d * prm[P_PKT]
    hi = min(prm[P_ELEMENTS], lo + prm[P_PKT])
    payload = st.packet[s, 1 - st.parity[s], HDR:HDR + hi - lo]
    sat, nonfinite, st.local_exp[d], st.low[d] = precode_chunk(_values(st, lo, hi), payload, _worker_key(prm), lo,
                                                               prm[P_VBITS], prm[P_STOCHASTIC] != 0, st.heads)
    st.stats[SATURATED] += sat
    st.stats[NONFINITE] += nonfinite


@njit(inline="always")
def _take_codes(st, c, exp, payload):
    """Precoded: copy chunk c's codes into its payload, if the engine can send them at agreed exponent exp (they
    are copied from the device, and need no new encode); else False."""
    prm = st.params
    lo = c * prm[P_PKT]
    vbits = prm[P_VBITS]
    if (lo + payload.size > prm[P_READY]
            or encodes_again(st.low[c], cnat_floor(exp, vbits), cnat_floor(st.local_exp[c], vbits))):
        return False
    for j in range(payload.size):  # a loop: a slice assignment may allocate a temporary (see State)
        payload[j] = st.codes[lo + j]
    return True


@njit(cache=True, nogil=True, boundscheck=False, _nrt=False)
def _build(st, s, c, now):
    """Write chunk c (or the bootstrap chunk c < 0) of slot s into the slot's datagram buffer for its parity;
    chunk c's codes are there already (precoded), unless the agreed floor changes some. Then precode the chunk
    whose exponent this packet carries, c + window, into the slot's other buffer. Returns False, with nothing
    built, for a precoded chunk whose codes the engine does not have yet: the slot is parked, timers off."""
    prm = st.params
    window, chunks, pkt = prm[P_WINDOW], prm[P_CHUNKS], prm[P_PKT]
    count = _chunk_count(st, c)
    exp = NO_EXP if c < 0 else st.agreed_exp[c]
    p = st.packet[s, st.parity[s]]
    codec = prm[P_CODEC]
    size = codecs.width(codec) * count
    if count > 0:
        lo = c * pkt
        payload = p[HDR:HDR + size]
        if prm[P_PRECODED] and not _take_codes(st, c, exp, payload):
            st.cur_chunk[s] = PARKED
            st.parked[s] = c
            disarm(st, s)
            return False
        codecs.encode_chunk(codec, _values(st, lo, lo + count), payload, _worker_key(prm), lo, exp, prm[P_VBITS],
                            st.low[c], st.local_exp[c], prm[P_STOCHASTIC] != 0, st.heads)
        if st.sent.size:  # asked for (error feedback): what this rank sends, decoded from the datagram itself
            codecs.decode_result(codec, payload, exp, prm[P_VBITS], st.sent[lo:lo + count])
    nxt = c + window
    if c >= 0:  # the bootstrap packets carry chunks 0..window-1, precoded by start_kernel
        _precode(st, nxt)
    next_exp = st.local_exp[nxt] if nxt < chunks else NO_EXP
    put_header(p, MsgType.DATA, prm[P_JOB], prm[P_ALLREDUCE], c, _owners(prm, c) << OWNERS_SHIFT | prm[P_RANK], s,
               count, codec, st.parity[s], exp, next_exp)
    keys = st.mac_keys
    if keys.shape[0]:
        k = s % prm[P_CORES]
        st.packet_len[s] = put_tag(p, HDR + size, keys[k, 0], keys[k, 1])
    else:
        st.packet_len[s] = HDR + size
    st.cur_chunk[s] = c
    arm(st, s, now)
    return True


@njit(cache=True, nogil=True, boundscheck=False, _nrt=False)
def start_kernel(state, now, tx_ptr, tx_len, tx_addr):
    """Send every slot's bootstrap chunk the send window admits. Returns the number of datagrams written."""
    st = State(*state)
    window = st.params[P_WINDOW]
    restart_silences(st.silence, now)
    for d in range(window):  # the bootstrap packets carry chunks 0..window-1's exponents
        _precode(st, d)
    for s in range(window):
        hold(st, s, s - window)
    return release(st, now, tx_ptr, tx_len, tx_addr, 0)


@njit(inline="always")
def hold(st, s, c):
    """Slot s's next chunk is c: held until the send window admits it (release), no timer meanwhile."""
    st.cur_chunk[s] = HELD
    st.parked[s] = c
    disarm(st, s)


@njit(cache=True, nogil=True, boundscheck=False, _nrt=False)
def release(st, now, tx_ptr, tx_len, tx_addr, n_tx):
    """Build and queue the held slots' chunks the send window admits now (worker.window.admitted: a slot that a
    PENDING answered, whose round waits on peers, is not in flight), lowest chunk first. Returns the new tx
    count."""
    while True:
        s = admitted(st.window, st.cur_chunk, st.parked, st.answered, st.params[P_WINDOW])
        if s < 0:
            return n_tx
        if _build(st, s, st.parked[s], now):  # (else parked: in flight all the same)
            queue_slot(st, s, tx_ptr, tx_len, tx_addr, n_tx)
            n_tx += 1


# ---- the receive pipeline's stages, in datagram order: validate the header, take its congestion mark, classify the
# result against its slot, validate it against the chunk, decode the sum, take the result (RTT, shadow set, send
# window), advance the slot.


@njit(inline="always")
def validate_header(p, length):
    """DROP_MALFORMED unless the datagram is a whole header of a RESULT or PENDING of this protocol version, else
    -1."""
    if (length < HDR or get_u16(p, O_MAGIC) != MAGIC or p[O_VERSION] != VERSION
            or (p[O_TYPE] != MsgType.RESULT and p[O_TYPE] != MsgType.PENDING)):
        return DROP_MALFORMED
    return -1


@njit(inline="always")
def have_ok(prm, have):
    """A PENDING's ``have`` names this rank, no rank beyond the world, and not every rank (its round is
    incomplete)."""
    world = np.uint64(prm[P_WORLD])
    every = np.uint64(0xFFFFFFFFFFFFFFFF) >> (np.uint64(64) - world)
    return (have >> np.uint64(prm[P_RANK])) & np.uint64(1) != 0 and have & ~every == 0 and have != every


@njit(inline="always")
def take_pending(st, p, length, addr, now):
    """A PENDING (protocol.wire): why it is dropped (as a result would be: foreign, stale, unsent, a bad tag, or
    malformed: not this rank's slot's round as it sent it, or a ``have`` without it), else -1 once the
    retransmission policy has taken it (worker.retransmit.on_pending; a second answer to one transmission is
    stale)."""
    prm = st.params
    drop = classify_result(prm, st.parity, st.cur_chunk, st.agg_addr, p, addr)
    if drop >= 0:
        return drop
    s = get_u16(p, O_SLOT)
    if st.taken[s]:
        return DROP_UNSENT
    length = authenticate(prm, st.mac_keys, p, length)
    if length < 0:
        return DROP_BAD_MAC
    if (length != PENDING_SIZE or get_u16(p, O_COUNT) != 0 or np.int64(p[O_CODEC]) != prm[P_CODEC]
            or get_u16(p, O_RANK) != _owners(prm, get_i32(p, O_CHUNK)) << OWNERS_SHIFT | prm[P_RANK]
            or not have_ok(prm, get_u64(p, HDR))):
        return DROP_MALFORMED
    if not on_pending(st, s, now):
        return DROP_STALE
    st.stats[PENDINGS] += 1
    return -1


@njit(inline="always")
def result_marks(p):
    """The marks a well-formed result carries outside its MAC (protocol.wire.MARKS): CONGESTED, the aggregator's
    congestion mark, and STORED, a completed round's result sent again in answer to this rank's duplicate."""
    return np.int64(p[O_SHADOW] & MARKS)


@njit(inline="always")
def classify_result(prm, parity, cur_chunk, agg_addr, p, addr):
    """Why a well-formed result is not the one slot get_u16(p, O_SLOT) waits for: DROP_FOREIGN (another job, a
    slot outside the pool, or not our aggregator core), DROP_STALE (a duplicate, or a result of an earlier round
    or allreduce), else -1. (The stages take the arrays they use, not the State: each array passed costs
    reference counting per datagram.)"""
    s = get_u16(p, O_SLOT)
    if get_u32(p, O_JOB) != prm[P_JOB] or s >= parity.size or addr != agg_addr[s % prm[P_CORES]]:
        return DROP_FOREIGN
    if (get_u32(p, O_ALLREDUCE) != prm[P_ALLREDUCE] or s >= prm[P_WINDOW] or get_i32(p, O_CHUNK) != cur_chunk[s]
            or np.int64(p[O_SHADOW] & SHADOW_SET) != parity[s]):
        return DROP_STALE
    return -1


@njit(inline="always")
def take_stale(st, p, length, marks):
    """A result classify_result found stale: if it is marked STORED, of this allreduce and authentic, a re-send of
    a round its slot took, which proves a retransmission of it spurious (worker.retransmit): counted."""
    prm = st.params
    if (marks & STORED and get_u32(p, O_ALLREDUCE) == prm[P_ALLREDUCE]
            and authenticate(prm, st.mac_keys, p, length) >= 0):
        st.stats[SPURIOUS] += 1
        needed(st.timing, False)


@njit(inline="always")
def authenticate(prm, keys, p, length):
    """With the DATA/RESULT MAC: the length of the result of slot get_u16(p, O_SLOT) without its tag, or -1 if the
    tag is missing or wrong (a forged result: counted, dropped, and the slot keeps waiting for the real one).
    Without it, the length."""
    if keys.shape[0] == 0:
        return length
    k = get_u16(p, O_SLOT) % prm[P_CORES]
    mark = p[O_SHADOW] & MARKS  # the tag covers the header without its marks: checked without them
    p[O_SHADOW] ^= mark  # (and the datagram left as it came: a simulator's ranks share a multicast result's copy)
    ok = tag_ok(p, length, keys[k, 0], keys[k, 1])
    p[O_SHADOW] |= mark
    return length - TAG_SIZE if ok else -1


@njit(inline="always")
def owned_count(prm, c, count):
    """The elements a result of chunk c (count elements) must carry to this rank: all of them, or none (a
    header-only completion) for a reduce-scatter chunk this rank does not own."""
    first, last = owner_range(_owners(prm, c), prm[P_WORLD])
    return count if first <= prm[P_RANK] <= last else 0


@njit(inline="always")
def validate_result(prm, agreed_exp, p, length, c, count):
    """DROP_MALFORMED unless the result of chunk c (count elements to this rank) has the codec, owners, size and
    exponents it must have, else -1."""
    codec = prm[P_CODEC]
    exp = NO_EXP if c < 0 else agreed_exp[c]
    next_exp = get_i8(p, O_NEXT_EXP)
    lo_exp, hi_exp = codecs.exp_range(codec)
    if (np.int64(p[O_CODEC]) != codec or get_u16(p, O_COUNT) != count or length != HDR + codecs.width(codec) * count
            or get_u16(p, O_RANK) != _owners(prm, c) << OWNERS_SHIFT
            or get_i8(p, O_EXP) != exp or (next_exp != NO_EXP and not lo_exp <= next_exp <= hi_exp)):
        return DROP_MALFORMED
    return -1


@njit(inline="always")
def decode_values(prm, payload, exp, out, out16, scratch, lo, hi):
    """The values of a result's payload into output elements lo..hi (one chunk at most), divided by the world
    size for a mean: into float32 ``out``, or for a 16-bit output through the scratch and rounded into ``out16``
    (to nearest even, as float32's values would be rounded: protocol.half)."""
    fmt = prm[P_FORMAT]
    values = out[lo:hi] if fmt == FLOAT32 else scratch[:hi - lo]
    codecs.decode_result(prm[P_CODEC], payload, exp, prm[P_VBITS], values)
    if prm[P_MEAN]:
        values /= np.float32(prm[P_WORLD])
    if fmt != FLOAT32:
        narrow_kernel(values.view(np.uint32), out16[lo:hi], fmt)


@njit(inline="always")
def decode_sum(prm, agreed_exp, out, out16, scratch, codes, p, c, count):
    """Chunk c's sum (count elements) from its result into the output ``out`` or ``out16`` (the part of it that
    lies there: the output holds elements P_OUT_LO .. P_OUT_LO + its size), or its codes into ``codes``
    (precoded: the device decodes them); DROP_MALFORMED instead if the payload is invalid for the codec, else -1.
    Count 0: a bootstrap round, which carries only the next exponent, or a header-only completion."""
    if c < 0:
        return -1
    if count:
        lo = c * prm[P_PKT]
        codec, exp, width = prm[P_CODEC], agreed_exp[c], codecs.width(prm[P_CODEC])
        payload = p[HDR:HDR + width * count]
        if not codecs.check_result(codec, payload, exp, prm[P_VBITS]):
            return DROP_MALFORMED
        if prm[P_PRECODED]:
            for j in range(count):  # a loop: a slice assignment may allocate a temporary (see State)
                codes[lo + j] = payload[j]
            prm[P_DONE] += 1
            return -1
        size = out.size if prm[P_FORMAT] == FLOAT32 else out16.size
        a, b = max(lo, prm[P_OUT_LO]), min(lo + count, prm[P_OUT_LO] + size)  # codes decode one by one
        if a < b:  # a chunk owned by every rank (more than 4 shards) may miss this one's
            decode_values(prm, payload[(a - lo) * width:(b - lo) * width], exp, out, out16, scratch,
                          a - prm[P_OUT_LO], b - prm[P_OUT_LO])
    prm[P_DONE] += 1
    return -1


@njit(inline="always")
def take_result(st, s, now, marks):
    """Slot s's round is over, its result carrying ``marks`` (result_marks): count it, tell the retransmission
    policy (round trip, overtaking, its core's silence) and the send window (the congestion mark), flip the shadow
    set."""
    st.stats[RESULTS] += 1
    on_result(st, s, now)
    st.parity[s] ^= 1
    marked = (marks & CONGESTED) != 0
    st.stats[CONGESTION_MARKS] += marked
    on_mark(st.window, marked, st.parity.size)


@njit(inline="always")
def goes_now(st, s, c):
    """Slot s's result was taken and its next chunk is c: whether c goes at once. Else the slot falls idle (c is
    past the allreduce's chunks), or holds c while the send window is smaller than the pool (release decides after
    the burst)."""
    prm = st.params
    if c >= prm[P_CHUNKS]:
        st.cur_chunk[s] = IDLE
        return False
    if holds(st.window, prm[P_WINDOW]):
        hold(st, s, c)
        return False
    return True


@njit(inline="always")
def advance(st, s, c, next_exp, now, tx_ptr, tx_len, tx_addr, n_tx):
    """Queue slot s's next chunk, c + window, to be encoded against next_exp, if it goes now (goes_now); returns
    the new tx count."""
    nxt = c + st.params[P_WINDOW]
    if nxt < st.params[P_CHUNKS]:
        st.agreed_exp[nxt] = next_exp
    if not goes_now(st, s, nxt) or not _build(st, s, nxt, now):
        return n_tx  # idle, held or parked
    queue_slot(st, s, tx_ptr, tx_len, tx_addr, n_tx)
    return n_tx + 1


@njit(cache=True, nogil=True, boundscheck=False, _nrt=False)
def receive_kernel(state, rx_data, rx_len, rx_addr, n_rx, now, tx_ptr, tx_len, tx_addr):
    """Accept results, decode them, and queue each slot's next chunk. Returns datagrams written to tx.

    A slot takes at most one result per call: its next chunk, queued by this call, has not been sent, so a
    result for it is forged (drop_unsent). That keeps every slot queued at most once, within tx's pool_size
    rows, whatever arrives, and keeps a queued datagram's buffer unchanged until it is sent."""
    st = State(*state)
    prm, agreed_exp, out, keys, taken = st.params, st.agreed_exp, st.out, st.mac_keys, st.taken
    taken[:] = False
    n_tx = 0
    for i in range(n_rx):
        st.stats[PACKETS_IN] += 1
        p = rx_data[i]
        length = rx_len[i]
        drop = validate_header(p, length)
        if drop < 0 and p[O_TYPE] == MsgType.PENDING:
            drop = take_pending(st, p, length, rx_addr[i], now)
            if drop >= 0:
                st.stats[drop] += 1
            continue
        marks = 0
        if drop < 0:
            marks = result_marks(p)
            drop = classify_result(prm, st.parity, st.cur_chunk, st.agg_addr, p, rx_addr[i])
            if drop == DROP_STALE:
                take_stale(st, p, length, marks)
            elif drop < 0 and taken[get_u16(p, O_SLOT)]:
                drop = DROP_UNSENT
        c = get_i32(p, O_CHUNK)
        if drop < 0:  # c is the slot's chunk
            length = authenticate(prm, keys, p, length)
            if length < 0:
                st.stats[DROP_BAD_MAC] += 1
                continue
            count = owned_count(prm, c, _chunk_count(st, c))
            drop = validate_result(prm, agreed_exp, p, length, c, count)
            if drop < 0:
                drop = decode_sum(prm, agreed_exp, out, st.out16, st.scratch, st.codes, p, c, count)
        if drop >= 0:
            st.stats[drop] += 1
            continue
        s = get_u16(p, O_SLOT)
        taken[s] = True
        take_result(st, s, now, marks)
        if marks & CONGESTED and c < 0:
            on_bootstrap_mark(st.window)
        n_tx = advance(st, s, c, get_i8(p, O_NEXT_EXP), now, tx_ptr, tx_len, tx_addr, n_tx)
    n_tx = release(st, now, tx_ptr, tx_len, tx_addr, n_tx)
    return fast_retransmit(st, now, tx_ptr, tx_len, tx_addr, n_tx)


@njit(cache=True, nogil=True, boundscheck=False, _nrt=False)
def unpark_kernel(state, now, tx_ptr, tx_len, tx_addr):
    """Precoded: send every parked slot's chunk whose codes the engine now has. Returns datagrams written to tx."""
    st = State(*state)
    n_tx = 0
    for s in range(st.params[P_WINDOW]):
        if st.cur_chunk[s] == PARKED and _build(st, s, st.parked[s], now):
            queue_slot(st, s, tx_ptr, tx_len, tx_addr, n_tx)
            n_tx += 1
    return n_tx


def _check_output(name: str, arr: np.ndarray, size: int, width: int) -> None:
    """arr must be C-contiguous with size elements: float32 (width 4), or of a 2-byte dtype (width 2)."""
    ok = arr.dtype == np.float32 if width == 4 else arr.dtype.itemsize == 2 and arr.dtype.kind in "uif"
    if not ok or arr.size != size or not arr.flags.c_contiguous:
        layout = "" if arr.flags.c_contiguous else ", not contiguous"
        kind = "float32" if width == 4 else "16-bit (uint16, int16 or float16)"
        raise ValueError(f"{name} must be a C-contiguous {kind} array of {size} elements, got "
                         f"{arr.dtype} of {arr.size} elements{layout}")


class StreamEngine:
    """One worker's side of a job's allreduces. Construct once per job; call ``start`` per allreduce."""

    def __init__(self, *, job: int, rank: int, world_size: int, codec: Codec, packet_elements: int, pool_size: int,
                 seed: int, agg_addrs: list[int], rto: float = WorkerTimers.rto,
                 min_rto: float = WorkerTimers.min_rto, max_rto: float = WorkerTimers.max_rto,
                 data_mac_keys: np.ndarray | None = None, nearest: bool = False) -> None:
        """``data_mac_keys``: the job's data key on each aggregator core, a (cores, 2) uint64 array of (k0, k1) rows
        (protocol.siphash.key_words), for a job with data_mac: every DATA datagram then ends in its SipHash tag
        under its core's key, and a RESULT is taken only with a valid one. None: no MAC. ``nearest``: cnat8 codes
        round to the nearer power of two (encode_nearest, the job's deterministic rounding) instead of
        stochastically."""
        if not 0 < min_rto <= rto <= max_rto:
            raise ValueError(f"need 0 < min_rto <= rto <= max_rto, got {min_rto}, {rto}, {max_rto}")
        if data_mac_keys is None:
            self.mac_keys = np.zeros((0, 2), np.uint64)
        else:
            self.mac_keys = np.ascontiguousarray(data_mac_keys, np.uint64)
            if self.mac_keys.shape != (len(agg_addrs), 2):
                raise ValueError(f"data_mac_keys must hold one (k0, k1) row per aggregator core, shape "
                                 f"({len(agg_addrs)}, 2), got {self.mac_keys.shape}")
        self.codec = Codec(codec)
        self.packet_elements = packet_elements
        self.pool_size = pool_size
        self.timing = timing_state(rto, min_rto, max_rto)
        self.silence = silence_state(len(agg_addrs))
        self.window = window_state(pool_size)
        self.params = np.zeros(PARAMS, np.int64)
        self.params[[P_JOB, P_RANK, P_WORLD, P_VBITS, P_CODEC, P_PKT, P_CORES]] = (
            job, rank, world_size, value_bits(world_size), int(self.codec), packet_elements, len(agg_addrs))
        self.params[P_SEED] = np.uint64(seed).view(np.int64)
        self.params[P_STOCHASTIC] = not nearest
        self.seed, self.rank = seed, rank
        self.parity = np.zeros(pool_size, np.int64)  # persists over the job's life
        # two datagram buffers per slot, by parity: the in-flight chunk's (kept for retransmission) and the next's
        size = element_datagram_size(self.codec, packet_elements, data_mac=bool(self.mac_keys.shape[0]))
        self.packet = np.zeros((pool_size, 2, size), np.uint8)
        # what each call hands out: rows pointing into self.packet. A call queues each slot at most once (its
        # next chunk, or a retransmission), so pool_size rows always suffice.
        self.tx = Burst(self.packet, pool_size)
        self.agg_addr = np.array(agg_addrs, np.uint64)
        self.stats = np.zeros(len(STAT_NAMES), np.int64)
        self.allreduce_seq = -1
        self.state: State | None = None
        self._no_sent = np.empty(0, np.float32)
        self._no_codes = np.empty(0, np.uint8)
        self._no_bits = np.empty(0, np.uint16)
        self.scratch = np.empty(packet_elements, np.float32)  # a 16-bit allreduce's chunk as float32
        self.taken = np.zeros(pool_size, np.bool_)
        self.heads = kept_heads()
        self._result: np.ndarray | None = None

    def resume(self, allreduce: int, shadow_sets: np.ndarray) -> None:
        """Continue a job where its peers are (a JOIN_ACK's resume point): the next ``start`` is allreduce
        ``allreduce``, and slot s uses shadow set ``shadow_sets[s]`` next."""
        self.allreduce_seq = allreduce - 1
        self.parity[:] = shadow_sets

    @property
    def max_datagram(self) -> int:
        return self.packet.shape[2]

    def _sent(self, n: int) -> Burst:
        """The output burst with its first n rows queued by a kernel; valid until the engine's next call."""
        self.tx.count = n
        return self.tx

    def start(self, x: np.ndarray, now: float, out: np.ndarray | None = None, *,
              sent: np.ndarray | None = None, scatter: bool = False, dtype: str | None = None,
              mean: bool = False) -> Burst:
        """Begin the next allreduce of x (any shape); returns the bootstrap datagrams (one per slot).
        ``scatter``: a reduce-scatter instead, x.size a multiple of the world size: the result is this rank's
        shard, its x.size / world elements from rank * x.size / world (``out`` then has that many). ``mean``: the
        result is the sum divided by the world size (in float32, chunk by chunk).

        ``dtype``: "float32" (x is converted to float32), "bfloat16" or "float16" (x holds the 16-bit values: their
        bits as uint16 or int16, or for float16 a float16 array). By default a float16 x is float16, anything else
        float32. A 16-bit x is encoded a chunk at a time from its own bits, the result written straight into a
        16-bit output (protocol.half): the float32 allreduce of its values, rounded to nearest even, with no float32
        copy of the tensor.

        The result goes to ``out`` (x's format: float32, or any 2-byte dtype for a 16-bit x; C-contiguous, x.size
        elements; it may be x itself: a chunk's input is encoded into its stored datagram before its result can
        arrive) or, by default, to a new array (of x's dtype if 16-bit): reusing one saves the page faults of a
        fresh tensor-sized allocation on every allreduce.

        ``sent`` (float32, x.size elements, optional): receives, chunk by chunk as they are encoded, the value of
        what this rank puts on the wire, decoded from its datagrams (error feedback's compressed gradient), before
        any mean's division. Complete once the allreduce is; without it the engine does no extra work."""
        arr = np.asarray(x)
        fmt = format_of(dtype) if dtype is not None else FLOAT16 if arr.dtype == np.float16 else FLOAT32
        if fmt == FLOAT32:
            flat, bits = np.ascontiguousarray(arr, dtype=np.float32).reshape(-1), self._no_bits
        else:
            if arr.dtype.itemsize != 2 or arr.dtype.kind not in "uif":
                raise TypeError(f"a {dtype or 'float16'} allreduce takes the values' 16-bit words (uint16, int16 or "
                                f"float16), got {arr.dtype}")
            flat, bits = self._no_sent, np.ascontiguousarray(arr).reshape(-1).view(np.uint16)
        elements = max(flat.size, bits.size)
        shard = self.shard_elements(elements, scatter)
        size = shard if scatter else elements
        if out is None:
            out = np.empty(size, np.float32 if fmt == FLOAT32 else arr.dtype)
        else:
            _check_output("out", out, size, 4 if fmt == FLOAT32 else 2)
        if sent is not None:
            _check_output("sent", sent, elements, 4)
        self._result = out.reshape(-1)
        out32, out16 = (out.reshape(-1), self._no_bits) if fmt == FLOAT32 else (self._no_sent,
                                                                               out.reshape(-1).view(np.uint16))
        chunks = -(-elements // self.packet_elements)
        codec = codecs.BY_ID[self.codec]
        local = np.empty(chunks, np.int64)
        low = np.zeros(chunks, np.uint32)  # 0: not precoded, encode_chunk encodes the chunk when it is sent
        if not codec.PRECODES:  # else each chunk's exponent comes with its codes, a window ahead (see _precode)
            self.stats[NONFINITE] += (
                chunk_exponents_kernel(flat, self.packet_elements, *codec.EXP_RANGE, local) if fmt == FLOAT32
                else chunk_exponents16_kernel(bits, self.packet_elements, *codec.EXP_RANGE, local, fmt, self.scratch))
        self.params[[P_FORMAT, P_MEAN]] = fmt, mean
        return self._start(now, elements, x=flat, out=out32, local=local, low=low,
                           sent=self._no_sent if sent is None else sent.reshape(-1), codes=self._no_codes,
                           shard=shard, precoded=False, x16=bits, out16=out16)

    def start_precoded(self, codes: np.ndarray, local_exp: np.ndarray, low: np.ndarray, now: float, *,
                       ready: int | None = None, scatter: bool = False) -> Burst:
        """Begin the next cnat8 allreduce of a tensor this engine gets as codes (worker.gpu: encoded on a GPU);
        returns the bootstrap datagrams. Bit for bit ``start`` on the tensor the codes came from: the same
        datagrams, and the same result as codes. ``scatter``: a reduce-scatter, as ``start``'s: only the chunks
        that overlap this rank's shard get their result codes (the driver decodes the shard's part of them).

        ``codes`` (uint8, C-contiguous, one per element; the result codes replace them, chunk by chunk, so the
        driver decodes chunk c at ``cnat_floor(agreed_exp[c], s(n))``): chunk c (elements c * packet_elements..)
        encoded at its own floor ``cnat_floor(local_exp[c], s(n))`` with this rank's key in the allreduce
        (``stream_key(next_allreduce)``) and its elements' indices, as protocol.arith.precode_chunk does.
        ``local_exp`` (exponent proposals) and ``low`` (low words, the PRECODED bit set) per chunk: precode_chunk's,
        or worker.gpu.cnat_cuda.chunk_stats'. ``ready``: the elements whose codes are in ``codes`` already (default
        all); a slot whose chunk lies beyond waits, parked, for ``codes_ready``. The inputs must be finite (the
        driver checks them while finding the exponents)."""
        if self.codec != Codec.CNAT8:
            raise ValueError(f"precoded allreduces are cnat8 only, this job's codec is {self.codec.name}")
        if codes.dtype != np.uint8 or codes.ndim != 1 or not codes.flags.c_contiguous:
            raise ValueError(f"codes must be a flat C-contiguous uint8 array, got {codes.dtype} of shape "
                             f"{codes.shape}")
        chunks = -(-codes.size // self.packet_elements)
        local = np.ascontiguousarray(local_exp, np.int64).reshape(-1)
        low = np.array(low, np.uint32).reshape(-1)  # a copy: reencoded() marks chunks in it
        if local.size != chunks or low.size != chunks:
            raise ValueError(f"{codes.size} codes in chunks of {self.packet_elements} need {chunks} exponents and "
                             f"low words, got {local.size} and {low.size}")
        self.params[[P_READY, P_FORMAT, P_MEAN]] = codes.size if ready is None else ready, FLOAT32, False
        self._result = None
        return self._start(now, codes.size, x=self._no_sent, out=self._no_sent, local=local, low=low,
                           sent=self._no_sent, codes=codes, shard=self.shard_elements(codes.size, scatter),
                           precoded=True, x16=self._no_bits, out16=self._no_bits)

    def shard_elements(self, elements: int, scatter: bool) -> int:
        """The elements of each rank's shard in a reduce-scatter of `elements` (a multiple of the world size), else
        0 (an allreduce)."""
        world = int(self.params[P_WORLD])
        if scatter and elements % world:
            raise ValueError(f"a reduce-scatter needs a multiple of the world size {world} elements, got {elements}")
        return elements // world if scatter else 0

    def _start(self, now: float, elements: int, *, x: np.ndarray, out: np.ndarray, local: np.ndarray,
               low: np.ndarray, sent: np.ndarray, codes: np.ndarray, shard: int, precoded: bool, x16: np.ndarray,
               out16: np.ndarray) -> Burst:
        """The next allreduce's state, and its bootstrap datagrams: start's and start_precoded's common part."""
        chunks = local.size
        window = min(self.pool_size, chunks)
        self.allreduce_seq += 1
        prm = self.params
        prm[[P_WINDOW, P_CHUNKS, P_ELEMENTS, P_ALLREDUCE, P_DONE, P_SHARD, P_OUT_LO, P_PRECODED]] = (
            window, chunks, elements, self.allreduce_seq, 0, shard, int(prm[P_RANK]) * shard, precoded)
        self.state = State(
            params=prm, x=x, out=out, local_exp=local,
            agreed_exp=np.full(chunks, NO_EXP, np.int64), cur_chunk=np.full(self.pool_size, IDLE, np.int64),
            parity=self.parity, sent_at=np.zeros(self.pool_size), rto=np.zeros(self.pool_size),
            retries=np.zeros(self.pool_size, np.int64), overtaken=np.zeros(self.pool_size, np.int64),
            packet=self.packet,
            packet_len=np.zeros(self.pool_size, np.int64), agg_addr=self.agg_addr, stats=self.stats,
            timing=self.timing, low=low, sent=sent, mac_keys=self.mac_keys, codes=codes,
            parked=np.full(self.pool_size, IDLE, np.int64), silence=self.silence, x16=x16, out16=out16,
            scratch=self.scratch, window=self.window, taken=self.taken, heads=self.heads,
            answered=np.full(self.pool_size, -np.inf), pendings=np.zeros(self.pool_size, np.int64))
        self._args = tuple(self.state)
        tx = self.tx
        n = start_kernel(self._args, now, tx.ptr, tx.length, tx.addr) if window else 0
        return self._sent(n)

    # ---- precoded allreduces: what the driver does between the engine's calls (see start_precoded)
    @property
    def next_allreduce(self) -> int:
        """The number the next ``start`` or ``start_precoded`` gives its allreduce."""
        return self.allreduce_seq + 1

    def stream_key(self, allreduce: int) -> int:
        """The key of this rank's random words in allreduce number ``allreduce`` (its codes' encode key)."""
        return int(_worker_key_of(self.params[P_SEED], allreduce, self.params[P_RANK]))

    def codes_ready(self, elements: int, now: float) -> Burst:
        """The codes of the first ``elements`` elements are in the codes array now (a copy from the device
        finished); returns the datagrams of the parked chunks that can go."""
        self.params[P_READY] = elements
        return self._unpark(now)

    def reencode_requests(self) -> list[tuple[int, int]]:
        """(chunk, floor) of each parked chunk whose codes must be encoded again at its agreed floor, exactly as
        ``start`` encodes a chunk (key ``stream_key``, the chunk's element offsets): one of its nonzero values
        lies below that floor. Write those codes over the chunk's in the codes array, then call ``reencoded``."""
        st = self.state
        if st is None or not self.params[P_PRECODED]:
            return []
        pkt, ready, vbits = self.packet_elements, int(self.params[P_READY]), int(self.params[P_VBITS])
        return [(c, int(cnat_floor(st.agreed_exp[c], vbits)))
                for c in st.parked[st.cur_chunk == PARKED].tolist() if min((c + 1) * pkt, st.codes.size) <= ready]

    def reencoded(self, chunks: list[int], now: float) -> Burst:
        """The codes array holds ``chunks``' codes at their agreed floors (``reencode_requests``); returns their
        datagrams."""
        st = self.state
        st.local_exp[chunks] = st.agreed_exp[chunks]  # their own floor is the agreed one now (sent already)
        st.low[chunks] = EXACT
        return self._unpark(now)

    def _unpark(self, now: float) -> Burst:
        tx = self.tx
        return self._sent(unpark_kernel(self._args, now, tx.ptr, tx.length, tx.addr))

    @property
    def agreed_exp(self) -> np.ndarray:
        """The current allreduce's agreed exponent per chunk (NO_EXP until its round has started)."""
        return self.state.agreed_exp

    @property
    def stochastic(self) -> bool:
        """Whether cnat8 codes round stochastically (else to nearest: the job's deterministic rounding)."""
        return bool(self.params[P_STOCHASTIC])

    def completed(self) -> int:
        """Chunks 0 .. completed() - 1 have their results (the others may too): every slot sends its chunks in
        order, so all chunks below the lowest one a slot still waits for are done."""
        st = self.state
        waiting = np.where((st.cur_chunk == PARKED) | (st.cur_chunk == HELD), st.parked, st.cur_chunk)[
            st.cur_chunk != IDLE]
        return int(self.params[P_CHUNKS]) if waiting.size == 0 else max(0, int(waiting.min()))

    def receive(self, rx: Burst, now: float) -> Burst:
        """Accept the ``rx.count`` received datagrams of ``rx`` (a burst with rows of its own, as
        ``BurstSocket.rx``); returns the datagrams to send: next chunks and fast retransmissions. Its rows point
        into the engine's datagram buffers: send them before the next call."""
        tx = self.tx
        return self._sent(receive_kernel(self._args, rx.data, rx.length, rx.addr, rx.count, now, tx.ptr, tx.length,
                                         tx.addr))

    def handle_timer(self, now: float) -> Burst:
        """Retransmit every slot whose timer expired by ``now``; returns the datagrams to send."""
        tx = self.tx
        return self._sent(timer_kernel(self._args, now, tx.ptr, tx.length, tx.addr))

    def get_timer(self) -> float | None:
        """When handle_timer is next due; None with nothing in flight."""
        if self.state is None:
            return None
        t = float(next_deadline(self._args))
        return None if t == np.inf else t

    @property
    def done(self) -> bool:
        return self.state is None or bool((self.state.cur_chunk == IDLE).all())

    @property
    def progress(self) -> tuple[int, int]:
        """(chunks whose result arrived, chunks) of the current allreduce."""
        return int(self.params[P_DONE]), int(self.params[P_CHUNKS])

    @property
    def result(self) -> np.ndarray:
        """The current allreduce's output: ``start``'s ``out``, or the array it made (flat)."""
        return self._result

    def pending_slots(self) -> list[int]:
        return np.flatnonzero(self.state.cur_chunk != IDLE).tolist()

    def counters(self) -> dict[str, int]:
        return dict(zip(STAT_NAMES, self.stats.tolist()))

    @property
    def rto(self) -> float:
        """The current adaptive retransmission timeout, seconds."""
        return float(self.timing[T_RTO])

    @property
    def send_window(self) -> float:
        """The current send window, in slots (worker.window; the pool: no limit)."""
        return float(self.window[W_CWND])
