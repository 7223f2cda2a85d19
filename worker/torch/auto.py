"""``INTML_CODEC=auto`` in the DDP hook: the online tuner (``worker.tuner``, docs/tuner.md) picks each bucket's codec.

Each measured step (every step, or one in ``INTML_TUNER_EVERY``: measuring costs CPU per element) every rank
measures its buckets (``tuner.measure``) and, at the step's last bucket, sums its statistics
vector with every other rank's through one small Gloo allreduce of float64. Gloo, not intml: the vector is a few
dozen numbers (intml's fixed cost per allreduce would dominate), its integer fields (step, digests) must sum
exactly and its float fields must come back the same bits at every rank, which Gloo's ring gives (every rank copies
each reduced chunk) and a compressing codec does not. Every rank then calls ``Tuner.decide``. The vector also
carries, in a slot per rank, each rank's digest of its last decision, so that a disagreement names the ranks.

A decision takes effect one step later than it is made: the decision of step s is applied at the end of step s + 1,
once that step's vector shows that every rank made the same one (the tuner's checked fields). A rank whose copy of
the statistics differed therefore never routes a bucket differently from the others (which would hang the
collectives); instead every rank falls back to the fixed codec (pins kept) with an ``IntmlTunerWarning`` naming it.

Per bucket, a codec is the switch codecs' (cnat8, int32, through the aggregator), a host codec's (the aggregator's
host mode) or Gloo's exact ring. Each codec other than Gloo has a link of its own (a job on the aggregator, its id
drawn by rank 0), joined when a bucket first uses it: every rank does so at the same bucket, since the codecs are
the same everywhere. Error feedback's residual is the bucket's unsent mass whatever the codec, so it carries over a
change of codec; a bucket on Gloo sends it (exactly) and the residual is zero afterwards.

The minibatch variance is measured against the step's own averaged result, not the last step's (as
``tuner.measure`` takes it): the hook shares the statistics once the step's allreduces are done, so it has that
mean, and in training the last step's mean is a poor stand-in (SGD moves the gradient between steps: on the
digits MLP, sum ||g_i||^2 - n ||last mean||^2 came out negative at about one step in five, and the tuner then
refuses every codec that adds variance). The decision still lags: step s's statistics choose step s + 2's codecs.

The rates the tuner needs come from the last step's allreduces: the link's rate is the goodput (bits this rank sent
over the seconds its allreduces took, intml's counted bytes and Gloo's ring bytes), the aggregator's rate per core
the elements x ranks it summed per second; both are lower bounds (the CPUs' time is in the seconds), and before the
first measurement DEFAULT_LINK_RATE and DEFAULT_AGGREGATOR_RATE stand in.
"""

from __future__ import annotations

import dataclasses
import logging
import time
import warnings
from collections.abc import Callable

import numpy as np
import torch

from intml.protocol.codecs import host
from intml.worker.costs import tuner_costs
from intml.worker.tuner import (
    DEFAULT_CANDIDATES,
    FIELDS,
    GLOO,
    NOT_AN_ESTIMATE,
    SWITCH_CODECS,
    Bucket,
    Decision,
    Measured,
    Network,
    Tuner,
    divergent_ranks,
    measure,
)

AUTO = "auto"
LOG = logging.getLogger(__name__)
DEFAULT_LINK_RATE = 10e9  # bit/s before the first measurement: a 10 Gbit/s link
DEFAULT_AGGREGATOR_RATE = 1e9  # elements/s per contribution before the first measurement
MEAN_NORM_SQ = FIELDS.index("mean_norm_sq")


# worker.costs' table and network models, the simulator's too (sim.training.COSTS)
COSTS = tuner_costs()


class IntmlTunerWarning(RuntimeWarning):
    """The tuner could not trust a step's statistics (ranks disagree, a gradient holds inf or NaN) and fell back to
    the fixed codec, or a bucket is pinned to a codec the statistics call unsafe."""


def parse_pins(text: str) -> dict[int, str]:
    """``INTML_CODEC_PIN="0:int32,3:gloo"`` -> {0: "int32", 3: "gloo"}: DDP bucket index -> codec, kept whatever
    the statistics say. ValueError in one line for a malformed entry or a codec auto cannot run."""
    pins: dict[int, str] = {}
    for entry in filter(None, (e.strip() for e in text.split(","))):
        index, _, codec = entry.partition(":")
        if not index.strip().isdigit() or not codec.strip():
            raise ValueError(f"INTML_CODEC_PIN takes BUCKET:CODEC pairs separated by commas (e.g. 0:int32,3:gloo), "
                             f"got {entry!r}")
        pins[int(index)] = check_codec(codec.strip())
    return pins


def check_codec(name: str) -> str:
    """The name, if auto can run it on a bucket: gloo, a switch codec, or a host codec whose result estimates the
    sum and that the costs know; else ValueError in one line."""
    if name in (GLOO, *SWITCH_CODECS):
        return name
    family = next((f for f in NOT_AN_ESTIMATE if name.startswith(f)), None)
    if family:
        raise ValueError(f"INTML_CODEC_PIN cannot pin {name}: {NOT_AN_ESTIMATE[family]}")
    try:
        codec = host.parse(name)
    except ValueError as exc:
        raise ValueError(f"INTML_CODEC_PIN: {name!r} is not gloo, {' or '.join(SWITCH_CODECS)} or a host codec "
                         f"({exc})") from None
    if type(codec) not in COSTS.host_cpu:
        raise ValueError(f"INTML_CODEC_PIN cannot pin {name}: the tuner has no cost model for it")
    return name


def bucket_name(index: int) -> str:
    return f"bucket{index}"


@dataclasses.dataclass
class Timing:
    """A step's allreduces as this rank saw them: bits sent, seconds taken, elements through the aggregator and
    its seconds."""

    bits: float = 0.0
    seconds: float = 0.0
    aggregated: float = 0.0
    aggregator_seconds: float = 0.0


class AutoCodec:
    """The hook's side of the tuner at one rank: each bucket's codec this step, its statistics, the last results,
    the rates measured, and the decisions (see the module's docstring)."""

    def __init__(self, rank: int, world: int, key: int, pins: dict[int, str], error_feedback: bool,
                 allreduce_sum: Callable[[torch.Tensor], torch.Tensor], every: int = 1,
                 pool: int | None = None) -> None:
        self.rank, self.world, self.key, self.pins, self.error_feedback = rank, world, key, dict(pins), error_feedback
        self.every = every  # measure, share and decide at every k-th step only: measuring costs CPU per element
        # the aggregator is the software one (intml-aggregator): cnat8 and int32 go through its kernel; the pool is
        # the slots in flight of the links (the in-network model's window)
        self.network = Network(switch=False, pool=pool)
        self.allreduce_sum = allreduce_sum  # sums a float64 CPU tensor over the group, exactly the same at each rank
        # randomk scales what it keeps by 1/ratio: with error feedback its residual grows (config refuses it)
        self.candidates = tuple(c for c in DEFAULT_CANDIDATES if not (error_feedback and c.startswith("randomk")))
        self.tuner: Tuner | None = None
        self.applied: dict[int, str] = {}  # bucket index -> codec this step (the verified decision)
        self.pending: Decision | None = None  # made last step, applied once this step's vector confirms it
        self.layout: dict[int, Bucket] = {}  # this step's buckets
        self.stats: dict[int, np.ndarray] = {}
        self.timing, self.rates = Timing(), (DEFAULT_LINK_RATE, DEFAULT_AGGREGATOR_RATE)
        self.step_started: float | None = None
        self.decision: Decision | None = None  # the last one applied, for logs and metrics
        self._warned: set[str] = set()
        self.steps = 0  # steps ended
        self.decisions = self.changes = self.fallbacks = 0  # for the metrics endpoint (worker.torch.metrics)

    @property
    def measuring(self) -> bool:
        """Whether this step is measured, shared and decided (every ``every``-th step, the same at every rank)."""
        return self.steps % self.every == 0

    def codec(self, index: int) -> str:
        """The codec of bucket ``index`` this step: its pin, the applied decision's, or the fallback (Gloo)."""
        return self.pins.get(index, self.applied.get(index, GLOO))

    def observe(self, index: int, buf: torch.Tensor, residual: torch.Tensor | None) -> None:
        """Measure this rank's bucket ``index`` before it is sent (its gradient, its residual), on a measured
        step."""
        if self.step_started is None:  # the step's first bucket: the last step's allreduces have all ended
            self.step_started, self.timing = time.perf_counter(), Timing()
        self.layout[index] = Bucket(bucket_name(index), buf.numel(), str(buf.dtype).removeprefix("torch."))
        if self.measuring:  # the spread is measured against this step's mean, which done() fills in
            x = buf.detach().reshape(-1).to("cpu", torch.float32).numpy()
            r = None if residual is None else residual.detach().to("cpu").numpy()
            self.stats[index] = measure(x, self.world, residual=r, key=self.key)

    def done(self, index: int, result: torch.Tensor, bits: float, seconds: float, aggregated: bool) -> None:
        """Bucket ``index``'s allreduce finished: its mean ``result``; it sent ``bits`` in ``seconds``, through
        the aggregator if ``aggregated``."""
        if index in self.stats:
            mean = result.detach().reshape(-1).to("cpu", torch.float64)
            self.stats[index][MEAN_NORM_SQ] = float(mean @ mean) / self.world
        t = self.timing
        t.bits, t.seconds = t.bits + bits, t.seconds + seconds
        if aggregated:
            t.aggregated += result.numel() * self.world
            t.aggregator_seconds += seconds

    def measured(self) -> Measured:
        """The last step's rates (the previous ones where it had no such allreduce) and compute seconds."""
        t, (link, aggregator) = self.timing, self.rates
        link = t.bits / t.seconds if t.seconds > 0 and t.bits > 0 else link
        aggregator = t.aggregated / t.aggregator_seconds if t.aggregator_seconds > 0 else aggregator
        self.rates = (link, aggregator)
        elapsed = time.perf_counter() - self.step_started if self.step_started is not None else 0.0
        return Measured(link, aggregator, max(0.0, elapsed - t.seconds))

    def end_step(self) -> Decision | None:
        """At the step's last bucket, at every rank: on a measured step, once its allreduces are done, share the
        statistics, decide, apply the verified decision."""
        buckets = [self.layout[i] for i in sorted(self.layout)]
        measured = self.measuring
        self.steps += 1
        # DDP's first step has provisional buckets, rebuilt after it: the tuner starts after it
        if self.steps == 1 or not measured:
            self._next_step()
            return None
        if self.tuner is None or self.tuner.buckets != buckets:  # the first step, or DDP rebuilt its buckets
            self.tuner = self._tuner(buckets)
            self.pending = None
        tuner = self.tuner
        local = tuner.local_vector([self.stats[i] for i in sorted(self.layout)], self.measured())
        slots = np.zeros(self.world)
        slots[self.rank] = tuner.last_digest  # 48 bits: exact in float64
        shared = self.allreduce_sum(torch.from_numpy(np.concatenate([local, slots]))).numpy()
        decision = tuner.decide(shared[:local.size])
        self.decisions, self.fallbacks = self.decisions + 1, self.fallbacks + decision.fallback
        ranks = divergent_ranks([int(d) for d in shared[local.size:]])
        if ranks:
            decision.warnings.append(f"tuner: ranks {ranks} decided differently from the others' last decision")
        for text in decision.warnings:
            if text not in self._warned:
                self._warned.add(text)
                warnings.warn(text, IntmlTunerWarning, stacklevel=2)
                LOG.warning(text)
        verified = None if tuner.diverged else self.pending
        self.pending = None if tuner.diverged else decision
        if tuner.diverged:  # every rank sees the same sum, so every rank falls back here
            self._use({})
        elif verified is not None:
            self._apply(verified)
        self._next_step()
        return verified

    def _next_step(self) -> None:
        self.layout, self.stats, self.step_started = {}, {}, None

    def _apply(self, decision: Decision) -> None:
        applied = {int(name.removeprefix("bucket")): c.codec for name, c in decision.choices.items()}
        if applied != self.applied:  # once per change
            reasons = "; ".join(f"{name}: {c.reason}" for name, c in decision.choices.items())
            LOG.info("%s (%s)", decision.line(), reasons)
        self._use(applied)
        self.decision = decision

    def _use(self, applied: dict[int, str]) -> None:
        """Route the buckets by ``applied`` from now on; a change of any bucket's codec is counted."""
        indices = {*applied, *self.applied}
        self.changes += any(self.applied.get(i, GLOO) != applied.get(i, GLOO) for i in indices)
        self.applied = applied

    def _tuner(self, buckets: list[Bucket]) -> Tuner:
        missing = sorted(set(self.pins) - {int(b.name.removeprefix("bucket")) for b in buckets})
        if missing:
            raise ValueError(f"INTML_CODEC_PIN names bucket(s) {missing}, but DDP has {len(buckets)} bucket(s) "
                             f"(0 to {len(buckets) - 1})")
        pins = {bucket_name(i): codec for i, codec in self.pins.items()}
        return Tuner(buckets, self.world, COSTS, self.network, candidates=self.candidates, pins=pins,
                     error_feedback=self.error_feedback)
