"""Host mode live on loopback: Workers with a host codec's name allreduce through a real aggregator core (its
data plane over a UDP socket, in a forked process that knows the tests' stand-in codec) and get the codec's
reference, bit for bit, at every rank."""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import socket
import threading
from collections.abc import Iterator

import numpy as np
import pytest
import uvloop
from support.cluster import HOST
from support.host_codec import HostQ, reference, registered

from intml.aggregator.core import AggregatorCore
from intml.aggregator.dataplane import DataPlane
from intml.protocol.job import host_aggregator_elements
from intml.worker import Worker

pytestmark = pytest.mark.process

TOKEN = "host-mode"
PACKET = 256


def _serve(conn) -> None:
    with registered():
        sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        sock.bind((HOST, 0))
        plane = DataPlane(AggregatorCore(tokens=[TOKEN], rows=64, max_elements=host_aggregator_elements(PACKET)), sock)
        conn.send(sock.getsockname()[1])
        uvloop.run(plane.serve())


@contextlib.contextmanager
def _aggregator() -> Iterator[int]:
    """The port of an aggregator core serving host codecs, killed on exit."""
    ours, theirs = mp.get_context("fork").Pipe()
    proc = mp.get_context("fork").Process(target=_serve, args=(theirs,), daemon=True)
    proc.start()
    try:
        assert ours.poll(30), "the aggregator did not start"
        yield ours.recv()
    finally:
        proc.kill()
        proc.join(10)


def test_workers_allreduce_with_a_host_codec() -> None:
    n, size = 3, 5000
    rng = np.random.default_rng(7)
    xs = [rng.standard_normal(size).astype(np.float32) for _ in range(n)]
    results: dict[int, list[np.ndarray]] = {}
    errors: list[BaseException] = []

    def rank(port: int, r: int) -> None:
        try:
            with Worker(f"{HOST}:{port}", job=11, rank=r, world_size=n, token=TOKEN, codec="hostq8",
                        packet_elements=PACKET, pool_size=8, seed=5, timeout=30) as w:
                results[r] = [w.allreduce(xs[r]), w.allreduce(xs[r], op="mean")]
                # each chunk's result taken once per allreduce; drop_malformed is not asserted: it also counts a late
                # JOIN_ACK, the second answer to a JOIN resent while the aggregator was slow to start
                assert w.counters()["results"] == 2 * -(-size // PACKET)
        except BaseException as exc:  # reported by the test's thread
            errors.append(exc)

    with registered(), _aggregator() as port:
        threads = [threading.Thread(target=rank, args=(port, r)) for r in range(n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
    assert not errors, errors
    for allreduce, mean in ((0, False), (1, True)):
        want = reference(HostQ(8), xs, seed=5, allreduce=allreduce, packet_elements=PACKET, mean=mean)
        for r in range(n):
            np.testing.assert_array_equal(results[r][allreduce].view(np.uint32), want.view(np.uint32))
