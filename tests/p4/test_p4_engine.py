"""``intml-aggregator --engine p4model``: the same workers over real UDP on 127.0.0.1, with the data path run
through the P4 pipeline model, get the kernel engine's results bit for bit (and protocol.reference's), for
allreduces and reduce-scatters; the engine refuses, in one line, what the switch cannot do."""

from __future__ import annotations

import socket

import numpy as np
import pytest
from support.cluster import HOST, aggregator, join_over, run_ok
from support.harness import handshake, worker_addr

from intml.p4.engine import p4model_core
from intml.protocol import wire
from intml.protocol.wire import MsgType
from support.allreduce import CODECS, RS_PLAN, SMALL_PLAN, assert_bits_equal, check_results, expected_results, new_job, reduce_scatter_worker, run_job, shard_of

pytestmark = pytest.mark.process


def result_bytes(results: list[dict]) -> list[list[bytes]]:
    return [[np.asarray(out).tobytes() for out in res["outs"]] for res in results]


@pytest.mark.parametrize("codec", CODECS)
def test_p4model_engine_is_bit_identical_to_the_kernel(codec: str) -> None:
    """Three workers, 10% loss, duplication and reordering, 256 elements a packet (4 passes of C_nat codes)."""
    n, seed = 3, 61
    runs = {}
    for engine in ("kernel", "p4model"):
        with aggregator("--engine", engine) as agg:
            runs[engine] = run_job(agg.port, n, codec, seed, SMALL_PLAN, faults=0.1)
            if engine == "p4model":  # STATS through the model's counters
                counters = agg.stats()[0]["core_counters"]
                assert counters["packets_in"] > 100, counters
    check_results(runs["p4model"], n, codec, seed, SMALL_PLAN, f"p4model {codec}")
    assert result_bytes(runs["p4model"]) == result_bytes(runs["kernel"])


@pytest.mark.parametrize("codec", CODECS)
def test_p4model_engine_serves_reduce_scatter_as_the_kernel(codec: str) -> None:
    """Four workers' Worker.reduce_scatter calls (shards straddling chunks, a mean, an allreduce between them), 10%
    loss, duplication and reordering: --engine p4model gives each rank the kernel engine's shards byte for byte,
    the allreduce's restricted to the rank's shard."""
    n, seed = 4, 63
    runs = {}
    for engine in ("kernel", "p4model"):
        with aggregator("--engine", engine, idle_timeout=10) as agg:
            job = new_job()
            runs[engine] = run_ok(reduce_scatter_worker, [(agg.port, job, r, n, codec, seed, RS_PLAN, 0.1, False)
                                                          for r in range(n)], timeout=120)
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
