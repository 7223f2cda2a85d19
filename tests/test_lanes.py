"""protocol.lanes: the width-keeping LLVM intrinsics, against plain Python arithmetic."""

import struct

import numpy as np
from hypothesis import given
from hypothesis import strategies as st
from numba import njit

from intml.aggregator.slots import _int32_ok
from intml.protocol.lanes import load_be32, store_be32
from intml.protocol.packet import HDR


@njit
def _load(a, o):
    return load_be32(a, o)


@njit
def _store(a, o, v):
    store_be32(a, o, v)


@given(values=st.lists(st.integers(-(2**31), 2**31 - 1), min_size=1, max_size=20), shift=st.integers(0, 7))
def test_be32_round_trip_at_any_alignment(values, shift):
    """Stores write network byte order at unaligned offsets without touching their neighbours; loads read it."""
    a = np.full(shift + 4 * len(values) + 3, 0xA5, np.uint8)
    for k, v in enumerate(values):
        _store(a, shift + 4 * k, np.int64(v))
    assert bytes(a[shift:shift + 4 * len(values)]) == struct.pack(f">{len(values)}i", *values)
    assert bytes(a[:shift]) == b"\xa5" * shift and bytes(a[shift + 4 * len(values):]) == b"\xa5" * 3
    assert [int(_load(a, shift + 4 * k)) for k in range(len(values))] == values


def test_int32_range_check_bounds():
    """The switch's int32 contribution check: [-limit, limit] is accepted, one past either end is not."""
    limit = 1 << 28
    for values, ok in (([limit, -limit, 0], True), ([limit + 1], False), ([-limit - 1], False),
                       ([-(2**31)], False), ([2**31 - 1], False), ([], True)):
        p = np.zeros(HDR + 4 * max(1, len(values)), np.uint8)
        p[HDR:HDR + 4 * len(values)] = np.frombuffer(struct.pack(f">{len(values)}i", *values), np.uint8)
        assert bool(_int32_ok(p, len(values), limit)) == ok, values
