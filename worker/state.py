"""The streaming engine's state: the arrays its kernels share and their layout, its counters, and the queueing of
a slot's datagram. Its own module so that the encode/decode path (worker.engine) and the retransmission policy
(worker.retransmit) both build on it without importing each other."""

from __future__ import annotations

from collections import namedtuple

import numpy as np
from numba import njit

STAT_NAMES = (
    "packets_out",
    "packets_in",
    "retransmissions",
    "fast_retransmissions",
    "results",
    "drop_malformed",
    "drop_foreign",
    "drop_stale",
    "saturated_elements",
    "drop_bad_mac",
    "spurious_retransmissions",
    "drop_unsent",
    "nonfinite_elements",
    "congestion_marks",
    "pendings",
)
(PACKETS_OUT, PACKETS_IN, RETRANSMISSIONS, FAST_RETRANSMISSIONS, RESULTS, DROP_MALFORMED, DROP_FOREIGN, DROP_STALE,
 SATURATED, DROP_BAD_MAC, SPURIOUS, DROP_UNSENT, NONFINITE, CONGESTION_MARKS, PENDINGS) = range(len(STAT_NAMES))
FAST_RETRANSMIT = 3  # results of later-sent slots that mark a slot as lost (worker.retransmit)
IDLE = np.iinfo(np.int64).min  # cur_chunk of a slot with nothing in flight
PARKED = IDLE + 1  # cur_chunk of a precoded slot waiting for its chunk's codes (its chunk: State.parked)
HELD = IDLE + 2  # cur_chunk of a slot whose next chunk (State.parked) the send window holds back (worker.window)

# All engine state the kernels touch, as arrays. Python passes it to the entry kernels as a plain tuple, which
# Numba types in C (~1 us a call), and they rebuild the namedtuple: Numba types a namedtuple argument on a slow
# Python path (~40 us a call), which made dispatch the largest cost of a worker.
State = namedtuple(
    "State",
    "params x out local_exp agreed_exp cur_chunk parity sent_at rto retries overtaken packet packet_len agg_addr stats "
    "timing low sent mac_keys codes parked silence x16 out16 scratch window taken heads answered pendings",
)
# params (int64): job, rank, world, value_bits, codec, packet_elements, window, chunks, elements, allreduce, cores,
#                 seed (as int64 bits), done_chunks, shard elements of a
#                 reduce-scatter (0: an allreduce), the first element the output holds, precoded (1) or
#                 float (0) input, elements whose codes are in ``codes`` (precoded), stochastic (1) or nearest (0)
#                 rounding, the input's format (protocol.half: FLOAT32, BFLOAT16, FLOAT16), mean (1: the result is
#                 divided by the world size) or sum (0)
(P_JOB, P_RANK, P_WORLD, P_VBITS, P_CODEC, P_PKT, P_WINDOW, P_CHUNKS, P_ELEMENTS, P_ALLREDUCE, P_CORES,
 P_SEED, P_DONE, P_SHARD, P_OUT_LO, P_PRECODED, P_READY, P_STOCHASTIC, P_FORMAT, P_MEAN) = range(20)
PARAMS = 20
# x, out (float32): a float32 allreduce's input and output; else empty
# x16, out16 (uint16): a 16-bit allreduce's input and output bits; else empty
# scratch (float32, packet_elements): a 16-bit allreduce's one chunk, widened to encode it or decoded to narrow it
# codes (uint8): precoded, the codes in (each chunk at its own floor) and the result codes out; else empty
# parked (int64): per slot, the chunk a PARKED or HELD slot waits to send
# mac_keys (uint64): (cores, 2), the data key (k0, k1) of each aggregator core; (0, 2) without the DATA/RESULT MAC
# sent_at, rto, retries, overtaken, answered, pendings (per slot), timing and silence: the retransmission policy's
# (worker.retransmit)
# window (float64): the send window's (worker.window)
# taken (bool, per slot): receive_kernel's marks of the slots that took a result in the current call
# heads (uint32, protocol.rng.BLOCK + 1): the cnat8 encode's table, kept between calls (protocol.cnat.kept_heads)
# The kernels get every buffer they use from here, sized once: they allocate nothing, so they compile without
# Numba's runtime (_nrt=False), whose atomic reference counts on each array and view they take were about 40% of
# the engine's time (docs/benchmarks.md, "The worker's engine without Numba's runtime").


@njit(cache=True, nogil=True, boundscheck=False, _nrt=False)
def queue_slot(st, s, tx_ptr, tx_len, tx_addr, n_tx):
    """Queue slot s's current datagram: the transmit entry points at the slot's buffer, nothing is copied (the
    buffer stays unchanged until the driver has sent the burst: see engine._build and
    retransmit.fast_retransmit)."""
    tx_ptr[n_tx] = st.packet[s, st.parity[s]].ctypes.data
    tx_len[n_tx] = st.packet_len[s]
    tx_addr[n_tx] = st.agg_addr[s % st.params[P_CORES]]
    st.stats[PACKETS_OUT] += 1
