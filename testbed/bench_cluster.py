"""`intml-testbed bench cluster`: intml cnat8, intml int32 and Gloo's ring over the same shaped links.

Each point builds a fresh namespace topology (testbed.netns), runs the aggregator in the switch namespace (or,
with ``--aggregators A`` > 1, one aggregator per aggregator namespace, the job's slots spread over all their
cores) and one rank per worker namespace, then Gloo's ranks over the same ports (routed through the switch
namespace), and tears the topology down. Reported per system: the median time per allreduce, goodput per link
(payload bits per second each way over the shaped rate) and the speedup over Gloo, beside the ideal speedup from
the bytes each puts on a link. Results go out by multicast (``--results``, the default): each aggregator sends
one copy per completion to the job's group and the switch namespace replicates it to every worker port
(testbed.mroute), as a switch's replication engine does; by unicast, one copy per worker, when asked or when the
topology has more devices than the kernel routes multicast between (32). Each row says which. Every aggregator
count must give the same result bits (checked).

``--collective reduce_scatter``: every system runs a reduce-scatter instead (the tensor rounded down to a multiple
of n), Gloo's ``reduce_scatter_tensor`` against intml's, whose aggregator sends each rank only the chunks of its
shard, by unicast (docs/protocol.md, "Reduce-scatter"). A worker then downloads about 1/n of what it uploads, so
its link's busier direction is the upload, unchanged from the allreduce: the ideal speedup uses that direction's
bytes, and Gloo's ring reduce-scatter puts half its allreduce's on the link.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import numpy as np

from intml.aggregator.cli import default_cores as aggregator_default_cores
from intml.protocol.codecs.host import parse as host_codec
from intml.protocol.job import AGGREGATOR_MAX_JOBS, CODEC_NAMES, host_aggregator_elements
from intml.protocol.packet import HDR
from intml.testbed import gloo
from intml.testbed.bench_allreduce import aggregator, run_ranks_intml
from intml.testbed.netns import RESULTS_GROUP, Topology, parse_rate
from intml.testbed.mroute import MAXVIFS
from intml.testbed.procs import run_ranks
from intml.testbed.timing import emit
from intml.worker.traffic import intml_bytes, ring_bytes

IP_UDP = 28
ETHERNET = 14
TCP_OVERHEAD = 20 + 20 + 12 + ETHERNET  # IP, TCP, timestamps option, Ethernet: per segment
GLOO_PORT = 29500


def packet_elements_for(codec: str, mtu: int) -> int:
    """The most elements one datagram carries without IP fragmentation (a host codec: int32's, so that its
    float32 RESULT fits)."""
    return (mtu - IP_UDP - HDR) // CODEC_NAMES[codec if codec in CODEC_NAMES else "int32"].bytes_per_element


def aggregator_elements(codec: str, mtu: int) -> int:
    """The --max-packet-elements an aggregator needs for ``codec``'s packets under ``mtu``."""
    pe = packet_elements_for(codec, mtu)
    return pe if codec in CODEC_NAMES else host_aggregator_elements(pe)


def result_package_bytes(codec: str, elements: int, packet_elements: int) -> int:
    """The RESULT package bytes a worker receives in one host-mode allreduce of ``elements`` (the codec's own
    encode_result of each packet's elements: float32, or less where the codec sends less)."""
    codec_of = host_codec(codec)
    return sum(len(codec_of.encode_result(np.zeros(min(packet_elements, elements - start))))
               for start in range(0, elements, packet_elements))


def wire_bytes_intml(codec: str, elements: int, mtu: int, pool: int) -> float:
    """Bytes one worker puts on its link each way, headers included (bootstrap packets too). A host codec: the
    RESULT's direction, the busier one (host mode sends no bootstrap round)."""
    pe = packet_elements_for(codec, mtu)
    if codec not in CODEC_NAMES:
        return result_package_bytes(codec, elements, pe) + -(-elements // pe) * (HDR + IP_UDP + ETHERNET)
    return intml_bytes(elements, codec, pe, pool, per_packet=HDR + IP_UDP + ETHERNET)


def wire_bytes_gloo(workers: int, elements: int, mtu: int, collective: str = "allreduce") -> float:
    """Bytes one worker puts on its link each way: the ring's payload in full TCP segments, headers included (a
    reduce-scatter: the ring's first half)."""
    half = 0.5 if collective == "reduce_scatter" else 1.0
    return half * ring_bytes(elements, workers) * (1 + TCP_OVERHEAD / (mtu - 52))


def default_cores(workers: int, aggregators: int = 1, cpus: int | None = None) -> int:
    """Cores each aggregator gets by default: the testbed's workers share the host, one CPU each; the
    aggregators share what intml-aggregator's default would take of the rest, at least one core each."""
    cpus = len(os.sched_getaffinity(0)) if cpus is None else cpus
    return max(1, aggregator_default_cores(cpus - workers) // aggregators)


@contextlib.contextmanager
def aggregators_in(topo: Topology, aggregators: int, cores: int, max_packet_elements: int,
                   multicast: bool) -> Iterator[list[str]]:
    """Run the aggregators of a point; yields each rank's aggregator argument. One: in the switch namespace (at
    the switch's port on the rank's link; with multicast, at port p0's address, the interface its results leave
    on). More: one per aggregator namespace, every rank listing them all. With multicast the switch namespace
    replicates each result to every worker port, as a switch does, so an aggregator sends one copy per
    completion (TTL 2: one routed hop)."""
    if aggregators == 1:
        senders, namespaces = [(topo.port_ip(0), "p0")], [topo.switch]
    else:
        senders = [(topo.aggregator_ip(k), f"a{k}") for k in range(aggregators)]
        namespaces = [topo.aggregator(k) for k in range(aggregators)]
    with contextlib.ExitStack() as stack:
        if multicast:
            stack.enter_context(topo.multicast_routes(senders, RESULTS_GROUP, AGGREGATOR_MAX_JOBS))
        ports = [stack.enter_context(aggregator(cores, max_packet_elements, host=ip if multicast else "0.0.0.0",
                                                prefix=topo.exec_prefix(ns),
                                                multicast=RESULTS_GROUP if multicast else None, multicast_ttl=2))
                 for (ip, _), ns in zip(senders, namespaces)]
        if aggregators == 1 and not multicast:
            yield [f"{topo.port_ip(r)}:{ports[0]}" for r in range(topo.workers)]
        else:
            yield [",".join(f"{ip}:{p}" for (ip, _), p in zip(senders, ports))] * topo.workers


def results_mode(requested: str, workers: int, aggregators: int) -> str:
    """How results reach the workers: multicast when asked for and the switch namespace can route it (the
    kernel's MAXVIFS devices), else unicast."""
    fits = workers + (aggregators if aggregators > 1 else 0) <= MAXVIFS
    return "multicast" if requested == "multicast" and fits else "unicast"


def run_point(workers: int, rate: str, elements: int, mtu: int, loss: float, warmup: int, rounds: int,
              pool: int, with_gloo: bool = True, aggregators: int = 1, cores: int | None = None,
              results: str = "multicast", collective: str = "allreduce",
              codecs: tuple[str, ...] = tuple(CODEC_NAMES)) -> dict:
    """Every system (intml with each of ``codecs``, switch or host codecs; Gloo) over one topology, with
    ``aggregators`` aggregators of ``cores`` cores each (default: default_cores), results by ``results`` where the
    topology allows (results_mode); returns {"rows": [...], "hashes": {codec: [...]}, "dropped": n}."""
    rate_bit = parse_rate(rate)
    cores = cores or default_cores(workers, aggregators)
    rows, hashes = [], {}
    results = results_mode(results, workers, aggregators)
    with Topology(workers, rate_bit, mtu=mtu, loss=loss, aggregators=aggregators if aggregators > 1 else 0) as topo:
        prefixes = [topo.exec_prefix(topo.worker(r)) for r in range(workers)]
        largest = max(aggregator_elements(codec, mtu) for codec in codecs)
        with aggregators_in(topo, aggregators, cores, largest, results == "multicast") as addresses:
            for job, codec in enumerate(codecs, start=1):
                result = run_ranks_intml(addresses, elements, codec, packet_elements_for(codec, mtu), pool, warmup,
                                         rounds, prefixes, job=job, collective=collective)
                if not result["identical_across_ranks"]:
                    raise RuntimeError(f"intml {codec}: ranks disagree on the result")
                hashes[codec] = result["hashes"]
                rows.append(_row(f"intml {codec}", result["median_s"], result["bytes_per_worker_each_way"],
                                 wire_bytes_intml(codec, elements, mtu, pool), rate_bit, result["retransmissions"]))
        if with_gloo:
            argvs = [[*prefixes[r], *gloo.command(r, workers, topo.worker_ip(0), GLOO_PORT, elements, warmup, rounds,
                                                  ifname="eth0", collective=collective)] for r in range(workers)]
            ring = gloo.summarize(run_ranks(argvs, "gloo", 900.0), elements, collective)
            rows.append(_row("gloo ring", ring["median_s"], ring["bytes_per_worker"],
                             wire_bytes_gloo(workers, elements, mtu, collective), rate_bit, 0))
        dropped = topo.dropped_packets()
    if with_gloo:
        against(rows, rows[-1])
    for row in rows:
        row.update(workers=workers, rate=rate, mtu=mtu, loss=loss, elements=elements, aggregators=aggregators,
                   cores=cores, results=results, collective=collective)
    return {"rows": rows, "hashes": hashes, "dropped": dropped}


def against(rows: list[dict], gloo_row: dict) -> None:
    """Each row's speedup over Gloo's, measured and ideal."""
    for row in rows:
        row["speedup_vs_gloo"] = gloo_row["median_s"] / row["median_s"]
        row["ideal_speedup"] = gloo_row["wire_bytes"] / row["wire_bytes"]


def _row(system: str, seconds: float, payload_bytes: float, wire_bytes: float, rate_bit: int,
         retransmissions: int) -> dict:
    return {"system": system, "median_s": seconds, "wire_bytes": wire_bytes,
            "goodput": payload_bytes * 8 / seconds / rate_bit, "link_use": wire_bytes * 8 / seconds / rate_bit,
            "retransmissions": retransmissions, "speedup_vs_gloo": float("nan"), "ideal_speedup": float("nan")}


COLUMNS = [("workers", "n", ""), ("rate", "rate", ""), ("aggregators", "aggs", ""), ("cores", "cores", ""),
           ("system", "system", ""), ("median_s", "median s", ".4f"),
           ("goodput", "goodput/rate", ".2f"), ("link_use", "wire/rate", ".2f"),
           ("speedup_vs_gloo", "× Gloo", ".2f"), ("ideal_speedup", "ideal ×", ".2f"),
           ("retransmissions", "retx", "d")]


def run(workers: list[int], rates: list[str], elements: int | None, mtu: int, loss: float, warmup: int,
        rounds: int, pool: int, as_json: bool, plot: str | None, aggregators: list[int] = (1,),
        cores: int | None = None, results: str = "multicast", collective: str = "allreduce") -> list[dict]:
    """Each rate, worker count and aggregator count (``cores`` per aggregator; default: default_cores; results by
    ``results`` where the topology allows, each row says which). Gloo runs once per rate and worker count, with
    the first aggregator count; every aggregator count must give the same result bits."""
    rows = []
    for rate in rates:
        # ~0.3 s of intml cnat8 traffic per round at the link rate, at most 10M elements (memory, CPU)
        size = elements or min(10_000_000, parse_rate(rate) // 8 * 3 // 10)
        for n in workers:
            n_size = size - size % n if collective == "reduce_scatter" else size  # whole shards
            points = [run_point(n, rate, n_size, mtu, loss, warmup, rounds, pool, with_gloo=k == 0, aggregators=a,
                                cores=cores, results=results, collective=collective)
                      for k, a in enumerate(aggregators)]
            differ = [p["rows"][0]["aggregators"] for p in points if p["hashes"] != points[0]["hashes"]]
            if differ:
                raise RuntimeError(f"n = {n}, {rate}: {differ} aggregators' results differ from {aggregators[0]}'s")
            point_rows = [row for p in points for row in p["rows"]]
            against(point_rows, next(row for row in point_rows if row["system"] == "gloo ring"))
            rows += point_rows
    emit(rows, as_json, f"{collective} over shaped links (network namespaces)", COLUMNS,
         {"mtu": mtu, "loss": loss, "rounds": rounds, "pool": pool, "collective": collective,
          "results": sorted({row["results"] for row in rows if row["system"] != "gloo ring"}),
          "identical_across_aggregator_counts": True})
    if plot:
        plot_times(rows, plot)
    return rows


def plot_times(rows: list[dict], path: str) -> None:
    """Time per allreduce against n, one panel per rate, one line per system."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rates = list(dict.fromkeys(r["rate"] for r in rows))
    fig, axes = plt.subplots(1, len(rates), figsize=(4.5 * len(rates), 3.6), squeeze=False)
    for ax, rate in zip(axes[0], rates):
        for system in dict.fromkeys(r["system"] for r in rows):
            points = sorted((r["workers"], r["median_s"]) for r in rows if r["rate"] == rate and r["system"] == system)
            ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=system)
        size = next(r["elements"] for r in rows if r["rate"] == rate)
        ax.set(title=f"{rate}, {size / 1e6:g}M elements", xlabel="workers n", ylabel="seconds per allreduce")
        ax.set_xticks(sorted({r["workers"] for r in rows}))
        ax.grid(alpha=0.3)
    axes[0][0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)



def run_loss(workers: int, rate: str, elements: int, losses: list[float], mtu: int, rounds: int, pool: int,
             as_json: bool) -> list[dict]:
    """`rounds` consecutive allreduces per loss level on fresh topologies; each level's per-round result hashes
    must equal the loss-free run's (same seeds), at every rank."""
    runs = {loss: run_point(workers, rate, elements, mtu, loss, 0, rounds, pool, with_gloo=False)
            for loss in [0.0, *[x for x in losses if x > 0]]}
    rows = []
    for loss, point in runs.items():
        for row in point["rows"]:
            codec = row["system"].split()[1]
            base = next(r for r in runs[0.0]["rows"] if r["system"] == row["system"])
            rows.append({"loss": loss, "system": row["system"], "allreduces": rounds, "median_s": row["median_s"],
                         "slowdown": row["median_s"] / base["median_s"], "retransmissions": row["retransmissions"],
                         "dropped_by_nft": point["dropped"],
                         "identical_to_loss_free": point["hashes"][codec] == runs[0.0]["hashes"][codec]})
    emit(rows, as_json, f"{rounds} consecutive allreduces under random loss in both directions",
         [("loss", "loss", ".2f"), ("system", "system", ""), ("allreduces", "allreduces", "d"),
          ("median_s", "median s", ".4f"), ("slowdown", "× loss-free", ".2f"), ("retransmissions", "retx", "d"),
          ("dropped_by_nft", "nft drops (all)", "d"), ("identical_to_loss_free", "bit-identical", "")],
         {"workers": workers, "rate": rate, "elements": elements, "mtu": mtu})
    bad = [r for r in rows if not r["identical_to_loss_free"]]
    if bad:
        raise RuntimeError(f"results under loss differ from the loss-free run: {bad}")
    return rows
