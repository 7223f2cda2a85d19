"""worker.torch: the DDP communication hook and the "intml" process-group backend, against Gloo.

Ranks are forked processes (tests/support/cluster.py) with a Gloo or intml process group on 127.0.0.1; the aggregator
is a real ``python -m intml.aggregator`` process. The parent process never runs torch computations (only numpy), so
forking it is safe.

What is checked, per allreduce of random buckets (several DDP buckets, several iterations, bucket rebuild):

* identical at every rank, bit for bit;
* bit for bit equal to ``protocol.reference.allreduce`` of the ranks' inputs (the design's determinism);
* within the deterministic C_nat error bound of Gloo's result, elementwise (derived in ``cnat_bound``);
* statistically: the summed error is consistent with zero (unbiased) and its second moment is below the C_nat
  variance bound (``cnat_variance``), with the tolerances stated at the assertions.
"""

from __future__ import annotations

import os
import tempfile
import time
import warnings
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
import torch.distributed as dist  # noqa: E402
from support.cluster import aggregator, free_udp_port, run_ok  # noqa: E402

import intml.worker.torch as intml  # noqa: E402
from intml.protocol import reference  # noqa: E402
from intml.testbed.procs import free_port  # noqa: E402
from support.torch_ranks import TOKEN, init_rank  # noqa: E402

pytestmark = [pytest.mark.torch, pytest.mark.process]

SHAPES = [(37,), (1000,), (64, 50), (3001,), (7, 7), (513,)]  # 7 800 elements
ORDER = [2, 0, 5, 1, 4, 3]
PACKET = 256  # small packets and pool: many chunks per bucket, slots reused within an allreduce
POOL = 8
BUCKET_MB = 0.004  # 4 KiB buckets (DDP puts everything in one bucket for the first step, then rebuilds)


# ---- the error bounds ---------------------------------------------------------------------------------------
def unit_bound(xs: np.ndarray) -> float:
    """An upper bound on every chunk's slot unit 2**f, f = max(-149, T - s(n)), with T <= floor(log2 max|x|) + 1
    over all ranks' elements (a chunk's agreed exponent is at most the tensor's)."""
    n = xs.shape[0]
    top = float(np.abs(xs).max()) if xs.size else 0.0
    e = np.frexp(top)[1] if top > 0 else -149
    return 2.0 ** max(-149, int(e) - (31 - n.bit_length()))


def cnat_bound(xs: np.ndarray) -> np.ndarray:
    """Elementwise bound on |intml sum - exact sum| for cnat8 (float64, sum scale).

    A worker's code C(x) is 2**a or 2**(a+1) for 2**a <= |x| < 2**(a+1), so |C(x) - x| <= |x|, and |C(x)| <= 2|x|;
    below the unit u it is 0 or u: |C(x) - x| <= u, |C(x)| <= u. The switch re-encodes the exact integer sum
    S = sum C(x_i) to 2**b or 2**(b+1) with 2**b <= |S|, an error <= |S|. In all:
    |R - sum x| <= sum max(|x_i|, u) + sum 2 max(|x_i|, u) = 3 sum max(|x_i|, u) <= 3 (sum |x_i| + n u)."""
    return 3.0 * (np.abs(xs).sum(axis=0) + xs.shape[0] * unit_bound(xs))


def int32_bound(xs: np.ndarray) -> np.ndarray:
    """int32: each worker rounds to the nearest unit 2**(E - s): |error| <= n u / 2."""
    return np.full(xs.shape[1], xs.shape[0] * unit_bound(xs) / 2)


def cnat_variance(xs: np.ndarray) -> np.ndarray:
    """Elementwise bound on E[(R - sum x)^2] for cnat8 (sum scale). Var C(x) <= x^2/8 (the maximum of
    p(1-p)/(1+p)^2 at p = 1/3), or <= |x| u below the unit; the re-encode adds E[S^2]/8 with
    E[S^2] = (sum x)^2 + Var S. So the bound is 9/8 sum (x_i^2/8 + |x_i| u) + (sum x_i)^2 / 8."""
    u = unit_bound(xs)
    var_s = (xs**2 / 8 + np.abs(xs) * u).sum(axis=0)
    return 9 / 8 * var_s + xs.sum(axis=0) ** 2 / 8


def float32_slack(xs: np.ndarray, result: np.ndarray) -> np.ndarray:
    """Float32 rounding of Gloo's n-term sum (n eps sum|x|), of intml's division by n and of the decode."""
    eps = 2.0**-24
    return xs.shape[0] * eps * np.abs(xs).sum(axis=0) + 2 * eps * np.abs(result)


class Stats:
    """Accumulates the error statistics of cnat8 allreduces (mean scale)."""

    def __init__(self) -> None:
        self.err_sum = self.var_sum = self.sq_sum = 0.0
        self.elements = 0

    def add(self, xs: np.ndarray, result: np.ndarray, n_div: int) -> None:
        err = result.astype(np.float64) - xs.sum(axis=0) / n_div
        self.err_sum += float(err.sum())
        self.sq_sum += float((err**2).sum())
        self.var_sum += float(cnat_variance(xs).sum()) / n_div**2
        self.elements += err.size

    def check(self) -> None:
        assert self.elements > 10_000, f"too few elements for the statistics: {self.elements}"
        # Unbiasedness: errors of different elements use independent random words, so by the CLT the sum of
        # errors over sqrt(sum of variance bounds) is at most N(0, 1) in spread; |z| < 5 fails by chance with
        # probability < 1e-6 (and the seeds are fixed, so the outcome is reproducible).
        z = self.err_sum / np.sqrt(self.var_sum)
        assert abs(z) < 5, f"summed error {self.err_sum:.4g} is {z:.2f} standard deviations from zero (biased?)"
        # Second moment: E[sum e^2] <= sum of bounds. The sum over >10k independent bounded terms concentrates
        # within a few percent of its mean; 1.25x leaves > 10 standard deviations of room.
        ratio = self.sq_sum / self.var_sum
        assert ratio < 1.25, f"squared error is {ratio:.3f}x the C_nat variance bound"


def assert_within(xs: np.ndarray, result: np.ndarray, gloo: np.ndarray, codec: str, n_div: int, what: str):
    bound = (cnat_bound(xs) if codec == "cnat8" else int32_bound(xs)) / n_div + float32_slack(xs, result)
    gap = np.abs(result.astype(np.float64) - gloo.astype(np.float64))
    bad = np.flatnonzero(gap > bound)
    assert bad.size == 0, (f"{what}: {bad.size} of {gap.size} elements outside the {codec} bound of Gloo's "
                           f"result, first {bad[:3].tolist()}: intml {result[bad[:3]]}, gloo {gloo[bad[:3]]}, "
                           f"bound {bound[bad[:3]]}")


def assert_reference(xs: np.ndarray, result: np.ndarray, codec: str, seed: int, seq: int, op: str, what: str):
    want = reference.allreduce(list(xs.astype(np.float32)), codec=codec, seed=seed, allreduce_seq=seq,
                               packet_elements=PACKET)
    if op == "mean":
        want = want / np.float32(xs.shape[0])
    diff = np.flatnonzero(result.view(np.uint32) != want.astype(np.float32).view(np.uint32))
    assert diff.size == 0, (f"{what}: {diff.size} elements differ from protocol.reference, first "
                            f"{diff[:3].tolist()}: got {result[diff[:3]]}, want {want[diff[:3]]}")


def is_cnat_value(a: np.ndarray) -> np.ndarray:
    """True where a value is 0 or +-2**e (what a C_nat code decodes to)."""
    mantissa, _ = np.frexp(np.abs(a))
    return (a == 0) | (mantissa == 0.5)


# ---- rank bodies (module level: run in forked processes) ---------------------------------------------------------
class Weights(torch.nn.Module):
    """forward(rs) = sum_p <p, r_p>: the gradient of parameter p is exactly r_p, a random bucket input."""

    def __init__(self) -> None:
        super().__init__()
        self.ps = torch.nn.ParameterList([torch.nn.Parameter(torch.zeros(s)) for s in SHAPES])

    def forward(self, rs):
        # terms added out of parameter order: gradients become ready in an order that differs from DDP's initial
        # bucket assignment (reverse parameter order), so DDP rebuilds its buckets after the first step
        return sum((self.ps[i] * rs[i]).sum() for i in ORDER)


def random_grads(seed: int, rank: int, it: int) -> list:
    rng = np.random.default_rng([seed, rank, it])
    return [torch.from_numpy((rng.standard_normal(s) * 2.0 ** int(rng.integers(-8, 3))).astype(np.float32))
            for s in SHAPES]


def recording(rec: dict):
    """intml_hook, recording each bucket's input and result."""

    def hook(state, bucket):
        rec["inputs"].append(bucket.buffer().clone().numpy())

        def keep(fut):
            value = fut.value()
            rec["results"].append(value.clone().numpy())
            return value

        return intml.intml_hook(state, bucket).then(keep)

    hook.__annotations__ = {"state": intml.IntmlHookState, "bucket": dist.GradBucket,
                            "return": torch.futures.Future[torch.Tensor]}
    return hook


def hook_rank(port: int, address: str, rank: int, n: int, codec: str, seed: int, iterations: int,
              threaded: bool) -> dict:
    from torch.nn.parallel import DistributedDataParallel as DDP

    init_rank(port, rank, n)
    model = Weights()
    ddp = DDP(model, bucket_cap_mb=BUCKET_MB)
    state = intml.IntmlHookState(aggregator=address, codec=codec, seed=seed, token=TOKEN,
                                 packet_elements=PACKET, pool_size=POOL, threaded=threaded)
    rec = {"inputs": [], "results": []}
    ddp.register_comm_hook(state, recording(rec))
    grads = []
    for it in range(iterations):
        ddp.zero_grad()
        ddp(random_grads(seed, rank, it)).backward()
        grads.append(np.concatenate([p.grad.numpy().reshape(-1) for p in model.ps]))
    gloo = []
    for x in rec["inputs"]:  # the anchor: Gloo's average of the same buckets
        t = torch.from_numpy(x.copy())
        dist.all_reduce(t)
        gloo.append((t / n).numpy())
    out = {"inputs": rec["inputs"], "results": rec["results"], "gloo": gloo, "grads": grads,
           "traffic": dict(vars(state.traffic)), "using_intml": state.using_intml}
    state.close()
    dist.destroy_process_group()
    return out


def backend_rank(port: int, address: str, rank: int, n: int, seed: int) -> dict:
    init_rank(port, rank, n, "intml", {"INTML_AGGREGATOR": address, "INTML_SEED": str(seed), "INTML_TOKEN": TOKEN,
                                   "INTML_PACKET_ELEMENTS": str(PACKET), "INTML_POOL": str(POOL),
                                   "INTML_MIN_ELEMENTS": "0"})  # every float32 SUM/AVG through intml
    pg = dist.distributed_c10d._get_default_group()
    assert isinstance(pg, intml.IntmlProcessGroup) and dist.get_backend() == "intml"
    rng = np.random.default_rng([seed, rank])

    def rand(shape, dtype=np.float32):
        return torch.from_numpy((rng.standard_normal(shape) * 2.0 ** int(rng.integers(-6, 3))).astype(dtype))

    def gloo_sum(x):
        t = x.clone()
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.SUM
        pg.gloo.allreduce([t], opts).wait()
        return t

    intml_calls = []
    for shape, op in [((5003,), "sum"), ((1,), "sum"), ((37, 101), "mean"), ((0,), "sum"), ((4099,), "mean"),
                      ((2048,), "async")]:
        x = rand(shape)
        t = x.clone()
        if op == "async":
            work = dist.all_reduce(t, async_op=True)
            work.wait()
            assert work.get_future().value()[0] is t
        else:
            dist.all_reduce(t, op=dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.AVG)
        g = gloo_sum(x)
        if op == "mean":
            g /= n
        intml_calls.append({"op": "mean" if op == "mean" else "sum", "input": x.numpy().reshape(-1),
                            "result": t.numpy().reshape(-1).copy(), "gloo": g.numpy().reshape(-1)})
    # DDP without a hook over the intml group: its buckets (gradients pre-divided by n) are summed by intml
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = Weights()
    ddp = DDP(model, bucket_cap_mb=BUCKET_MB)
    before = dict(vars(pg.traffic))
    rs = random_grads(seed, rank, 0)
    ddp(rs).backward()
    ddp_step = {"grads": [p.grad.numpy().reshape(-1).copy() for p in model.ps],
                "inputs": [r.numpy().reshape(-1) for r in rs],
                "gloo": [(gloo_sum(r) / n).numpy().reshape(-1) for r in rs],
                "intml_allreduces": pg.traffic.intml_allreduces - before["intml_allreduces"],
                "gloo_allreduces": pg.traffic.gloo_allreduces - before["gloo_allreduces"]}
    # everything else goes to Gloo and must equal Gloo's own result exactly
    delegated = {}
    x64 = rand((777,), np.float64)
    t = x64.clone()
    dist.all_reduce(t)
    delegated["float64 sum"] = torch.equal(t, gloo_sum(x64))
    xi = torch.from_numpy(rng.integers(-1000, 1000, 513))
    t = xi.clone()
    dist.all_reduce(t)
    delegated["int64 sum"] = torch.equal(t, gloo_sum(xi))
    xm = rand((301,))
    t = xm.clone()
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    gathered = [torch.zeros(301) for _ in range(n)]
    dist.all_gather(gathered, xm)
    delegated["float32 max"] = torch.equal(t, torch.stack(gathered).max(dim=0).values)
    xt = rand((40, 30)).t()  # not contiguous
    t = xt.clone().t().t()  # same strides as xt
    assert not t.is_contiguous()
    dist.all_reduce(t)
    delegated["non-contiguous sum"] = torch.equal(t, gloo_sum(xt.contiguous()))
    b = torch.full((5,), float(rank))
    dist.broadcast(b, src=1)
    delegated["broadcast"] = torch.equal(b, torch.full((5,), 1.0))
    objs = [None] * n
    dist.all_gather_object(objs, {"rank": rank})
    delegated["all_gather_object"] = objs == [{"rank": r} for r in range(n)]
    dist.barrier()
    out = {"intml": intml_calls, "ddp": ddp_step, "delegated": delegated, "traffic": dict(vars(pg.traffic))}
    dist.destroy_process_group()
    return out


def startup_rank(port: int, rank: int, n: int, good: str, bad: str) -> dict:
    """The start-up failure paths, in one pair of processes (each construction is a collective)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    init_rank(port, rank, n)
    report = {}

    def attempt(name, make, **env):
        for key in ("INTML_AGGREGATOR", "INTML_FALLBACK"):
            os.environ.pop(key, None)
        os.environ.update({k: v for k, v in env.items() if v is not None})
        os.environ["INTML_CONNECT_TIMEOUT"] = "0.5"
        os.environ["INTML_TOKEN"] = TOKEN  # the aggregator's: a refused join is not an unavailable aggregator
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                obj = make()
                error = None
            except intml.AggregatorUnavailable as exc:
                obj, error = None, str(exc)
        fallback = [str(w.message) for w in caught if issubclass(w.category, intml.IntmlFallbackWarning)]
        report[name] = {"error": error, "warnings": fallback}
        return obj

    attempt("hook, no address", intml.IntmlHookState)
    attempt("hook, unreachable", intml.IntmlHookState, INTML_AGGREGATOR=bad)
    state = attempt("hook, unreachable, fallback", intml.IntmlHookState, INTML_AGGREGATOR=bad, INTML_FALLBACK="gloo")
    # with the fallback, the hook averages through Gloo: exactly DDP's own Gloo result
    grads = random_grads(7, rank, 0)
    model, plain = Weights(), Weights()
    ddp = DDP(model, bucket_cap_mb=BUCKET_MB)
    ddp.register_comm_hook(state, intml.intml_hook)
    ddp(grads).backward()
    plain_ddp = DDP(plain, bucket_cap_mb=BUCKET_MB)  # keep a reference: a collected DDP stops reducing
    plain_ddp(grads).backward()
    pairs = zip(model.ps, plain.ps, strict=True)
    report["hook fallback equals gloo"] = all(torch.equal(a.grad, b.grad) for a, b in pairs)
    report["hook fallback using intml"] = state.using_intml
    # the backend, with rank 1 unable to reach the aggregator that rank 0 reaches: the ranks still agree
    mine = good if rank == 0 else bad
    attempt("backend, rank 1 unreachable", lambda: dist.new_group(backend="intml"), INTML_AGGREGATOR=mine)
    group = attempt("backend, rank 1 unreachable, fallback", lambda: dist.new_group(backend="intml"),
                    INTML_AGGREGATOR=mine, INTML_FALLBACK="gloo")
    x = torch.arange(10, dtype=torch.float32) * (rank + 1) / 3
    t = x.clone()
    dist.all_reduce(t, group=group)
    ref = x.clone()
    dist.all_reduce(ref)
    report["backend fallback equals gloo"] = torch.equal(t, ref)
    report["backend fallback traffic"] = dict(vars(group.traffic))
    dist.destroy_process_group()
    return report


def midtraining_rank(port: int, address: str, rank: int, n: int, tmp: str) -> dict:
    """Train one step through the hook (one model with the allreduces on the background thread, one completing
    them in the hook) and allreduce once through the backend; then the parent kills the aggregator and all must
    raise (not hang), and later allreduces must fail at once."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    init_rank(port, rank, n, env={"INTML_AGGREGATOR": address, "INTML_TIMEOUT": "1.0", "INTML_TOKEN": TOKEN,
                              "INTML_MIN_ELEMENTS": "0"})  # the backend's 100-element allreduces through intml
    model = Weights()
    ddp = DDP(model, bucket_cap_mb=BUCKET_MB)
    state = intml.IntmlHookState(threaded=True)
    ddp.register_comm_hook(state, intml.intml_hook)
    sync_ddp = DDP(Weights(), bucket_cap_mb=BUCKET_MB)
    sync_state = intml.IntmlHookState(threaded=False)
    sync_ddp.register_comm_hook(sync_state, intml.intml_hook)
    group = dist.new_group(backend="intml")
    ddp(random_grads(3, rank, 0)).backward()
    sync_ddp(random_grads(3, rank, 0)).backward()
    t = torch.ones(100)
    dist.all_reduce(t, group=group)
    assert state.using_intml and sync_state.using_intml and group.using_intml and float(t[0]) == n
    Path(tmp, f"ready{rank}").touch()
    go = Path(tmp, "go")
    deadline = time.monotonic() + 30
    while not go.exists():
        assert time.monotonic() < deadline, "the parent never said go"
        time.sleep(0.02)
    report = {}
    for name, call in [("hook", lambda: ddp(random_grads(3, rank, 1)).backward()),
                       ("hook sync", lambda: sync_ddp(random_grads(3, rank, 1)).backward()),
                       ("backend", lambda: dist.all_reduce(torch.ones(100), group=group)),
                       ("backend again", lambda: dist.all_reduce(torch.ones(100), group=group)),
                       ("hook again", lambda: state.link.submit(torch.ones(10), "mean", inplace=False).wait())]:
        start = time.monotonic()
        try:
            call()
            report[name] = {"raised": None}
        except Exception as exc:  # noqa: BLE001 -- what matters is the type and message
            report[name] = {"raised": type(exc).__name__, "message": str(exc), "seconds": time.monotonic() - start}
    return report


def world1_rank(port: int, address: str, seed: int) -> dict:
    """Error feedback and warm-up at world size 1, where the aggregator's sum is exactly this worker's codes."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    init_rank(port, 0, 1)
    out = {}
    # error feedback: after every step, gradient + residual == what was sent == g + previous residual, exactly
    model = Weights()
    ddp = DDP(model, bucket_cap_mb=BUCKET_MB)
    state = intml.IntmlHookState(aggregator=address, codec="cnat8", error_feedback=True, seed=seed, token=TOKEN,
                                 packet_elements=PACKET, pool_size=POOL)
    ddp.register_comm_hook(state, intml.intml_hook)
    prev = {id(p): torch.zeros_like(p) for p in model.ps}
    layouts, mismatched, nonzero, not_cnat = [], 0, 0, 0
    for it in range(4):
        rs = random_grads(seed, 0, it)
        ddp.zero_grad()
        ddp(rs).backward()
        layouts.append(sorted(k for k, _ in state.residuals.of_bucket.values()))
        for p, r in zip(model.ps, rs, strict=True):
            res = state.residuals.of_param[id(p)].view(p.shape)
            mismatched += int((p.grad + res != r + prev[id(p)]).sum())
            nonzero += int((res != 0).sum())
            not_cnat += int((~torch.from_numpy(is_cnat_value(p.grad.numpy()))).sum())
            prev[id(p)] = res.clone()
    out["ef"] = {"mismatched": mismatched, "nonzero_residuals": nonzero, "not_cnat": not_cnat,
                 "layout_changed": layouts[0] != layouts[-1], "elements": sum(p.numel() for p in model.ps) * 4}
    state.close()
    # warm-up: the first 2 steps through Gloo (exact at world size 1), then intml
    model = Weights()
    ddp = DDP(model, bucket_cap_mb=BUCKET_MB)
    state = intml.IntmlHookState(aggregator=address, codec="cnat8", warmup_steps=2, seed=seed, token=TOKEN,
                                 packet_elements=PACKET, pool_size=POOL)
    ddp.register_comm_hook(state, intml.intml_hook)
    steps = []
    for it in range(3):
        rs = random_grads(seed, 0, it)
        ddp.zero_grad()
        ddp(rs).backward()
        g = np.concatenate([p.grad.numpy().reshape(-1) for p in model.ps])
        r = np.concatenate([x.numpy().reshape(-1) for x in rs])
        steps.append({"exact": bool(np.array_equal(g, r)), "all_cnat": bool(is_cnat_value(g).all()),
                      "traffic": dict(vars(state.traffic))})
    out["warmup"] = steps
    state.close()
    dist.destroy_process_group()
    return out


# ---- tests ---------------------------------------------------------------------------------------------------
def test_config_from_env_and_overrides() -> None:
    env = {"INTML_AGGREGATOR": "10.0.0.1:9000", "INTML_CODEC": "int32", "INTML_POOL": "16", "INTML_TIMEOUT": "2.5",
           "INTML_ERROR_FEEDBACK": "1", "INTML_WARMUP_STEPS": "7", "INTML_THREAD": "1", "INTML_JOB": "0x10", "INTML_MIN_ELEMENTS": "4096"}
    c = intml.IntmlConfig.from_env(env, codec="cnat8")
    assert (c.aggregator, c.codec, c.pool_size, c.timeout, c.error_feedback, c.warmup_steps, c.threaded, c.job,
            c.min_elements) == ("10.0.0.1:9000", "cnat8", 16, 2.5, True, 7, True, 16, 4096)
    assert intml.IntmlConfig.from_env({}) == intml.IntmlConfig()
    for key, value in [("INTML_CODEC", "fp16"), ("INTML_FALLBACK", "maybe"), ("INTML_POOL", "many"),
                       ("INTML_ERROR_FEEDBACK", "sometimes"), ("INTML_MIN_ELEMENTS", "-1")]:
        with pytest.raises(ValueError, match=key):
            intml.IntmlConfig.from_env({key: value})
    with pytest.raises(TypeError, match="codex"):
        intml.IntmlConfig.from_env({}, codex="cnat8")


@pytest.mark.parametrize(("codec", "threaded"), [("cnat8", True), ("int32", False)])
def test_hook_matches_gloo_on_random_buckets(ranks, codec: str, threaded: bool) -> None:
    """cnat8 with the allreduces on the background thread, int32 completed in the hook (the default)."""
    n, seed, iterations = 3, 1234 + len(codec), 3
    results = ranks(hook_rank, n, codec, seed, iterations, threaded, timeout=120)
    buckets = len(results[0]["inputs"])
    assert buckets >= 1 + 3 * (iterations - 1), f"expected several buckets per step, got {buckets} in {iterations}"
    stats = Stats()
    for k in range(buckets):
        xs = np.stack([r["inputs"][k] for r in results]).astype(np.float64)
        got = results[0]["results"][k]
        for rank, r in enumerate(results[1:], 1):
            assert r["results"][k].tobytes() == got.tobytes(), f"bucket {k}: rank {rank} differs from rank 0"
        assert_within(xs, got, results[0]["gloo"][k], codec, n, f"{codec} bucket {k}")
        assert_reference(xs, got, codec, seed, k, "mean", f"{codec} bucket {k}")
        if codec == "cnat8":
            stats.add(xs, got, n)
    if codec == "cnat8":
        stats.check()
    for it in range(iterations):  # DDP wrote the hook's results into the gradients: identical everywhere
        assert all(np.array_equal(r["grads"][it], results[0]["grads"][it]) for r in results)
    traffic = results[0]["traffic"]
    sizes = [x.size for x in results[0]["inputs"]]
    assert traffic["intml_allreduces"] == buckets and traffic["gloo_allreduces"] == 0
    assert traffic["intml_bytes"] == sum(intml.intml_bytes(s, codec, PACKET, POOL) for s in sizes)
    expected_packets = sum(-(-s // PACKET) + min(POOL, -(-s // PACKET)) for s in sizes)
    assert traffic["packets_out"] - traffic["retransmissions"] == expected_packets


def test_backend_matches_gloo_and_delegates(ranks) -> None:
    n, seed = 2, 99
    results = ranks(backend_rank, n, seed, timeout=120)
    calls = len(results[0]["intml"])
    stats = Stats()
    for k in range(calls):
        op = results[0]["intml"][k]["op"]
        xs = np.stack([r["intml"][k]["input"] for r in results]).astype(np.float64)
        got = results[0]["intml"][k]["result"]
        assert all(r["intml"][k]["result"].tobytes() == got.tobytes() for r in results), f"call {k} differs"
        n_div = n if op == "mean" else 1
        assert_within(xs, got, results[0]["intml"][k]["gloo"], "cnat8", n_div, f"backend call {k} ({op})")
        assert_reference(xs, got, "cnat8", seed, k, op, f"backend call {k}")
        stats.add(xs, got, n_div)
    stats.check()
    # DDP with no hook: gradients identical at every rank, within the bound of Gloo's average
    ddp = [r["ddp"] for r in results]
    for i, shape in enumerate(SHAPES):
        got = ddp[0]["grads"][i]
        assert all(d["grads"][i].tobytes() == got.tobytes() for d in ddp), f"DDP gradient {i} differs across ranks"
        xs = np.stack([d["inputs"][i] for d in ddp]).astype(np.float64)
        assert_within(xs, got, ddp[0]["gloo"][i], "cnat8", n, f"DDP gradient {i} {shape}")
    assert ddp[0]["intml_allreduces"] >= 1 and ddp[0]["gloo_allreduces"] == 0, ddp[0]
    for rank, r in enumerate(results):
        failed = [name for name, ok in r["delegated"].items() if not ok]
        assert not failed, f"rank {rank}: delegated to Gloo but wrong: {failed}"
        assert r["traffic"]["intml_allreduces"] == calls + r["ddp"]["intml_allreduces"]
        assert r["traffic"]["gloo_allreduces"] == 4  # float64, int64, MAX, non-contiguous
        assert r["traffic"]["gloo_reasons"] == {"dtype": 2, "op": 1, "layout": 1}


def test_startup_without_aggregator_errors_or_falls_back(agg) -> None:
    bad = f"127.0.0.1:{free_udp_port()}"  # nothing listens there
    n = 2
    port = free_port()
    reports = run_ok(startup_rank, [(port, r, n, agg.address, bad) for r in range(n)], timeout=120)
    for rank, rep in enumerate(reports):
        e = rep["hook, no address"]["error"]
        assert e and "INTML_AGGREGATOR" in e and "ranks [0, 1]" in e, e
        e = rep["hook, unreachable"]["error"]
        assert e and bad in e and "unreachable" in e and "INTML_FALLBACK=gloo" in e and "intml-aggregator" in e, e
        assert "AllreduceTimeout" in e, e  # the rank's own reason
        assert rep["hook, unreachable"]["warnings"] == []
        fb = rep["hook, unreachable, fallback"]
        assert fb["error"] is None and len(fb["warnings"]) == 1 and "falling back to Gloo" in fb["warnings"][0]
        assert rep["hook fallback using intml"] is False
        assert rep["hook fallback equals gloo"] is True
        # partial failure: rank 0 joined, rank 1 could not; both ranks take the same path
        e = rep["backend, rank 1 unreachable"]["error"]
        assert e and "ranks [1]" in e, f"rank {rank}: {e}"
        fb = rep["backend, rank 1 unreachable, fallback"]
        assert fb["error"] is None and len(fb["warnings"]) == 1 and "ranks [1]" in fb["warnings"][0]
        assert rep["backend fallback equals gloo"] is True
        assert rep["backend fallback traffic"]["intml_allreduces"] == 0
        assert rep["backend fallback traffic"]["gloo_allreduces"] == 1
        assert rep["backend fallback traffic"]["gloo_reasons"] == {"fallback": 1}


def test_losing_the_aggregator_mid_training_raises() -> None:
    n = 2
    with aggregator(idle_timeout=20) as a, tempfile.TemporaryDirectory() as tmp:
        from support.cluster import Procs

        port = free_port()
        with Procs() as procs:
            for r in range(n):
                procs.start(r, midtraining_rank, port, a.address, r, n, tmp)
            deadline = time.monotonic() + 60
            while not all(Path(tmp, f"ready{r}").exists() for r in range(n)):
                dead = [k for k, p in procs.procs.items() if p.exitcode is not None]
                assert not dead, f"ranks {dead} exited early: {procs.collect(dead, 5)}"
                assert time.monotonic() < deadline, "the ranks never finished their first step"
                time.sleep(0.02)
            a.stop()
            Path(tmp, "go").touch()
            outcomes = procs.collect(range(n), timeout=60)  # a hang fails here
    for rank in range(n):
        rep = outcomes[rank].unwrap()
        for name in ("hook", "hook sync", "backend"):
            got = rep[name]
            assert got["raised"] is not None, f"rank {rank} {name}: no error after the aggregator died"
            assert "AllreduceTimeout" in got["raised"] + got["message"], f"rank {rank} {name}: {got}"
            assert "made no progress for 1.0 s" in got["message"], f"rank {rank} {name}: {got['message']}"
            assert a.address in got["message"], f"rank {rank} {name}: {got['message']}"
        for name in ("backend again", "hook again"):
            got = rep[name]
            assert got["raised"] == "IntmlError" and "earlier allreduce" in got["message"], f"{name}: {got}"
        assert rep["backend"]["raised"] == "AllreduceTimeout"


def test_error_feedback_and_warmup_at_world_size_one(agg) -> None:
    [out] = run_ok(world1_rank, [(free_port(), agg.address, 5)], timeout=120)
    ef = out["ef"]
    assert ef["mismatched"] == 0, f"{ef['mismatched']} elements: gradient + new residual != gradient input + old"
    assert ef["nonzero_residuals"] > ef["elements"] // 2, ef  # C_nat leaves a residual almost everywhere
    assert ef["not_cnat"] == 0, ef
    assert ef["layout_changed"], "DDP did not rebuild its buckets: the residual migration went untested"
    w = out["warmup"]
    assert [s["exact"] for s in w] == [True, True, False]
    assert w[2]["all_cnat"] and not w[1]["all_cnat"]
    # DDP reduces one bucket in the first step, then rebuilds into several
    first, second = w[0]["traffic"]["gloo_allreduces"], w[1]["traffic"]["gloo_allreduces"] - 1
    assert first == 1 and second >= 3, (first, second)
    assert w[1]["traffic"]["intml_allreduces"] == 0
    assert w[2]["traffic"]["intml_allreduces"] == second and w[2]["traffic"]["gloo_allreduces"] == 1 + second
    assert w[2]["traffic"]["gloo_reasons"] == {"warmup": 1 + second}
