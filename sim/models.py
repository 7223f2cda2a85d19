"""Analytic (alpha-beta) models of one allreduce of N float32 elements on n workers, each on its own link of rate
B bit/s to one switch (one-way latency ``delay`` per link, so a host-switch-host round trip is 2 x delay plus the
serialisation of a packet each way). All sizes count the bytes on the wire (headers included), so the models
and the packet-level engine agree on the same links.

* Gloo's ring and the in-network allreduce (intml cnat8, SwitchML int32): ``worker.costs``' models, the ones the
  DDP hook's tuner predicts with, on a Net (``ring``, ``in_network``).
* A sharded parameter server (seed 004): k servers, each holding 1/k of the parameters; every worker pushes its
  gradient (S = 4N) and pulls the new parameters (S); each server receives n·S/k and sends n·S/k. Pushes and pulls
  overlap on full-duplex links, so the time is the busier end: max(S, n·S/k)·(1 + h_tcp)/B + 2·alpha, with h_tcp
  the TCP/IP/Ethernet header share of an MSS. Colocated servers (k = n, one on each worker) move 2(n-1)/n·S each
  way instead, the ring's bytes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from intml.protocol.packet import HDR
from intml.protocol.partial import SUM_WIDTH as PARTIAL_SUM_WIDTH
from intml.protocol.partial import TRAILER as PARTIAL_TRAILER
from intml.sim.network import IP_UDP, WIRE_OVERHEAD
from intml.worker.costs import RING_STEP_LATENCY, covering_pool, in_network_seconds, ring_seconds, segment_overhead


@dataclass(frozen=True)
class Net:
    """A single-switch network: n workers, link rate (bit/s), one-way delay per link (s), MTU, and the ring's
    per-step software latency ``alpha`` (s: a TCP send and receive through the kernel and Gloo)."""

    workers: int
    rate: float
    delay: float = 1e-6
    mtu: int = 1500
    alpha: float = RING_STEP_LATENCY
    switch_latency: float = 1e-6  # the switch's pipeline (sim.costs.ASIC)

    @property
    def rtt(self) -> float:
        """Host to switch and back: two link traversals and the switch's pipeline."""
        return 2 * self.delay + self.switch_latency

    @property
    def tcp_overhead(self) -> float:
        """Wire bytes per payload byte of a full TCP segment."""
        return segment_overhead(self.mtu)


def ring(net: Net, elements: int, element_size: int = 4) -> float:
    """Gloo's ring allreduce (reduce-scatter, then allgather): ``worker.costs.ring_seconds``."""
    return ring_seconds(net.workers, net.rate, elements, net.rtt, net.mtu, element_size=element_size,
                        alpha=net.alpha)


def parameter_server(net: Net, elements: int, servers: int | None = None, element_size: int = 4) -> float:
    """A sharded parameter server: ``servers`` dedicated shards (None: colocated, one per worker)."""
    n = net.workers
    s = element_size * elements * net.tcp_overhead
    if servers is None:
        busiest = 2 * (n - 1) / n * s if n > 1 else 0.0  # each worker's link, each way
    else:
        busiest = max(s, n * s / servers)
    return busiest * 8 / net.rate + 2 * (net.alpha + net.rtt)


def in_network(net: Net, elements: int, packet_elements: int, pool: int, element_size: int = 1) -> float:
    """intml (element_size 1: cnat8) or SwitchML (4: int32): ``worker.costs.in_network_seconds``, capped by the
    pool."""
    return in_network_seconds(net.rate, net.rtt, elements, packet_elements, pool, element_size)


def pool_for(net: Net, packet_elements: int, element_size: int = 1) -> int:
    """The smallest pool that covers the bandwidth-delay product (SwitchML's rule)."""
    return covering_pool(net.rate, net.rtt, packet_elements, element_size)


def largest_packet(element_size: int, mtu: int) -> int:
    """Elements of ``element_size`` bytes that fit one datagram under ``mtu`` (no MAC)."""
    return (mtu - IP_UDP - HDR) // element_size


SYSTEMS = {
    "intml-cnat8": lambda net, n_el, pe, pool: in_network(net, n_el, pe or largest_packet(1, net.mtu), pool, 1),
    "switchml-int32": lambda net, n_el, pe, pool: in_network(net, n_el, pe or largest_packet(4, net.mtu), pool, 4),
    "gloo-ring": lambda net, n_el, pe, pool: ring(net, n_el),
    "ps-colocated": lambda net, n_el, pe, pool: parameter_server(net, n_el),
    "ps-dedicated": lambda net, n_el, pe, pool: parameter_server(net, n_el, servers=max(1, net.workers // 4)),
}


# ---- two-level leaf-spine: aggregation at the racks, then at the spine -------------------------------------------
# Exactness: every rank encodes against the job's fixed-point unit 2^(E - s(n)), s(n) from the total n, so the sum
# of any subset of contributions fits 31 bits. A leaf adds its rack's contributions as int32 and forwards the
# partial sum as int32 (4 bytes per element, one PARTIAL datagram per round: protocol.partial); the spine adds the
# leaves' partials, still exact, and only it re-encodes the total (C_nat codes for cnat8) for the results back
# down. So the result is bit for bit the one-switch result; the cost is 4 bytes per element on the leaf uplinks,
# and packets no larger than a partial that fits the uplink's MTU.


@dataclass(frozen=True)
class LeafSpine:
    """``racks`` leaves of ``workers / racks`` hosts each, host links at ``rate``, each leaf's uplink to the spine
    at ``uplink_rate`` (oversubscription = hosts per rack x rate / uplink_rate) with MTU ``uplink_mtu`` (None:
    ``mtu``); every link's one-way delay ``delay``, every switch's pipeline ``switch_latency``."""

    workers: int
    racks: int
    rate: float
    uplink_rate: float
    delay: float = 1e-6
    mtu: int = 9000
    alpha: float = RING_STEP_LATENCY
    switch_latency: float = 1e-6
    uplink_mtu: int | None = None

    def packet_elements(self, element_size: int) -> int:
        """The largest packet whose DATA fits the host MTU and whose partial fits the uplink's."""
        return min(largest_packet(element_size, self.mtu), largest_partial(self.uplink_mtu or self.mtu))


def leaf_spine_in_network(t: LeafSpine, elements: int, element_size: int = 1, packet_elements: int | None = None,
                          pool: int = 256) -> float:
    """Hosts send P-element packets to their leaf; each leaf sends one partial (4P bytes and the contributors
    bitmap) per packet to the spine and gets a P-element result back. Each round of a slot crosses both levels:
    a chunk takes the slowest of the host link, the uplink and the round trip shared by the pool's window, as
    ``in_network`` does for one switch; the first round of each slot carries no elements (the bootstrap). One
    rack is one switch (``in_network``)."""
    p = packet_elements or t.packet_elements(element_size)
    if t.racks == 1:
        return in_network(Net(t.workers, t.rate, t.delay, t.mtu, t.alpha, t.switch_latency), elements, p, pool,
                          element_size)
    chunks = math.ceil(elements / p)
    window = min(pool, chunks)
    host = (p * element_size + HDR + WIRE_OVERHEAD) * 8 / t.rate
    up = (PARTIAL_SUM_WIDTH * p + HDR + PARTIAL_TRAILER + WIRE_OVERHEAD) * 8 / t.uplink_rate
    down = (p * element_size + HDR + WIRE_OVERHEAD) * 8 / t.uplink_rate
    rtt = 4 * t.delay + 3 * t.switch_latency + 2 * host + up + down
    bootstrap = max((HDR + WIRE_OVERHEAD) * 8 / t.rate, (HDR + PARTIAL_TRAILER + WIRE_OVERHEAD) * 8 / t.uplink_rate)
    return chunks * max(host, up, rtt / window) + window * bootstrap + rtt


def largest_partial(mtu: int) -> int:
    """Elements of a packet whose partial sums (and contributors bitmap) fit one datagram under ``mtu``."""
    return (mtu - IP_UDP - HDR - PARTIAL_TRAILER) // PARTIAL_SUM_WIDTH


def leaf_spine_ring(t: LeafSpine, elements: int, element_size: int = 4) -> float:
    """Gloo's ring laid out rack by rack: each leaf uplink carries one ring flow each way."""
    net = Net(t.workers, min(t.rate, t.uplink_rate) if t.racks > 1 else t.rate, t.delay, t.mtu, t.alpha)
    return ring(net, elements, element_size)
