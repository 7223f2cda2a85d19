"""The comparison's shaped-link part: a host codec's allreduce timed in network namespaces by bench cluster's
run_point, as `intml-testbed compare --rate` does. Needs root, iproute2 and nftables; skipped otherwise."""

from __future__ import annotations

import pytest

from intml.testbed import netns
from intml.testbed.bench_cluster import run_point

pytestmark = [pytest.mark.process, pytest.mark.netns]

problem = netns.missing_requirements()


@pytest.mark.skipif(problem is not None, reason=f"namespace cluster unavailable: {problem}")
def test_a_host_codec_runs_over_shaped_links() -> None:
    elements, rate = 20_000, "50mbit"
    point = run_point(2, rate, elements, 1500, 0.0, 0, 2, 16, with_gloo=False, results="unicast",
                      codecs=("uniform8",))
    [row] = point["rows"]
    assert row["system"] == "intml uniform8" and len(point["hashes"]["uniform8"]) == 2
    # the float32 RESULTs bound it: 80 KB and headers down each link at 50 Mbit/s take at least 13 ms
    assert row["wire_bytes"] > 4 * elements
    assert row["median_s"] >= row["wire_bytes"] * 8 / netns.parse_rate(rate)
