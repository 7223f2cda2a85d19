"""Graceful overload: workers over real loopback UDP against a deliberately slowed aggregator
(tests/support/slow_aggregator.py: the real data plane, asleep ``PER_DATAGRAM`` seconds per datagram, answering in
bursts of 16). The aggregator is the bottleneck and its queue holds every worker's window: round trips of about
100 ms, twice the RTO's floor, which made each worker resend more than twice what it sent (the RTO fired
before any round trip could be sampled). Its receive buffer (512 KB, against the 64 MiB a BurstSocket asks
for) holds that queue. A receive buffer of 64 KB (``SMALL_RCVBUF``) holds about 50 of the workers' 256 datagrams: the
kernel drops the rest, real losses, unless the workers' send windows (worker.window) follow the aggregator's
congestion marks (aggregator.congestion; docs/window.md). Checked, for both buffers:

* every rank's result of every allreduce is bit-identical to protocol.reference.allreduce;
* retransmissions (timer and fast) stay under 1% of the data packets (2% with the small buffer, the target of
  docs/window.md), and the aggregator sees under 1% of duplicates (a retransmission whose original arrived: a
  spurious one);
* goodput stays near what the slowed aggregator allows: an allreduce needs (chunks + window) x n datagrams at
  the aggregator, PER_DATAGRAM seconds each, and the timed allreduces together take at most GOODPUT_SLACK times
  that (the slack covers the sleeps' overshoot and the workers' own time on a loaded 2-core machine).
"""

from __future__ import annotations

import time

import numpy as np
import pytest
from support.cluster import TOKENS, run_ok
from support.harness import Network
from support.slow_aggregator import slow_aggregator

from intml import Worker
from intml.protocol import reference

pytestmark = pytest.mark.process

N = 4
PACKET = 256  # the slowed aggregator costs per datagram; small ones keep the reference (the oracle) quick
POOL = 64
CHUNKS = 160
ELEMENTS = CHUNKS * PACKET - 321  # a partial last chunk
ALLREDUCES = 4  # the first (Numba's kernels load, the RTO starts unadapted) is checked but not timed
PER_DATAGRAM = 400e-6  # the slowed aggregator: 2500 datagrams/s; its queue (N x POOL) takes 100 ms
RCVBUF = 256 << 10
SMALL_RCVBUF = 32 << 10  # the kernel grants twice what is asked
GOODPUT_SLACK = 1.5
SEED = 11
JOB = 31


def rank_input(rank: int, k: int) -> np.ndarray:
    return (np.random.default_rng([SEED, rank, k]).standard_normal(ELEMENTS) * 2.0 ** (k - 2)).astype(np.float32)


def run_rank(rank: int, port: int) -> dict:
    with Worker(f"127.0.0.1:{port}", job=JOB, rank=rank, world_size=N, token=TOKENS[0], packet_elements=PACKET,
                pool_size=POOL, seed=SEED, timeout=20.0) as w:
        results, times = [], []
        for k in range(ALLREDUCES):
            start = time.monotonic()
            results.append(w.allreduce(rank_input(rank, k)))
            times.append((start, time.monotonic()))
        return {"results": results, "times": times, "counters": w.counters(), "window": w.engine.send_window}


@pytest.mark.parametrize(("rcvbuf", "retx_share"), [(RCVBUF, 0.01), (SMALL_RCVBUF, 0.02)])
def test_slowed_aggregator_degrades_gracefully(rcvbuf: int, retx_share: float) -> None:
    # the engine's kernels compiled here, before the workers fork: compiling in each of them at once would make
    # the first allreduce wait for the slowest (seconds, under load) and time out slots on their peers
    Network(N, packet_elements=PACKET, pool_size=2).allreduce([rank_input(r, 0)[:3 * PACKET] for r in range(N)])
    with slow_aggregator(PER_DATAGRAM, rcvbuf) as agg:
        reports = run_ok(run_rank, [(r, agg.port) for r in range(N)], timeout=120.0)
        core = agg.counters()
    for k in range(ALLREDUCES):
        want = reference.allreduce([rank_input(r, k) for r in range(N)], codec="cnat8", seed=SEED, allreduce_seq=k,
                                   packet_elements=PACKET)
        for rep in reports:
            np.testing.assert_array_equal(rep["results"][k], want)
    data = ALLREDUCES * (CHUNKS + POOL)  # per rank: every chunk and every slot's bootstrap packet
    retx = [rep["counters"]["retransmissions"] + rep["counters"]["fast_retransmissions"] for rep in reports]
    timed = max(rep["times"][-1][1] for rep in reports) - min(rep["times"][1][0] for rep in reports)
    bound = (ALLREDUCES - 1) * (CHUNKS + POOL) * N * PER_DATAGRAM
    print(f"\nrcvbuf {agg.rcvbuf} B; per rank: {data} data packets, retransmissions {retx}, counters "
          f"{[rep['counters'] for rep in reports]}; aggregator: duplicates {core['retransmissions']}, "
          f"results resent {core['results_resent']}, dropped incomplete {core['drop_duplicate_incomplete']}; "
          f"timed {timed:.3f} s, the slowed aggregator's bound {bound:.3f} s ({bound / timed:.2f} of it); send windows "
          f"{[rep['window'] for rep in reports]}")
    assert all(r < retx_share * data for r in retx), retx
    if rcvbuf == SMALL_RCVBUF:  # the aggregator marked its deep queue, and the windows followed
        assert all(rep["counters"]["congestion_marks"] > 0 and rep["window"] < POOL for rep in reports)
    assert core["retransmissions"] < 0.01 * N * data
    assert timed < GOODPUT_SLACK * bound
