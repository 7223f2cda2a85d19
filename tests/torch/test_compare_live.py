"""One short live comparison: gloo and a host codec trained for 2 epochs on 2 workers under torchrun, then
simulated at 10 Gbit/s (tests/testbed/test_compare.py covers the rest in process)."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")
pytest.importorskip("sklearn")

from intml.testbed import compare  # noqa: E402

pytestmark = [pytest.mark.torch, pytest.mark.process]


def test_two_codecs_two_workers() -> None:
    out = compare.run(codecs=("gloo", "uniform8"), workers=2, epochs=2, sim_rates=(10e9,), sim_models=("digits",),
                      quiet=True)
    loopback, simulated = out["settings"]
    assert simulated["setting"] == "sim digits 10gbit x16"
    rows = {r["codec"]: r for r in loopback["rows"]}
    assert rows["gloo"]["up_bits_per_parameter"] == rows["gloo"]["down_bits_per_parameter"] == 32  # ring, n = 2
    assert 8 < rows["uniform8"]["up_bits_per_parameter"] < 8.8 < 32 < rows["uniform8"]["down_bits_per_parameter"]
    for r in loopback["rows"] + simulated["rows"]:
        assert r["final_accuracy"] >= 0.9 and r["step_s"] > 0 and len(r["curve"]) == 2, r
    assert 0 < out["compute_step_s"] < 0.1
