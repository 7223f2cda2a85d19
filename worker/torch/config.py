"""The PyTorch integration's configuration: ``IntmlConfig``, from ``INTML_*`` environment variables and keyword
arguments. The job's and the worker's defaults come from ``protocol.job``.

Why ``min_elements = 65536`` (``INTML_MIN_ELEMENTS``): the process-group backend compresses an allreduce only when a
user would want it compressed, and cannot tell a gradient from a loss or a metric except by size. Losses, counters,
metrics and small parameters (biases, norms: at most a few thousand elements) are far below 64 Ki elements, and
they must stay exact. Every full DDP bucket is far above it (DDP's first bucket holds 1 MiB, 256 Ki float32, the
others 25 MiB), so plain DDP over the backend still sends nearly all of its gradient bytes through intml; only a
smaller tail bucket goes to Gloo, exactly. What compression saves below the threshold is small: at most 192 KiB
per call with cnat8, against a fixed cost per intml allreduce (2 ranks on this 2-core machine, loopback, median:
0.49 ms for 1 Ki elements through intml against 0.33 ms through Gloo). Set 0 to send every float32 SUM/AVG through
intml, or use the DDP hook, which compresses every bucket whatever its size."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping

from intml.protocol.codecs import host
from intml.protocol.codecs.host.powersgd import PowerSGD
from intml.protocol.codecs.host.randomk import RandomK
from intml.protocol.job import CODEC_NAMES, ROUNDINGS, JobParams, WorkerTimers, codec_name
from intml.worker.torch.auto import AUTO, parse_pins

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}


def _parse_bool(text: str, name: str) -> bool:
    value = text.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ValueError(f"{name} must be 0 or 1 (or true/false), got {text!r}")


@dataclasses.dataclass
class IntmlConfig:
    """Where the aggregator is and how to use it. ``from_env`` reads ``INTML_<FIELD>`` (upper case; ``pool_size``
    is ``INTML_POOL``, ``threaded`` is ``INTML_THREAD``); keyword arguments override the environment."""

    aggregator: str | None = None  # host:port of intml-aggregator, or several comma-separated (one job over all)
    token: str = ""  # INTML_TOKEN: the job's shared secret, one the aggregator knows (it never goes on the wire)
    codec: str = codec_name(JobParams.codec)  # cnat8 or int32 (summed by a switch), a host codec's name, or auto
    codec_pin: str = ""  # hook, codec auto: "0:int32,3:gloo", DDP bucket index -> codec the tuner keeps (auto.py)
    tuner_every: int = 1  # hook, codec auto: the tuner measures, shares and decides every K-th step (measuring costs)
    metrics_port: int | None = None  # hook, codec auto: the tuner's Prometheus metrics on port + rank (0: any free)
    metrics_address: str = "127.0.0.1"  # where the metrics port listens
    job: int | None = None  # job id on the aggregator; None: rank 0 draws one at random and shares it
    seed: int | None = None  # job seed of the stochastic rounding; None: rank 0's from torch's (link.rounding_seed)
    rounding: str = ROUNDINGS[0]  # C_nat's: "stochastic" (unbiased) or "nearest" (deterministic, biased)
    packet_elements: int = JobParams.packet_elements  # elements per packet
    pool_size: int = JobParams.pool_size  # slots, i.e. packets in flight per worker
    timeout: float = WorkerTimers.timeout  # an allreduce with no progress for this long raises AllreduceTimeout
    connect_timeout: float = WorkerTimers.connect_timeout  # start-up: seconds to wait for the JOIN_ACK
    fallback: str = "error"  # aggregator unreachable at start-up: "error" raises, "gloo" warns and uses Gloo
    error_feedback: bool = False  # hook: keep each bucket's compression residual and add it next step
    warmup_steps: int = 0  # hook: the first K steps go uncompressed through Gloo
    threaded: bool = False  # hook: run allreduces on a background thread instead of in the caller (see link.Link)
    min_elements: int = 65536  # backend: smaller allreduces go exactly through Gloo (why: above)

    _ENV = {"pool_size": "INTML_POOL", "threaded": "INTML_THREAD"}

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, **overrides) -> IntmlConfig:
        env = os.environ if env is None else env
        values: dict = {}
        for f in dataclasses.fields(cls):
            name = cls._ENV.get(f.name, f"INTML_{f.name.upper()}")
            if name not in env:
                continue
            text = env[name]
            kind = str(f.type)
            if f.name == "aggregator" or kind == "str":
                values[f.name] = text
            elif kind == "bool":
                values[f.name] = _parse_bool(text, name)
            else:
                number = "a number" if "float" in kind else "an integer"
                try:
                    values[f.name] = float(text) if "float" in kind else int(text, 0)
                except ValueError:
                    raise ValueError(f"{name} must be {number}, got {text!r}") from None
        unknown = set(overrides) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            raise TypeError(f"unknown intml option(s): {sorted(unknown)}")
        values.update(overrides)
        return cls(**values).validated()

    def validated(self) -> IntmlConfig:
        if self.codec_pin and self.codec != AUTO:
            raise ValueError(f"INTML_CODEC_PIN pins buckets for the tuner: it needs INTML_CODEC=auto, got "
                             f"{self.codec!r}")
        self.pins()  # raises for a malformed pin
        if self.metrics_port is not None and (self.codec != AUTO or not 0 <= self.metrics_port < 65536):
            raise ValueError(f"INTML_METRICS_PORT serves the tuner's metrics: it needs INTML_CODEC=auto and a TCP "
                             f"port (0: a free one), got {self.metrics_port} with {self.codec!r}")
        if self.tuner_every < 1:
            raise ValueError(f"INTML_TUNER_EVERY must be >= 1 (steps between the tuner's decisions), got "
                             f"{self.tuner_every}")
        if self.codec == AUTO and self.rounding != ROUNDINGS[0]:
            raise ValueError(f"INTML_ROUNDING={self.rounding} cannot go with INTML_CODEC=auto: the tuner's variance "
                             f"model is stochastic rounding's (unbiased)")
        codec = self.host_codec()  # raises for a name that is neither a switch nor a host codec's
        if self.rounding not in ROUNDINGS:
            raise ValueError(f"INTML_ROUNDING must be one of {', '.join(ROUNDINGS)}, got {self.rounding!r}")
        if codec is not None and self.rounding != ROUNDINGS[0]:
            raise ValueError(f"INTML_ROUNDING={self.rounding} is C_nat's; {codec.name} rounds as it defines "
                             f"(docs/codecs.md): leave INTML_ROUNDING unset with a host codec")
        if self.error_feedback and isinstance(codec, PowerSGD):
            raise ValueError(f"INTML_ERROR_FEEDBACK=1 cannot go with {codec.name}: PowerSGD keeps its own error "
                             f"feedback (what its factors left out); leave INTML_ERROR_FEEDBACK unset")
        if self.error_feedback and isinstance(codec, RandomK):
            raise ValueError(f"INTML_ERROR_FEEDBACK=1 cannot go with {codec.name}: it is unbiased and scales what it "
                             f"keeps by 1/ratio, so the residual would grow without bound; use topk with error "
                             f"feedback, or randomk without")
        if self.fallback not in ("error", "gloo"):
            raise ValueError(f"INTML_FALLBACK must be 'error' or 'gloo', got {self.fallback!r}")
        if self.min_elements < 0:
            raise ValueError(f"INTML_MIN_ELEMENTS must be >= 0, got {self.min_elements}")
        if self.warmup_steps < 0:
            raise ValueError(f"INTML_WARMUP_STEPS must be >= 0, got {self.warmup_steps}")
        for name, seconds in (("INTML_TIMEOUT", self.timeout), ("INTML_CONNECT_TIMEOUT", self.connect_timeout)):
            if not seconds > 0:
                raise ValueError(f"{name} must be a positive number of seconds, got {seconds}")
        return self

    def pins(self) -> dict[int, str]:
        """``codec_pin`` parsed: DDP bucket index -> codec (auto.parse_pins)."""
        return parse_pins(self.codec_pin)

    def host_codec(self) -> host.HostCodec | None:
        """The host codec ``codec`` names (the aggregator's host mode sums it), or None for cnat8, int32 and auto. A
        name that is none of them raises ValueError in one line naming the switch codecs and the host codecs'
        families."""
        if self.codec in (*CODEC_NAMES, AUTO):
            return None
        try:
            return host.parse(self.codec)
        except ValueError as exc:
            families = ", ".join(sorted(host.FAMILIES))
            why = "" if not self.codec.startswith(tuple(host.FAMILIES)) else f" ({exc})"
            raise ValueError(f"INTML_CODEC must be {' or '.join(CODEC_NAMES)} (summed by a switch), a host codec "
                             f"of the families {families} (docs/codecs.md) or {AUTO} (the tuner picks per bucket, "
                             f"DDP hook only), got {self.codec!r}{why}") from None
