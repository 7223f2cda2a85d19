"""The online codec tuner (docs/tuner.md): per gradient bucket, the codec (switch cnat8 or int32, a host codec, or
Gloo's exact ring) with the least predicted time to a target accuracy, within a stated variance budget, and why.

Sans-I/O: it is fed measurements and returns decisions; the caller allreduces its statistics. Each step:

    local = tuner.local_vector([measure(grad, world, ...) for each bucket], Measured(...))
    shared = allreduce_sum(local)           # any allreduce whose result is the same bits at every rank
    decision = tuner.decide(shared)         # the same at every rank: a function of shared and the config only

Every input of a decision is either in the tuner's configuration or in the shared vector, so ranks cannot decide
differently unless their configuration or their copy of the shared vector differs. The vector carries, besides the
statistics, fields every rank must hold equal (the step, the configuration's and the previous decision's
digests), each summed: a sum other than world x the rank's own value means some rank differs, and every rank then
falls back to a fixed codec with a warning. Decisions use only +, -, *, /, sqrt, frexp and comparisons on the
shared values, which IEEE 754 rounds the same way everywhere (no libm logarithm).
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from intml.protocol.codecs import host
from intml.protocol.codecs.host.adaptive import Adaptive, AdaptiveHuffman, bits_for, entropy_bits, sample_threshold
from intml.protocol.codecs.host.bitmask import Bitmask
from intml.protocol.codecs.host.lloyd import Lloyd
from intml.protocol.codecs.host.packing import random_words
from intml.protocol.codecs.host.qsgd import QSGD
from intml.protocol.codecs.host.randomk import RandomK
from intml.protocol.codecs.host.terngrad import TernGrad
from intml.protocol.codecs.host.topk import TopK
from intml.protocol.codecs.host.uniform import Uniform, quantize, range_of
from intml.protocol.job import AGGREGATOR_MAX_ELEMENTS
from intml.protocol.packet import HDR

SWITCH_BITS = {"cnat8": 8, "int32": 32}  # each element's bits, up and down
SWITCH_CODECS = tuple(SWITCH_BITS)
GLOO = "gloo"  # Gloo's ring allreduce of float32, as the hook's fallback: exact, never beyond any range
DEFAULT_CANDIDATES = (GLOO, "cnat8", "int32", "uniform4", "uniform6", "uniform8", "adaptive", "adaptive-huffman",
                      "qsgd127", "terngrad", "bitmask", "topk0.01", "randomk0.01")
# Why these never run under auto: their result is not an estimate of the gradients' sum
NOT_AN_ESTIMATE = {"signsgd": "signsgd's result is the sign of the vote, not an estimate of the gradients' mean",
                   "powersgd": "powersgd needs each layer's matrix shape and two allreduces per step, not a bucket"}


# Per-bucket statistics, each a sum over the ranks of one rank's value (measure()).
FIELDS = ("ranks", "norm_sq", "mean_norm_sq", "entropy", "range_sq", "max_abs", "median_abs", "tern", "residual_sq",
          "nonfinite")
# Measurements of the step, summed over the ranks and used as their mean.
MEASURED = ("link_rate", "aggregator_rate", "compute_s", "overlap")
# Fields every rank must hold equal: the step (mod 4096), the configuration's digest, the previous decision's digest,
# in 12-bit pieces so that world x piece stays exact through float32 (and int32) up to 4096 ranks.
PIECE_BITS = 12
DIGEST_PIECES = 4
CHECKED = ("step", "config_0", "config_1") + tuple(f"decision_{i}" for i in range(DIGEST_PIECES))
FLOAT16_MAX = 65504.0
FLOAT32_MAX = float(np.finfo(np.float32).max)
INT32_KEPT_BITS = 8  # int32 is refused when a typical element keeps fewer significant bits than this
RESOLUTION = 2.0 ** -16  # the smallest spread of the ranks' gradients, relative to their norms, that is trusted:
# float32 statistics carry 24 bits; 8 are left for the rounding of the sums and of the transport


@dataclass(frozen=True)
class Bucket:
    """A bucket (or a layer) the tuner picks a codec for: its name, its element count, its dtype's name."""

    name: str
    elements: int
    dtype: str = "float32"


@dataclass(frozen=True)
class Measured:
    """One rank's measurements of the last step: its link's achieved rate (bit/s), the software aggregator's rate
    per core (elements/s per contribution), the step's compute seconds, and the share of the compute that
    communication overlaps (DDP: the backward pass, about 2/3)."""

    link_rate: float
    aggregator_rate: float
    compute_s: float
    overlap: float = 2 / 3


@dataclass(frozen=True)
class Network:
    """What the ranks share and do not measure: whether a switch sums cnat8 and int32 at line rate (else they go
    through the software aggregator as the host codecs do), the aggregator's cores and its link's rate (None: the
    ranks'), the round trip, the MTU, the most elements per packet and the pool of slots each rank keeps in flight
    (None: one that covers the bandwidth-delay product)."""

    switch: bool = True
    aggregator_cores: int = 1
    aggregator_link_rate: float | None = None
    rtt: float = 10e-6
    mtu: int = 9000
    packet_elements: int = AGGREGATOR_MAX_ELEMENTS
    pool: int | None = None


@dataclass(frozen=True)
class Costs:
    """What the tuner predicts times from, calibrated or measured by its user (worker.costs): a rank's CPU seconds
    per element (encode, decode) for the switch codecs by name and the host codecs by class, to decode a float32
    result, and per datagram each way; a datagram's wire bytes beyond its payload and the part of them that the MTU
    counts; Gloo's ring allreduce seconds for (world, link rate, elements, network); and the software aggregator's
    seconds per package of one rank in host mode, beyond the codec's decode; and the network's seconds for a switch
    codec's in-network allreduce for (world, link rate, elements, elements per packet, bytes per element, network),
    its round trips included (``switch_seconds`` adds the rank's CPU).

    The DDP hook (worker.torch.auto) and the simulator (sim.training) both carry worker.costs' models of the ring
    and of the in-network allreduce, so that the tuner predicts each codec's time with the model that the simulator
    then charges."""

    switch_cpu: dict[str, tuple[float, float]]
    host_cpu: dict[type, tuple[float, float]]
    result_decode: float
    datagram_io: float
    datagram_overhead: int
    ip_udp: int
    ring: Callable[[int, float, int, Network], float]
    in_network: Callable[[int, float, int, int, int, Network], float]
    host_package: float = 0.0


def packet_elements(costs: Costs, network: Network, bits: float, header_bits: float = 0.0) -> int:
    """Elements of ``bits`` each in the largest packet the MTU holds beside ``header_bits`` of package header, at
    most the network's ``packet_elements``."""
    room = (network.mtu - costs.ip_udp - HDR) * 8 - header_bits
    return max(1, min(network.packet_elements, int(room // bits)))


def switch_seconds(costs: Costs, network: Network, codec: str, world: int, link_rate: float, elements: int) -> float:
    """One allreduce of ``elements`` with switch codec ``codec`` through a switch: the slower of the rank's CPU
    (encode, decode, a datagram out and one in per packet) and the network (``costs.in_network``)."""
    bits = SWITCH_BITS[codec]
    per_packet = packet_elements(costs, network, bits)
    encode, decode = costs.switch_cpu[codec]
    cpu = elements * (encode + decode) + 2 * costs.datagram_io * math.ceil(elements / per_packet)
    return max(cpu, costs.in_network(world, link_rate, elements, per_packet, bits // 8, network))


def measure(x: np.ndarray, world: int, *, residual: np.ndarray | None = None, last_mean: np.ndarray | None = None,
            key: int = 0, sample_bp: int = 300, sample_bits: int = 4) -> np.ndarray:
    """One rank's statistics of one bucket (FIELDS): its gradient ``x``, its error-feedback ``residual``, and
    ``last_mean``, the bucket's averaged result of the last step (the same at every rank; None before the first).
    The entropy is seed 001's: of a keyed ``sample_bp``-basis-point sample quantized to ``sample_bits`` bits."""
    x = np.asarray(x, np.float32).reshape(-1)
    nonfinite = 0
    with np.errstate(over="ignore", invalid="ignore"):
        suspect = not np.isfinite(x.sum())
    if suspect:  # an inf or NaN (or a float32 sum's overflow): count them, and measure the rest
        finite = np.isfinite(x)
        nonfinite, x = int(x.size - finite.sum()), x[finite]
    norm_sq = _square_sum(x)
    lo, hi = range_of(x)
    sample = x[random_words(key, 0, x.size) < sample_threshold(sample_bp)]
    sample = sample if sample.size else x
    entropy = entropy_bits(np.bincount(quantize(sample, lo, hi, sample_bits), minlength=2 ** sample_bits))
    max_abs = max(abs(lo), abs(hi))
    last = 0.0 if last_mean is None else _square_sum(last_mean)
    res = 0.0 if residual is None else _square_sum(residual)
    median_abs = float(np.median(np.abs(sample))) if sample.size else 0.0
    l1 = float(np.linalg.norm(x, 1))
    return np.array([1.0, norm_sq, last / world, entropy, (hi - lo) ** 2, max_abs, median_abs,
                     max_abs * l1 - norm_sq, res, float(nonfinite)])


def _square_sum(x: np.ndarray) -> float:
    """The sum of squares in float64: the minibatch variance is the small difference of two of them."""
    v = np.asarray(x).reshape(-1)
    return float(np.einsum("i,i->", v, v, dtype=np.float64))


@dataclass(frozen=True)
class Shared:
    """A bucket's shared statistics, as means over the ranks where that is what the model needs."""

    ranks: int
    norm_sq: float  # sum over ranks of ||g_i||^2
    mean_norm_sq: float  # ||mean of the last step||^2 (0 before the first result)
    entropy: float  # mean of the ranks' sample entropies, bits at sample_bits
    range_sq: float  # sum of (max - min)^2
    max_abs: float  # sum of max|g_i|: at least any rank's max
    median_abs: float  # mean of the ranks' median |g| (of the sample): a typical element
    tern: float  # sum of max_i ||g_i||_1 - ||g_i||^2: terngrad's variance
    residual_sq: float  # sum of ||r_i||^2
    nonfinite: float

    def minibatch_variance(self) -> float | None:
        """The variance of the averaged gradient from the ranks' own spread (summed over elements):
        sum ||g_i - mean||^2 / (n - 1) / n, with ``mean_norm_sq`` from the last step; None before there is a mean
        (or with one rank), 0 when the spread is below what the statistics resolve (RESOLUTION of the norms: the
        ranks agree, or the vector lost the digits that tell them apart)."""
        n = self.ranks
        if n < 2 or self.mean_norm_sq <= 0:
            return None
        spread = self.norm_sq - n * self.mean_norm_sq
        return spread / (n - 1) / n if spread > RESOLUTION * self.norm_sq else 0.0


@dataclass(frozen=True)
class Choice:
    """One bucket's codec, why, its predicted allreduce seconds and its variance ratio (added / minibatch)."""

    codec: str
    reason: str
    seconds: float
    ratio: float | None
    refused: dict[str, str] = field(default_factory=dict)  # codec -> why it was not allowed


@dataclass(frozen=True)
class Decision:
    """A step's choices per bucket, the predicted seconds per step, the digest ranks compare, the warnings
    (inconsistencies, fallbacks, unsafe pins) to log, and whether every unpinned bucket fell back to the fixed
    codec (an inconsistency, now or earlier in the run)."""

    step: int
    choices: dict[str, Choice]
    step_seconds: float
    digest: int
    warnings: list[str] = field(default_factory=list)
    fallback: bool = False

    def line(self) -> str:
        """One log line: the step, each bucket's codec, the predicted step time and the digest."""
        codecs = " ".join(f"{name}={c.codec}" for name, c in self.choices.items())
        return f"tuner step {self.step}: {codecs}; predicted {self.step_seconds * 1e3:.3f} ms/step; " \
               f"digest {self.digest:012x}"

    def as_dict(self) -> dict:
        """The decision for a metrics endpoint or JSON: plain numbers and strings."""
        return {"step": self.step, "step_seconds": self.step_seconds, "digest": f"{self.digest:012x}",
                "warnings": list(self.warnings), "fallback": self.fallback,
                "buckets": {name: {"codec": c.codec, "reason": c.reason, "seconds": c.seconds, "ratio": c.ratio,
                                   "refused": dict(c.refused)} for name, c in self.choices.items()}}


def divergent_ranks(digests: list[int]) -> list[int]:
    """The ranks whose decision digest (allgathered) differs from the most common one: who to name in the report
    when the shared vector's checked fields say that some rank differs."""
    common = max(set(digests), key=digests.count)
    return [rank for rank, digest in enumerate(digests) if digest != common]


def ceil_log2(x: float) -> int:
    """ceil(log2(x)) for x > 0, exactly (frexp, not a libm logarithm that may round differently elsewhere)."""
    mantissa, exponent = math.frexp(x)
    return exponent - 1 if mantissa == 0.5 else exponent


def _adaptive_bits(codec: Adaptive, s: Shared) -> int:
    """The N that adaptive picks from the ranks' mean entropy (bits_for, as the codec does per package)."""
    return bits_for(s.entropy, codec.c)


def _pieces(value: int) -> list[int]:
    return [(value >> (PIECE_BITS * i)) & ((1 << PIECE_BITS) - 1) for i in range(DIGEST_PIECES)]


class Tuner:
    """The codec per bucket from shared statistics (see the module's docstring).

    ``budget``: the most variance a codec may add to the averaged gradient, as a ratio of the minibatch's own
    (docs/tuner.md says why 0.5). Among the codecs within it and safe for the bucket, the one with the least
    predicted seconds x (1 + ratio) wins: in SGD's noise-bound regime the steps to a target grow with the total
    variance. ``margin`` and ``patience``: a better codec replaces the current one only when it is predicted
    ``margin`` faster for ``patience`` decisions in a row (hysteresis); an unsafe current codec goes at once.
    ``pins``: bucket name -> codec, kept whatever the statistics say. ``fallback``: the fixed codec used before
    there is a variance estimate and after any inconsistency."""

    def __init__(self, buckets: list[Bucket], world: int, costs: Costs, network: Network = Network(), *,
                 candidates: tuple[str, ...] = DEFAULT_CANDIDATES, pins: dict[str, str] | None = None,
                 budget: float = 0.5, margin: float = 0.1, patience: int = 3, fallback: str = GLOO,
                 error_feedback: bool = False) -> None:
        self.buckets, self.world, self.costs, self.network = list(buckets), world, costs, network
        names = [b.name for b in self.buckets]
        if len(set(names)) != len(names):
            raise ValueError(f"bucket names must be distinct: {names}")
        self.pins = dict(pins or {})
        unknown = set(self.pins) - set(names)
        if unknown:
            raise ValueError(f"pins name no bucket: {sorted(unknown)}")
        self.codecs = {name: self._parse(name) for name in {*candidates, *self.pins.values(), fallback}}
        self.candidates, self.fallback = tuple(candidates), fallback
        self.budget, self.margin, self.patience, self.error_feedback = budget, margin, patience, error_feedback
        self.current = {b.name: self.pins.get(b.name, fallback) for b in self.buckets}
        self.pending = {b.name: 0 for b in self.buckets}
        self.step, self.last_digest, self.diverged = 0, 0, False
        self.config_digest = int.from_bytes(hashlib.sha256(repr(
            (self.buckets, world, network, self.candidates, sorted(self.pins.items()), budget, margin, patience,
             fallback, error_feedback)).encode()).digest()[:3], "big")

    def _parse(self, name: str) -> host.HostCodec | None:
        """None for a switch codec and Gloo; ValueError for a codec auto cannot run or has no cost for."""
        if name in SWITCH_CODECS or name == GLOO:
            return None
        codec = host.parse(name)
        family = next((f for f in NOT_AN_ESTIMATE if name.startswith(f)), None)
        if family:
            raise ValueError(f"{name}: {NOT_AN_ESTIMATE[family]}")
        if type(codec) not in self.costs.host_cpu:
            raise ValueError(f"{name}: the tuner has no cost model for it")
        return codec

    # ---- the shared vector ---------------------------------------------------------------------------------------

    def local_vector(self, stats: list[np.ndarray], measured: Measured) -> np.ndarray:
        """This rank's contribution: the checked fields, its measurements, then each bucket's ``measure()``."""
        if len(stats) != len(self.buckets):
            raise ValueError(f"{len(stats)} buckets measured, the tuner has {len(self.buckets)}")
        checked = self._checked()
        own = [measured.link_rate, measured.aggregator_rate, measured.compute_s, measured.overlap]
        return np.concatenate([np.array(checked + own, np.float64), *[np.asarray(s, np.float64) for s in stats]])

    def _checked(self) -> list[int]:
        """The fields every rank must hold equal (CHECKED), each below 2**PIECE_BITS."""
        mask = (1 << PIECE_BITS) - 1
        return [self.step & mask, self.config_digest & mask, self.config_digest >> PIECE_BITS,
                *_pieces(self.last_digest)]

    def _size(self) -> int:
        return len(CHECKED) + len(MEASURED) + len(FIELDS) * len(self.buckets)

    def _inconsistency(self, shared: np.ndarray) -> str | None:
        """Why the shared vector cannot be trusted, or None."""
        size = self._size()
        if shared.shape != (size,):
            return f"the shared vector has shape {shared.shape}, expected ({size},)"
        if not np.isfinite(shared).all():
            return "the shared statistics are not finite (a rank's gradient holds inf or NaN)"
        for name, got, mine in zip(CHECKED, shared[:len(CHECKED)], self._checked()):
            if got != self.world * mine:
                return (f"ranks disagree on {name} (sum {got:g}, {self.world} x this rank's {mine}): a rank computed "
                        "different statistics or decisions")
        per_bucket = shared[len(CHECKED) + len(MEASURED):].reshape(len(self.buckets), len(FIELDS))
        if (per_bucket[:, 0] != self.world).any():
            return f"{per_bucket[:, 0].tolist()} ranks contributed, the job has {self.world}"
        if per_bucket[:, -1].any():
            return "a rank's gradient holds inf or NaN"
        return None

    # ---- the cost and variance models ----------------------------------------------------------------------------

    def _bits(self, name: str, s: Shared) -> tuple[float, float]:
        """Bits per element of a rank's package, and its header's bits per package."""
        if name in SWITCH_CODECS:
            return SWITCH_BITS[name], 0.0
        codec = self.codecs[name]
        if isinstance(codec, Adaptive):
            bits = _adaptive_bits(codec, s)
            if isinstance(codec, AdaptiveHuffman):  # entropy at N bits ~ H + N - M; a codebook per package
                return min(bits, s.entropy + bits - codec.m), 120 + 5 * 2 ** bits
            return bits, 72
        if isinstance(codec, Lloyd):
            return codec.bits, 8 + 32 * 2 ** codec.bits
        if isinstance(codec, (Uniform, Bitmask)):
            return codec.bits, 72 if isinstance(codec, Uniform) else 0
        if isinstance(codec, QSGD):
            return codec.width, 64
        if isinstance(codec, TernGrad):
            return 2, 32
        return 64 * codec.ratio, 0  # TopK, RandomK: (index, value) pairs

    def _wire(self, name: str, s: Shared) -> tuple[float, float, float]:
        """Wire bits per element up (a rank's packages) and down (the result: float32 for a host codec), headers
        included, and datagrams per element (the largest packet the MTU holds, at most ``packet_elements``)."""
        bits, package_header = self._bits(name, s)
        down_bits = SWITCH_BITS.get(name, 32)
        per_packet = packet_elements(self.costs, self.network, max(bits, down_bits), package_header)
        header = (HDR + self.costs.datagram_overhead) * 8 / per_packet
        return bits + package_header / per_packet + header, down_bits + header, 1 / per_packet

    def added_variance(self, name: str, s: Shared, bucket: Bucket) -> float:
        """The variance (or, for a biased codec, the mean squared error) the codec adds to the averaged gradient,
        summed over the bucket's elements: docs/tuner.md's bounds."""
        n, e, total = s.ranks, bucket.elements, s.norm_sq
        if name == GLOO:
            return 0.0
        if name == "cnat8":  # docs/arithmetic.md: mu^2 / 8 + 9/64 sum x_i^2 for the sum
            added = n * n * s.mean_norm_sq / 8 + 9 / 64 * total
        elif name == "int32":  # fixed point with unit 2^(E - s(n)), s(n) = 31 - ceil(log2 n): u^2 / 4 per element
            unit = 2.0 ** (ceil_log2(max(s.max_abs, 1e-300)) - (31 - ceil_log2(n)))
            added = n * e * unit * unit / 4
        else:
            codec = self.codecs[name]
            if isinstance(codec, (Uniform, Lloyd, Adaptive)):  # a bin of range / 2^N: width^2 / 12 per element
                bits = _adaptive_bits(codec, s) if isinstance(codec, Adaptive) else codec.bits
                added = s.range_sq * e / (12 * 4.0 ** bits)
            elif isinstance(codec, Bitmask):  # truncation below B - 9 mantissa bits
                added = total * 4.0 ** -(codec.bits - 9)
            elif isinstance(codec, QSGD):  # Alistarh et al., Lemma 3.1
                added = min(e / codec.levels ** 2, math.sqrt(e) / codec.levels) * total
            elif isinstance(codec, TernGrad):
                added = s.tern
            elif isinstance(codec, RandomK):
                added = (1 / codec.ratio - 1) * total
            else:  # TopK with error feedback: what it held back this step, measured or bounded
                added = s.residual_sq if s.residual_sq > 0 else (1 - codec.ratio) * total
        return added / (n * n)

    def _seconds(self, name: str, s: Shared, bucket: Bucket, m: dict[str, float]) -> float:
        """Predicted seconds of the bucket's allreduce: Gloo's ring or the in-network one (the costs' models), or
        through the software aggregator the slowest of the rank's CPU, its link each way, the aggregator's link and
        CPU (host mode, or its kernel), plus a round trip."""
        net, e, n = self.network, bucket.elements, s.ranks
        if name == GLOO:
            return self.costs.ring(n, m["link_rate"], e, net)
        if net.switch and name in SWITCH_CODECS:
            return switch_seconds(self.costs, net, name, n, m["link_rate"], e)
        up, down, datagrams = self._wire(name, s)
        io = 2 * self.costs.datagram_io * datagrams  # a datagram out and one in per packet
        if name in SWITCH_CODECS:
            encode, decode = self.costs.switch_cpu[name]
            rank_cpu = e * (encode + decode + io)
            aggregator_per_element = 1 / m["aggregator_rate"]
        else:  # host mode: the aggregator also handles each rank's packages one by one
            encode, decode = self.costs.host_cpu[type(self.codecs[name])]
            rank_cpu = e * (encode + self.costs.result_decode + io)
            aggregator_per_element = decode + 1 / m["aggregator_rate"] + self.costs.host_package * datagrams
        agg_rate = net.aggregator_link_rate or m["link_rate"]  # n packages in, one result out
        bounds = [rank_cpu, e * up / m["link_rate"], e * down / m["link_rate"], n * e * up / agg_rate,
                  e * down / agg_rate, n * e * aggregator_per_element / net.aggregator_cores]
        return max(bounds) + net.rtt

    def _unsafe(self, name: str, s: Shared, bucket: Bucket) -> str | None:
        """Why the codec would lose precision silently on this bucket, or None (docs/tuner.md, "Safety")."""
        largest = s.max_abs  # at least any rank's max|g|
        limit = FLOAT16_MAX if bucket.dtype == "float16" else FLOAT32_MAX
        codec = self.codecs.get(name)
        if name == "int32" and 0 < s.median_abs < largest * 2.0 ** -(31 - ceil_log2(s.ranks) - INT32_KEPT_BITS):
            return f"int32: half the elements keep fewer than {INT32_KEPT_BITS} bits below the largest"
        if name == "cnat8" and 2 * largest > limit:
            return f"cnat8 rounds up to a power of two past {bucket.dtype}'s largest value"
        if isinstance(codec, QSGD) and math.sqrt(s.norm_sq) > limit:
            return f"{name}'s levels scale by the norm, past {bucket.dtype}'s largest value"
        if isinstance(codec, RandomK) and largest / codec.ratio > limit:
            return f"{name} scales kept values by 1/ratio, past {bucket.dtype}'s largest value"
        if isinstance(codec, TopK) and not self.error_feedback:
            return f"{name} is biased: it needs error feedback"
        return None

    # ---- the decision ----------------------------------------------------------------------------------------------

    def statistics(self, shared: np.ndarray) -> list[Shared]:
        """Each bucket's shared statistics in an allreduced vector of ``local_vector``s."""
        out = []
        for i in range(len(self.buckets)):
            start = len(CHECKED) + len(MEASURED) + i * len(FIELDS)
            v = [float(x) for x in shared[start:start + len(FIELDS)]]
            out.append(Shared(self.world, v[1], v[2], v[3] / self.world, v[4], v[5], v[6] / self.world, *v[7:]))
        return out

    def decide(self, shared: np.ndarray) -> Decision:
        """The codec of every bucket for the next step, from the allreduced ``local_vector``s."""
        shared = np.asarray(shared, np.float64)
        warnings: list[str] = []
        problem = self._inconsistency(shared)
        if problem and problem.startswith("ranks disagree"):
            self.diverged = True  # decisions may already differ: stay on the fixed codec for the rest of the run
        if problem:
            warnings.append(f"tuner: {problem}; every unpinned bucket falls back to {self.fallback}")
        base = len(CHECKED)
        m = {k: float(v) / self.world if not problem else 0.0
             for k, v in zip(MEASURED, shared[base:base + len(MEASURED)])}
        per_bucket = self.statistics(shared if not problem else np.zeros(self._size()))
        choices = {bucket.name: self._choose(bucket, s, m, problem is not None or self.diverged, warnings)
                   for bucket, s in zip(self.buckets, per_bucket)}
        compute, overlap = m["compute_s"], m["overlap"]
        comm = sum(c.seconds for c in choices.values())
        step_seconds = max(compute, compute * (1 - overlap) + comm)
        digest = int.from_bytes(hashlib.sha256(repr(
            (self.step, self.config_digest, shared.astype(">f8").tobytes(),
             sorted((k, c.codec) for k, c in choices.items()))).encode()).digest()[:6], "big")
        decision = Decision(self.step, choices, step_seconds, digest, warnings, problem is not None or self.diverged)
        self.step, self.last_digest = self.step + 1, digest
        return decision

    def _choose(self, bucket: Bucket, s: Shared, m: dict[str, float], fixed: bool, warnings: list[str]) -> Choice:
        name = bucket.name
        valid = not fixed and m["link_rate"] > 0 and m["aggregator_rate"] > 0
        if name in self.pins:
            codec = self.pins[name]
            unsafe = self._unsafe(codec, s, bucket) if valid else None
            if unsafe:
                warnings.append(f"tuner: bucket {name} is pinned to {codec} although {unsafe}")
            return Choice(codec, "pinned", self._seconds(codec, s, bucket, m) if valid else 0.0, None)
        if not valid:
            self.current[name] = self.fallback
            return Choice(self.fallback, "fixed: inconsistent or missing measurements", 0.0, None)
        noise = s.minibatch_variance()
        if noise is None:
            return Choice(self.current[name], "no minibatch variance estimate yet (first step, or one rank)",
                          self._seconds(self.current[name], s, bucket, m), None)
        scored: dict[str, tuple[float, float, float]] = {}  # name -> (score, seconds, ratio)
        refused: dict[str, str] = {}
        for codec in dict.fromkeys((*self.candidates, self.current[name])):
            unsafe = self._unsafe(codec, s, bucket)
            added = self.added_variance(codec, s, bucket)
            ratio = added / noise if noise > 0 else (0.0 if added == 0 else math.inf)
            if unsafe or ratio > self.budget:
                refused[codec] = unsafe or (f"adds {ratio:.3g} of the minibatch variance, over {self.budget}"
                                            if noise > 0 else "adds variance, and the ranks' spread is unresolved")
                continue
            seconds = self._seconds(codec, s, bucket, m)
            scored[codec] = (seconds * (1 + ratio), seconds, ratio)
        if not scored:
            self.current[name], self.pending[name] = self.fallback, 0
            warnings.append(f"tuner: no codec is allowed for {name}; falling back to {self.fallback}"
                            + (f" although {refused[self.fallback]}" if self.fallback in refused else ""))
            return Choice(self.fallback, "none allowed", self._seconds(self.fallback, s, bucket, m), None, refused)
        best = min(scored, key=lambda c: scored[c][0])
        now = self.current[name]
        if now not in scored:
            reason = f"{now} is no longer allowed"
            self.current[name], self.pending[name] = best, 0
        elif best != now and scored[best][0] < (1 - self.margin) * scored[now][0]:
            self.pending[name] += 1
            if self.pending[name] >= self.patience:
                reason = f"{best} beat {now} by over {self.margin:.0%} for {self.patience} steps"
                self.current[name], self.pending[name] = best, 0
            else:
                reason = f"keeping {now}: {best} better for {self.pending[name]} of {self.patience} steps"
        else:
            reason = f"keeping {now}" if best != now else f"{now}: least time x (1 + variance ratio)"
            self.pending[name] = 0
        chosen = self.current[name]
        _, seconds, ratio = scored[chosen]
        return Choice(chosen, f"{reason} ({seconds * 1e3:.3f} ms, variance ratio {ratio:.3f}; refused "
                              f"{', '.join(refused) or 'none'})", seconds, ratio, refused)
