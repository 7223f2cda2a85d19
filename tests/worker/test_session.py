"""Tests of worker.session.WorkerSession, the worker's sans-I/O control plane, against real AggregatorCores
(tests/support/harness.py) on a virtual clock: joining one and several cores, resending a lost JOIN, refusals, the
join and progress deadlines, statistics requests and leaving."""

from __future__ import annotations

import numpy as np
import pytest
from support.harness import Network, agg_addr, core_receive, msg_type

from intml.protocol import keys, wire
from intml.protocol.job import JobParams
from intml.protocol.packet import HDR
from intml.protocol.wire import MsgType
from intml.worker.session import (
    JOIN_RESEND,
    STATS_REQUEST_SIZE,
    STATS_WAIT,
    CoreJoined,
    JobJoined,
    JoinRefused,
    JoinTimedOut,
    NoProgress,
    StatsAnswered,
    WorkerSession,
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


def handshake(net: Network, rank: int, session: WorkerSession, now: float) -> list[tuple[bytes, int]]:
    """One JOIN round trip per core due, then the proved JOINs' (two exchanges); returns every reply."""
    return exchange(net, rank, session, now) + exchange(net, rank, session, now)


def ack_not_yet_delivered() -> tuple[Network, WorkerSession, bytes]:
    """A rank-0 session past the CHALLENGE, and the JOIN_ACK the core gave its proved JOIN (not delivered)."""
    net = Network(1, join=False)
    session = net.session(0)
    session.connect(0.0)
    exchange(net, 0, session, 0.0)
    [(proved, _)] = session.datagrams_to_send(0.0)
    [(ack, _)] = core_receive(net.cores[0], [(proved, net.addr(0))], 0.0)
    return net, session, ack


def test_join_builds_the_join_from_job_params_without_the_token():
    params = JobParams(world_size=3, packet_elements=256, pool_size=5, seed=2**64 - 1, data_mac=True)
    session = WorkerSession(job=9, rank=2, params=params, token="s3cret", aggregator=agg_addr(0),
                            random_bytes=lambda n: b"N" * n)
    assert session.get_timer() is None and session.datagrams_to_send(0.0) == []
    session.connect(1.0)
    [(data, dst)] = session.datagrams_to_send(1.0)
    header, body, bitmap = wire.unpack_join(data)
    assert dst == agg_addr(0) and (header["type"], header["job"], header["rank"]) == (MsgType.JOIN, 9, 2)
    assert {k: int(body[k]) for k in ("world_size", "packet_elements", "pool_size", "codec", "seed", "flags")} == \
        {"world_size": 3, "packet_elements": 256, "pool_size": 5, "codec": 0, "seed": 2**64 - 1, "flags": 1}
    assert bytes(body["nonce"]) == b"N" * 16 and not any(bytes(body["cookie"])) and not any(bytes(body["mac"]))
    assert bitmap == bytes(1) and b"s3cret" not in data and keys.token_key("s3cret") not in data


def test_challenge_then_proved_join():
    """The CHALLENGE's cookie goes back at once in a JOIN MAC'd under the token key; a CHALLENGE for another
    nonce (a stale or forged one) changes nothing."""
    net = Network(1, join=False)
    session = net.session(0)
    session.connect(0.0)
    [(challenge, _)] = exchange(net, 0, session, 0.0)
    assert msg_type(challenge) == MsgType.CHALLENGE and session.get_timer() == 0.0  # the proof is due now
    forged = wire.pack_challenge(net.job, 0, b"x" * 16, b"y" * 16)
    session.receive(forged, agg_addr(0), 0.0)
    [(proved, _)] = session.datagrams_to_send(0.0)
    body = wire.unpack_join(proved)[1]
    assert bytes(body["cookie"]) == bytes(wire.unpack_challenge(challenge)[1]["cookie"])
    assert keys.verify(keys.token_key(net.token), proved, wire.JOIN_MAC)


def test_forged_join_ack_is_refused():
    """A JOIN_ACK that echoes the nonce and cookie but is not MAC'd under the session key (an on-path forger
    without the token) is ignored; the real one is taken."""
    net, session, ack = ack_not_yet_delivered()
    header, body, bitmap = wire.unpack_join(ack)
    fields = {k: (bytes(body[k]) if body.dtype.fields[k][0].kind == "V" else int(body[k])) for k in body.dtype.names}
    for forged in (wire.pack_join({"type": int(MsgType.JOIN_ACK), "job": net.job}, {**fields, "group": 0xE0000001,
                                                                                    "group_port": 9}, bitmap),
                   keys.seal(keys.token_key("guess"), ack, wire.JOIN_MAC)):
        session.receive(forged, agg_addr(0), 0.0)
        assert not session.joined and events(session) == []
    session.receive(ack, agg_addr(0), 0.0)
    assert session.joined


@pytest.mark.parametrize("cores", [1, 3])
def test_join_every_core(cores):
    net = Network(2, cores=cores, join=False)
    session = net.session(1)
    session.connect(0.0)
    handshake(net, 1, session, 0.0)  # core 0, which tells how many cores there are
    assert session.cores == cores and session.joined == (cores == 1)
    handshake(net, 1, session, 0.0)  # the others, all at once
    # no deadline left but the first keepalive's, a third of the cores' idle timeout from now
    assert session.joined and session.get_timer() == session.keepalive_every == net.cores[0].idle_timeout / 3
    got = events(session)
    assert [e.core for e in got if isinstance(e, CoreJoined)] == list(range(cores))
    joined = got[-1]
    assert isinstance(joined, JobJoined) and (joined.cores, joined.groups, joined.allreduce) == (cores, [], 0)
    assert joined.data_keys.shape == (cores, 2) and joined.data_keys.dtype == np.uint64
    assert len({tuple(k) for k in joined.data_keys}) == cores  # each core's job nonce makes its own key
    assert (joined.shadow_sets == 0).all() and joined.shadow_sets.shape == (4,)
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
    assert len(handshake(net, 0, session, JOIN_RESEND)) == 2
    assert session.joined and session.datagrams_to_send(0.1) == []
    assert session.get_timer() == JOIN_RESEND + session.keepalive_every  # the JOINs' timers are gone


def test_join_times_out_naming_the_silent_core():
    net = Network(1, cores=2, join=False)
    session = net.session(0)
    session.connect(0.0)
    handshake(net, 0, session, 0.0)  # core 0 acknowledges; core 1's JOIN goes nowhere from now on
    t = 0.0
    while not (got := [e for e in events(session) if not isinstance(e, CoreJoined)]):
        session.datagrams_to_send(t)
        t = session.get_timer()
        session.handle_timer(t)
    assert got == [JoinTimedOut(agg_addr(1))] and t == pytest.approx(session.timeout)
    assert session.get_timer() is None and session.datagrams_to_send(t + 1) == []


def test_refused_join_reports_the_reason_and_stops():
    net = Network(2, join=False)
    net.join(0, world_size=3)  # rank 0 made the job with other parameters
    session = net.session(1)
    session.connect(0.0)
    [_, (reply, _)] = handshake(net, 1, session, 0.0)
    assert msg_type(reply) == MsgType.ERROR
    [refused] = events(session)
    assert isinstance(refused, JoinRefused) and refused.addr == agg_addr(0)
    assert refused.reason == reply[HDR:].decode() and "world" in refused.reason
    assert session.get_timer() is None and not session.joined


def test_datagrams_from_elsewhere_are_ignored():
    net, session, ack = ack_not_yet_delivered()
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
    while not session.joined:  # rank 0 joins again: the session learns the cores and gets session keys
        exchange(net, 0, session, net.now)
    events(session)
    session.request_stats(net.now)
    exchange(net, 0, session, net.now)
    [answer] = events(session)
    assert isinstance(answer, StatsAnswered) and answer.missing == [2]
    assert set(answer.silent) == {"0", "1", "2"} and session.get_timer() == net.now + session.keepalive_every


def test_stats_unanswered_and_job_unknown():
    net = Network(1)
    session = net.sessions[0]
    events(session)
    session.request_stats(5.0)
    [(request, _)] = session.datagrams_to_send(5.0)  # lost
    assert len(request) == STATS_REQUEST_SIZE
    assert session.get_timer() == 5.0 + STATS_WAIT
    session.handle_timer(5.0 + STATS_WAIT)
    assert events(session) == [StatsAnswered(None, None)]
    net.cores[0].teardown(net.job)  # the aggregator no longer knows the job
    session.request_stats(net.now)
    exchange(net, 0, session, net.now)
    assert events(session) == [StatsAnswered([], None)]


def test_forged_stats_reply_is_ignored():
    net = Network(2)
    session = net.sessions[0]
    events(session)
    session.request_stats(0.0)
    [(request, dst)] = session.datagrams_to_send(0.0)
    [(reply, _)] = core_receive(net.cores[0], [(request, net.addr(0))], 0.0)
    forged = reply[:HDR] + b'{"missing": [1]}' + reply[-16:]
    session.receive(forged, dst, 0.0)
    assert events(session) == []
    session.receive(reply, dst, 0.0)
    assert events(session) == [StatsAnswered([], {"0": 0.0, "1": 0.0})]


def test_leave_every_core_frees_the_job():
    net = Network(1, cores=2, join=False)
    session = net.session(0)
    session.connect(0.0)
    while not session.joined:
        exchange(net, 0, session, 0.0)
    assert all(net.job in core.info for core in net.cores)
    sealed = session.sealed(MsgType.LEAVE, agg_addr(0))
    stale = sealed[:-1] + bytes([sealed[-1] ^ 1])  # a LEAVE with a bad MAC changes nothing
    assert core_receive(net.cores[0], [(stale, net.addr(0))], 0.0) == [] and net.job in net.cores[0].info
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
    session = WorkerSession(job=1, rank=0, params=params, token="t", aggregator=agg_addr(0), timeout=30.0,
                            connect_timeout=2.0)
    session.connect(0.0)
    t = 0.0
    while not (got := events(session)):
        session.datagrams_to_send(t)
        t = session.get_timer()
        session.handle_timer(t)
    assert got == [JoinTimedOut(agg_addr(0))] and t == pytest.approx(2.0)
    session.watch_progress(5.0)
    assert session.get_timer() == 35.0
    assert WorkerSession(job=1, rank=0, params=params, token="t", aggregator=agg_addr(0),
                         timeout=7.0).connect_timeout == 7.0  # by default the JOIN gets the whole timeout


def test_a_join_refused_by_one_core_leaves_the_others():
    """Core 1 refuses (its table is full); the LEAVE the session then queues goes to core 0 only, which accepted,
    and frees the job there: no binding is left behind."""
    net = Network(1, cores=2, join=False)
    net.cores[1].counters.row_used[:] = True  # no free slot rows on core 1
    session = net.session(0)
    session.connect(0.0)
    while not (refused := [e for e in events(session) if isinstance(e, JoinRefused)]):
        handshake(net, 0, session, 0.0)
    assert refused[0].addr == agg_addr(1) and "no free slots" in refused[0].reason
    assert net.job in net.cores[0].info and net.job not in net.cores[1].info
    session.leave()
    [(leave, dst)] = session.datagrams_to_send(0.0)
    assert dst == agg_addr(0)
    core_receive(net.cores[0], [(leave, net.addr(0))], 0.0)
    assert net.job not in net.cores[0].info
