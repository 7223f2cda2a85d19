"""Loss at scale: how long a slot's round takes when any of n contributions or n results may be lost.

A round completes only when all n contributions reached the switch and all n workers have the result, so with
loss p per link direction a round needs a retransmission with probability 1 - (1 - p)^(2n): at n = 1024 and
p = 1e-4, 18% of rounds (9.7% counting the uplink alone). The slot model, per round:

* no loss: the base round time T0 = max(RTT, pool · serialisation): the window cycles at line rate, or the pool
  cannot cover the bandwidth-delay product and each slot waits a round trip;
* the worst of the 2n channels needs K retransmissions, drawn exactly from P(K <= k) = (1 - p^(k+1))^(2n)
  (inverse CDF: one draw per round whatever n, so 1024 workers cost no more than 4; a retry's own loss is taken
  as p, not the 1 - (1 - p)^2 of a resent contribution plus its result);
* the first retry comes after fast retransmit, T0 plus three packet times (FAST_RETRANSMIT later results
  overtake the lost one), if the pool has more than FAST_RETRANSMIT slots and FAST_RETRANSMIT packets are sent
  after it (not so for the allreduce's last rounds); otherwise, and for later retries, after the retransmission
  timer, doubling up to ``max_rto``. intml's RTO sits at its floor (``min_rto``) on a fabric
  whose round trips are microseconds, so the timer here is that floor.

The allreduce takes the loss-free time (``models.in_network``) plus the largest sum of retry delays of any one
slot (a slot's rounds are sequential; the others go on meanwhile); its p50 and p99 are over ``repeats`` allreduces.
"""

from __future__ import annotations

import math

import numpy as np

from intml.protocol.packet import HDR
from intml.sim.models import Net, in_network
from intml.sim.network import WIRE_OVERHEAD
from intml.worker.state import FAST_RETRANSMIT

COLUMNS = ("workers", "loss", "pool", "rto", "rounds_retried", "slot_p50_us", "slot_p99_us", "allreduce_p50_ms",
           "allreduce_p99_ms", "lossless_ms")


def retry_delays(k: np.ndarray, fast: np.ndarray, t0: float, serial: float, rto: float,
                 max_rto: float) -> np.ndarray:
    """The extra time of each round whose worst channel needed k retransmissions; ``fast``: whether its first
    retry is a fast retransmit."""
    kmax = int(k.max(initial=0))
    timer = np.concatenate([[0.0], np.cumsum([min(max_rto, rto * 2 ** i) for i in range(kmax)])])
    first = t0 + FAST_RETRANSMIT * serial
    # fast: the first retry after `first`, then the timer's steps from its first
    with_fast = np.where(k > 0, first + timer[np.maximum(k - 1, 0)], 0.0)
    return np.where(fast, with_fast, timer[k])


def slot_rounds(workers: int, loss: float, *, elements: int, packet_elements: int, pool: int, rate: float,
                delay: float, rto: float, max_rto: float = 1.0, switch_latency: float = 1e-6, repeats: int = 200,
                seed: int = 1) -> tuple[np.ndarray, np.ndarray, float]:
    """(round completion times, (repeats, chunks); each repeat's allreduce time; the time without loss) of
    ``repeats`` cnat8 allreduces."""
    wire = (packet_elements + HDR + WIRE_OVERHEAD) * 8 / rate
    chunks = math.ceil(elements / packet_elements)
    window = min(pool, chunks)
    t0 = max(2 * delay + switch_latency + 2 * wire, window * wire)
    rng = np.random.default_rng(seed)
    if loss > 0:
        u = rng.random((repeats, chunks))
        with np.errstate(divide="ignore"):
            tail = -np.expm1(np.log(u) / (2 * workers))  # 1 - u^(1/2n), accurately for u near 1
            k = np.maximum(0, np.ceil(np.log(tail) / math.log(loss)) - 1).astype(np.int64)
    else:
        k = np.zeros((repeats, chunks), np.int64)
    # overtaking needs FAST_RETRANSMIT later-sent packets: none for the allreduce's last rounds, nor a small pool
    fast = (np.arange(chunks) < chunks - FAST_RETRANSMIT) & (window > FAST_RETRANSMIT)
    extra = retry_delays(k, fast, t0, wire, rto, max_rto)
    slot = np.arange(chunks) % window
    per_slot = np.stack([np.bincount(slot, weights=e, minlength=window) for e in extra])
    lossless = in_network(Net(workers, rate, delay, switch_latency=switch_latency), elements, packet_elements, pool)
    return t0 + extra, lossless + per_slot.max(axis=1), lossless


def table(workers: list[int], losses: list[float], pools: list[int], rtos: list[float], *, elements: int,
          rate: float, seed: int = 1, delay: float = 1e-6, packet_elements: int = 8946) -> list[dict]:
    out = []
    for n in workers:
        for p in losses:
            for pool in pools:
                for rto in rtos:
                    rounds, totals, lossless = slot_rounds(n, p, elements=elements, packet_elements=packet_elements,
                                                           pool=pool, rate=rate, delay=delay, rto=rto, seed=seed)
                    q = np.quantile(rounds, [0.5, 0.99])
                    a = np.quantile(totals, [0.5, 0.99])
                    out.append({"workers": n, "loss": p, "pool": pool, "rto": rto,
                                "rounds_retried": float(np.mean(rounds > rounds.min())),
                                "slot_p50_us": q[0] * 1e6, "slot_p99_us": q[1] * 1e6,
                                "allreduce_p50_ms": a[0] * 1e3, "allreduce_p99_ms": a[1] * 1e3,
                                "lossless_ms": lossless * 1e3})
    return out
