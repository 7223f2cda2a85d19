"""What the "intml" backend does for a user who swaps it in for Gloo:

* Coalesced allreduces (``all_reduce_coalesced``, ``_coalescing_manager``: DDP's and FSDP's path for several
  tensors at once) go through intml as one allreduce of the concatenation, equal to ``protocol.reference`` of it;
  tensors that differ in dtype or device go to Gloo under ``coalesced``.
* It says what it did: one ``IntmlRoutingWarning`` at a group's first collective sent to Gloo for its size, the
  totals when the group is destroyed, each pointing at the user's line, and "reduce-scatter" when it was one.
* Reproducible when the user seeds: with ``torch.manual_seed`` fixed and no ``INTML_SEED``, two runs give the same
  bits; another seed gives other bits; an unseeded interpreter draws another rounding seed each time.

Ranks are forked processes (tests/support/cluster.py) against a real aggregator process, as in test_torch.py.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import warnings

import numpy as np
import pytest

torch = pytest.importorskip("torch")
import torch.distributed as dist  # noqa: E402
from support.cluster import repo_env  # noqa: E402
from support.torch_ranks import TOKEN, init_rank  # noqa: E402
from test_torch import PACKET, POOL, assert_reference  # noqa: E402

import intml.worker.torch as intml  # noqa: E402
from intml.worker.torch import routing  # noqa: E402

SIZES = (30_000, 40_000, 5)  # together above the 64 Ki default, each but the last below it


pytestmark = [pytest.mark.torch, pytest.mark.process]


def _env(address: str, **extra: str) -> dict[str, str]:
    os.environ.pop("INTML_SEED", None)
    return {"INTML_AGGREGATOR": address, "INTML_TOKEN": TOKEN, "INTML_PACKET_ELEMENTS": str(PACKET),
            "INTML_POOL": str(POOL), **extra}


def coalesced_rank(port: int, address: str, rank: int, n: int, seed: int) -> dict:
    init_rank(port, rank, n, "intml", _env(address, INTML_SEED=str(seed)))
    pg = dist.distributed_c10d._get_default_group()
    rng = np.random.default_rng([seed, rank])
    out: dict = {"inputs": [], "results": []}
    for op, use_manager in ((dist.ReduceOp.SUM, False), (dist.ReduceOp.AVG, True)):
        xs = [torch.from_numpy(rng.standard_normal(size).astype(np.float32)) for size in SIZES]
        ts = [x.clone() for x in xs]
        if use_manager:
            with dist._coalescing_manager(async_ops=True) as cm:
                for t in ts:
                    dist.all_reduce(t, op=op)
            cm.wait()
        else:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", FutureWarning)  # all_reduce_coalesced is deprecated, not gone
                dist.all_reduce_coalesced(ts, op=op)
        out["inputs"].append(np.concatenate([x.numpy() for x in xs]))
        out["results"].append(np.concatenate([t.numpy() for t in ts]))
        out["shapes_kept"] = [t.shape for t in ts] == [x.shape for x in xs]
    out["traffic"] = dataclasses.asdict(pg.traffic)
    dist.destroy_process_group()
    return out


def test_coalesced_allreduces_go_through_intml_as_one(ranks) -> None:
    n, seed = 2, 57
    results = ranks(coalesced_rank, n, seed, timeout=120)
    total = sum(SIZES)
    for rank, r in enumerate(results):
        assert r["shapes_kept"] is True
        for seq, op in enumerate(("sum", "mean")):
            xs = np.stack([q["inputs"][seq] for q in results]).astype(np.float64)
            assert_reference(xs, r["results"][seq], "cnat8", seed, seq, op, f"rank {rank} coalesced {op}")
            assert r["results"][seq].tobytes() == results[0]["results"][seq].tobytes()
        t = r["traffic"]
        assert (t["intml_allreduces"], t["intml_elements"], t["gloo_allreduces"]) == (2, 2 * total, 0), t


def test_coalesced_tensors_of_different_dtypes_are_routed_to_gloo() -> None:
    """Gloo then refuses them as it would for a Gloo user ("tensors must all have the same type")."""
    f32, f64 = torch.ones(40_000), torch.ones(40_000, dtype=torch.float64)
    assert routing.backend_route([f32, f64], "sum", 0, lambda: None) == routing.COALESCED
    assert routing.backend_route([f64, f64], "sum", 0, lambda: None) == routing.DTYPE
    assert routing.backend_route([f32, f32[::2]], "sum", 0, lambda: None) == routing.LAYOUT
    assert routing.backend_route([f32, f32], "sum", 0, lambda: None) is None
    assert routing.backend_route([f32, f32], "sum", 80_001, lambda: None) == routing.SMALL  # the total counts


INTML_WARNINGS = (intml.IntmlRoutingWarning, intml.IntmlUncompressedWarning)


def _ours(caught) -> list[tuple[str, str]]:
    return [(str(w.message), w.filename) for w in caught if issubclass(w.category, INTML_WARNINGS)]


def swap_rank(port: int, address: str, rank: int, n: int) -> dict:
    init_rank(port, rank, n, "intml", _env(address, INTML_MIN_ELEMENTS="1000"))
    out: dict = {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            dist.all_reduce(torch.ones(10))  # small: one line, at the first only
        dist.all_reduce(torch.ones(2000))  # through intml: nothing to say
        out["small"] = _ours(caught)
        del caught[:]
        shard = torch.empty(1000, dtype=torch.float64)
        dist.reduce_scatter_tensor(shard, torch.ones(1000 * n, dtype=torch.float64))  # dtype: uncompressed
        out["scatter"] = _ours(caught)
        del caught[:]
        dist.destroy_process_group()
        out["destroy"] = [(*w, c) for w, c in zip(_ours(caught), [w.category for w in caught
                                                                  if issubclass(w.category, INTML_WARNINGS)])]
    return out


def test_the_swap_says_what_went_where_at_the_users_line(ranks) -> None:
    n = 2
    results = ranks(swap_rank, n, timeout=120)
    for r in results:
        assert len(r["small"]) == 1, r["small"]  # once per group, however many small ones
        [(small, where)] = r["small"]
        assert where == __file__, where  # the user's dist.all_reduce line, not torch's files
        assert "an allreduce of 10 elements goes exactly through Gloo" in small, small
        assert "INTML_MIN_ELEMENTS=1000" in small, small
        assert len(r["scatter"]) == 1, r["scatter"]
        [(scatter, where)] = r["scatter"]
        assert where == __file__, where
        assert scatter.startswith("intml: a reduce-scatter of 2000 elements goes uncompressed"), scatter
        [(totals, where, category)] = r["destroy"]
        assert where == __file__ and category is intml.IntmlRoutingWarning, (where, category)
        # 2000 of 2000 + 3 * 10 + 2000 elements went through intml
        assert "sent 49.6% of its collectives' elements through intml (1 collectives, 2000 elements)" in totals, totals
        assert "(4 collectives, 2030 elements; by reason: dtype: 1, small: 3)" in totals, totals


def seeded_rank(port: int, address: str, rank: int, n: int, torch_seed: int) -> np.ndarray:
    torch.manual_seed(torch_seed + rank)  # rank-dependent on purpose: rank 0's seed decides
    init_rank(port, rank, n, "intml", _env(address))
    x = torch.from_numpy(np.random.default_rng(rank).standard_normal(70_000).astype(np.float32))
    dist.all_reduce(x)
    dist.destroy_process_group()
    return x.numpy()


def test_a_seeded_run_repeats_bit_for_bit(ranks) -> None:
    n = 2
    runs = [ranks(seeded_rank, n, s, timeout=120) for s in (11, 11, 12)]
    for run in runs:
        assert run[0].tobytes() == run[1].tobytes()
    assert runs[0][0].tobytes() == runs[1][0].tobytes()  # the same torch seed: the same rounding
    assert runs[0][0].tobytes() != runs[2][0].tobytes()  # another seed: other random words


def _rounding_seed(code: str) -> int:
    script = f"import torch\n{code}\nfrom intml.worker.torch.link import rounding_seed\nprint(rounding_seed())"
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=repo_env(), timeout=120,
                          check=True)
    return int(done.stdout)


def test_default_seed_varies_unless_torch_was_seeded() -> None:
    from intml.worker.torch.link import rounding_seed

    state = torch.random.get_rng_state()
    try:
        seeded = []
        for seed in (3, 3, 4):
            torch.manual_seed(seed)
            seeded.append(rounding_seed())
    finally:
        torch.random.set_rng_state(state)
    assert seeded[0] == seeded[1] != seeded[2]
    assert 0 <= seeded[0] < 2**62
    # a fresh interpreter's torch seeds itself at random: so does intml
    assert _rounding_seed("") != _rounding_seed("")
