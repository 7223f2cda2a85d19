"""``intml-aggregator --engine p4model``: the same workers over real UDP on 127.0.0.1, with the data path run
through the P4 pipeline model, get the kernel engine's results bit for bit (and protocol.reference's), for
allreduces and reduce-scatters; the engine refuses, in one line, what the switch cannot do."""

from __future__ import annotations

import socket
from contextlib import ExitStack

import numpy as np
import pytest
from support.cluster import HOST, aggregator, join_over, run_ok
from support.harness import handshake, worker_addr

from intml.p4.engine import p4model_core
from intml.protocol import wire
from intml.protocol.wire import MsgType
from support.allreduce import CODECS, RS_PLAN, SMALL_PLAN, allreduce_worker, assert_bits_equal, check_results, expected_results, new_job, reduce_scatter_worker, run_job, shard_of

pytestmark = pytest.mark.process


ENGINES = ("kernel", "p4model")


def result_bytes(results: list[dict]) -> list[list[bytes]]:
    return [[np.asarray(out).tobytes() for out in res["outs"]] for res in results]


def on_both_engines(fn, args, n: int, **kwargs) -> tuple[dict[str, list], dict]:
    """fn(port, job, rank, *args) for n ranks against a kernel-engine and a p4model-engine aggregator at once (the
    jobs wait on loss timers far more than they compute); each engine's outcomes by rank, and the p4model core's
    counters."""
    with ExitStack() as stack:
        aggs = [stack.enter_context(aggregator("--engine", engine, idle_timeout=10)) for engine in ENGINES]
        jobs = [new_job() for _ in ENGINES]
        outs = run_ok(fn, [(agg.port, job, r, *args) for agg, job in zip(aggs, jobs) for r in range(n)],
                      timeout=120, **kwargs)
        counters = aggs[1].stats()[0]["core_counters"]
    return {engine: outs[i * n:(i + 1) * n] for i, engine in enumerate(ENGINES)}, counters


@pytest.mark.parametrize("codec", CODECS)
def test_p4model_engine_is_bit_identical_to_the_kernel(codec: str) -> None:
    """Three workers, 10% loss, duplication and reordering, 256 elements a packet (4 passes of C_nat codes)."""
    n, seed = 3, 61
    runs, counters = on_both_engines(allreduce_worker, (n, codec, seed, SMALL_PLAN), n, faults=0.1)
    assert counters["packets_in"] > 100, counters  # STATS through the model's counters
    check_results(runs["p4model"], n, codec, seed, SMALL_PLAN, f"p4model {codec}")
    assert result_bytes(runs["p4model"]) == result_bytes(runs["kernel"])


@pytest.mark.parametrize("codec", CODECS)
def test_p4model_engine_serves_reduce_scatter_as_the_kernel(codec: str) -> None:
    """Four workers' Worker.reduce_scatter calls (shards straddling chunks, a mean, an allreduce between them), 10%
    loss, duplication and reordering: --engine p4model gives each rank the kernel engine's shards byte for byte,
    the allreduce's restricted to the rank's shard."""
    n, seed = 4, 63
    runs, _ = on_both_engines(reduce_scatter_worker, (n, codec, seed, RS_PLAN, 0.1, False), n)
    assert result_bytes(runs["p4model"]) == result_bytes(runs["kernel"])
    want = expected_results(n, codec, seed, [spec for _, spec in RS_PLAN])
    for r, res in enumerate(runs["p4model"]):
        for (kind, spec), got, w in zip(RS_PLAN, res["outs"], want):
            assert_bits_equal(got, shard_of(w, r, n) if kind == "rs" else w, f"rank {r} {kind} {spec}")


def test_p4model_engine_on_two_cores() -> None:
    n, seed = 2, 62
    with aggregator("--engine", "p4model", cores=2) as agg:
        results = run_job(agg.port, n, "cnat8", seed, SMALL_PLAN)
        replies = agg.stats()
    check_results(results, n, "cnat8", seed, SMALL_PLAN, "p4model --cores 2")
    assert [r["core"] for r in replies] == [0, 1]
    assert all(r["core_counters"]["packets_in"] > 10 for r in replies), replies


@pytest.mark.parametrize("params, says", [({"flags": wire.FLAG_DATA_MAC}, "without data_mac"),
                                          ({"packet_elements": 2048}, "at most 1024 payload bytes")])
def test_p4model_engine_refuses_a_join_in_one_line(params: dict, says: str) -> None:
    with aggregator("--engine", "p4model") as agg, socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.bind((HOST, 0))
        reply = join_over(sock, (HOST, agg.port), new_job(), 0,
                          **{"world_size": 2, "packet_elements": 64, "pool_size": 2, "codec": 0, **params})
    header, payload = wire.unpack(reply)
    text = payload.tobytes().decode()
    assert header["type"] == MsgType.ERROR and says in text and "\n" not in text, text


def test_p4model_engine_refuses_a_second_tenants_job_of_one_id_naming_why() -> None:
    """The P4 job table matches the wire job id alone: a second token's job of an id running is refused."""
    core = p4model_core(rows=16, max_elements=64, max_jobs=4, tokens=["a", "b"])
    params = {"world_size": 2, "packet_elements": 64, "pool_size": 4, "codec": 0, "seed": 1}
    [(reply, _)] = handshake(core, worker_addr(0), 0.0, 7, 0, token="a", **params)
    assert reply[wire.OFFSETS["type"]] == MsgType.JOIN_ACK
    [(reply, _)] = handshake(core, worker_addr(1), 0.0, 7, 1, token="b", **params)
    assert reply[wire.OFFSETS["type"]] == MsgType.ERROR and b"keeps one job per job id" in reply
    [(reply, _)] = handshake(core, worker_addr(1), 0.0, 8, 1, token="b", **params)
    assert reply[wire.OFFSETS["type"]] == MsgType.JOIN_ACK  # another id is b's to take
