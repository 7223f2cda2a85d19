"""aggregator.congestion: the mark is set (or cleared) in RESULTs only, in place, rows outside the burst's memory
left alone; a queue is deep from a quarter of the receive buffer the kernel granted, as the kernel counts it."""

from __future__ import annotations

import socket

import numpy as np
import pytest

from intml.aggregator.congestion import deep_queue, mark_results
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


def test_a_data_paths_own_mark_is_kept_and_the_sockets_added():
    """keep (DataPath.marks, BMv2's program): a RESULT the switch marked leaves marked from a shallow socket queue; one
    it did not mark is marked from a deep one; without keep the driver's rewrite clears the switch's mark."""
    tx = burst_of([MsgType.RESULT, MsgType.RESULT])
    tx.data[0, O_SHADOW] |= CONGESTED  # the switch's egress queue marked this copy
    mark_results(tx, False, keep=True)
    assert tx.data[:, O_SHADOW].tolist() == [1 | CONGESTED, 1]
    mark_results(tx, True, keep=True)
    assert tx.data[:, O_SHADOW].tolist() == [1 | CONGESTED, 1 | CONGESTED]
    mark_results(tx, False)
    assert tx.data[:, O_SHADOW].tolist() == [1, 1]


def test_rows_outside_the_memory_and_short_rows_are_left_alone():
    tx = burst_of([MsgType.RESULT, MsgType.RESULT])
    other = burst_of([MsgType.RESULT])
    tx.ptr[1] = other.ptr[0]  # a row of another burst
    tx.length[0] = HDR - 1
    mark_results(tx, True)
    assert tx.data[:, O_SHADOW].tolist() == [1, 1] and other.data[0, O_SHADOW] == 1


@pytest.mark.process
def test_a_queue_is_deep_from_a_quarter_of_the_receive_buffer():
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as rx, socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as tx:
        rx.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 << 10)
        rx.bind(("127.0.0.1", 0))
        rx.setblocking(False)
        assert not deep_queue(rx)
        sent = 0
        while not deep_queue(rx):
            tx.sendto(bytes(1000), rx.getsockname())
            sent += 1
        assert sent > 3  # a few datagrams fill less than a quarter
        while True:
            try:
                rx.recv(2048)
            except BlockingIOError:
                break
        assert not deep_queue(rx)
