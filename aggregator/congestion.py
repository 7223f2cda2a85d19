"""The aggregator's congestion mark (docs/window.md): when a burst is read from a deep receive queue, every RESULT sent
in answer carries the CONGESTED bit in its shadow byte, and the workers' windows shrink (worker.window).

The queue's depth is what a receive call returns: a call that reads ``depth`` datagrams or more found at least that
many waiting. A data path never sees it (the P4 model, BMv2 and the kernel stay byte-equal); the driver, which reads
the socket, marks the burst the data path hands back, after the results' MAC (protocol.wire.CONGESTED), as a
queue marks ECN on a packet's way out. The mark is rewritten on every send, so a stored result that is sent again
carries the queue's state at that time.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from intml.protocol.burst import Burst
from intml.protocol.packet import HDR, O_MAGIC, O_SHADOW, O_TYPE, get_u16
from intml.protocol.wire import CONGESTED, MAGIC, SHADOW_SET, MsgType

# What one queued datagram costs a socket's receive buffer beyond its bytes (the sk_buff, its shared info, the
# headers and the allocator's rounding), so that a buffer of R bytes holds about R / (width + SKB_OVERHEAD).
SKB_OVERHEAD = 1024
MARK_FRACTION = 4  # mark at a quarter of what the buffer holds: room for a round trip's arrivals before it drops


def mark_depth(rcvbuf: int, max_packet: int, burst: int) -> int:
    """The queue depth, in datagrams, from which results are marked: a quarter of what a receive buffer of
    ``rcvbuf`` bytes (as the kernel granted it) holds of datagrams up to ``max_packet`` bytes, at most a full
    ``burst``, at least 1."""
    return max(1, min(burst, rcvbuf // (max_packet + SKB_OVERHEAD) // MARK_FRACTION))


@njit(cache=True, nogil=True, boundscheck=False)
def _mark(flat, base, ptr, length, count, bit):
    for i in range(count):
        o = np.int64(ptr[i]) - base
        if (0 <= o and o + HDR <= flat.size and length[i] >= HDR and flat[o + O_TYPE] == MsgType.RESULT
                and get_u16(flat, o + O_MAGIC) == MAGIC):
            flat[o + O_SHADOW] = (flat[o + O_SHADOW] & SHADOW_SET) | bit


def mark_results(tx: Burst, congested: bool) -> None:
    """Set (``congested``) or clear the congestion mark of every RESULT among ``tx``'s rows, in place (rows that
    point outside its memory, such as the rows of another burst, are left alone)."""
    if tx.count:
        _mark(tx.memory.reshape(-1).view(np.uint8), np.int64(tx.memory.ctypes.data), tx.ptr, tx.length, tx.count,
              np.uint8(CONGESTED if congested else 0))
