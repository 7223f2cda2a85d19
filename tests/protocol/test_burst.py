"""protocol.burst.Burst and protocol.address: owned datagrams in and out of a burst, no pointer arithmetic outside."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from intml.protocol.address import addr_key_of, addr_of, format_addr
from intml.protocol.burst import Burst

DATAGRAMS = st.lists(st.tuples(st.binary(max_size=40), st.integers(0, (1 << 48) - 1)), max_size=8)


@given(DATAGRAMS)
def test_fill_then_datagrams_round_trips(datagrams) -> None:
    burst = Burst.rows_of(8, 40)
    assert burst.fill(datagrams) == len(datagrams) == burst.count
    assert burst.datagrams() == datagrams


def test_datagrams_follow_pointers_into_memory() -> None:
    store = np.arange(60, dtype=np.uint8).reshape(3, 20)
    burst = Burst(store, 2)
    burst.ptr[:] = [store.ctypes.data + 45, store.ctypes.data + 3]
    burst.length[:] = [5, 0]
    burst.addr[:] = [7, 9]
    burst.count = 2
    assert burst.datagrams() == [(bytes(range(45, 50)), 7), (b"", 9)]
    burst.ptr[0] = store.ctypes.data + 58  # runs past the memory: refused, never read
    with pytest.raises(ValueError, match="outside"):
        burst.datagrams()


def test_fill_refuses_too_many_and_marks_truncation() -> None:
    burst = Burst.rows_of(2, 4)
    with pytest.raises(ValueError, match="more than 2"):
        burst.fill([(b"a", 1)] * 3)
    burst.fill([(b"abcdef", 1)])
    assert burst.length[0] == -1  # as BurstSocket reports a datagram longer than its buffer
    with pytest.raises(ValueError, match="rows of its own"):
        Burst(np.zeros(4, np.uint8), 1).fill([])


@given(st.integers(0, 2**32 - 1), st.integers(0, 0xFFFF))
def test_address_keys_round_trip(ip: int, port: int) -> None:
    text = ".".join(str(ip >> s & 0xFF) for s in (24, 16, 8, 0))
    key = addr_key_of(text, port)
    assert key == ip << 16 | port and addr_of(key) == (text, port) and format_addr(key) == f"{text}:{port}"


@pytest.mark.parametrize("ip, port", [("1.2.3", 1), ("1.2.3.256", 1), ("a.b.c.d", 1), ("1.2.3.4", 65536)])
def test_bad_addresses_are_refused(ip: str, port: int) -> None:
    with pytest.raises(ValueError):
        addr_key_of(ip, port)
