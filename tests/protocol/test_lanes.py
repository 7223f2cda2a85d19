"""protocol.lanes: the width-keeping LLVM intrinsics, against plain Python arithmetic."""

import struct

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from numba import njit

from intml.protocol.lanes import load_be32, store_be32


@njit
def _load(a, o):
    return load_be32(a, o)


@njit
def _store(a, o, v):
    store_be32(a, o, v)


@pytest.mark.slow
@settings(deadline=None)  # the first example compiles _load and _store (uncached)
@given(values=st.lists(st.integers(-(2**31), 2**31 - 1), min_size=1, max_size=20), shift=st.integers(0, 7))
def test_be32_round_trip_at_any_alignment(values, shift):
    """Stores write network byte order at unaligned offsets without touching their neighbours; loads read it."""
    a = np.full(shift + 4 * len(values) + 3, 0xA5, np.uint8)
    for k, v in enumerate(values):
        _store(a, shift + 4 * k, np.int64(v))
    assert bytes(a[shift:shift + 4 * len(values)]) == struct.pack(f">{len(values)}i", *values)
    assert bytes(a[:shift]) == b"\xa5" * shift and bytes(a[shift + 4 * len(values):]) == b"\xa5" * 3
    assert [int(_load(a, shift + 4 * k)) for k in range(len(values))] == values

