"""The online codec tuner (worker/tuner.py): every rank decides the same from the shared statistics, also when
they lose precision on the way; it switches when the link rate changes, but not back and forth; pins stay pinned;
unsafe codecs are refused; a rank that decided from other statistics is detected and all fall back."""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest

from intml.protocol.codecs import host
from intml.protocol.codecs.host.adaptive import Adaptive, bits_for
from intml.protocol.codecs.host.uniform import range_of
from intml.sim.tuning import COSTS
from intml.worker.tuner import (CHECKED, FIELDS, MEASURED, Bucket, Measured, Network, Tuner, ceil_log2, divergent_ranks,
                                measure)

WORLD = 4
BUCKETS = [Bucket("head", 20_000), Bucket("body", 60_000)]  # several jumbo packets each: the wire binds at 10 Gbit
FAST, SLOW = Measured(100e9, 500e6, 0.05), Measured(10e9, 500e6, 0.05)


class Ranks:
    """WORLD ranks of one job, each with its own tuner, fed Gaussian gradients: a shared true gradient plus each
    rank's own minibatch noise (``noise`` times the signal's deviation)."""

    def __init__(self, buckets: list[Bucket] = BUCKETS, noise: float = 4.0, seed: int = 0, **options) -> None:
        self.rng = np.random.default_rng(seed)
        self.buckets, self.noise = buckets, noise
        self.tuners = [Tuner(buckets, WORLD, COSTS, Network(), **options) for _ in range(WORLD)]
        self.signal = [self.rng.normal(0, 1, b.elements) for b in buckets]
        self.last: list[np.ndarray | None] = [None] * len(buckets)

    def shared(self, measured: Measured, scale: float = 1.0) -> tuple[list[np.ndarray], np.ndarray]:
        """Each rank's local vector and their sum in rank order (what an allreduce gives every rank)."""
        grads = [[(scale * (s + self.rng.normal(0, self.noise, s.size))).astype(np.float32) for s in self.signal]
                 for _ in range(WORLD)]
        local = [t.local_vector([measure(g, WORLD, last_mean=m, key=7) for g, m in zip(gs, self.last)], measured)
                 for t, gs in zip(self.tuners, grads)]
        self.last = [np.mean([gs[i] for gs in grads], axis=0) for i in range(len(self.buckets))]
        return local, np.sum(local, axis=0)

    def step(self, measured: Measured, lossy=None, **kw):
        _, shared = self.shared(measured, **kw)
        shared = lossy(shared) if lossy else shared
        decisions = [t.decide(shared) for t in self.tuners]
        assert len({d.digest for d in decisions}) == 1
        assert len({tuple(c.codec for c in d.choices.values()) for d in decisions}) == 1
        return decisions[0]


def codecs(decision) -> list[str]:
    return [c.codec for c in decision.choices.values()]


def statistics_only(round_fn):
    """A lossy path for the statistics, with the checked fields (small integers) kept exact, as they are in
    float32 and int32 up to 4096 ranks."""
    def lossy(shared: np.ndarray) -> np.ndarray:
        out = round_fn(shared)
        out[:len(CHECKED)] = shared[:len(CHECKED)]
        return out
    return lossy


def to_bfloat16(x: np.ndarray) -> np.ndarray:
    """bfloat16's 8 significant bits (truncation of float32's lower 16 bits)."""
    bits = x.astype(np.float32).view(np.uint32) & np.uint32(0xFFFF0000)
    return bits.view(np.float32).astype(np.float64)


def test_every_rank_decides_the_same_and_settles_on_cnat8_at_10gbit() -> None:
    ranks = Ranks()
    first = ranks.step(SLOW)
    assert codecs(first) == ["gloo", "gloo"] and "no minibatch variance estimate" in first.choices["head"].reason
    got = [codecs(ranks.step(SLOW)) for _ in range(4)]
    assert got[:2] == [["gloo", "gloo"]] * 2  # hysteresis: cnat8 must win 3 times in a row
    assert got[2:] == [["cnat8", "cnat8"]] * 2
    decision = ranks.step(SLOW)
    assert decision.line().startswith(f"tuner step {decision.step}: head=cnat8 body=cnat8; predicted ")
    ratio = decision.choices["body"].ratio
    assert 0 < ratio < 0.5  # within the default budget
    metrics = json.loads(json.dumps(decision.as_dict()))
    assert not metrics["fallback"]
    assert metrics["buckets"]["body"]["codec"] == "cnat8" and metrics["buckets"]["body"]["ratio"] == ratio
    assert metrics["digest"] == f"{decision.digest:012x}" and "topk0.01" in metrics["buckets"]["body"]["refused"]


@pytest.mark.parametrize("lossy", [statistics_only(lambda v: v.astype(np.float32).astype(np.float64)),
                                   statistics_only(to_bfloat16)], ids=["float32", "bfloat16"])
def test_decisions_survive_the_statistics_losing_precision(lossy) -> None:
    """Every rank decides the same from the same lossy vector, and here (no codec near a boundary) as it does from
    the exact one."""
    exact, rounded = Ranks(seed=3), Ranks(seed=3)
    for _ in range(6):
        a, b = exact.step(SLOW), rounded.step(SLOW, lossy=lossy)
        assert codecs(a) == codecs(b)
        assert not b.warnings


def test_statistics_too_coarse_to_see_the_ranks_spread_allow_no_lossy_codec() -> None:
    """The ranks agree to 1 part in 10^6, which bfloat16 statistics cannot resolve: the minibatch variance is
    taken as 0, and only an exact codec is allowed (never a permissive guess from rounding noise)."""
    ranks = Ranks(noise=1e-3)
    for _ in range(6):
        decision = ranks.step(SLOW, lossy=statistics_only(to_bfloat16))
    assert codecs(decision) == ["gloo", "gloo"]
    assert decision.choices["body"].refused["cnat8"] == "adds variance, and the ranks' spread is unresolved"


def test_switches_when_the_link_rate_changes() -> None:
    ranks = Ranks()
    for _ in range(5):
        ranks.step(SLOW)
    assert codecs(ranks.step(SLOW)) == ["cnat8", "cnat8"]
    got = [codecs(ranks.step(FAST)) for _ in range(3)]
    # at 100 Gbit cnat8's host CPU binds and int32 is as fast without the variance: switch after 3 steps
    assert got == [["cnat8", "cnat8"], ["cnat8", "cnat8"], ["int32", "int32"]]


def test_hysteresis_keeps_a_rate_that_changes_every_step_from_flipping_the_choice() -> None:
    """The rate alternates between 10 Gbit (cnat8 wins) and 100 Gbit (int32 wins): without hysteresis the choice
    flips at every step; with the default margin and patience it never moves."""
    def switches(**options) -> int:
        ranks = Ranks(candidates=("cnat8", "int32"), fallback="int32", **options)
        history = [codecs(ranks.step(rate))[1] for rate in [SLOW, FAST] * 6]
        return sum(a != b for a, b in zip(history, history[1:]))

    assert switches(margin=0.0, patience=1) >= 9
    assert switches() == 0


def test_pins_stay_pinned() -> None:
    ranks = Ranks(pins={"head": "uniform4"})
    for rate in [SLOW] * 5 + [FAST] * 5:
        decision = ranks.step(rate)
        assert decision.choices["head"].codec == "uniform4" and decision.choices["head"].reason == "pinned"
    assert decision.choices["body"].codec == "int32"  # the other bucket is still tuned


def test_a_pin_that_is_unsafe_stays_but_is_warned_about() -> None:
    ranks = Ranks(pins={"head": "topk0.01"})
    ranks.step(SLOW)
    decision = ranks.step(SLOW)
    assert decision.choices["head"].codec == "topk0.01"
    assert any("pinned to topk0.01 although topk0.01 is biased: it needs error feedback" in w
               for w in decision.warnings)


def test_a_rank_that_decided_from_other_statistics_is_detected() -> None:
    ranks = Ranks()
    for _ in range(5):
        ranks.step(SLOW)
    _, shared = ranks.shared(SLOW)
    other = shared.copy()
    other[len(CHECKED) + len(MEASURED) + 1] *= 1.5  # rank 3's copy: another norm, as a bug would give
    decisions = [t.decide(shared if r < 3 else other) for r, t in enumerate(ranks.tuners)]
    assert decisions[3].digest != decisions[0].digest
    assert divergent_ranks([d.digest for d in decisions]) == [3]  # named, where the caller allgathers the digests
    _, shared = ranks.shared(SLOW)
    after = [t.decide(shared) for t in ranks.tuners]
    for d in after:  # every rank sees it at the next step and falls back, with a warning
        assert codecs(d) == ["gloo", "gloo"] and d.fallback
        assert any("ranks disagree on decision_" in w for w in d.warnings)
    _, shared = ranks.shared(SLOW)
    assert all(codecs(d) == ["gloo", "gloo"] and d.fallback  # and stays on it
               for d in (t.decide(shared) for t in ranks.tuners))


def test_a_rank_with_another_configuration_is_detected() -> None:
    ranks = Ranks()
    ranks.tuners[2] = Tuner(BUCKETS, WORLD, COSTS, Network(), budget=0.25)
    _, shared = ranks.shared(SLOW)
    for tuner in ranks.tuners:
        decision = tuner.decide(shared)
        assert codecs(decision) == ["gloo", "gloo"]
        assert any("ranks disagree on config_" in w for w in decision.warnings)


def test_inf_or_nan_in_a_gradient_falls_back_for_that_step() -> None:
    ranks = Ranks()
    for _ in range(5):
        ranks.step(SLOW)
    local, shared = ranks.shared(SLOW)
    bad = np.full(BUCKETS[0].elements, np.inf, np.float32)
    stats = measure(bad, WORLD)
    assert stats[FIELDS.index("nonfinite")] == bad.size and np.isfinite(stats).all()
    head = slice(len(CHECKED) + len(MEASURED), len(CHECKED) + len(MEASURED) + len(FIELDS))
    shared[head] += stats - local[1][head]  # rank 1's head bucket overflowed
    decision = ranks.tuners[0].decide(shared)
    assert codecs(decision) == ["gloo", "gloo"] and decision.fallback
    assert any("inf or NaN" in w for w in decision.warnings)


@pytest.mark.parametrize("cut, why", [(slice(0, -1), "shape"), (None, "ranks contributed")])
def test_a_malformed_shared_vector_falls_back(cut, why) -> None:
    ranks = Ranks()
    _, shared = ranks.shared(SLOW)
    if cut is None:
        shared[len(CHECKED) + len(MEASURED)] -= 1  # one rank's contribution missing
    else:
        shared = shared[cut]
    decision = ranks.tuners[0].decide(shared)
    assert codecs(decision) == ["gloo", "gloo"] and why in decision.warnings[0]


def test_little_noise_leaves_no_room_for_cnat8() -> None:
    """When the ranks' gradients agree (little minibatch noise), C_nat's variance is over the budget."""
    ranks = Ranks(noise=0.2)
    for _ in range(6):
        decision = ranks.step(SLOW)
    assert codecs(decision) == ["int32", "int32"]
    assert "over 0.5" in decision.choices["body"].refused["cnat8"]


def test_with_no_codec_allowed_the_fallback_is_used_with_a_warning() -> None:
    ranks = Ranks(noise=0.2, candidates=("cnat8",), fallback="cnat8")
    for _ in range(2):
        decision = ranks.step(SLOW)
    assert codecs(decision) == ["cnat8", "cnat8"] and decision.choices["body"].reason == "none allowed"
    assert any(w.startswith("tuner: no codec is allowed for body; falling back to cnat8 although adds ")
               for w in decision.warnings)


def test_float16_buckets_refuse_codecs_that_round_past_its_range() -> None:
    ranks = Ranks(buckets=[Bucket("half", 3_000, "float16")])
    for _ in range(6):
        decision = ranks.step(SLOW, scale=40_000.0 / 5)  # max|g| near 40000: cnat8 may round up to 65536
    refused = decision.choices["half"].refused
    assert "past float16's largest value" in refused["cnat8"] and decision.choices["half"].codec == "int32"


def test_topk_needs_error_feedback() -> None:
    without = Ranks(candidates=("int32", "topk0.01"))
    with_ef = Ranks(candidates=("int32", "topk0.01"), error_feedback=True)
    for _ in range(2):
        a, b = without.step(SLOW), with_ef.step(SLOW)
    assert "needs error feedback" in a.choices["body"].refused["topk0.01"]
    assert "needs error feedback" not in b.choices["body"].refused.get("topk0.01", "")


def test_int32_is_refused_when_elements_span_more_than_its_fixed_point() -> None:
    ranks = Ranks()
    ranks.signal[1][0] = 1e9  # one huge element: every other keeps almost no bits of int32's fixed point
    for _ in range(6):
        decision = ranks.step(SLOW)
    # and every lossy codec's error on that element is over the budget: only Gloo's exact sum is left
    assert "keep fewer than 8 bits" in decision.choices["body"].refused["int32"]
    assert decision.choices["body"].codec == "gloo" and decision.choices["head"].codec == "cnat8"


@pytest.mark.parametrize("name, why", [("signsgd", "not an estimate"), ("powersgd2", "matrix shape"),
                                       ("nosuch", "unknown codec")])
def test_codecs_auto_cannot_run_are_refused_up_front(name: str, why: str) -> None:
    with pytest.raises(ValueError, match=why):
        Tuner(BUCKETS, WORLD, COSTS, candidates=("int32", name))


def test_pins_must_name_buckets() -> None:
    with pytest.raises(ValueError, match="pins name no bucket"):
        Tuner(BUCKETS, WORLD, COSTS, pins={"tail": "int32"})


def test_measure_uses_seed_001s_entropy_as_adaptive_does() -> None:
    x = np.random.default_rng(1).normal(0, 1, 20_000).astype(np.float32)
    stats = dict(zip(FIELDS, measure(x, WORLD, key=5)))
    lo, hi = range_of(x)
    assert bits_for(stats["entropy"], 5) == Adaptive().bits(x, 5, 0, lo, hi)
    assert stats["norm_sq"] == pytest.approx(float(x.astype(np.float64) @ x))
    assert stats["range_sq"] == pytest.approx((hi - lo) ** 2) and stats["max_abs"] == max(-lo, hi)
    assert stats["ranks"] == 1 and stats["mean_norm_sq"] == 0 and stats["residual_sq"] == 0


@pytest.mark.parametrize("name, exact", [("uniform4", False), ("bitmask12", False), ("qsgd15", False),
                                         ("terngrad", True), ("randomk0.25", True)])
def test_the_variance_model_bounds_the_real_codecs(name: str, exact: bool) -> None:
    """What a codec really adds to the average of 4 ranks' gradients, over 8 keys, is within the tuner's figure
    (and close to it where the figure is the codec's exact variance)."""
    codec = host.parse(name)
    ranks = Ranks(candidates=(name,))
    bucket = BUCKETS[1]
    grads = [(ranks.signal[1] + ranks.rng.normal(0, 4, bucket.elements)).astype(np.float32) for _ in range(WORLD)]
    mean = np.mean(grads, axis=0, dtype=np.float64)
    local = [ranks.tuners[0].local_vector([measure(np.zeros(BUCKETS[0].elements), WORLD),
                                           measure(g, WORLD, last_mean=mean)], SLOW) for g in grads]
    stats = ranks.tuners[0].statistics(np.sum(local, axis=0))[1]
    predicted = ranks.tuners[0].added_variance(name, stats, bucket)
    errors = []
    for key in range(8):
        decoded = [codec.decode(codec.encode(g, key * WORLD + r, 0), g.size) for r, g in enumerate(grads)]
        errors.append(float(np.square(np.mean(decoded, axis=0, dtype=np.float64) - mean).sum()))
    assert np.mean(errors) <= 1.1 * predicted
    if exact:
        assert np.mean(errors) >= 0.8 * predicted


def test_without_a_switch_and_with_fast_host_kernels_a_few_bits_win_at_1_gbit() -> None:
    """Through the aggregator's host mode the n packages share its link: at 1 Gbit the bits per element bind, and
    with host kernels as fast as C_nat's (and no cost per package beyond them) a 4- to 6-bit uniform code beats
    cnat8's 8 bits."""
    fast = replace(COSTS, host_cpu={kind: COSTS.switch_cpu["cnat8"] for kind in COSTS.host_cpu}, host_package=0.0)
    ranks = Ranks(candidates=("cnat8", "uniform4", "uniform6", "uniform8"))
    ranks.tuners = [Tuner(BUCKETS, WORLD, fast, Network(switch=False), candidates=("cnat8", "uniform4", "uniform6",
                                                                                    "uniform8"))
                    for _ in range(WORLD)]
    for _ in range(6):
        decision = ranks.step(Measured(1e9, 500e6, 0.05))
    assert {c.codec for c in decision.choices.values()} <= {"uniform4", "uniform6"}
    with_switch = Ranks(candidates=("cnat8", "uniform4", "uniform6", "uniform8"))
    for _ in range(6):
        decision = with_switch.step(Measured(1e9, 500e6, 0.05))
    assert codecs(decision) == ["cnat8", "cnat8"]  # a switch sums cnat8 at line rate; results come back 8-bit


def test_ceil_log2_is_exact_at_and_around_powers_of_two() -> None:
    for e in range(-60, 60):
        x = 2.0 ** e
        assert ceil_log2(x) == e and ceil_log2(np.nextafter(x, np.inf)) == e + 1
        assert ceil_log2(np.nextafter(x, 0)) == e
    assert [ceil_log2(n) for n in (1, 2, 3, 4, 5, 16, 17)] == [0, 1, 2, 2, 3, 4, 5]
