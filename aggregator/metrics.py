"""Prometheus metrics of an aggregator (``intml-aggregator --metrics-port``): a Collector that reads every core's
counter block (aggregator.counters) when it is scraped, served in the standard text format over HTTP by
prometheus-client's threaded server, in the aggregator's main process.

Nothing is counted twice and nothing runs on the data path: the cores keep their counters as they always do,
in blocks the main process shares (an anonymous shared mmap for --cores processes), and a scrape copies them.
Reading them while the cores write them is safe for the reasons aggregator.counters gives (aligned 8-byte
counters with one writer each, a per-row sequence number for a job's identity): a scrape may see a value a
moment old, never a torn one, and it never writes. With --metrics-port every core runs in a process of its
own (even with --cores 1): a scrape's Python work (about 1.5 ms for two cores with a job each, 55 ms with 64
jobs each: most of it prometheus-client building and formatting the ~4000 samples) holds only the main
process's GIL, and costs the cores nothing but a share of the CPU.

Families (the counters are those of docs/protocol.md, "Drop reasons"):
    intml_aggregator_<counter>_total{core}             each counter that is not a drop, every event on the core
    intml_aggregator_drops_total{core,reason}          each drop counter, reason = its name without ``drop_``
    intml_aggregator_job_<counter>_total{core,tenant,job}  the same per live job (tenant: the index of the job's
                                                           token, docs/protocol.md "Tenants")
    intml_aggregator_job_drops_total{core,tenant,job,reason}
    intml_aggregator_finished_jobs_total{core,reason}  jobs that ended: leave, idle, evicted
    intml_aggregator_active_jobs{core}, intml_aggregator_slots_in_use{core}, intml_aggregator_slots{core}
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from intml.aggregator.counters import END_REASONS, CoreCounters
from intml.protocol.stats import STAT_NAMES

PREFIX = "intml_aggregator"
DROP = "drop_"


def _families(scope: str, labels: list[str]) -> tuple[dict[str, CounterMetricFamily], CounterMetricFamily]:
    """One counter family per counter that is not a drop, and one for every drop with a ``reason`` label."""
    of = "live job's" if scope else "core's"
    plain = {name: CounterMetricFamily(f"{PREFIX}_{scope}{name}", f"the {of} {name} (docs/protocol.md, Drop reasons)",
                                       labels=labels)
             for name in STAT_NAMES if not name.startswith(DROP)}
    drops = CounterMetricFamily(f"{PREFIX}_{scope}drops", f"datagrams the {of} checks dropped, by reason",
                                labels=[*labels, "reason"])
    return plain, drops


def _add(plain: dict[str, CounterMetricFamily], drops: CounterMetricFamily, labels: list[str], counters) -> None:
    for name, value in zip(STAT_NAMES, counters.tolist()):
        if name.startswith(DROP):
            drops.add_metric([*labels, name[len(DROP):]], value)
        else:
            plain[name].add_metric(labels, value)


class AggregatorCollector(Collector):
    """Every core's counters, read at scrape time (``cores[i]`` is core i's block)."""

    def __init__(self, cores: Sequence[CoreCounters]) -> None:
        self.cores = list(cores)

    def collect(self) -> Iterator[Metric]:
        core_plain, core_drops = _families("", ["core"])
        job_plain, job_drops = _families("job_", ["core", "tenant", "job"])
        finished = CounterMetricFamily(f"{PREFIX}_finished_jobs", "jobs that ended, by reason (leave: every rank "
                                       "left; idle: --idle-timeout; evicted: torn down by the aggregator)",
                                       labels=["core", "reason"])
        active = GaugeMetricFamily(f"{PREFIX}_active_jobs", "jobs registered on the core", labels=["core"])
        in_use = GaugeMetricFamily(f"{PREFIX}_slots_in_use", "slot rows held by live jobs", labels=["core"])
        slots = GaugeMetricFamily(f"{PREFIX}_slots", "slot rows of the core (--slots)", labels=["core"])
        for i, counters in enumerate(self.cores):
            core = str(i)
            _add(core_plain, core_drops, [core], counters.totals())
            live = counters.live_jobs()
            for sample in live:
                _add(job_plain, job_drops, [core, str(sample.tenant), str(sample.job_id)], sample.counters)
            for reason, count in zip(END_REASONS, counters.finished.tolist()):
                finished.add_metric([core, reason], count)
            active.add_metric([core], len(live))
            in_use.add_metric([core], int(counters.row_used.sum()))
            slots.add_metric([core], counters.rows)
        yield from core_plain.values()
        yield core_drops
        yield from job_plain.values()
        yield from (job_drops, finished, active, in_use, slots)


def serve(cores: Sequence[CoreCounters], address: str, port: int) -> int:
    """Serve the cores' metrics at http://address:port/metrics from a daemon thread; returns the port (port 0
    picks a free one)."""
    registry = CollectorRegistry()  # only the aggregator's families: the process metrics would be the parent's
    registry.register(AggregatorCollector(cores))
    server, _ = start_http_server(port, address, registry)
    return server.server_port
