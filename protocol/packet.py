"""The wire header as seen from Numba kernels: big-endian field accessors at the offsets of ``protocol.wire``.

Numba cannot view non-native-endian structured dtypes, so hot-path kernels read and write header fields byte by
byte at offsets taken from the one field list in protocol.wire (``OFFSETS``); nothing here restates the layout.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from intml.protocol.wire import (
    HEADER_SIZE,
    MAGIC,
    MAX_OWNER_SPAN,
    OFFSETS,
    OWNERS_SHIFT,
    PENDING_SIZE,
    RANK_MASK,
    VERSION,
    MsgType,
)

O_MAGIC = OFFSETS["magic"]
O_VERSION = OFFSETS["version"]
O_TYPE = OFFSETS["type"]
O_JOB = OFFSETS["job"]
O_ALLREDUCE = OFFSETS["allreduce"]
O_CHUNK = OFFSETS["chunk"]
O_RANK = OFFSETS["rank"]
O_SLOT = OFFSETS["slot"]
O_COUNT = OFFSETS["count"]
O_CODEC = OFFSETS["codec"]
O_SHADOW = OFFSETS["shadow"]
O_EXP = OFFSETS["exp"]
O_NEXT_EXP = OFFSETS["next_exp"]
HDR = HEADER_SIZE


@njit(inline="always")
def get_u16(p, o):
    return (np.int64(p[o]) << 8) | np.int64(p[o + 1])


@njit(inline="always")
def get_u32(p, o):
    return (np.int64(p[o]) << 24) | (np.int64(p[o + 1]) << 16) | (np.int64(p[o + 2]) << 8) | np.int64(p[o + 3])


@njit(inline="always")
def get_i32(p, o):
    v = get_u32(p, o)
    return v - (np.int64(1) << 32) if v >= (np.int64(1) << 31) else v


@njit(inline="always")
def get_i8(p, o):
    v = np.int64(p[o])
    return v - 256 if v >= 128 else v


@njit(inline="always")
def put_u16(p, o, v):
    p[o] = np.uint8((v >> 8) & 0xFF)
    p[o + 1] = np.uint8(v & 0xFF)


@njit(inline="always")
def put_u32(p, o, v):
    p[o] = np.uint8((v >> 24) & 0xFF)
    p[o + 1] = np.uint8((v >> 16) & 0xFF)
    p[o + 2] = np.uint8((v >> 8) & 0xFF)
    p[o + 3] = np.uint8(v & 0xFF)


@njit(inline="always")
def get_u64(p, o):
    v = np.uint64(0)
    for b in range(8):
        v = (v << np.uint64(8)) | np.uint64(p[o + b])
    return v


@njit(inline="always")
def put_u64(p, o, v):
    for b in range(8):
        p[o + 7 - b] = np.uint8((v >> np.uint64(8 * b)) & np.uint64(0xFF))


@njit(inline="always")
def put_header(p, typ, job, allreduce, chunk, rank, slot, count, codec, shadow, exp, next_exp):
    """Write a complete header into the first HDR bytes of p."""
    put_u16(p, O_MAGIC, MAGIC)
    p[O_VERSION] = VERSION
    p[O_TYPE] = typ
    put_u32(p, O_JOB, job)
    put_u32(p, O_ALLREDUCE, allreduce)
    put_u32(p, O_CHUNK, chunk & 0xFFFFFFFF)
    put_u16(p, O_RANK, rank)
    put_u16(p, O_SLOT, slot)
    put_u16(p, O_COUNT, count)
    p[O_CODEC] = codec
    p[O_SHADOW] = shadow
    p[O_EXP] = np.uint8(exp & 0xFF)
    p[O_NEXT_EXP] = np.uint8(next_exp & 0xFF)


@njit(inline="always")
def put_pending(q, p, have):
    """Write into q the PENDING that answers DATA datagram p (protocol.wire): p's header with type PENDING and
    count 0, then ``have``, the ranks its round has; returns its length before any tag."""
    for c in range(HDR):  # a loop: a slice assignment may allocate a temporary
        q[c] = p[c]
    q[O_TYPE] = MsgType.PENDING
    put_u16(q, O_COUNT, 0)
    put_u64(q, HDR, have)
    return PENDING_SIZE


@njit(inline="always")
def element_fields(p):
    """The fields of a DATA, RESULT or PARTIAL header that name its round and describe its elements: (rank,
    owners, slot, count, codec, shadow, exp, next_exp, round key); rank and owners: the rank field's low and
    high byte."""
    rank = get_u16(p, O_RANK)
    return (rank & RANK_MASK, rank >> OWNERS_SHIFT, get_u16(p, O_SLOT), get_u16(p, O_COUNT), np.int64(p[O_CODEC]),
            np.int64(p[O_SHADOW]), get_i8(p, O_EXP), get_i8(p, O_NEXT_EXP),
            round_key(get_u32(p, O_ALLREDUCE), get_i32(p, O_CHUNK)))


@njit(inline="always")
def round_key(allreduce, chunk):
    """Names one use of a slot: the 32-bit allreduce in the high word, chunk + 2**31 in the low word (the bit
    pattern in an int64, negative once allreduce >= 2**31). Compare keys with round_order, never with <."""
    return (np.int64(allreduce) << 32) | (np.int64(chunk) + (np.int64(1) << 31))


@njit(inline="always")
def round_order(key, current):
    """-1, 0 or 1 as round `key` comes before, is, or comes after round `current`: the allreduces in serial
    number order (RFC 1982 on 32 bits, so the order survives the wrap from 2**32 - 1 to 0; a difference of
    2**31 or more counts as before), then the chunks in order."""
    ahead = ((key >> 32) - (current >> 32)) & 0xFFFFFFFF
    if ahead:
        return 1 if ahead < (np.int64(1) << 31) else -1
    low, cur_low = key & 0xFFFFFFFF, current & 0xFFFFFFFF
    return (low > cur_low) - (low < cur_low)


@njit(inline="always")
def owners_code(first, last):
    """The owners byte (protocol.wire, "Owners") of the ranks first .. last; ALL_OWNERS (0) when they are more
    than MAX_OWNER_SPAN + 1, or first < 0 (every rank)."""
    span = last - first
    if first < 0 or span > MAX_OWNER_SPAN:
        return 0
    return 1 + span * 64 + first


@njit(inline="always")
def owner_range(code, world):
    """(first, last) owner of the owners byte `code` in a job of `world` ranks: (0, world - 1) for ALL_OWNERS.
    last >= world: a malformed code (drop_bad_owner)."""
    if code == 0:
        return 0, world - 1
    first = (code - 1) & 63
    return first, first + ((code - 1) >> 6)
