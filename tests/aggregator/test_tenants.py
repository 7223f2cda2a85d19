"""Tenant quotas: the jobs and slot rows the holders of one token may hold on a core, each refusal naming its
option, so that one tenant cannot take the table from another."""

from __future__ import annotations

import socket

import pytest
from support.cluster import HOST, aggregator, join_over
from support.harness import handshake, msg_type, worker_addr
from test_aggregator_core import error_text

from intml.aggregator.core import AggregatorCore
from intml.protocol.job import ControlLimits
from intml.protocol.wire import MsgType

PARAMS = {"world_size": 1, "packet_elements": 64, "codec": 0, "seed": 9}


def _core(**quotas) -> AggregatorCore:
    return AggregatorCore(tokens=["a", "b"], rows=16, max_elements=64, max_jobs=8,
                          control_limits=ControlLimits(source_burst=1000, global_burst=100_000), **quotas)


def _join(core: AggregatorCore, job: int, token: str, pool: int, now: float = 0.0) -> bytes:
    [(reply, _)] = handshake(core, worker_addr(job), now, job, 0, token=token, pool_size=pool, **PARAMS)
    return reply


def test_a_tenant_over_its_job_quota_is_refused_naming_it_and_others_are_not():
    core = _core(tenant_max_jobs=2)
    assert all(msg_type(_join(core, job, "a", 1)) == MsgType.JOIN_ACK for job in (1, 2))
    refusal = _join(core, 3, "a", 1)
    assert msg_type(refusal) == MsgType.ERROR and "--tenant-max-jobs" in error_text(refusal)
    assert 3 not in core.info
    assert all(msg_type(_join(core, job, "b", 1)) == MsgType.JOIN_ACK for job in (4, 5))


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
