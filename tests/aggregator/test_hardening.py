"""The aggregator against a hostile network and careless callers: a destination the kernel refuses
costs nobody else anything, the ready line means ready, and JOINs that would let one address stand in for a
whole job are refused and counted."""

from __future__ import annotations

import multiprocessing
import os
import signal
import socket
import struct
import time

import numpy as np
import pytest
from support.cluster import HOST, Aggregator, join_over, operator_stats
from support.harness import Network, core_receive, join_datagram, msg_type, new_core
from test_aggregator_core import STRANGER, error_text

from intml.aggregator.core import AggregatorCore
from intml.protocol import keys, wire
from intml.protocol.address import addr_key_of
from intml.protocol.burst import Burst
from intml.protocol.codec import Codec
from intml.protocol.job import BURST
from intml.protocol.slot_reference import Job, SlotReference
from intml.protocol.wire import NO_EXP, MsgType

P = 32
TOKEN = "t"


def _params(world: int) -> dict:
    return {"world_size": world, "packet_elements": P, "pool_size": 1, "codec": int(Codec.INT32), "seed": 3}


def _data(job: int, rank: int, allreduce: int, values: np.ndarray) -> bytes:
    header = {"type": int(MsgType.DATA), "job": job, "allreduce": allreduce, "chunk": 0, "rank": rank, "slot": 0,
              "count": values.size, "codec": int(Codec.INT32), "shadow": allreduce % 2, "exp": 0,
              "next_exp": NO_EXP}
    return wire.pack(header, values)


def _from_port_zero(raw: socket.socket, datagram: bytes, port: int) -> None:
    """Send `datagram` to HOST:port from source port 0: a source the kernel accepts but will not send to."""
    raw.sendto(struct.pack("!HHHH", 0, port, 8 + len(datagram), 0) + datagram, (HOST, 0))


def _recv(sock: socket.socket, timeout: float) -> bytes:
    sock.settimeout(timeout)
    return sock.recv(1 << 16)


def _known_secret_core() -> AggregatorCore:
    """A core whose cookie secret is all zeros, so that a test can answer a CHALLENGE it cannot receive (one sent
    to port 0). Its burst kernel is compiled here, before the fork: a child that compiled it itself (seconds on a
    cold cache) would miss the tests' 2 s handshake timeouts, and die before writing the cache."""
    core = AggregatorCore(tokens=[TOKEN], random_bytes=bytes)
    empty = Burst.rows_of(1, 64)
    empty.count = 0
    core.receive(empty, 0.0)
    return core


def _serve(core: AggregatorCore, sock: socket.socket) -> None:
    from intml.aggregator.dataplane import run_core

    run_core(core, sock, BURST, 0.0)


class _InProcessAggregator:
    """An aggregator core of _known_secret_core in a forked process (``proc.pid``, ``port``, ``stats()``)."""

    def __enter__(self) -> _InProcessAggregator:
        sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        sock.bind((HOST, 0))
        self.port = sock.getsockname()[1]
        self.proc = multiprocessing.get_context("fork").Process(target=_serve, args=(_known_secret_core(), sock),
                                                                daemon=True)
        self.proc.start()
        sock.close()
        return self

    def __exit__(self, *exc) -> None:
        self.proc.kill()
        self.proc.join(5)

    def alive(self) -> bool:
        return self.proc.is_alive()

    def stats(self) -> list[dict]:
        return operator_stats(self.port, 1, TOKEN)


def _join_from_port_zero(raw: socket.socket, port: int, job: int, rank: int, params: dict) -> None:
    """The JOIN handshake from source port 0: the CHALLENGE cannot reach it, so its cookie is computed with the
    known secret."""
    nonce = bytes(keys.NONCE_SIZE)
    cookie = keys.cookie(bytes(keys.KEY_SIZE), addr_key_of(HOST, 0), job, rank, nonce, keys.epoch(time.monotonic()))
    proved = join_datagram(job, rank, nonce=nonce, cookie=cookie, token=TOKEN, **params)
    _from_port_zero(raw, proved, port)


@pytest.mark.process
def test_refused_destination_is_counted_and_skipped_live(raw_udp):
    """Job 1's rank 1 joined from port 0, which the kernel refuses to send to (EINVAL). Its JOIN_ACK and every
    result to it fail; job 2, whose results follow job 1's in the same burst, still gets each one at once and
    bit for bit, and the failures are counted."""
    rng = np.random.default_rng(0)
    with _InProcessAggregator() as agg, \
            socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as a0, \
            socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as b0, \
            socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as b1:
        target = (HOST, agg.port)
        for s in (a0, b0, b1):
            s.bind((HOST, 0))
        ref = SlotReference()
        ref.join(Job(1, 2, P, 1, int(Codec.INT32), 3, {0: addr_key_of(HOST, a0.getsockname()[1]),
                                                         1: addr_key_of(HOST, 0)}))
        ref.join(Job(2, 2, P, 1, int(Codec.INT32), 3, {r: addr_key_of(HOST, s.getsockname()[1])
                                                         for r, s in enumerate((b0, b1))}))
        _join_from_port_zero(raw_udp, agg.port, 1, 1, _params(2))
        for s, (job, rank) in zip((a0, b0, b1), ((1, 0), (2, 0), (2, 1))):
            assert msg_type(join_over(s, target, job, rank, token=TOKEN, **_params(2))) == MsgType.JOIN_ACK
        rounds = 5
        for allreduce in range(rounds):
            xs = [rng.integers(-1000, 1000, P).astype(np.int32) for _ in range(4)]
            os.kill(agg.proc.pid, signal.SIGSTOP)  # all four arrive in one burst: job 1's results come first
            try:
                a0.sendto(_data(1, 0, allreduce, xs[0]), target)
                _from_port_zero(raw_udp, _data(1, 1, allreduce, xs[1]), agg.port)
                b0.sendto(_data(2, 0, allreduce, xs[2]), target)
                b1.sendto(_data(2, 1, allreduce, xs[3]), target)
                time.sleep(0.05)
            finally:
                os.kill(agg.proc.pid, signal.SIGCONT)
            expected = [ref.receive(_data(1, 0, allreduce, xs[0]), ref.jobs[1].members[0]),
                        ref.receive(_data(1, 1, allreduce, xs[1]), ref.jobs[1].members[1]),
                        ref.receive(_data(2, 0, allreduce, xs[2]), ref.jobs[2].members[0]),
                        ref.receive(_data(2, 1, allreduce, xs[3]), ref.jobs[2].members[1])]
            results = {dst: data for out in expected for data, dst in out}
            start = time.monotonic()
            for s in (a0, b0, b1):
                assert _recv(s, 1.0) == results[addr_key_of(HOST, s.getsockname()[1])]
            assert time.monotonic() - start < 1.0
        counters = agg.stats()[0]["core_counters"]
        assert counters["send_failed"] == 1 + rounds  # the JOIN_ACK and each result to port 0
        assert agg.alive()


@pytest.mark.process
def test_ready_line_means_a_join_is_answered_at_once():
    """Every kernel a JOIN needs is compiled, or loaded from Numba's cache, before the ready line, not on the first
    packet: with NUMBA_DEBUG_CACHE, Numba prints a "[cache]" line for each kernel it loads or compiles and saves,
    and none follows the ready line. (Compiling into an empty cache instead cost 35 s of CPU.)"""
    os.environ["NUMBA_DEBUG_CACHE"] = "1"
    try:
        agg = Aggregator(startup_timeout=120.0)
        with agg, socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.bind((HOST, 0))
            start = time.monotonic()
            assert msg_type(join_over(s, (HOST, agg.port), 9, 0, timeout=1.0, **_params(1))) == MsgType.JOIN_ACK
            assert time.monotonic() - start < 1.0
            before, ready, after = agg.stdout().partition("intml-aggregator listening on")
    finally:
        del os.environ["NUMBA_DEBUG_CACHE"]
    assert ready
    assert "[cache] data loaded from" in before or "[cache] data saved to" in before, before[-2000:]
    assert "[cache]" not in after, after


def test_one_address_may_hold_one_rank_of_a_job():
    net = Network(3, join=False)
    net.join(0)
    (reply, _), = net.join(1, src=net.addr(0))
    assert msg_type(reply) == MsgType.ERROR
    assert "already holds rank 0 of job" in error_text(reply)
    assert net.core_counters()["drop_refused_join"] == 1
    # the refused JOIN bound nothing: rank 1 still joins from its own address
    (reply, _), = net.join(1)
    assert msg_type(reply) == MsgType.JOIN_ACK
    # the same address may hold a rank of another job
    (reply, _), = net.join(0, job=net.job + 1, src=net.addr(1))
    assert msg_type(reply) == MsgType.JOIN_ACK


def test_shared_address_is_allowed_when_asked():
    core = new_core(rows=16, max_elements=64)
    core.one_rank_per_address = False
    net = Network(3, join=False, aggregators=[core])
    for rank in range(3):
        (reply, _), = net.join(rank, src=net.addr(0))
        assert msg_type(reply) == MsgType.JOIN_ACK


def test_refused_joins_and_foreign_leaves_are_counted():
    net = Network(2)
    before = net.core_counters()
    (reply, _), = net.join(1, world_size=3)  # proved, but with another world size
    assert msg_type(reply) == MsgType.ERROR
    assert core_receive(net.cores[0], [(net.leave(1), STRANGER)], 0.0) == []  # not rank 1's address
    unknown = wire.pack({"type": int(MsgType.LEAVE), "job": net.job + 1, "rank": 0}, bytes(16))
    assert core_receive(net.cores[0], [(unknown, net.addr(0))], 0.0) == []  # no such job
    after = net.core_counters()
    assert after["drop_refused_join"] - before["drop_refused_join"] == 1
    assert after["drop_leave_non_member"] - before["drop_leave_non_member"] == 2
    assert net.job in {int(j) for j in net.stats()["jobs"]}  # the foreign LEAVE tore nothing down
