"""The codec comparison's simulated side: time per training step for each codec at scale, from the analytic
models, and accuracy against wall time.

A codec is a name: ``gloo`` (Gloo's ring, float32), a switch codec (``cnat8``, ``int32``: in-network, bounded by
the workers' CPU as in ``sim.training``), or a host codec (``uniform8``, ``adaptive-huffman``...: the aggregator's
host mode). Each codec's exchange of N elements:

* gloo: ``sim.models.ring``;
* cnat8, int32: ``sim.training.in_network_cpu``, the tuner's own model of them;
* auto: the online tuner (worker/tuner.py) replayed at the setting (``sim.tuning.settled``: Gaussian statistics
  of the run's batch per rank, a switch for cnat8 and int32, the compared codecs as its candidates, since a host
  codec's bits are the measured ones, and ``COSTS``, which price the fixed rows); each DDP bucket costs what the
  codec it settles on costs, and each step the tuner's measuring (``measuring_seconds``);
* a host codec: dedicated host-mode aggregators (one per ``HOST_AGGREGATORS_PER_WORKERS`` workers, each on its own
  link at the workers' rate) that each receive their share of every worker's packages and send every worker its
  share of the result. Its wire bits per parameter each way are the testbed's measurement (packages and headers
  up; the codec's RESULT down, float32 unless the codec sends less). The time is the slowest of the busiest link
  (a worker's, or an aggregator's n/k times a worker's bytes), the worker's CPU (encode, decode the result, a
  datagram each way per packet) and the aggregator's (decode n/k contributions per element and handle each
  package, on its cores), plus a round trip (``sim.costs`` and ``worker.costs`` name every constant's source).

A step: with DDP, ``sim.training.iteration`` (buckets overlapped with backward); with model averaging, the compute
plus one exchange of all parameters every ``steps_per_epoch`` steps. Accuracy against wall time is the MEASURED
accuracy after each epoch (the digits run) placed at the SIMULATED time that epoch ends: the simulated model's
step time times the measured run's steps per epoch. It says when that curve would be reached if the larger model
learned per epoch as the digits model did; it is not a simulation of learning.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from intml.protocol.job import CODEC_NAMES, JobParams
from intml.sim import tuning
from intml.sim.costs import HOST_AGGREGATOR_CORES, HOST_AGGREGATORS_PER_WORKERS, RESULT_FLOAT32, host_codec_costs
from intml.sim.models import Net, ring
from intml.sim.output import pyplot
from intml.sim.training import PROFILES, SENDMMSG_COSTS, buckets, in_network_cpu, iteration
from intml.worker.costs import HOST_PACKAGE, MEASURE
from intml.worker.tuner import Decision, Network

PARALLEL = ("average", "ddp")
COLUMNS = ("setting", "codec", "up_bits_per_parameter", "down_bits_per_parameter", "step_s", "final_accuracy",
           "epochs_to_target", "time_to_target_s", "choice")
HOW = ("simulated step times (sim.compare: the measured bits per parameter, sim.costs' host costs; auto's choice: "
       "the tuner replayed at the setting); the accuracy is the measured digits run's per epoch, placed at the "
       "simulated epoch times")
HOST_PACKET_ELEMENTS = JobParams.packet_elements  # a host codec's elements per packet: its datagrams' count
AUTO = "auto"
COSTS = SENDMMSG_COSTS  # every codec's and the tuner's: a datagram through sendmmsg (the testbed's calibration)
STYLES = {"gloo": {"color": "black", "linewidth": 2.2}, AUTO: {"color": "red", "linewidth": 2.2, "linestyle": "--"}}


def host_exchange(codec: str, net: Net, elements: int, up_bits: float, down_bits: float) -> float:
    """One host-mode allreduce of ``elements`` (see the module's docstring)."""
    n = net.workers
    aggregators = max(1, n // HOST_AGGREGATORS_PER_WORKERS)
    up, down = elements * up_bits / 8, elements * down_bits / 8
    busiest = max(up, down, n / aggregators * max(up, down))
    cost = host_codec_costs(codec)
    packets = math.ceil(elements / HOST_PACKET_ELEMENTS)
    worker = elements * (cost.encode + RESULT_FLOAT32) + 2 * packets * COSTS.datagram_io
    aggregator = (n / aggregators * (elements * cost.decode + packets * (2 * COSTS.datagram_io + HOST_PACKAGE))
                  / HOST_AGGREGATOR_CORES)
    return max(busiest * 8 / net.rate, worker, aggregator) + net.rtt


def exchange_seconds(codec: str, net: Net, elements: int, up_bits: float, down_bits: float) -> float:
    """One allreduce of ``elements`` float32 values under ``codec``."""
    if codec == "gloo":
        return ring(net, elements)
    if codec in CODEC_NAMES:
        return in_network_cpu(net, elements, codec, COSTS)
    return host_exchange(codec, net, elements, up_bits, down_bits)


def step_seconds(codec: str, parallel: str, net: Net, parameters: int, compute: float, steps_per_epoch: int,
                 up_bits: float, down_bits: float) -> float:
    """One training step's time: DDP's overlapped iteration, or the compute plus an averaging's share."""
    if parallel == "ddp":
        return iteration(parameters, compute, lambda n: exchange_seconds(codec, net, n, up_bits, down_bits))
    return compute + exchange_seconds(codec, net, parameters, up_bits, down_bits) / steps_per_epoch


def auto_decision(inputs: dict[str, dict], net: Net, parameters: int, compute: float, batch: int) -> Decision:
    """The tuner's settled decision over the DDP buckets at this setting (the module's docstring)."""
    candidates = tuple(c for c in inputs if c != AUTO)
    aggregators = max(1, net.workers // HOST_AGGREGATORS_PER_WORKERS)  # host mode's, as host_exchange has them
    network = Network(rtt=net.rtt, mtu=net.mtu, aggregator_cores=aggregators * HOST_AGGREGATOR_CORES,
                      aggregator_link_rate=aggregators * net.rate)
    return tuning.settle(buckets(parameters), compute, net.workers, net.rate, network=network, candidates=candidates,
                         batch=batch, costs=COSTS)


def measuring_seconds(parameters: int, every: int) -> float:
    """The tuner's own cost per step: ``measure`` of every parameter at one step in ``every``, on the rank's CPU
    (worker.costs.MEASURE); the statistics' allreduce, a few dozen float64 per bucket, is left out."""
    return parameters * MEASURE / every


def auto_step(chosen: list[str], inputs: dict[str, dict], net: Net, parameters: int, compute: float,
              every: int) -> tuple[float, float, float]:
    """DDP's iteration with each bucket through its ``chosen`` codec plus the tuner's measuring, and the bits per
    parameter each way (the buckets' weighted by their elements)."""
    sizes = buckets(parameters)
    bits = [(inputs[c]["up_bits"], inputs[c]["down_bits"]) for c in chosen]
    times = iter(exchange_seconds(c, net, n, up, down) for c, n, (up, down) in zip(chosen, sizes, bits))
    step = iteration(parameters, compute, lambda n: next(times)) + measuring_seconds(parameters, every)
    return (step, sum(n * up for n, (up, _) in zip(sizes, bits)) / parameters,
            sum(n * down for n, (_, down) in zip(sizes, bits)) / parameters)


def profile(model: str, measured_parameters: int, measured_compute: float) -> tuple[int, float]:
    """(parameters, compute seconds per step) of a model: ``digits`` is the measured run's own, the others
    ``sim.training.PROFILES``."""
    if model == "digits":
        return measured_parameters, measured_compute
    if model not in PROFILES:
        raise ValueError(f"unknown model {model!r}: digits or one of {', '.join(PROFILES)}")
    return PROFILES[model]


def epochs_to(accuracy: Sequence[float], target: float) -> int | None:
    """The first epoch (1-based) whose test accuracy is >= target, or None."""
    return next((e + 1 for e, a in enumerate(accuracy) if a >= target), None)


def wall_curve(epoch_seconds: Sequence[float]) -> list[float]:
    """The wall time at which each epoch ends."""
    total, out = 0.0, []
    for seconds in epoch_seconds:
        total += seconds
        out.append(total)
    return out


def summary(codec: str, accuracy: Sequence[float], epoch_seconds: Sequence[float], step_s: float, target: float,
            up_bits: float, down_bits: float) -> dict:
    """One codec's row of a setting: bits each way, time per step, final accuracy, the epoch and the wall time
    the accuracy first reaches ``target`` (None: never), and the curve (wall seconds, accuracy) for the plot."""
    if len(accuracy) != len(epoch_seconds) or not accuracy:
        raise ValueError(f"{codec}: {len(accuracy)} accuracies for {len(epoch_seconds)} epoch times")
    wall = wall_curve(epoch_seconds)
    reach = epochs_to(accuracy, target)
    return {"codec": codec, "up_bits_per_parameter": up_bits, "down_bits_per_parameter": down_bits, "step_s": step_s,
            "final_accuracy": accuracy[-1], "epochs_to_target": reach,
            "time_to_target_s": None if reach is None else wall[reach - 1],
            "curve": [[w, a] for w, a in zip(wall, accuracy)]}


def setting(inputs: dict[str, dict], model: str, workers: int, rate: float, compute_s: float, parallel: str,
            target: float, mtu: int = 9000, batch: int = tuning.BATCH, tuner_every: int = 1) -> dict:
    """A simulated setting: each codec's step at ``workers`` workers of ``rate`` bit/s, times the measured run's
    steps per epoch, and the measured accuracy curve on that clock. ``inputs``: per codec, the measured
    ``accuracy`` per epoch, ``up_bits`` and ``down_bits`` per parameter, ``parameters`` and ``steps_per_epoch``
    (``intml-testbed compare --json``'s "inputs"); ``compute_s``: the measured model's compute per step; ``batch``:
    the run's batch per rank (auto's statistics); ``tuner_every``: the steps per measured step (INTML_TUNER_EVERY)."""
    rows = []
    net = Net(workers, rate, mtu=mtu)
    for codec, m in inputs.items():
        parameters, compute = profile(model, m["parameters"], compute_s)
        if codec == AUTO:
            if parallel != "ddp":
                raise ValueError("auto runs in the DDP hook: its comparison needs parallel ddp")
            chosen = [c.codec for c in auto_decision(inputs, net, parameters, compute, batch).choices.values()]
            step, up, down = auto_step(chosen, inputs, net, parameters, compute, tuner_every)
        else:
            up, down = m["up_bits"], m["down_bits"]
            step = step_seconds(codec, parallel, net, parameters, compute, m["steps_per_epoch"], up, down)
        epochs = [step * m["steps_per_epoch"]] * len(m["accuracy"])
        rows.append(summary(codec, m["accuracy"], epochs, step, target, up, down))
        if codec == AUTO:
            rows[-1]["choice"] = tuning.summary(chosen)
    return {"setting": f"sim {model} {rate / 1e9:g}gbit x{workers}",
            "kind": "simulated step times; the measured accuracy per epoch on that clock", "rows": rows}


def plot(settings: list[dict], path: str, target: float, title: str) -> None:
    """Accuracy against wall time, one panel per setting, one line per codec (gloo black, auto red and dashed)."""
    plt = pyplot()
    from matplotlib.ticker import NullFormatter

    columns = min(3, len(settings))
    rows = -(-len(settings) // columns)
    fig, axes = plt.subplots(rows, columns, figsize=(4.6 * columns, 3.6 * rows), squeeze=False)
    for ax, s in zip(axes.flat, settings):
        for r in s["rows"]:
            style = STYLES.get(r["codec"], {"linewidth": 1.3})
            ax.plot([w for w, _ in r["curve"]], [100 * a for _, a in r["curve"]], label=r["codec"], **style)
        ax.axhline(100 * target, color="grey", linestyle=":", linewidth=1)
        lowest = min(100 * a for r in s["rows"] for _, a in r["curve"])
        ax.set(title=s["setting"], xlabel="wall time (s)", ylabel="test accuracy (%)",
               ylim=(max(0, min(80, lowest - 2)), 100))
        ax.set_xscale("log")
        ax.xaxis.set_minor_formatter(NullFormatter())  # labels at the decades only: the 2x10^-1... ones overlap
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(settings):]:
        ax.set_visible(False)
    axes[0][0].legend(fontsize=7, loc="lower right")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
