"""The torch rooms' shared preamble: one aggregator process per module, and ``ranks`` to run rank bodies against
it (support/torch_ranks.py: ``init_rank`` is the body's side)."""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator

import pytest
from support.cluster import Aggregator, aggregator
from support.torch_ranks import run_ranks


@pytest.fixture(scope="module")
def agg() -> Iterator[Aggregator]:
    """One aggregator shared by a module's tests (each group joins its own job)."""
    with aggregator(idle_timeout=20) as a:
        yield a
        assert a.alive(), f"the shared aggregator died:\n{a.stderr()}"


@pytest.fixture
def ranks(agg: Aggregator) -> Callable[..., list]:
    """``ranks(fn, n, *args, timeout=...)``: fn(port, agg.address, rank, n, *args) in n forked ranks."""
    return functools.partial(run_ranks, agg.address)
