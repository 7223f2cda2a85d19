"""Tests of worker.session.WorkerSession, the worker's sans-I/O control plane, against real AggregatorCores
(tests/harness.py) on a virtual clock: joining one and several cores, resending a lost JOIN, refusals, the
join and progress deadlines, statistics requests and leaving."""

from __future__ import annotations

import numpy as np
import pytest
from harness import Network, agg_addr, core_receive, msg_type

from intml.protocol import wire
from intml.protocol.job import JobParams
from intml.protocol.packet import HDR
from intml.protocol.wire import MsgType
from intml.worker.session import (
    JOIN_RESEND,
    STATS_WAIT,
    CoreJoined,
    JobJoined,
    JoinRefused,
    JoinTimedOut,
    NoProgress,
    StatsAnswered,
    WorkerSession,
    token_hash,
)


def events(session: WorkerSession) -> list:
    return list(iter(session.next_event, None))


def exchange(net: Network, rank: int, session: WorkerSession, now: float) -> list[tuple[bytes, int]]:
    """Deliver what the session sends to the cores and their replies back; returns the replies."""
    replies = []
    for data, dst in session.datagrams_to_send(now):
        for reply, _ in core_receive(net.cores[net.core_of[dst]], [(data, net.addr(rank))], now):
            session.receive(reply, dst, now)
            replies.append((reply, dst))
    return replies


def test_token_hash_is_blake2b_of_the_secret():
    assert token_hash("s3cret") == token_hash("s3cret") != token_hash("s3cret!")
    assert 0 <= token_hash("") < 1 << 64


def test_join_builds_the_join_from_job_params():
    params = JobParams(world_size=3, packet_elements=256, pool_size=5, seed=2**64 - 1)
    session = WorkerSession(job=9, rank=2, params=params, token=77, aggregator=agg_addr(0))
    assert session.get_timer() is None and session.datagrams_to_send(0.0) == []
    session.connect(1.0)
    [(data, dst)] = session.datagrams_to_send(1.0)
    header, body = wire.unpack_join(data)
    assert dst == agg_addr(0) and (header["type"], header["job"], header["rank"]) == (MsgType.JOIN, 9, 2)
    assert {k: int(body[k]) for k in ("world_size", "packet_elements", "pool_size", "codec", "seed", "token")} == \
        {"world_size": 3, "packet_elements": 256, "pool_size": 5, "codec": 0, "seed": 2**64 - 1, "token": 77}


@pytest.mark.parametrize("cores", [1, 3])
def test_join_every_core(cores):
    net = Network(2, cores=cores, join=False)
    session = net.session(1)
    session.connect(0.0)
    exchange(net, 1, session, 0.0)  # core 0, which tells how many cores there are
    assert session.cores == cores and session.joined == (cores == 1)
    exchange(net, 1, session, 0.0)  # the others, all at once
    assert session.joined and session.get_timer() is None
    got = events(session)
    assert [e.core for e in got if isinstance(e, CoreJoined)] == list(range(cores))
    assert got[-1] == JobJoined(cores, [])
    assert all(e.ack["cores"] == cores for e in got[:-1])


def test_lost_join_is_resent_until_acknowledged_then_stops():
    net = Network(1, join=False)
    session = net.session(0)
    session.connect(0.0)
    assert len(session.datagrams_to_send(0.0)) == 1  # lost
    assert session.get_timer() == JOIN_RESEND
    assert session.datagrams_to_send(JOIN_RESEND / 2) == []
    session.handle_timer(JOIN_RESEND)
    assert events(session) == []
    assert len(exchange(net, 0, session, JOIN_RESEND)) == 1
    assert session.joined and session.datagrams_to_send(10.0) == [] and session.get_timer() is None


def test_join_times_out_naming_the_silent_core():
    net = Network(1, cores=2, join=False)
    session = net.session(0)
    session.connect(0.0)
    exchange(net, 0, session, 0.0)  # core 0 acknowledges; core 1's JOIN goes nowhere from now on
    t = 0.0
    while not (got := [e for e in events(session) if not isinstance(e, CoreJoined)]):
        session.datagrams_to_send(t)
        t = session.get_timer()
        session.handle_timer(t)
    assert got == [JoinTimedOut(1)] and t == pytest.approx(session.timeout)
    assert session.get_timer() is None and session.datagrams_to_send(t + 1) == []


def test_refused_join_reports_the_reason_and_stops():
    net = Network(2, join=False)
    net.join(0, world_size=3)  # rank 0 made the job with other parameters
    session = net.session(1)
    session.connect(0.0)
    [(reply, _)] = exchange(net, 1, session, 0.0)
    assert msg_type(reply) == MsgType.ERROR
    [refused] = events(session)
    assert isinstance(refused, JoinRefused) and refused.core == 0
    assert refused.reason == reply[HDR:].decode() and "world" in refused.reason
    assert session.get_timer() is None and not session.joined


def test_datagrams_from_elsewhere_are_ignored():
    net = Network(1, join=False)
    session = net.session(0)
    session.connect(0.0)
    [(join, _)] = session.datagrams_to_send(0.0)
    [(ack, _)] = core_receive(net.cores[0], [(join, net.addr(0))], 0.0)
    for data, addr in ((ack, agg_addr(1)), (ack, 12345), (ack[:HDR - 1], agg_addr(0)), (ack[:-1], agg_addr(0))):
        session.receive(data, addr, 0.0)
    assert not session.joined and events(session) == []
    session.receive(ack, agg_addr(0), 0.0)
    assert session.joined


def test_progress_deadline():
    net = Network(1)
    session = net.session(0)
    session.watch_progress(1.0)
    assert session.get_timer() == 1.0 + session.timeout
    session.watch_progress(2.0)  # progress pushes the deadline
    session.handle_timer(1.0 + session.timeout)
    assert events(session) == []
    session.handle_timer(2.0 + session.timeout)
    assert events(session) == [NoProgress()] and session.get_timer() is None
    session.watch_progress(3.0)
    session.unwatch_progress()
    assert session.get_timer() is None


@pytest.mark.parametrize("cores", [1, 2])
def test_stats_name_the_missing_ranks(cores):
    net = Network(3, cores=cores, pool_size=4)
    net.start([np.ones(1000, np.float32)] * 3)
    net.up = [item for item in net.up if item[1] != net.addr(2)]  # rank 2 never reaches the aggregator
    for _ in range(3):
        net.step()
    session = net.session(0)
    session.connect(net.now)
    while not session.joined:  # a repeated JOIN is answered again: the session learns the cores
        exchange(net, 0, session, net.now)
    events(session)
    session.request_stats(net.now)
    exchange(net, 0, session, net.now)
    [answer] = events(session)
    assert isinstance(answer, StatsAnswered) and answer.missing == [2]
    assert set(answer.silent) == {"0", "1", "2"} and session.get_timer() is None


def test_stats_unanswered_and_job_unknown():
    net = Network(1)
    session = net.session(0)
    session.request_stats(5.0)
    assert len(session.datagrams_to_send(5.0)) == 1  # lost
    assert session.get_timer() == 5.0 + STATS_WAIT
    session.handle_timer(5.0 + STATS_WAIT)
    assert events(session) == [StatsAnswered(None, None)]
    other = Network(1, job=8, join=False).session(0)  # a job the aggregator does not know
    other.request_stats(net.now)
    exchange(net, 0, other, net.now)
    assert events(other) == [StatsAnswered([], None)]


def test_leave_every_core_frees_the_job():
    net = Network(1, cores=2, join=False)
    session = net.session(0)
    session.connect(0.0)
    while not session.joined:
        exchange(net, 0, session, 0.0)
    assert all(net.job in core.info for core in net.cores)
    session.leave()
    leaves = session.datagrams_to_send(0.0)
    assert [dst for _, dst in leaves] == [agg_addr(0), agg_addr(1)]
    assert all(msg_type(d) == MsgType.LEAVE for d, _ in leaves)
    for data, dst in leaves:
        core_receive(net.cores[net.core_of[dst]], [(data, net.addr(0))], 0.0)
    assert all(net.job not in core.info for core in net.cores)
    assert session.get_timer() is None


def test_join_and_progress_deadlines_are_separate():
    """connect_timeout bounds the JOIN, timeout the allreduce's progress: a short join deadline (the PyTorch
    integration's connect_timeout) must not cut allreduces short."""
    params = JobParams(world_size=1)
    session = WorkerSession(job=1, rank=0, params=params, token=1, aggregator=agg_addr(0), timeout=30.0,
                            connect_timeout=2.0)
    session.connect(0.0)
    t = 0.0
    while not (got := events(session)):
        session.datagrams_to_send(t)
        t = session.get_timer()
        session.handle_timer(t)
    assert got == [JoinTimedOut(0)] and t == pytest.approx(2.0)
    session.watch_progress(5.0)
    assert session.get_timer() == 35.0
    assert WorkerSession(job=1, rank=0, params=params, token=1, aggregator=agg_addr(0),
                         timeout=7.0).connect_timeout == 7.0  # by default the JOIN gets the whole timeout
