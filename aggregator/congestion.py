"""The aggregator's congestion mark (docs/window.md): when a burst is read from a deep receive queue, every RESULT sent
in answer carries the CONGESTED bit in its shadow byte, and the workers' windows shrink (worker.window).

The queue's depth is the kernel's own account: after a receive that filled its burst, the bytes still queued on the
socket (SO_MEMINFO's rmem_alloc, datagrams at their true size) against the buffer's size. From a quarter full on,
the results of that burst are marked: room for a round trip's arrivals before the kernel drops. A receive that did
not fill its burst emptied the queue: not marked.

The driver, which reads the socket, marks the burst the data path hands back, after the results' MAC
(protocol.wire.CONGESTED), as a queue marks ECN on a packet's way out; the kernel and the P4 model never set the
bit, so their outputs stay byte-equal. The mark is rewritten on every send, so a stored result that is sent again
carries the queue's state at that time; a data path whose results a queue of its own has marked (BMv2 running the
P4 program: DataPath.marks) keeps that mark, and the socket's is added.
"""

from __future__ import annotations

import socket
import struct

import numpy as np
from numba import njit

from intml.protocol.burst import Burst
from intml.protocol.packet import HDR, O_MAGIC, O_SHADOW, O_TYPE, get_u16
from intml.protocol.wire import CONGESTED, MAGIC, MARK_FRACTION, SHADOW_SET, STORED, MsgType

SO_MEMINFO = 55  # Linux: the socket's memory counters, u32 each, rmem_alloc first and rcvbuf second
_MEMINFO = struct.Struct("=9I")


def deep_queue(sock: socket.socket) -> bool:
    """Whether the datagrams queued on ``sock`` fill a quarter of its receive buffer or more."""
    rmem_alloc, rcvbuf = _MEMINFO.unpack(sock.getsockopt(socket.SOL_SOCKET, SO_MEMINFO, _MEMINFO.size))[:2]
    return rmem_alloc * MARK_FRACTION >= rcvbuf


@njit(cache=True, nogil=True, boundscheck=False, _nrt=False)
def _mark(memory, ptr, length, count, bit, kept):
    flat = memory.reshape(memory.size).view(np.uint8)  # the views here, not per call in Python: microseconds a burst
    base = np.int64(memory.ctypes.data)
    for i in range(count):
        o = np.int64(ptr[i]) - base
        if (0 <= o and o + HDR <= flat.size and length[i] >= HDR and flat[o + O_TYPE] == MsgType.RESULT
                and get_u16(flat, o + O_MAGIC) == MAGIC):
            flat[o + O_SHADOW] = (flat[o + O_SHADOW] & kept) | bit


def mark_results(tx: Burst, congested: bool, keep: bool = False) -> None:
    """Set (``congested``) or clear the congestion mark of every RESULT among ``tx``'s rows, in place (rows that
    point outside its memory, such as the rows of another burst, are left alone). ``keep``: a mark a row already
    carries (a switch's, DataPath.marks) stays; only the socket's is added. A re-sent result's STORED mark always
    stays: it is the row's own, not a queue's."""
    if tx.count:
        _mark(tx.memory, tx.ptr, tx.length, tx.count, np.uint8(CONGESTED if congested else 0),
              np.uint8(SHADOW_SET | STORED | (CONGESTED if keep else 0)))
