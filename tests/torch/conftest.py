"""The torch room's shared preamble: one aggregator process for the whole room, and ``ranks`` to run rank bodies
against it (support/torch_ranks.py: ``init_rank`` is the body's side)."""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator

import pytest
from support.cluster import Aggregator, aggregator
from support.torch_ranks import run_ranks


@pytest.fixture(scope="session")
def agg() -> Iterator[Aggregator]:
    """One aggregator shared by the room's tests: each process group joins and leaves its own job, and none reads
    the aggregator's counters, so a fresh one per module only added start-ups. Its idle timeout is 60 s: a rank's
    keepalive (every 6.7 s) can starve on a loaded 2-core machine while its group sits in Gloo (the tuner's Gloo
    buckets, a statistics allreduce), the suspect, not reproduced, in a run that failed with "no longer knows job"."""
    with aggregator(idle_timeout=60) as a:
        yield a
        assert a.alive(), f"the shared aggregator died:\n{a.stderr()}"


@pytest.fixture
def ranks(agg: Aggregator) -> Callable[..., list]:
    """``ranks(fn, n, *args, timeout=...)``: fn(port, agg.address, rank, n, *args) in n forked ranks."""
    return functools.partial(run_ranks, agg.address)
