"""A rank's unicast socket (worker.api.rank_socket): GRO where the job's datagrams are short enough for it to pay,
and any datagram still arrives whole (a statistics reply can be longer than a data packet)."""

from __future__ import annotations

import socket

import numpy as np
import pytest

from intml.burstio.mmsg import GRO_MAX_PACKET, BurstSocket, addr_key, offload_default
from intml.protocol import wire
from intml.protocol.burst import Burst
from intml.protocol.codec import Codec
from intml.worker.api import rank_socket

pytestmark = pytest.mark.process


def _bound() -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.bind(("127.0.0.1", 0))
    return sock


@pytest.mark.skipif(not offload_default(GRO_MAX_PACKET)[1], reason="GRO forced off (INTML_GSO=0)")
def test_gro_where_the_jobs_datagrams_are_short_and_any_datagram_arrives_whole() -> None:
    small = rank_socket(_bound(), 64, wire.element_datagram_size(Codec.CNAT8, 1024))
    large = rank_socket(_bound(), 64, wire.MAX_DATAGRAM)  # a host codec's packages, 64 KiB datagrams
    sender = BurstSocket(_bound(), burst=64, max_packet=GRO_MAX_PACKET)  # GRO if the kernel has it
    try:
        assert small.gro == sender.gro and not large.gro
        assert large.max_packet == small.max_packet == wire.MAX_DATAGRAM
        results = [bytes([i]) * 1050 for i in range(40)]
        dest = addr_key(*small.sock.getsockname())
        burst = Burst.rows_of(len(results), 1050)
        burst.fill((d, dest) for d in results)
        assert sender.send(burst) == len(results)  # one GSO batch where the kernel has GSO: coalesced on arrival
        sender.send_one(b"r" * 9000, dest)  # then a control reply longer than any result
        sent = results + [b"r" * 9000]
        got = []
        while len(got) < len(sent) and small.recv_burst() > 0:
            got += [bytes(d) for d, _ in small.rx.datagrams()]
        assert got == sent
    finally:
        for s in (small, large, sender):
            s.sock.close()
