"""Evaluating a scenario: each grid point for each system, packet-level where the scenario asks for it and the
system runs on the real cores (intml-cnat8, switchml-int32, up to MAX_WORLD ranks) or, with ``baselines =
"packet"``, over the engine's TCP (gloo-ring, ps-colocated, ps-dedicated; ``sim.collectives``), else the analytic
or flow model."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Iterator

from intml.protocol import codecs
from intml.protocol.job import MAX_WORLD
from intml.sim.collectives import TcpRun, simulate_tcp
from intml.sim.models import SYSTEMS, LeafSpine, Net, largest_packet, leaf_spine_in_network, leaf_spine_ring
from intml.sim.packet_level import PacketRun, simulate
from intml.sim.scenario import PACKET_SYSTEMS, TCP_SYSTEMS, grid, point_params

COLUMNS = ("system", "method", "workers", "racks", "elements", "rate", "uplink_rate", "mtu", "loss", "pool", "time_s",
           "goodput_gbit", "retransmissions")


def evaluate(point: dict, system: str, mode: str) -> dict:
    """One row: the time of one allreduce (the median over ``rounds`` in packet mode) and its goodput (float32
    tensor bytes per second, the application's view)."""
    p = point_params(point)
    row = {"system": system, "workers": p["workers"], "racks": p["racks"], "elements": p["elements"], "rate": p["rate"],
           "uplink_rate": p["uplink_rate"], "mtu": p["mtu"], "loss": p["loss"], "pool": p["pool"], "seed": p["seed"], "retransmissions": 0}
    codec = PACKET_SYSTEMS.get(system)
    if mode == "packet" and codec is not None and p["workers"] <= MAX_WORLD:
        r = simulate(PacketRun(workers=p["workers"], elements=p["elements"], codec=codec, rate=p["rate"],
                               delay=p["delay"], mtu=p["mtu"], queue_bytes=p["queue_bytes"], loss=p["loss"],
                               packet_elements=p["packet_elements"] or None, pool=p["pool"], rounds=p["rounds"],
                               seed=p["seed"], switch=p["switch"], engine=p["engine"], passes=p["passes"],
                               host_costs=p["host_costs"], cpus=p["cpus"], racks=p["racks"],
                               uplink_rate=p["uplink_rate"], uplink_queue=p["uplink_queue"] or None,
                               inputs="shared" if p["elements"] * p["workers"] > 50_000_000 else "distinct"))
        t = sorted(r.times)[len(r.times) // 2]
        row.update(method="packet", time_s=t, retransmissions=r.retransmissions, packet_events=r.packet_events,
                   wall_s=round(r.wall, 3))
    elif mode == "packet" and p["baselines"] == "packet" and system in TCP_SYSTEMS and p["workers"] > 1:
        r = simulate_tcp(TcpRun(workers=p["workers"], elements=p["elements"], algorithm=TCP_SYSTEMS[system],
                                rate=p["rate"], delay=p["delay"], mtu=p["mtu"], queue_bytes=p["queue_bytes"],
                                loss=p["loss"], alpha=p["alpha"], rounds=p["rounds"], seed=p["seed"]))
        t = sorted(r.times)[len(r.times) // 2]
        row.update(method="packet (tcp)", time_s=t, retransmissions=r.retransmissions,
                   packet_events=r.packet_events, wall_s=round(r.wall, 3))
    elif p["racks"] > 1:
        fabric = LeafSpine(p["workers"], p["racks"], p["rate"], p["uplink_rate"], p["delay"], p["mtu"], p["alpha"])
        t = (leaf_spine_in_network(fabric, p["elements"], codecs.BY_NAME[codec].WIDTH, p["packet_elements"] or None,
                                   p["pool"]) if codec else leaf_spine_ring(fabric, p["elements"]))
        row.update(method="analytic" if codec else "flow model", time_s=t)
    else:
        net = Net(p["workers"], p["rate"], p["delay"], p["mtu"], p["alpha"])
        t = SYSTEMS[system](net, p["elements"], p["packet_elements"] or None, p["pool"])
        row.update(method="analytic" if codec else "flow model", time_s=t)
    row["goodput_gbit"] = 4 * p["elements"] * 8 / t / 1e9 if t > 0 else float("inf")
    return row


def rows(s: dict, progress: Callable[[int, int], None] | None = None) -> Iterator[dict]:
    points = [(pt, system) for pt in grid(s) for system in s["systems"]]
    for i, (pt, system) in enumerate(points):
        yield evaluate(pt, system, s["mode"])
        if progress:
            progress(i + 1, len(points))


class Progress:
    """A bar on stderr, shown once a run has lasted ``after`` seconds."""

    def __init__(self, after: float = 2.0) -> None:
        self.start, self.after, self.shown = time.monotonic(), after, False

    def __call__(self, done: int, total: int) -> None:
        if time.monotonic() - self.start < self.after:
            return
        self.shown = True
        filled = 30 * done // total
        sys.stderr.write(f"\r[{'#' * filled}{' ' * (30 - filled)}] {done}/{total}")
        if done == total:
            sys.stderr.write("\n")
        sys.stderr.flush()


