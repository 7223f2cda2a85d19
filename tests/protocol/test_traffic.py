"""worker.traffic: the bytes-per-allreduce formulas against what the engines really send (in-process harness,
no loss), and the ring model."""

from __future__ import annotations

import pytest
from support.harness import Network, make_inputs

from intml.worker.traffic import host_bytes, intml_bytes, intml_packets, ring_bytes


@pytest.mark.parametrize("codec", ["cnat8", "int32"])
@pytest.mark.parametrize(("size", "pool"), [(1, 4), (64, 4), (64 * 3 + 1, 2), (64 * 3 + 1, 16), (1000, 5)])
def test_intml_formula_counts_what_a_worker_sends(codec: str, size: int, pool: int) -> None:
    net = Network(2, codec=codec, packet_elements=64, pool_size=pool, record=True)
    net.allreduce(make_inputs(2, size, 64, "normal", seed=size))
    for rank in range(2):
        mine = [data for data, src, _ in net.sent_up if src == net.addr(rank)]
        assert len(mine) == intml_packets(size, 64, pool)
        assert sum(len(data) for data in mine) == intml_bytes(size, codec, 64, pool)
    assert intml_bytes(size, codec, 64, pool, per_packet=0) == size * (1 if codec == "cnat8" else 4)


@pytest.mark.parametrize("codec", ["uniform8", "topk0.1"])
def test_host_bytes_count_what_a_host_codec_worker_sends_and_receives(codec: str) -> None:
    """A host codec's bytes are its engine's measured packages plus a header per datagram, each way (no bootstrap
    round); the switch formula refuses a host codec."""
    size = 64 * 3 + 1
    net = Network(2, codec=codec, packet_elements=64, pool_size=2, record=True)
    net.allreduce(make_inputs(2, size, 64, "normal", seed=3))
    for rank, engine in enumerate(net.engines):
        c = engine.counters()
        up = [data for data, src, _ in net.sent_up if src == net.addr(rank)]
        down = [data for data, _, dst in net.sent_down if dst == net.addr(rank)]
        assert sum(len(data) for data in up) == host_bytes(c["package_bytes"], size, 64)
        assert sum(len(data) for data in down) == host_bytes(c["result_bytes"], size, 64)
    with pytest.raises(ValueError, match="not a switch codec"):
        intml_bytes(size, codec, 64, 2)


def test_ring_model() -> None:
    assert ring_bytes(1000, 1) == 0
    assert ring_bytes(1000, 4) == 2 * 3 / 4 * 4 * 1000
    assert ring_bytes(1000, 2, element_size=8) == 8000
