"""aggregator.congestion: the mark is set (or cleared) in RESULTs only, in place, rows outside the burst's memory
left alone; the marking depth follows the receive buffer the kernel granted."""

from __future__ import annotations

import numpy as np

from intml.aggregator.congestion import SKB_OVERHEAD, mark_depth, mark_results
from intml.protocol.burst import Burst
from intml.protocol.packet import HDR, O_SHADOW, put_header
from intml.protocol.wire import CONGESTED, MsgType


def burst_of(types: list[MsgType], shadow: int = 1) -> Burst:
    tx = Burst.rows_of(len(types), HDR + 4)
    for i, t in enumerate(types):
        put_header(tx.data[i], t, 7, 0, 3, 0, i, 0, 0, shadow, 0, 0)
        tx.length[i] = HDR
    tx.count = len(types)
    return tx


def test_marks_results_only_and_clears_them():
    tx = burst_of([MsgType.RESULT, MsgType.DATA, MsgType.RESULT, MsgType.JOIN_ACK])
    before = tx.data.copy()
    mark_results(tx, True)
    assert tx.data[:, O_SHADOW].tolist() == [1 | CONGESTED, 1, 1 | CONGESTED, 1]
    changed = before != tx.data
    changed[:, O_SHADOW] = False
    assert not changed.any()  # nothing but the shadow byte
    mark_results(tx, False)
    np.testing.assert_array_equal(tx.data, before)


def test_rows_outside_the_memory_and_short_rows_are_left_alone():
    tx = burst_of([MsgType.RESULT, MsgType.RESULT])
    other = burst_of([MsgType.RESULT])
    tx.ptr[1] = other.ptr[0]  # a row of another burst
    tx.length[0] = HDR - 1
    mark_results(tx, True)
    assert tx.data[:, O_SHADOW].tolist() == [1, 1] and other.data[0, O_SHADOW] == 1


def test_mark_depth_is_a_quarter_of_the_buffer_at_most_a_burst():
    width = 1058
    assert mark_depth(64 << 10, width, 16) == (64 << 10) // (width + SKB_OVERHEAD) // 4
    assert mark_depth(64 << 20, width, 256) == 256
    assert mark_depth(1024, width, 256) == 1
