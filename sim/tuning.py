"""``intml-sim train --codec``: the online tuner (worker/tuner.py) run against simulated link rates and the model
profiles of sim.training, so that a user can ask what it would choose on a cluster, and what a fixed codec costs.

Gradients are not simulated element by element: each bucket's statistics are those of Gaussian gradients, each
rank's gradient the true gradient (per element variance ``signal``) plus its minibatch noise (``noise``), with
noise / signal = the gradient noise scale / the per-rank batch (McCandlish et al. 2018, "An Empirical Model of
Large-Batch Training": B_noise = tr(Sigma) / |G|^2 per sample). The rest is the tuner's own cost model, fed the
simulated rates, and sim.training's DDP overlap of the buckets' allreduces with the backward pass.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterator

import numpy as np

from intml.protocol.job import AGGREGATOR_MAX_ELEMENTS
from intml.sim.costs import SOFTWARE_AGGREGATOR
from intml.sim.training import COSTS, PROFILES, SENDMMSG_COSTS, SOURCES, buckets, iteration
from intml.worker.costs import tuner_ring
from intml.worker.tuner import DEFAULT_CANDIDATES, Bucket, Costs, Decision, Measured, Network, Tuner


NOISE_SCALE = 1000  # per-sample gradient noise scale: of the order McCandlish et al. measure for ImageNet classifiers
BATCH = 64  # per rank
SIGNAL = 1e-6  # per element variance of the true gradient (the tuner's choices are scale-free)
# the software aggregator, elements per second per core per contribution: sim.costs' calibration
AGGREGATOR_RATE = 1 / (SOFTWARE_AGGREGATOR.per_element + SOFTWARE_AGGREGATOR.per_packet / AGGREGATOR_MAX_ELEMENTS)
SETTLE_STEPS = 6  # the first decision has no variance estimate; then the hysteresis' 3 steps, and a margin
MEDIAN = 0.6744897501960817  # of |N(0, 1)|
COLUMNS = ("model", "rate_gbit", "workers", "codec", "step_s", "ring_s", "less_time", "why")
STEP_COLUMNS = ("model", "step", "rate_gbit", "codec", "step_s", "why")
__all__ = ["SOURCES", "run", "steps", "table"]


def gaussian_stats(elements: int, world: int, signal: float, noise: float, first: bool = False) -> np.ndarray:
    """One rank's ``measure()`` of a bucket of Gaussian gradients (per element variance signal + noise) in closed
    form: the largest of ``elements`` normals at about sqrt(2 ln elements) deviations, the median |x| at 0.674
    deviations, the sample entropy of 16 equal bins over that range, and the last step's mean with variance
    signal + noise / world (0 on the first)."""
    v = signal + noise
    a = math.sqrt(2 * math.log(max(elements, 2)))
    edges = [math.erf(a * (2 * i / 16 - 1) / math.sqrt(2)) for i in range(17)]
    p = [(hi - lo) / (edges[-1] - edges[0]) for lo, hi in zip(edges, edges[1:])]
    entropy = -sum(q * math.log2(q) for q in p if q > 0)
    largest = a * math.sqrt(v)
    mean_sq = 0.0 if first else elements * (signal + noise / world)
    return np.array([1.0, elements * v, mean_sq / world, entropy, (2 * largest) ** 2, largest, MEDIAN * math.sqrt(v),
                     largest * elements * math.sqrt(v) * math.sqrt(2 / math.pi) - elements * v, 0.0, 0.0])


def named(sizes: list[int]) -> list[Bucket]:
    """Buckets of these sizes, named bucket0, bucket1, ... in the order they are ready."""
    return [Bucket(f"bucket{i}", size) for i, size in enumerate(sizes)]


def model_buckets(parameters: int) -> list[Bucket]:
    """A model's DDP buckets (sim.training.buckets)."""
    return named(buckets(parameters))


def decisions(named: list[Bucket], compute: float, workers: int, rates: list[tuple[int, float]], steps: int,
              codec: str = "auto", *, network: Network = Network(), costs: Costs = COSTS,
              candidates: tuple[str, ...] = DEFAULT_CANDIDATES, noise_scale: float = NOISE_SCALE,
              batch: int = BATCH, aggregator_rate: float = AGGREGATOR_RATE) -> Iterator[tuple[int, float, Decision]]:
    """(step, rate, decision) for ``steps`` steps of the tuner over the buckets ``named`` (``auto``, or every
    bucket pinned to the fixed ``codec``); ``rates``: (first step, link rate) in order; ``aggregator_rate``: the
    software aggregator's, as the ranks would measure it. Every rank measures the same (the statistics are
    closed-form), so the shared vector is world x one rank's."""
    pins = {} if codec == "auto" else {b.name: codec for b in named}
    tuner = Tuner(named, workers, costs, network, candidates=candidates, pins=pins)
    noise = SIGNAL * noise_scale / batch
    for step in range(steps):
        rate = [r for first, r in rates if first <= step][-1]
        stats = [gaussian_stats(b.elements, workers, SIGNAL, noise, first=step == 0) for b in named]
        local = tuner.local_vector(stats, Measured(rate, aggregator_rate, compute))
        yield step, rate, tuner.decide(workers * local)


def settle(sizes: list[int], compute: float, workers: int, rate: float, **options) -> Decision:
    """The tuner's decision over buckets of these ``sizes`` once it has settled (past its hysteresis) at ``rate``;
    ``options``: ``decisions``'."""
    *_, (_, _, last) = decisions(named(sizes), compute, workers, [(0, rate)], SETTLE_STEPS, **options)
    return last


def settled(sizes: list[int], compute: float, workers: int, rate: float, **options) -> list[str]:
    """The codec of each bucket once the tuner has settled (``settle``)."""
    return [c.codec for c in settle(sizes, compute, workers, rate, **options).choices.values()]


def run(model: str, workers: int, rates: list[tuple[int, float]], steps: int, codec: str = "auto",
        **options) -> list[dict]:
    """``steps`` steps of the model's DDP iteration with the tuner deciding (``decisions``). Each row: the step,
    the rate, the codec per bucket, the decision and the predicted seconds."""
    parameters, compute = PROFILES[model]
    out = []
    for step, rate, decision in decisions(model_buckets(parameters), compute, workers, rates, steps, codec,
                                          **options):
        times = iter([c.seconds for c in decision.choices.values()])
        out.append({"step": step, "rate": rate, "codecs": [c.codec for c in decision.choices.values()],
                    "decision": decision, "step_s": iteration(parameters, compute, lambda n: next(times))})
    return out


def summary(codecs: list[str]) -> str:
    """``cnat8 x6`` or ``cnat8 x5, int32 x1``: the buckets' codecs, most used first."""
    return ", ".join(f"{name} x{count}" for name, count in Counter(codecs).most_common())


def table(workers: int, rates: list[float], codec: str = "auto", *, switch: bool = True, gso: bool = True,
          noise_scale: float = NOISE_SCALE, batch: int = BATCH,
          models: tuple[str, ...] = tuple(PROFILES)) -> list[dict]:
    """Per model and rate, what the tuner settles on after its hysteresis (or the fixed codec) and the predicted
    seconds per iteration, beside Gloo's ring; ``why`` is the largest bucket's reason."""
    options = setup(switch, gso)
    got = []
    for model in models:
        parameters, compute = PROFILES[model]
        for rate in rates:
            last = run(model, workers, [(0, rate)], SETTLE_STEPS, codec, **options, noise_scale=noise_scale,
                       batch=batch)[-1]
            ring_s = iteration(parameters, compute, lambda n: tuner_ring(workers, rate, n, options["network"]))
            choices = last["decision"].choices
            largest = max(model_buckets(parameters), key=lambda b: b.elements).name
            got.append({"model": model, "rate_gbit": rate / 1e9, "workers": workers, "codec": summary(last["codecs"]),
                        "step_s": last["step_s"], "ring_s": ring_s, "less_time": 1 - last["step_s"] / ring_s,
                        "why": choices[largest].reason})
    return got


def steps(model: str, workers: int, rates: list[tuple[int, float]], count: int, codec: str = "auto", *,
          switch: bool = True, gso: bool = True, noise_scale: float = NOISE_SCALE, batch: int = BATCH) -> list[dict]:
    """``run``'s steps as table rows: the rate, the buckets' codecs, the predicted seconds, the largest bucket's
    reason."""
    largest = max(model_buckets(PROFILES[model][0]), key=lambda b: b.elements).name
    return [{"model": model, "step": r["step"], "rate_gbit": r["rate"] / 1e9, "codec": summary(r["codecs"]),
             "step_s": r["step_s"], "why": r["decision"].choices[largest].reason}
            for r in run(model, workers, rates, count, codec, **setup(switch, gso), noise_scale=noise_scale,
                         batch=batch)]


def setup(switch: bool, gso: bool) -> dict:
    """``run``'s network and costs: an ASIC switch or none; GSO/GRO's datagram cost or sendmmsg's."""
    return {"network": Network(switch=switch), "costs": COSTS if gso else SENDMMSG_COSTS}
