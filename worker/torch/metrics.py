"""Prometheus metrics of the DDP hook's tuner (``INTML_CODEC=auto`` with ``INTML_METRICS_PORT``): a Collector that
reads the rank's ``AutoCodec`` when it is scraped, served in the standard text format over HTTP by
prometheus-client's threaded server, as the aggregator's are (aggregator/metrics.py). Nothing is computed for a
scrape but the copy of the last applied decision and two counters. prometheus-client is optional: the
``metrics`` extra.

Families (docs/metrics.md, "The tuner"):
    intml_tuner_codec{rank,bucket,codec}           1 for the codec each bucket uses now (pins and fallbacks included)
    intml_tuner_predicted_seconds{rank,bucket}     the applied decision's predicted allreduce seconds of the bucket
    intml_tuner_variance_ratio{rank,bucket}        the variance the bucket's codec adds over the minibatch's own
                                                   (NaN: pinned, fallback or not yet estimated)
    intml_tuner_predicted_step_seconds{rank}       the applied decision's predicted seconds per step
    intml_tuner_decisions_total{rank}              decisions made (one per measured step)
    intml_tuner_changes_total{rank}                applied decisions that changed a bucket's codec
    intml_tuner_fallbacks_total{rank}              decisions that fell back to the fixed codec (an inconsistency)
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from wsgiref.simple_server import WSGIServer

from intml.worker.torch.auto import AutoCodec

PREFIX = "intml_tuner"


def _prometheus():
    try:
        import prometheus_client
        from prometheus_client import core
    except ImportError:
        raise ValueError("INTML_METRICS_PORT needs prometheus-client: pip install 'intml[metrics]'") from None
    return prometheus_client, core


class TunerCollector:
    """The rank's tuner state, read at scrape time (a prometheus_client Collector)."""

    def __init__(self, auto: AutoCodec) -> None:
        self.auto = auto

    def collect(self) -> Iterator:
        _, core = _prometheus()
        auto, rank = self.auto, str(self.auto.rank)
        codec = core.GaugeMetricFamily(f"{PREFIX}_codec", "1 for the codec each bucket uses now",
                                       labels=["rank", "bucket", "codec"])
        seconds = core.GaugeMetricFamily(f"{PREFIX}_predicted_seconds", "the bucket's predicted allreduce seconds "
                                         "under the applied decision", labels=["rank", "bucket"])
        ratio = core.GaugeMetricFamily(f"{PREFIX}_variance_ratio", "the variance the bucket's codec adds over the "
                                       "minibatch's own (NaN: pinned, fallback, or not estimated yet)",
                                       labels=["rank", "bucket"])
        step = core.GaugeMetricFamily(f"{PREFIX}_predicted_step_seconds", "the applied decision's predicted "
                                      "seconds per step", labels=["rank"])
        decision = auto.decision
        buckets = [int(b.name.removeprefix("bucket")) for b in auto.tuner.buckets] if auto.tuner else []
        for index in sorted({*buckets, *auto.pins}):
            codec.add_metric([rank, str(index), auto.codec(index)], 1)
        if decision is not None:
            for name, choice in decision.choices.items():
                bucket = name.removeprefix("bucket")
                seconds.add_metric([rank, bucket], choice.seconds)
                ratio.add_metric([rank, bucket], math.nan if choice.ratio is None else choice.ratio)
            step.add_metric([rank], decision.step_seconds)
        yield from (codec, seconds, ratio, step)
        for name, value, text in (("decisions", auto.decisions, "decisions made, one per measured step"),
                                  ("changes", auto.changes, "applied decisions that changed a bucket's codec"),
                                  ("fallbacks", auto.fallbacks, "decisions that fell back to the fixed codec")):
            family = core.CounterMetricFamily(f"{PREFIX}_{name}", text, labels=["rank"])
            family.add_metric([rank], value)
            yield family


def serve(auto: AutoCodec, address: str, port: int) -> WSGIServer:
    """Serve the tuner's metrics at http://address:port/metrics from a daemon thread (port 0 picks a free one:
    ``server.server_port``); ``server.shutdown()`` stops it. ValueError in one line without prometheus-client."""
    prometheus_client, _ = _prometheus()
    registry = prometheus_client.CollectorRegistry()  # the tuner's families only
    registry.register(TunerCollector(auto))
    server, _ = prometheus_client.start_http_server(port, address, registry)
    return server
