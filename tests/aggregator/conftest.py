"""The aggregator room's shared fixture: a raw UDP socket, to send datagrams from any source address and port."""

from __future__ import annotations

import socket
from collections.abc import Iterator

import pytest


@pytest.fixture
def raw_udp() -> Iterator[socket.socket]:
    try:
        raw = socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_UDP)
    except PermissionError:
        pytest.skip("needs a raw socket (root or CAP_NET_RAW) to send from source port 0")
    with raw:
        yield raw
