"""Worker's two deadlines against a live aggregator: ``connect_timeout`` bounds the JOIN, ``timeout`` an allreduce
that makes no progress. A short join deadline must not cut allreduces short (the PyTorch integration joins with
INTML_CONNECT_TIMEOUT and trains with INTML_TIMEOUT)."""

from __future__ import annotations

import time

import numpy as np
import pytest
from support.cluster import aggregator, free_udp_port

from intml import AllreduceTimeout, Worker

pytestmark = pytest.mark.process


def test_allreduce_waits_for_timeout_not_connect_timeout() -> None:
    with aggregator() as agg, Worker(agg.address, job=4242, rank=0, world_size=2, token="t", codec="int32",
                                     timeout=3.0, connect_timeout=1.0) as w:
        start = time.monotonic()
        with pytest.raises(AllreduceTimeout, match="made no progress for 3.0 s"):
            w.allreduce(np.ones(10, np.float32))  # rank 1 never comes
        assert time.monotonic() - start >= 3.0


def test_join_gives_up_after_connect_timeout() -> None:
    start = time.monotonic()
    with pytest.raises(AllreduceTimeout, match="no answer to JOIN .* within 1.0 s"):
        Worker(f"127.0.0.1:{free_udp_port()}", job=1, rank=0, world_size=1, timeout=60.0, connect_timeout=1.0)
    assert time.monotonic() - start < 30.0  # well before the 60 s allreduce deadline
