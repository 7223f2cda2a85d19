"""Validation: replay ``intml-testbed bench cluster --json`` points in the simulator and compare.

Calibrated once (``CALIBRATION``) and not fitted per point: the hosts' and the software aggregator's costs are
``sim.costs``'s (from the codec and burst I/O benchmarks); a veth pair plus ``tc tbf`` is modelled as a 20 us
one-way delay; Gloo's ring runs as Gloo does (1 MB segments, ready notices) over the engine's TCP
(``sim.collectives``) with a 20 us latency per segment received and the testbed kernel's congestion control,
BBR (its ``net.ipv4.tcp_congestion_control``; ``sim.tcp``). The testbed runs every rank, the aggregator and the kernel's forwarding on one 2-CPU machine: ``cpus`` (default
``TESTBED_CPUS``) replays it so, each sender paying ``sim.costs.KERNEL_FORWARD`` per datagram copy (0: every host
its own CPU, no forwarding). A point is called link-bound when the testbed's own ``link_use`` (wire bytes per
second over the rate) is at least 0.85; the 10% target applies to those. A lossy point is predicted as the median
of ``lossy_seeds`` x ``lossy_rounds`` simulated allreduces (the testbed's rows are medians of their rounds).

``implied_rtt_ms`` (intml rows): the round trip at which the pool alone would give the measured time (pool x time
/ chunks per rank): a window-bound allreduce moves ``pool`` datagrams per round trip. Where it is far above the
model's round trip, what slows the testbed is latency per round trip, not CPU work (docs/benchmarks.md,
"intml-sim against the testbed").
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Callable

from intml.sim.collectives import TcpRun, simulate_tcp
from intml.sim.costs import KERNEL_FORWARD, TESTBED_CPUS
from intml.sim.models import largest_packet
from intml.sim.output import pyplot
from intml.sim.packet_level import PacketRun, simulate
from intml.sim.scenario import ScenarioError, parse_rate

CALIBRATION = {"delay_s": 20e-6, "ring_alpha_s": 20e-6, "switch": "software", "host_costs": "sim.costs",
               "kernel_forward_s": KERNEL_FORWARD, "link_bound_if_link_use_at_least": 0.85,
               "tcp_congestion": "bbr", "lossy_seeds": 3, "lossy_rounds": 3}
COLUMNS = ("system", "workers", "rate", "mtu", "loss", "measured_s", "predicted_s", "error", "bottleneck", "method",
           "cpus", "implied_rtt_ms")
CODECS = {"intml cnat8": "cnat8", "intml int32": "int32"}


def load(path: str) -> dict:
    try:
        with open(path) as f:
            data = json.load(f)
    except OSError as exc:
        raise ScenarioError(f"cannot read {path}: {exc.strerror}") from None
    except json.JSONDecodeError as exc:
        raise ScenarioError(f"{path} is not JSON: {exc}") from None
    if not isinstance(data, dict) or not isinstance(data.get("rows"), list):
        raise ScenarioError(f"{path} is not `intml-testbed bench cluster --json` output (no rows)")
    return data


def predict(row: dict, pool: int, cpus: int = TESTBED_CPUS) -> tuple[float, str]:
    """The simulated allreduce time for a testbed row: one allreduce when loss-free (deterministic), else the
    median of ``lossy_seeds`` seeds x ``lossy_rounds`` consecutive allreduces, as the testbed's row is a median
    of its rounds (under loss one simulated allreduce varies by a factor of 3 from seed to seed)."""
    rate = parse_rate(row["rate"])
    codec = CODECS.get(row["system"])
    loss = row.get("loss", 0.0)
    seeds, rounds = (CALIBRATION["lossy_seeds"], CALIBRATION["lossy_rounds"]) if loss > 0 else (1, 1)
    times = []
    for seed in range(1, seeds + 1):
        if codec is None:  # gloo ring, over the engine's TCP
            r = simulate_tcp(TcpRun(workers=row["workers"], elements=row["elements"], algorithm="ring", rate=rate,
                                    delay=CALIBRATION["delay_s"], mtu=row["mtu"], loss=loss,
                                    alpha=CALIBRATION["ring_alpha_s"], congestion=CALIBRATION["tcp_congestion"],
                                    rounds=rounds, seed=seed))
        else:
            r = simulate(PacketRun(workers=row["workers"], elements=row["elements"], codec=codec, rate=rate,
                                   delay=CALIBRATION["delay_s"], mtu=row["mtu"], loss=loss, pool=pool,
                                   switch="software", multicast=row.get("results", "multicast") == "multicast",
                                   inputs="shared", cpus=cpus, forward_cost=KERNEL_FORWARD, rounds=rounds,
                                   seed=seed))
        times += r.times
    return statistics.median(times), "packet (tcp)" if codec is None else "packet"


def compare(data: dict, progress: Callable[[int, int], None] | None = None, cpus: int = TESTBED_CPUS) -> list[dict]:
    out = []
    rows = data["rows"]
    pool = data.get("pool", 64)
    for i, row in enumerate(rows):
        try:
            predicted, method = predict(row, pool, cpus)
            measured = float(row["median_s"])
            link = float(row.get("link_use", 0.0))
        except (KeyError, TypeError, ValueError) as exc:
            raise ScenarioError(f"testbed row {i} lacks or garbles a field: {exc}") from None
        out.append({"system": row["system"], "workers": row["workers"], "rate": row["rate"], "mtu": row["mtu"],
                    "loss": row.get("loss", 0.0), "measured_s": measured, "predicted_s": predicted,
                    "error": predicted / measured - 1,
                    "bottleneck": "link" if link >= CALIBRATION["link_bound_if_link_use_at_least"] else "cpu",
                    "method": method, "cpus": cpus if method == "packet" else "",
                    "implied_rtt_ms": implied_rtt(row, pool, measured) * 1e3 if method == "packet" else ""})
        if progress:
            progress(i + 1, len(rows))
    return out


def implied_rtt(row: dict, pool: int, measured: float) -> float:
    """The round trip (s) at which ``pool`` datagrams per round trip take ``measured`` for a rank's chunks."""
    width = 1 if CODECS[row["system"]] == "cnat8" else 4
    chunks = -(-row["elements"] // largest_packet(width, row["mtu"]))
    return pool * measured / chunks


def plot(rows: list[dict], path: str) -> None:
    """Predicted against measured, one marker per system, the diagonal and the 10% band."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(5.6, 5.0))
    top = max(max(r["measured_s"], r["predicted_s"]) for r in rows) * 1.2
    low = min(min(r["measured_s"], r["predicted_s"]) for r in rows) / 1.2
    ax.plot([low, top], [low, top], color="gray", lw=1)
    ax.fill_between([low, top], [low * 0.9, top * 0.9], [low * 1.1, top * 1.1], color="gray", alpha=0.15,
                    label="±10%")
    for system in dict.fromkeys(r["system"] for r in rows):
        for kind, marker in (("link", "o"), ("cpu", "x")):
            pts = [r for r in rows if r["system"] == system and r["bottleneck"] == kind]
            if pts:
                ax.scatter([r["measured_s"] for r in pts], [r["predicted_s"] for r in pts], marker=marker,
                           label=f"{system} ({kind}-bound)")
    ax.set(xscale="log", yscale="log", xlabel="measured s (testbed)", ylabel="predicted s (intml-sim)",
           title="validation against the netns testbed")
    ticks = [t for t in (0.05, 0.1, 0.2, 0.3, 0.5, 1, 2, 3, 5, 10) if low <= t <= top]
    for axis in (ax.xaxis, ax.yaxis):  # plain labels at round values (log-axis minor labels overlap)
        axis.set_minor_formatter(plt.NullFormatter())
        axis.set_ticks(ticks, [f"{t:g}" for t in ticks])
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


