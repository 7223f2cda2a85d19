"""intml-sim's analytic models against hand-computed cases, and against the packet-level engine (the real cores)
where both run."""

from __future__ import annotations

import time

import numpy as np
import pytest

from intml.protocol.packet import HDR
from intml.sim import models
from intml.sim.models import Net
from intml.sim.packet_level import PacketRun, simulate
from intml.worker.costs import MIN_POOL, tuner_in_network, tuner_ring
from intml.worker.tuner import Network


def test_ring_hand_computed():
    # n = 4, 1M float32 (4 MB), 1 Gbit/s, MTU 1500 (MSS 1448: 1514 wire bytes per 1448), alpha 10 us, delay 0
    net = Net(4, 1e9, delay=0.0, mtu=1500, alpha=10e-6, switch_latency=0.0)
    expected = 6 * 10e-6 + 1.5 * 4e6 * (1514 / 1448) * 8 / 1e9
    assert models.ring(net, 1_000_000) == pytest.approx(expected)
    assert models.ring(Net(1, 1e9), 1000) == 0.0


def test_parameter_server_hand_computed():
    net = Net(8, 1e9, delay=0.0, alpha=0.0, switch_latency=0.0)
    s = 4e6 * (1514 / 1448)
    assert models.parameter_server(net, 1_000_000, servers=2) == pytest.approx(4 * s * 8 / 1e9)  # 8 x S / 2
    assert models.parameter_server(net, 1_000_000, servers=8) == pytest.approx(s * 8 / 1e9)
    assert models.parameter_server(net, 1_000_000) == pytest.approx(2 * 7 / 8 * s * 8 / 1e9)  # colocated


def test_in_network_hand_computed():
    # 1446 cnat8 codes per packet: 1446 + HDR + 42 = 1514 bytes on the wire; 10 chunks at 1 Gbit/s
    net = Net(4, 1e9, delay=5e-6, switch_latency=1e-6)
    wire = 1446 + HDR + 42
    assert wire == 1514
    serial = wire * 8 / 1e9
    expected = 10 * serial + 10 * (HDR + 42) * 8 / 1e9 + 11e-6 + 2 * serial
    assert models.in_network(net, 14460, 1446, pool=64) == pytest.approx(expected)
    # a pool of 1 is one packet per round trip (11 us + both serialisations)
    rtt = 11e-6 + 2 * serial
    assert models.in_network(net, 14460, 1446, pool=1) == pytest.approx(
        10 * rtt + (HDR + 42) * 8 / 1e9 + rtt)
    assert models.pool_for(net, 1446) == int(np.ceil(1e9 * rtt / 8 / wire))


def test_tuner_prices_the_in_network_allreduce_as_the_simulator_does():
    """The tuner's in-network model (worker.costs, the DDP hook's) is sim.models' on a Net of the same round trip:
    with the network's pool as the window, or where it names none the pool covering the bandwidth-delay product,
    at least MIN_POOL slots."""
    net = Net(4, 1e9, delay=5e-6, switch_latency=0.0)
    covered = models.pool_for(net, 1446)
    assert covered < MIN_POOL < models.pool_for(Net(4, 100e9, delay=50e-6), 1446)
    for rate, delay, pool in ((1e9, 5e-6, None), (1e9, 5e-6, 1), (100e9, 50e-6, None), (100e9, 50e-6, 16)):
        net = Net(4, rate, delay=delay, switch_latency=0.0)
        window = pool or max(MIN_POOL, models.pool_for(net, 1446))
        assert tuner_in_network(4, rate, 144600, 1446, 1, Network(rtt=2 * delay, pool=pool)) \
            == models.in_network(net, 144600, 1446, window)
    assert tuner_in_network(4, 1e9, 144600, 1446, 1, Network(rtt=10e-6, pool=1)) \
        > tuner_in_network(4, 1e9, 144600, 1446, 1, Network(rtt=10e-6))  # the pool caps the window


def test_tuner_prices_the_ring_as_the_simulator_does():
    """The tuner's ring (worker.costs, the DDP hook's) is sim.models' on a Net of the same round trip and MTU, with
    its step latency and TCP's headers."""
    for world, mtu in ((2, 9000), (16, 1500)):
        net = Net(world, 10e9, delay=15e-6, mtu=mtu, switch_latency=0.0)
        assert tuner_ring(world, 10e9, 1 << 20, Network(rtt=30e-6, mtu=mtu)) == models.ring(net, 1 << 20)


@pytest.mark.parametrize("codec, workers, rate, pool, delay", [
    ("cnat8", 4, 10e9, 64, 1e-6),  # link-bound
    ("int32", 8, 1e9, 64, 1e-6),
    ("cnat8", 4, 10e9, 4, 5e-6),  # pool-bound: the window is smaller than the bandwidth-delay product
    ("cnat8", 2, 100e6, 16, 50e-6),
])
def test_packet_level_agrees_with_the_model(codec, workers, rate, pool, delay):
    elements = 200_000
    r = simulate(PacketRun(workers=workers, elements=elements, codec=codec, rate=rate, pool=pool, delay=delay,
                           host_costs=False, inputs="shared"))
    width = 1 if codec == "cnat8" else 4
    model = models.in_network(Net(workers, rate, delay), elements, models.largest_packet(width, 1500), pool, width)
    assert r.times[0] == pytest.approx(model, rel=0.03)


def test_analytic_speed_1024_workers():
    net = Net(1024, 100e9, mtu=9000)
    start = time.perf_counter()
    for i in range(1000):
        for system in models.SYSTEMS.values():
            system(net, 1_000_000 + i, None, 256)
    assert time.perf_counter() - start < 5.0  # 5,000 points; the target is 1,000 in a minute
