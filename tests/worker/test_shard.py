"""A job's slots spread over several aggregators (endpoints), on the virtual-clock harness: every rank's result is
bit-identical to one aggregator with the same total core count and to protocol.reference, with faults too; the
JOIN lays the job out (first_core, total_cores); ranks that list the endpoints differently, endpoints whose cores
overlap, and a CHALLENGE that lies about the core count are refused. The loopback test with two aggregator
processes is in tests/integration/test_e2e.py."""

from __future__ import annotations

import numpy as np
import pytest
from support.harness import ENDPOINT_PORTS, Network, agg_addr, core_receive, make_inputs, msg_type

from intml.protocol import reference, wire
from intml.protocol.job import JobParams
from intml.protocol.wire import MsgType
from intml.worker.session import JobJoined, JoinRefused, WorkerSession

P = 32


def results(net: Network, xs: list[np.ndarray], allreduces: int = 2) -> list[list[np.ndarray]]:
    """Every rank's result of `allreduces` allreduces of xs (the k-th scaled by k + 1), checked against the
    reference bit for bit."""
    out = []
    for k in range(allreduces):
        inputs = [x * np.float32(k + 1) for x in xs]
        got = net.allreduce(inputs)
        want = reference.allreduce(inputs, codec=net.codec.name.lower(), seed=net.seed, allreduce_seq=k,
                                   packet_elements=P)
        for rank, result in enumerate(got):
            assert np.array_equal(result.view(np.uint32), want.view(np.uint32)), (k, rank)
        out.append(got)
    return out


@pytest.mark.parametrize("endpoints,codec,faults", [([1, 2], "cnat8", False), ([2, 1], "int32", False),
                                                    ([1, 1, 1], "cnat8", True), ([2, 2], "cnat8", True)])
def test_endpoints_give_the_results_of_one_aggregator_with_as_many_cores(endpoints, codec, faults):
    n, pool = 3, 7
    xs = make_inputs(n, 23 * P + 5, P, "mixed", seed=len(endpoints))
    lossy = dict(drop=0.1, duplicate=0.1, reorder=0.2, fault_seed=5) if faults else {}
    one = Network(n, codec=codec, packet_elements=P, pool_size=pool, cores=sum(endpoints), **lossy)
    spread = Network(n, codec=codec, packet_elements=P, pool_size=pool, endpoints=endpoints, **lossy)
    assert [a - agg_addr(0) for a in spread.core_addrs] == [ENDPOINT_PORTS * e + i for e, k in
                                                             enumerate(endpoints) for i in range(k)]
    for a, b in zip(results(one, xs), results(spread, xs)):
        assert all(np.array_equal(x.view(np.uint32), y.view(np.uint32)) for x, y in zip(a, b))
    if not faults:  # each core of the job did the same work as the core with its index on one aggregator
        for i in range(sum(endpoints)):
            assert spread.job_counters(i) == one.job_counters(i), i


def test_the_join_lays_the_job_out_over_the_endpoints():
    net = Network(2, packet_elements=P, pool_size=7, endpoints=[1, 3])
    layout = [(int(c.datapath.jobs.stride[c.info[net.job].index]), int(c.datapath.jobs.offset[c.info[net.job].index]))
              for c in net.cores]
    assert layout == [(4, 0), (4, 1), (4, 2), (4, 3)]
    assert [c.info[net.job].rows.stop - c.info[net.job].rows.start for c in net.cores] == [2, 2, 2, 1]
    assert [(c.info[net.job].first_core, c.info[net.job].slots.stride) for c in net.cores] == [(0, 4), (1, 4), (1, 4),
                                                                                           (1, 4)]
    # statistics name the job's slots by their number in the whole pool
    xs = make_inputs(2, 7 * P, P, "normal", seed=1)
    net.start(xs)
    for data, src, dst in net.up:  # rank 0's first packets only: every slot waits for rank 1
        if src == net.addr(0):
            core_receive(net.cores[net.core_of[dst]], [(data, src)], net.now)
    pending = sorted(p["slot"] for c in net.cores for p in c.stats(net.now)["jobs"][str(net.job)]["pending"])
    assert pending == list(range(7))


def join_events(net: Network, session: WorkerSession, max_rounds: int = 10) -> list:
    """Run the session's handshake against the network's cores; returns its events."""
    session.connect(net.now)
    got: list = []
    for _ in range(max_rounds):
        for data, dst in session.datagrams_to_send(net.now):
            for reply, _ in core_receive(net.cores[net.core_of[dst]], [(data, net.addr(session.rank))], net.now):
                session.receive(reply, dst, net.now)
        got += list(iter(session.next_event, None))
        if any(isinstance(e, (JobJoined, JoinRefused)) for e in got):
            break
    return got


def session(net: Network, rank: int, endpoints: list[int]) -> WorkerSession:
    params = JobParams(world_size=net.n, packet_elements=net.packet_elements, pool_size=net.pool_size,
                       codec=net.codec, seed=net.seed)
    return WorkerSession(job=net.job, rank=rank, params=params, token=net.token, aggregator=endpoints)


def test_ranks_must_list_the_endpoints_in_the_same_order():
    net = Network(2, packet_elements=P, pool_size=4, endpoints=[1, 2], join=False)
    first = join_events(net, session(net, 0, net.endpoints))
    assert isinstance(first[-1], JobJoined) and first[-1].addrs == net.core_addrs
    other = join_events(net, session(net, 1, net.endpoints[::-1]))
    [refused] = [e for e in other if isinstance(e, JoinRefused)]
    assert "first_core" in refused.reason and refused.addr in net.core_addrs


def test_endpoints_whose_cores_overlap_are_refused_before_any_proof():
    net = Network(1, packet_elements=P, pool_size=4, cores=2, join=False)
    s = session(net, 0, [agg_addr(0), agg_addr(1)])  # core 1 of the first is the second
    got = join_events(net, s)
    assert [type(e) for e in got] == [JoinRefused] and "share ports" in got[0].reason
    assert all(net.job not in c.info for c in net.cores) and s.sessions == {}


def test_a_challenge_that_lies_about_the_cores_fails_the_join_and_leaves():
    """An on-path forger says the first aggregator has 1 core (it has 2): the JOIN_ACK, MAC'd, says 2; the
    session refuses the join and its LEAVE frees what the cores accepted."""
    net = Network(1, packet_elements=P, pool_size=4, endpoints=[2, 1], join=False)
    s = session(net, 0, net.endpoints)
    s.connect(0.0)
    for data, dst in s.datagrams_to_send(0.0):
        [(challenge, _)] = core_receive(net.cores[net.core_of[dst]], [(data, net.addr(0))], 0.0)
        if dst == net.endpoints[0]:
            header, body = wire.unpack_challenge(challenge)
            challenge = wire.pack_challenge(net.job, 0, bytes(body["nonce"]), bytes(body["cookie"]), cores=1)
        s.receive(challenge, dst, 0.0)
    assert s.cores == 2  # as the forger wants: 1 + 1
    got = []
    while not got:
        for data, dst in s.datagrams_to_send(0.0):
            for reply, _ in core_receive(net.cores[net.core_of[dst]], [(data, net.addr(0))], 0.0):
                s.receive(reply, dst, 0.0)
        got = [e for e in iter(s.next_event, None) if isinstance(e, JoinRefused)]
    assert "not the 1 its CHALLENGE said" in got[0].reason
    s.leave()
    for data, dst in s.datagrams_to_send(0.0):
        core_receive(net.cores[net.core_of[dst]], [(data, net.addr(0))], 0.0)
    assert all(net.job not in c.info for c in net.cores)


def test_an_aggregator_refuses_a_layout_its_cores_do_not_fit():
    net = Network(1, packet_elements=P, pool_size=4, cores=2, join=False)
    for first, total in ((1, 2), (0, 1), (3, 4)):
        [(reply, _)] = net.join(0, first_core=first, total_cores=total)
        assert msg_type(reply) == MsgType.ERROR and b"do not fit" in reply, (first, total)
    [(reply, _)] = net.join(0, first_core=2, total_cores=4)
    assert msg_type(reply) == MsgType.JOIN_ACK


@pytest.mark.process
def test_worker_and_pytorch_take_a_list_of_aggregators():
    from intml.worker.api import parse_aggregators
    from intml.worker.torch.config import IntmlConfig

    assert parse_aggregators("127.0.0.1:5000, localhost:6000") == [("127.0.0.1", 5000), ("127.0.0.1", 6000)]
    with pytest.raises(ValueError, match="host:port"):
        parse_aggregators("127.0.0.1:5000,")
    config = IntmlConfig.from_env({"INTML_AGGREGATOR": "10.0.0.1:48879,10.0.0.2:48879"})
    assert config.aggregator == "10.0.0.1:48879,10.0.0.2:48879"


def test_a_session_needs_distinct_endpoints():
    params = JobParams(world_size=1)
    for endpoints in ([], [agg_addr(0), agg_addr(0)]):
        with pytest.raises(ValueError, match="distinct"):
            WorkerSession(job=1, rank=0, params=params, token="t", aggregator=endpoints)
