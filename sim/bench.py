"""``intml-sim bench``: packet events per second of wall time and per second of this process's CPU time (the
machine may be shared), with the real cores in the loop and with the engine alone (the same links and switch, an
aggregator that completes a slot when all n packets arrived, and hosts that keep a window of packets in flight,
with no protocol work), so the two can be told apart; ``of_engine`` is a row's rate per CPU-second over the engine
alone's in the same run."""

from __future__ import annotations

import time

from intml.sim.engine import Datagram, Simulator
from intml.sim.network import Link, Switch, SwitchCosts
from intml.sim.packet_level import PacketRun, simulate

AGG = 1 << 16


class CountingAggregator:
    """The engine-alone aggregator: a slot's round completes when n datagrams for it arrived (its first byte)."""

    def __init__(self, n: int, group: int) -> None:
        self.addrs, self.n, self.group = [AGG], n, group
        self.seen: dict[int, int] = {}

    def receive(self, datagrams: list[Datagram], now: float) -> list[Datagram]:
        out = []
        for payload, _, _ in datagrams:
            s = payload[0]
            got = self.seen.get(s, 0) + 1
            if got == self.n:
                got = 0
                out.append((payload, AGG, self.group))
            self.seen[s] = got
        return out

    def elements(self, datagrams: list[Datagram]) -> int:
        return 0


class WindowHost:
    """Sends one packet per slot, the next when the slot's result is back, ``rounds`` times."""

    def __init__(self, addr: int, rounds: int, size: int) -> None:
        self.addr, self.rounds, self.size = addr, rounds, size
        self.left: dict[int, int] = {}
        self.uplink: Link | None = None

    def start(self, window: int, now: float) -> None:
        for s in range(window):
            self.left[s] = self.rounds - 1
            self.uplink.send((bytes([s]) * self.size, self.addr, AGG), now)

    def arrive(self, datagrams: list[Datagram], now: float) -> None:
        for payload, _, _ in datagrams:
            s = payload[0]
            if self.left[s] > 0:
                self.left[s] -= 1
                self.uplink.send((payload, self.addr, AGG), now)


def engine_alone(workers: int = 64, window: int = 64, rounds: int = 300, size: int = 1472,
                 rate: float = 10e9) -> dict:
    sim = Simulator()
    group = 2 << 16
    switch = Switch(sim, CountingAggregator(workers, group), SwitchCosts())
    hosts = []
    for r in range(workers):
        h = WindowHost((r + 10) << 16, rounds, size)
        h.uplink = Link(sim, switch, rate=rate, delay=1e-6)
        switch.attach(h.addr, Link(sim, h, rate=rate, delay=1e-6))
        hosts.append(h)
    switch.groups[group] = [h.addr for h in hosts]
    for h in hosts:
        h.start(window, 0.0)
    wall, cpu = time.perf_counter(), time.process_time()
    sim.run()
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    return {"what": "engine alone", "packet_events": sim.packet_events, "loop_s": wall, "loop_cpu_s": cpu,
            "cpu_s": cpu, "events_per_s": sim.packet_events / wall, "events_per_cpu_s": sim.packet_events / cpu,
            "virtual_s": sim.now}


def real_cores(workers: int = 64, elements: int = 25_000_000, rate: float = 10e9) -> dict:
    """The cores' kernels are compiled (or loaded from Numba's cache) by a small run first, so that the loop's
    time is the simulation's; ``loop_cpu_s`` is the process's CPU time in the loop, ``cpu_s`` in the whole run
    (setup and the inputs included)."""
    simulate(PacketRun(workers=workers, elements=100_000, rate=rate, inputs="shared"))
    cpu = time.process_time()
    r = simulate(PacketRun(workers=workers, elements=elements, rate=rate, inputs="shared"))
    cpu = time.process_time() - cpu
    return {"what": f"real cores, {workers} x {elements} cnat8", "packet_events": r.packet_events,
            "loop_s": r.loop, "loop_cpu_s": r.loop_cpu, "wall_s": r.wall, "cpu_s": cpu,
            "events_per_s": r.packet_events / r.loop, "events_per_cpu_s": r.packet_events / r.loop_cpu,
            "virtual_s": r.times[0]}


COLUMNS = ("what", "packet_events", "loop_s", "loop_cpu_s", "events_per_s", "events_per_cpu_s", "of_engine",
           "virtual_s")


def table(workers: int = 64, elements: int = 25_000_000) -> list[dict]:
    """The engine alone, then the real cores, each with its rate per CPU-second over the engine alone's."""
    rows = [engine_alone(workers), real_cores(workers, elements)]
    for row in rows:
        row["of_engine"] = row["events_per_cpu_s"] / rows[0]["events_per_cpu_s"]
    return rows
