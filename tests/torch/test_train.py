"""Short 2-worker training runs of the convergence experiment (testbed/train.py) under torchrun: DDP with the hook,
and FSDP2 over the backend.

One run of 2 epochs on load_digits with 2 ranks: the hook with cnat8, error feedback and a 5-step Gloo
warm-up (DDP over the "intml" backend is checked in test_torch.py). Every rank checks
after every step that all ranks hold bit-identical parameters (a hash all-gathered over Gloo) and the run fails
otherwise; here we check that all steps were checked, that the traffic took the expected paths, and that the
model learned.
"""

from __future__ import annotations

import pytest

pytest.importorskip("torch")
pytest.importorskip("sklearn")

from intml.testbed import train  # noqa: E402

pytestmark = [pytest.mark.torch, pytest.mark.process]

EPOCHS = 2
WARMUP = 5
# Gloo reaches 94-96% test accuracy after 2 epochs of this setup (2 ranks, seeds 0-2); chance is 10%. A run
# whose gradients were wrong (unscaled sums, misplaced buckets, stale residuals) stays far below 90%.
MIN_ACCURACY = 0.90


def test_two_worker_training_under_torchrun() -> None:
    result = train.run(workers=2, seeds=1, epochs=EPOCHS, runs=(f"cnat8-ef-w{WARMUP}",), quiet=True,
                       run_timeout=120)
    reports = {r["run"]: r for r in result["reports"]}
    assert set(reports) == {f"cnat8-ef-w{WARMUP}"}
    for name, r in reports.items():
        steps = EPOCHS * r["steps_per_epoch"]
        assert r["using_intml"], name
        assert r["hash_checked_steps"] == steps, f"{name}: {r['hash_checked_steps']} of {steps} steps checked"
        assert r["final_accuracy"] >= MIN_ACCURACY, f"{name}: test accuracy {r['final_accuracy']:.3f}"
        assert r["test_accuracy"][-1] == r["final_accuracy"] and len(r["test_accuracy"]) == EPOCHS
    # the 45 640 parameters fit one DDP bucket: one allreduce per step
    hook = reports[f"cnat8-ef-w{WARMUP}"]["traffic"]
    steps = EPOCHS * reports[f"cnat8-ef-w{WARMUP}"]["steps_per_epoch"]
    assert hook["gloo_allreduces"] == WARMUP and hook["intml_allreduces"] == steps - WARMUP, hook


def test_fsdp2_training_under_torchrun() -> None:
    """FSDP2 (fully_shard per Linear layer and the root) over the intml backend: it learns as the DDP run does, and
    the report carries the group's counters per kind of collective. FSDP2 reduces gradients by reduce-scatter,
    never by allreduce."""
    result = train.run(workers=2, seeds=1, epochs=EPOCHS, runs=("cnat8-backend",), parallel="fsdp2", quiet=True,
                       run_timeout=120)
    [r] = result["reports"]
    assert result["parallel"] == r["parallel"] == "fsdp2"
    assert r["using_intml"]
    assert r["final_accuracy"] >= MIN_ACCURACY, f"test accuracy {r['final_accuracy']:.3f}"
    assert r["hash_checked_steps"] == 0 and r["bytes_per_step"] is None  # shards, not replicas; no allreduce model
    [row] = result["rows"]
    c = row["collectives"]
    assert c["intml_allreduces"] == c["gloo_allreduces"] == 0, c
    if "intml_reduce_scatters" in c:  # once the backend counts reduce-scatters: one per Linear layer and step
        assert c["intml_reduce_scatters"] + c["gloo_reduce_scatters"] == 3, c
        assert c["intml_bytes"] + c["gloo_bytes"] > 0, c
    with pytest.raises(ValueError, match="use the backend instead"):
        train.run(runs=("cnat8",), parallel="fsdp2")


def test_model_averaging_over_an_intml_group() -> None:
    """Seed 001's scheme: local SGD, parameters averaged after every epoch by torch's PeriodicModelAverager over the
    intml backend. The ranks hold identical parameters after each averaging (hash-checked then), the run learns,
    and the wire carries the codec the run names: int32 costs 32 bits per parameter plus the packet headers."""
    result = train.run(workers=2, seeds=1, epochs=EPOCHS, runs=("int32-backend",), parallel="average", quiet=True,
                       run_timeout=120)
    [r] = result["reports"]
    assert result["parallel"] == r["parallel"] == "average" and r["using_intml"]
    assert r["hash_checked_steps"] == EPOCHS  # one check per averaging: the replicas differ in between
    assert r["final_accuracy"] >= MIN_ACCURACY, f"test accuracy {r['final_accuracy']:.3f}"
    assert r["traffic"]["intml_allreduces"] == EPOCHS and r["traffic"]["gloo_allreduces"] == 0, r["traffic"]
    # 4-byte words plus a 26-byte header per packet of 256 or more: within 10% of 32 bits
    assert 32 < r["bits_per_parameter"] < 35.2, r["bits_per_parameter"]
    assert 0 < r["gzip_bits_per_parameter"] <= 33, r["gzip_bits_per_parameter"]
    assert 30 < r["lzw_bits_per_parameter"] < 45, r["lzw_bits_per_parameter"]  # LZW of raw floats saves nothing
    with pytest.raises(ValueError, match="use the backend instead"):
        train.run(runs=("cnat8",), parallel="average")


def test_model_averaging_through_a_host_codec() -> None:
    """A host codec's run (seed 001's uniform 8-bit quantizer) averages through the aggregator's host mode: the
    replicas agree after each averaging, the run learns, and the wire carries 8 bits per parameter plus the
    package and packet headers."""
    result = train.run(workers=2, seeds=1, epochs=EPOCHS, runs=("uniform8",), parallel="average", quiet=True,
                       run_timeout=120)
    [r] = result["reports"]
    assert r["using_intml"] and r["hash_checked_steps"] == EPOCHS
    assert r["final_accuracy"] >= MIN_ACCURACY, f"test accuracy {r['final_accuracy']:.3f}"
    assert 8 < r["bits_per_parameter"] < 8.8, r["bits_per_parameter"]


def test_ddp_over_the_backend_with_a_host_codec() -> None:
    """DDP over the intml backend with INTML_CODEC=uniform8: every step's bucket through the aggregator's host mode,
    replicas bit-identical after every step, the run learns, and the bytes per step are the measured packages: 8
    bits per parameter plus package and packet headers."""
    result = train.run(workers=2, seeds=1, epochs=EPOCHS, runs=("uniform8-backend",), quiet=True, run_timeout=120)
    [r] = result["reports"]
    steps = EPOCHS * r["steps_per_epoch"]
    assert r["using_intml"] and r["hash_checked_steps"] == steps
    assert r["final_accuracy"] >= MIN_ACCURACY, f"test accuracy {r['final_accuracy']:.3f}"
    assert r["traffic"]["intml_allreduces"] == steps and r["traffic"]["gloo_allreduces"] == 0, r["traffic"]
    assert 8 < 8 * r["bytes_per_step"] / r["parameters"] < 8.8, r["bytes_per_step"]


def test_run_specs_name_host_codecs_with_options() -> None:
    """A host codec's name takes the options cnat8 takes (its own name may hold '-'); bare, it runs with the hook,
    or under --parallel average through a Worker; FSDP2 has no hook, and says which run to use instead."""
    assert train.parse_run("uniform8")["integration"] == "hook"
    assert train.parse_run("uniform8", "average")["integration"] == "worker"
    run = train.parse_run("adaptive-huffman-c6-backend", "average")
    assert run["codec"] == "adaptive-huffman-c6" and run["integration"] == "backend"
    run = train.parse_run("topk0.01-ef-w5")
    assert (run["codec"], run["error_feedback"], run["warmup_steps"]) == ("topk0.01", True, 5)
    with pytest.raises(ValueError, match="uniform takes an integer in 2..16"):
        train.parse_run("uniform99-backend")
    assert train.parse_run("powersgd2")["integration"] == "hook"
    with pytest.raises(ValueError, match="powersgd2 runs in the DDP hook, not the backend"):
        train.parse_run("powersgd2-backend")
    with pytest.raises(ValueError, match=r"use the backend instead \(for example uniform8-backend\)"):
        train.check_parallel(("uniform8",), "fsdp2")
