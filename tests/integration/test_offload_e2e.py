"""End to end with UDP GSO/GRO on and off: the same allreduces through a live aggregator (its core processes and
the workers all with INTML_GSO=1, then all with INTML_GSO=0) give results bit-identical to the reference and to
each other, with faults (loss, duplication, reordering at the workers) and without, over one core and two."""

from __future__ import annotations

import numpy as np
import pytest
from support.cluster import aggregator
from support.allreduce import PLAN, SMALL_PLAN, check_results, run_job

pytestmark = pytest.mark.process


@pytest.mark.parametrize("faults, cores, plan", [(0.0, 1, PLAN), (0.1, 2, SMALL_PLAN)], ids=["clean", "faults"])
def test_allreduce_bit_identical_with_and_without_gso_gro(monkeypatch, faults: float, cores: int, plan) -> None:
    n, seed = 4, 31
    bits = {}
    for mode in ("1", "0"):
        monkeypatch.setenv("INTML_GSO", mode)  # inherited by the aggregator and the worker processes
        with aggregator(cores=cores, idle_timeout=10) as agg:
            results = run_job(agg.port, n, "cnat8", seed, plan, faults=faults)
            assert agg.alive(), agg.stderr()
        check_results(results, n, "cnat8", seed, plan, f"INTML_GSO={mode}")
        bits[mode] = [np.ascontiguousarray(out).view(np.uint32).tobytes() for res in results for out in res["outs"]]
        if faults:
            assert sum(res["faults"]["dropped"] for res in results) > 0
    assert bits["1"] == bits["0"]
