"""Forged RESULTs (and PENDINGs) against a worker without the DATA/RESULT MAC: whatever arrives, the receive path writes only
within its arrays, counts what it drops, and queues each slot at most once per burst."""

from __future__ import annotations

import random
import time

import numba
import numpy as np
import pytest
from support.harness import AGG_IP, AGG_PORT, addr_key, engine_receive
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from intml.protocol.wire import HEADER_SIZE, Codec, MsgType
from intml.testbed.forge import forged_rounds, fuzzed
from intml.worker.engine import StreamEngine

JOB, SEED, P = 7, 11, 16
AGG = addr_key(AGG_IP, AGG_PORT)


def engine_of(pool: int, chunks: int, codec: Codec = Codec.CNAT8, world: int = 2) -> tuple[StreamEngine, int]:
    """A rank-0 engine of a fresh job that has started an allreduce of ``chunks`` chunks (elements returned)."""
    engine = StreamEngine(job=JOB, rank=0, world_size=world, codec=codec, packet_elements=P, pool_size=pool,
                          seed=SEED, agg_addrs=[AGG])
    elements = P * chunks - 3
    engine.start(np.linspace(-1, 1, elements, dtype=np.float32), 0.0)
    return engine, elements


def assert_counters_add_up(engine: StreamEngine) -> None:
    c = engine.counters()
    drops = sum(v for k, v in c.items() if k.startswith("drop_"))
    assert c["packets_in"] == c["results"] + c["pendings"] + drops, c


@pytest.mark.parametrize("codec", [Codec.CNAT8, Codec.INT32])
@pytest.mark.parametrize("pool", [1, 2, 3, 7, 64, 255, 256])
def test_consecutive_forged_rounds_in_one_burst(pool, codec):
    """Four consecutive rounds of every slot in one burst (the segfault: each accepted round queued a datagram,
    past the pool's tx rows). Each slot takes its first, the second is counted as drop_unsent (its chunk was
    not sent yet), the rest are stale; the burst queues one datagram per slot, each from its own buffer."""
    engine, elements = engine_of(pool, 4 * pool + 1, codec)
    window = min(pool, -(-elements // P))
    burst = forged_rounds(job=JOB, elements=elements, packet_elements=P, pool_size=pool, rounds=4, codec=codec)
    sent = engine_receive(engine, [(d, AGG) for d in burst], 0.001)
    c = engine.counters()
    assert c["results"] == window and c["drop_unsent"] == window
    assert c["drop_stale"] == len(burst) - 2 * window
    assert_counters_add_up(engine)
    assert len(sent) == window
    assert sorted(int.from_bytes(d[18:20], "big") for d, _ in sent) == list(range(window))
    assert all(dst == AGG and len(d) > HEADER_SIZE for d, dst in sent)


def _run_bursts(pool: int, chunks: int, codec: Codec, seed: int, bursts: int, size: int) -> StreamEngine:
    """Bursts of fuzzed RESULTs, with forged consecutive rounds mixed in, and PENDINGs for them (the DATA's header
    with type PENDING, count 0 and a ``have`` that names rank 0 or anything), and a timer call after each burst."""
    engine, elements = engine_of(pool, chunks, codec)
    rng = random.Random(seed)
    rounds = forged_rounds(job=JOB, elements=elements, packet_elements=P, pool_size=pool, rounds=3, codec=codec)
    rounds += [d[:3] + bytes([MsgType.PENDING]) + d[4:20] + bytes(2) + d[22:HEADER_SIZE]
               + rng.choice([1, rng.getrandbits(64)]).to_bytes(8, "big") for d in rounds]
    for b in range(bursts):
        burst = fuzzed(rng, size, job=JOB, elements=elements, packet_elements=P, pool_size=pool,
                               max_len=engine.max_datagram + 16)
        burst += rng.sample(rounds, min(len(rounds), rng.randint(0, size)))
        rng.shuffle(burst)
        sent = engine_receive(engine, [(d, AGG) for d in burst], 0.001 * (b + 1))
        assert len(sent) <= pool
        assert len(engine.handle_timer(1.0 * (b + 1)).datagrams()) <= pool
    assert_counters_add_up(engine)
    return engine


@pytest.mark.skipif(not numba.config.BOUNDSCHECK, reason="run by tests/testbed/test_audit.py in a "
                                                          "child with NUMBA_BOUNDSCHECK=1")
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(pool=st.sampled_from([1, 2, 3, 5, 16, 64]), extra=st.integers(0, 40),
       codec=st.sampled_from([Codec.CNAT8, Codec.INT32]), seed=st.integers(0, 2**32 - 1),
       size=st.integers(1, 300))
def test_receive_kernel_in_bounds_when_checked(pool, extra, codec, seed, size):
    """With bounds checking compiled in, any out-of-range index raises IndexError: none does."""
    _run_bursts(pool, pool + extra + 1, codec, seed, bursts=4, size=size)


@pytest.mark.parametrize("pool", [1, 7, 64])
def test_fuzzed_bursts_keep_counters_consistent(pool):
    """The same bursts without bounds checking: counters add up and no burst queues more than the pool."""
    _run_bursts(pool, 3 * pool + 2, Codec.CNAT8, seed=pool, bursts=8, size=200)


# ---- live: a real aggregator, a real worker process, forgeries from a raw socket --------------------------------


@pytest.mark.process
@pytest.mark.parametrize("mode", ["result", "data"])
def test_live_forgeries_never_crash_a_worker(mode):
    """Without the MAC, at pool sizes 1 to 256: forged RESULTs of two consecutive rounds of every slot, sent from
    the aggregator's address (mode "result"), or forged DATA sent from the rank's address that the aggregator
    completes into such RESULTs (mode "data", a world-1 job: each DATA completes a round), land in the rank's
    socket before its allreduce starts, so that they arrive in its first bursts. The worker survives, counts
    the results it could not have asked for (drop_unsent), its counters add up, and its next job is bit-exact."""
    from support.cluster import TOKENS, Procs, aggregator

    from intml.testbed.audit import POOLS, check_victim_reports, forge_at, get_from, victim
    from intml.testbed.spoof import raw_socket

    try:
        raw = raw_socket()
    except PermissionError:
        pytest.skip("needs CAP_NET_RAW to spoof source addresses")
    with raw, aggregator(idle_timeout=30) as agg, Procs() as procs:
        ports, go = procs.ctx.Queue(), procs.ctx.Event()
        procs.start("victim", victim, agg.port, TOKENS[0], POOLS, ports, go)
        for pool in POOLS:
            forge_at(raw, mode, agg.port, get_from(ports, procs.procs["victim"], 60), pool)
            time.sleep(0.5)  # every forgery (and the results the aggregator made of them) is in the socket
            go.set()
        [report] = procs.collect(["victim"], timeout=240).values()
    assert check_victim_reports(report.unwrap()) is None
