"""The PARTIAL datagram of two-level aggregation (docs/protocol.md, "Leaf-spine"): a leaf's int32 partial sum of
its rack's contributions to one round, sent up to the spine.

Layout: the data header (type PARTIAL; ``rank``: the leaf's index at the spine; ``count``, ``codec``, ``slot``,
``shadow``, ``allreduce``, ``chunk`` and ``exp`` as the round's DATA packets; ``next_exp``: the largest of the
rack's proposals), then ``count`` big-endian int32 sums in the slot's fixed-point units (whatever the job's codec:
the leaf never re-encodes), then the contributors bitmap: a big-endian u64 with bit r set for each rank r summed.

Kernel helpers (Numba, inline) for the leaf that writes it and the spine that checks it; no state, no I/O.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from intml.protocol.lanes import load_be32, store_be32
from intml.protocol.packet import HDR, get_u64, put_header, put_u64
from intml.protocol.wire import MAX_DATAGRAM, MsgType

SUM_WIDTH = 4  # bytes per partial sum: an int32 register
TRAILER = 8  # the contributors bitmap


@njit(inline="always")
def partial_size(count):
    """Bytes of a PARTIAL of ``count`` sums."""
    return HDR + SUM_WIDTH * count + TRAILER


def max_partial_elements() -> int:
    """The most sums one PARTIAL datagram carries (a leaf's job's packet elements must not exceed it)."""
    return (MAX_DATAGRAM - HDR - TRAILER) // SUM_WIDTH


@njit(inline="always")
def put_partial(p, job, allreduce, chunk, leaf, slot, codec, shadow, exp, next_exp, sums, contributors):
    """Write the PARTIAL of ``sums`` (the round's int32 accumulators) into p; returns its length."""
    count = sums.size
    put_header(p, MsgType.PARTIAL, job, allreduce, chunk, leaf, slot, count, codec, shadow, exp, next_exp)
    for i in range(count):
        store_be32(p, HDR + SUM_WIDTH * i, sums[i])
    put_u64(p, HDR + SUM_WIDTH * count, contributors)
    return partial_size(count)


@njit(inline="always")
def contributors(p, count):
    """The contributors bitmap of a PARTIAL of ``count`` sums (its length already checked)."""
    return get_u64(p, HDR + SUM_WIDTH * count)


@njit(inline="always")
def sums_in_bounds(p, count, limit):
    """Every sum of the PARTIAL lies in [-limit, limit]: ``limit`` = contributors x the codec's
    contribution_bound, so an honest leaf's sums always do and n of them cannot overflow 31 bits."""
    low = high = np.int64(0)
    for i in range(count):
        v = np.int64(load_be32(p, HDR + SUM_WIDTH * i))
        low = min(low, v)
        high = max(high, v)
    return low >= -limit and high <= limit
