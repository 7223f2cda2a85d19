"""Tenants: each token is a tenant with its own job ids (two tokens' jobs of one id are two jobs, isolated), and
quotas on the jobs and slot rows the holders of one token may hold on a core, each refusal naming its option, so
that one tenant cannot take the table from another (docs/protocol.md, "Tenants")."""

from __future__ import annotations

import json
import socket
import threading

import numpy as np
import pytest
from support.cluster import HOST, aggregator, join_over
from support.harness import (
    HDR,
    Network,
    assert_table_equal,
    core_receive,
    handshake,
    make_inputs,
    msg_type,
    table_snapshot,
    worker_addr,
)
from test_aggregator_core import STRANGER, assert_results, error_text

from intml.aggregator.core import AggregatorCore, operator_request
from intml.aggregator.datapath import job_key
from intml.aggregator.leafspine import leaf_core
from intml.protocol import keys, reference
from intml.protocol.job import ControlLimits
from intml.protocol.wire import MsgType
from intml.testbed.forge import forged_data
from intml.worker import Worker

PARAMS = {"world_size": 1, "packet_elements": 64, "codec": 0, "seed": 9}


def _core(**quotas) -> AggregatorCore:
    return AggregatorCore(tokens=["a", "b"], rows=16, max_elements=64, max_jobs=8,
                          control_limits=ControlLimits(source_burst=1000, global_burst=100_000), **quotas)


def _join(core: AggregatorCore, job: int, token: str, pool: int, now: float = 0.0) -> bytes:
    src = worker_addr(job + 100 * ["a", "b"].index(token))  # each tenant's ranks from addresses of their own
    [(reply, _)] = handshake(core, src, now, job, 0, token=token, pool_size=pool, **PARAMS)
    return reply


def test_a_tenant_over_its_job_quota_is_refused_naming_it_and_others_are_not():
    core = _core(tenant_max_jobs=2)
    assert all(msg_type(_join(core, job, "a", 1)) == MsgType.JOIN_ACK for job in (1, 2))
    refusal = _join(core, 3, "a", 1)
    assert msg_type(refusal) == MsgType.ERROR and "--tenant-max-jobs" in error_text(refusal)
    assert 3 not in core.info
    assert all(msg_type(_join(core, job, "b", 1)) == MsgType.JOIN_ACK for job in (1, 2))  # b's own jobs 1 and 2


def test_a_tenant_cannot_exhaust_another_tenants_slots():
    core = _core(tenant_max_slots=8)
    assert msg_type(_join(core, 1, "a", 8)) == MsgType.JOIN_ACK
    refusal = _join(core, 2, "a", 1)
    assert msg_type(refusal) == MsgType.ERROR and "--tenant-max-slots" in error_text(refusal)
    assert "8 slot rows" in error_text(refusal)
    assert msg_type(_join(core, 3, "b", 8)) == MsgType.JOIN_ACK  # the other half of the table is b's to take
    core.teardown(1, 1.0)
    assert msg_type(_join(core, 2, "a", 8, now=1.0)) == MsgType.JOIN_ACK  # a's rows came back with its job


@pytest.mark.parametrize("quota", [None, 16])
def test_without_a_quota_the_core_limits_still_apply(quota):
    core = _core(tenant_max_slots=quota)
    assert msg_type(_join(core, 1, "a", 16)) == MsgType.JOIN_ACK
    refusal = _join(core, 2, "b", 1)
    assert msg_type(refusal) == MsgType.ERROR and "--slots" in error_text(refusal)


@pytest.mark.process
def test_quota_options_live():
    with aggregator("--tenant-max-jobs", "1", "--tenant-max-slots", "4", tokens=("a", "b")) as agg, \
            socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.bind((HOST, 0))
        target = (HOST, agg.port)
        assert msg_type(join_over(sock, target, 1, 0, token="a", pool_size=1, **PARAMS)) == MsgType.JOIN_ACK
        refusal = join_over(sock, target, 2, 0, token="a", pool_size=1, **PARAMS)
        assert "--tenant-max-jobs" in error_text(refusal)
        refusal = join_over(sock, target, 3, 0, token="b", pool_size=5, **PARAMS)
        assert "--tenant-max-slots" in error_text(refusal)
        assert msg_type(join_over(sock, target, 3, 0, token="b", pool_size=4, **PARAMS)) == MsgType.JOIN_ACK


# ---- each token is a tenant with its own job ids --------------------------------------------------------------
JOB = 7


def _tenants(core: AggregatorCore | None = None) -> tuple[AggregatorCore, Network, Network]:
    """Tenant a (3 ranks) and tenant b (2 ranks) on one core, both with job id JOB and the same slots and codec,
    so that their rounds name the same (job, slot, allreduce, chunk)."""
    core = core or _core()
    a = Network(3, packet_elements=64, pool_size=4, aggregators=[core], job=JOB, token="a", seed=5)
    b = Network(2, packet_elements=64, pool_size=4, aggregators=[core], job=JOB, token="b", seed=6, worker_port=6000)
    return core, a, b


def test_two_tenants_run_jobs_of_one_id_each_summing_only_its_own_ranks():
    core, a, b = _tenants()
    assert set(core.info) == {JOB, job_key(1, JOB)}  # tenant 0's key is the job id
    assert not set(core.info[JOB].rows) & set(core.info[job_key(1, JOB)].rows)
    for seq in range(2):
        xa, xb = make_inputs(3, 500, 64, "normal", seed=seq), make_inputs(2, 500, 64, "normal", seed=seq + 10)
        a.start(xa)
        b.start(xb)
        Network.run_together([a, b], shuffle_seed=seq)
        assert_results(a, xa, seq)  # the reference of a's three inputs alone
        assert_results(b, xb, seq)
    assert not a.stray and not b.stray
    jobs = core.stats(a.now)["jobs"]
    assert sorted(jobs) == [str(JOB), f"{JOB}@1"] and [jobs[k]["tenant"] for k in sorted(jobs)] == [0, 1]
    for job in jobs.values():
        assert not {k: v for k, v in job["counters"].items() if k.startswith("drop_") and v}, job["counters"]


def test_a_leave_or_a_forged_packet_of_one_tenant_does_not_touch_the_other():
    core, a, b = _tenants()
    before = table_snapshot(core, JOB)
    forged = forged_data(job=JOB, rank=2, allreduce=0, chunk=0, slot=0, shadow=0, count=64, exp=0, next_exp=0)
    # rank 2 of job JOB is a's; b's rank 1 claims it, and so does a stranger
    assert a.to_core(0, [(forged, b.addr(1)), (forged, STRANGER)]) == []
    assert_table_equal(before, table_snapshot(core, JOB))
    drops = [v for job in core.stats(a.now)["jobs"].values() for k, v in job["counters"].items()
             if k.startswith("drop_")]
    assert sum(drops) == 2  # both counted (under the first job of the id: neither is a seat of it) and dropped
    for rank in range(b.n):  # every rank of b leaves: b's job ends, a's stays with its members
        assert b.to_core(0, [(b.leave(rank), b.addr(rank))]) == []
    assert set(core.info) == {JOB} and core.info[JOB].members == {r: a.addr(r) for r in range(3)}
    assert [past["tenant"] for past in core.history] == [1]
    xs = make_inputs(3, 300, 64, "normal", seed=3)
    a.allreduce(xs)
    assert_results(a, xs)


def test_a_rank_seat_names_one_job_of_an_id():
    """The data path tells two tenants' jobs of one id apart by the rank's seat: an address holding rank r of one
    of them cannot take rank r of the other."""
    core, a, _ = _tenants()
    [(reply, _)] = handshake(core, a.addr(0), a.now, JOB, 0, token="b", nonce=bytes(range(3, 19)), world_size=2,
                             packet_elements=64, pool_size=4, codec=0, seed=6)
    assert "already holds rank 0 of another token's job 7" in error_text(reply)


def test_an_operator_sees_only_its_own_tenants_jobs():
    core, a, b = _tenants()
    for seq, (token, world) in enumerate((("a", 3), ("b", 2)), start=1):
        [(reply, _)] = core_receive(core, [(operator_request(token, seq), STRANGER)], a.now)
        body = json.loads(reply[HDR:-keys.MAC_SIZE])
        assert list(body["jobs"]) == [str(JOB)] and body["jobs"][str(JOB)]["params"]["world_size"] == world
    b.to_core(0, [(b.leave(r), b.addr(r)) for r in range(b.n)])
    for seq, (token, finished) in enumerate((("a", 0), ("b", 1)), start=3):  # b's finished job is b's to see
        [(reply, _)] = core_receive(core, [(operator_request(token, seq, size=1400), STRANGER)], a.now)
        assert len(json.loads(reply[HDR:-keys.MAC_SIZE])["finished"]) == finished


def test_metrics_label_each_tenants_job():
    pytest.importorskip("prometheus_client")
    from intml.aggregator.metrics import AggregatorCollector

    core, a, b = _tenants()
    xs = make_inputs(3, 100, 64, "normal", seed=1)
    a.allreduce(xs)
    got = {(s.labels["tenant"], s.labels["job"]): s.value for family in AggregatorCollector([core.counters]).collect()
           for s in family.samples if s.name == "intml_aggregator_job_completions_total"}
    completions = core.stats(a.now)["jobs"][str(JOB)]["counters"]["completions"]
    assert completions > 0 and got == {("0", str(JOB)): completions, ("1", str(JOB)): 0}  # b ran nothing


def test_a_leaf_refuses_a_second_tenants_job_of_one_id_naming_why():
    core = leaf_core(rows=16, max_elements=64, tokens=["a", "b"])
    core.datapath.add_route(JOB, leaf=0, ranks=[0, 1], spine=worker_addr(99))
    params = {"world_size": 2, "packet_elements": 64, "pool_size": 4, "codec": 0, "seed": 1}
    [(reply, _)] = handshake(core, worker_addr(0), 0.0, JOB, 0, token="a", **params)
    assert msg_type(reply) == MsgType.JOIN_ACK
    [(reply, _)] = handshake(core, worker_addr(1), 0.0, JOB, 1, token="b", **params)
    assert "keeps one job per job id" in error_text(reply) and set(core.info) == {JOB}


@pytest.mark.process
def test_two_workers_on_two_tokens_with_one_job_id_live():
    """Two real Workers, one per token, both job 5 at once: each gets the allreduce of its own input alone."""
    xs = {"a": np.linspace(-3, 3, 1000, dtype=np.float32), "b": np.linspace(10, 20, 1000, dtype=np.float32)}
    got: dict[str, np.ndarray] = {}
    with aggregator(tokens=("a", "b")) as agg:
        start = threading.Barrier(2)

        def tenant(token: str) -> None:
            with Worker(agg.address, job=5, rank=0, world_size=1, token=token, packet_elements=64, pool_size=4,
                        seed=11) as w:
                start.wait(30)
                got[token] = w.allreduce(xs[token]).copy()

        threads = [threading.Thread(target=tenant, args=(t,)) for t in xs]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
    for token, x in xs.items():
        want = reference.allreduce([x], codec="cnat8", seed=11, allreduce_seq=0, packet_elements=64)
        assert np.array_equal(got[token].view(np.uint32), want.view(np.uint32)), token
