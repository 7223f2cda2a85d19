"""worker.traffic: the bytes-per-allreduce formulas against what the engines really send (in-process harness,
no loss), and the ring model."""

from __future__ import annotations

import pytest
from support.harness import Network, make_inputs

from intml.worker.traffic import intml_bytes, intml_packets, ring_bytes


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


def test_ring_model() -> None:
    assert ring_bytes(1000, 1) == 0
    assert ring_bytes(1000, 4) == 2 * 3 / 4 * 4 * 1000
    assert ring_bytes(1000, 2, element_size=8) == 8000
