"""Sans-I/O cores of two-level aggregation (docs/protocol.md, "Leaf-spine"): a leaf core (``leaf_core``), a rack
switch's aggregator, and ``SpineCore``, the switch above the leaves. Their data paths are aggregator.tiers' kernels.

The ranks see only their leaf: they join it as they would one aggregator (the same handshake, the job's whole
world size, so every rank encodes against s(n) of the whole job), send it their DATA and get their RESULTs from
it. A leaf is an AggregatorCore (the handshake, membership, statistics) whose data path is a ``LeafDataPath``
(``leaf_core`` builds one). What the ranks do not set up, the fabric's controller does, as a switch's control
plane installs table entries: it tells each leaf, per job, its index at the spine, the ranks of its rack and the
spine's address (``LeafDataPath.add_route``), and the spine the job's parameters and each leaf's address and rack
(``SpineCore.install``). A partial is accepted only from the leaf address installed for its index.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from functools import reduce
from operator import or_
from typing import Any

import numpy as np

from intml.aggregator.core import AggregatorCore
from intml.aggregator.counters import EVICTED
from intml.aggregator.datapath import Placed, Slots, host_refusal, one_tenant_per_id, wire_job
from intml.aggregator.kernel import KernelDataPath
from intml.aggregator.tiers import leaf_burst, new_fabric, new_routes, spine_burst
from intml.protocol.burst import Burst
from intml.protocol.job import (
    AGGREGATOR_MAX_ELEMENTS,
    AGGREGATOR_MAX_JOBS,
    AGGREGATOR_SLOTS,
    BURST,
    MAX_WORLD,
    JobParams,
)
from intml.protocol.partial import max_partial_elements
from intml.protocol.stats import STAT_NAMES


def rack_bitmap(ranks: Iterable[int]) -> int:
    """The contributors bitmap of a rack: bit r for each rank r (each below MAX_WORLD)."""
    bits = 0
    for r in ranks:
        if not 0 <= r < MAX_WORLD:
            raise ValueError(f"a rank must be in [0, {MAX_WORLD}), got {r}")
        bits |= 1 << r
    return bits


class LeafDataPath(KernelDataPath):
    """The data path of an aggregator core at a rack's switch: a job's round completes when the rack's ranks have
    contributed, and its int32 partial sum goes up to the spine; the spine's result comes back through it.
    Options as KernelDataPath's; it holds every slot of its jobs (its core is its aggregator's only one)."""

    marks = True  # the spine's results go on to the ranks with the marks they came with (aggregator.tiers)

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        self.routes: dict[int, tuple[int, int, int, float]] = {}  # job id -> (leaf index, rack bitmap, spine, hold)
        self.route = new_routes(self.jobs.active.size, self.table.result.shape[0])
        self._route_arrays = tuple(self.route)
        self._scratch = np.zeros(1, np.int64)

    def add_route(self, job_id: int, *, leaf: int, ranks: Iterable[int], spine: int,
                  hold: float = 0.0) -> None:
        """The controller's entry for ``job_id``: this leaf is leaf ``leaf`` at the spine whose address key is
        ``spine``, and its rack holds ``ranks``. Before the job's first JOIN (its ranks are refused without it).
        ``hold``: seconds a partial sent up again answers the rack's other duplicates of its round (docs/window.md,
        "One partial per wave of duplicates"; 0: each duplicate sends it, the default while 1% random loss
        measured slower with a hold)."""
        bits = rack_bitmap(ranks)
        if not bits or not 0 <= leaf < MAX_WORLD:
            raise ValueError(f"a route needs a leaf index in [0, {MAX_WORLD}) and at least one rank")
        if not hold >= 0:
            raise ValueError(f"a route's hold must be a duration of at least 0 s, got {hold}")
        if any(wire_job(k) == job_id for k in self.placed):
            raise ValueError(f"job {job_id} already runs on this leaf; add its route before its first JOIN")
        self.routes[job_id] = (leaf, bits, spine, hold)

    def refuse(self, job: int, params: JobParams, slots: Slots, rank: int) -> str | None:
        job_id = wire_job(job)
        route = self.routes.get(job_id)
        if route is None:
            return f"this leaf has no route to a spine for job {job_id} (the fabric's controller installs it)"
        if not route[1] >> rank & 1:
            return f"rank {rank} is not in this leaf's rack for job {job_id}: join the leaf of its rack"
        if route[1] >> params.world_size:
            return f"this leaf's rack for job {job_id} names ranks beyond world size {params.world_size}"
        if params.data_mac:
            return "a leaf does not carry the DATA/RESULT MAC: join without data_mac"
        if problem := host_refusal(params, self.name):
            return problem
        # the controller routes a job id, and the spine's RESULT names only the id
        if problem := one_tenant_per_id(self.placed, job, self.name):
            return problem
        if slots != Slots():
            return "a leaf holds all of a job's slots: list only the leaf as the job's aggregator"
        if params.packet_elements > max_partial_elements():
            return (f"packet elements must be at most {max_partial_elements()} under a leaf (its partial sums, "
                    f"4 bytes each, must fit one datagram), got {params.packet_elements}")
        return None

    def place(self, job: int, params: JobParams, slots: Slots, data_key: bytes, now: float) -> Placed | str:
        placed = super().place(job, params, slots, data_key, now)
        if isinstance(placed, Placed):
            leaf, bits, spine, hold = self.routes[wire_job(job)]
            j = placed.index
            self.route.quorum[j] = bin(bits).count("1")
            self.route.rack[j], self.route.spine[j], self.route.leaf[j], self.route.hold[j] = bits, spine, leaf, hold
        return placed

    def run(self, rx: Burst, now: float, out: Burst) -> tuple[int, int]:
        return leaf_burst(rx.data, rx.length, rx.addr, rx.count, now, *self.kernel_tables, self._route_arrays,
                          self._scratch, self.spill, out.ptr, out.length, out.addr, self.control, self.limiter)


def leaf_core(*, rows: int = AGGREGATOR_SLOTS, max_elements: int = AGGREGATOR_MAX_ELEMENTS,
              max_jobs: int = AGGREGATOR_MAX_JOBS, burst: int = BURST, results_group: tuple[int, int] | None = None,
              **options: Any) -> AggregatorCore:
    """An aggregator core at a rack's switch (one core: its aggregator's only one) with a LeafDataPath (its
    ``datapath``, where the controller adds routes). ``options``: AggregatorCore's."""
    return AggregatorCore(LeafDataPath(rows=rows, max_elements=max_elements, max_jobs=max_jobs, burst=burst,
                                       results_group=results_group, name="this leaf"), **options)


class SpineCore(KernelDataPath):
    """The aggregator at the spine: a data path (aggregator.datapath) with one rank per leaf, and no control plane
    of its own: the fabric's controller drives it (``install``, ``remove``); it answers nothing but PARTIALs.
    ``rows``: its slot memory; ``max_elements``: the largest packet; ``burst``: the most datagrams a receive
    burst is expected to hold."""

    marks = True  # its results echo the marks of the leaves' partials (aggregator.tiers)

    def __init__(self, *, rows: int = AGGREGATOR_SLOTS, max_elements: int = AGGREGATOR_MAX_ELEMENTS,
                 max_jobs: int = AGGREGATOR_MAX_JOBS, burst: int = BURST) -> None:
        super().__init__(rows=rows, max_elements=max_elements, max_jobs=max_jobs, burst=burst, name="the spine")
        self.racks: dict[int, list[int]] = {}  # job id -> each leaf's rack bitmap
        self.fabric = new_fabric(max_jobs, rows)
        self._fabric_arrays = tuple(self.fabric)
        self._scratch = np.zeros(1, np.int64)

    # ---- the controller's side ------------------------------------------------------------------------------
    def install(self, job_id: int, params: JobParams, leaves: Sequence[tuple[int, Iterable[int]]]) -> None:
        """The controller's entries for ``job_id``: leaf l is at address key ``leaves[l][0]`` and sums the ranks
        ``leaves[l][1]``; the racks split the job's ranks 0 .. world_size - 1 exactly."""
        if job_id in self.placed:
            raise ValueError(f"job {job_id} is already installed")
        self.racks[job_id] = [rack_bitmap(ranks) for _, ranks in leaves]
        placed = self.refuse(job_id, params, Slots(), 0) or self.place(job_id, params, Slots(), bytes(16), 0.0)
        if isinstance(placed, str):
            del self.racks[job_id]
            raise ValueError(placed)
        for leaf, (addr, _) in enumerate(leaves):
            self.seat(job_id, leaf, addr, 0.0)
        self.counters.start_job(placed.index, job_id)

    def uninstall(self, job_id: int) -> None:
        """The controller ends the job: its rows and entry are free again."""
        self.counters.end_job(self.placed[job_id].index, EVICTED)
        self.remove(job_id)

    def receive(self, rx: Burst, now: float) -> Burst:
        """Handle a receive burst (rows of its own); returns the RESULTs to send (valid until the next call)."""
        return self.process(rx, now)[0]

    def take_replies(self) -> list[tuple[bytes, int]]:
        """A spine has no control plane to answer (the same interface as AggregatorCore)."""
        return []

    def job_counters(self, job_id: int | None = None) -> dict[str, int]:
        """A job's counters, or (None) the core's: every datagram that named no installed job."""
        cells = self.jobs.core_stats if job_id is None else self.counters.job(self.placed[job_id].index)
        return dict(zip(STAT_NAMES, cells.tolist()))

    # ---- aggregator.datapath.DataPath (the rank of a spine's job is a leaf) -------------------------------------
    def refuse(self, job_id: int, params: JobParams, slots: Slots, rank: int) -> str | None:
        racks, n = self.racks.get(job_id, []), params.world_size
        if not 1 <= len(racks) <= MAX_WORLD:
            return f"a job needs 1 to {MAX_WORLD} leaves, got {len(racks)}"
        if sum(bin(b).count("1") for b in racks) != n or reduce(or_, racks) != (1 << n) - 1:  # (Python ints: 64 bits)
            return f"the racks must split ranks 0..{n - 1} exactly, each rank in one rack"
        if params.data_mac:
            return "a spine does not carry the DATA/RESULT MAC"
        if not params.packet_elements <= min(self.max_elements, max_partial_elements()):
            return f"packet elements must be at most {min(self.max_elements, max_partial_elements())} here"
        return None

    def contributors(self, job_id: int, params: JobParams) -> int:
        return len(self.racks[job_id])  # one PARTIAL per leaf

    def place(self, job_id: int, params: JobParams, slots: Slots, data_key: bytes, now: float) -> Placed | str:
        placed = super().place(job_id, params, slots, data_key, now)
        if isinstance(placed, Placed):
            for leaf, bits in enumerate(self.racks[job_id]):
                self.fabric.racks[placed.index, leaf] = bits
                self.fabric.sizes[placed.index, leaf] = bin(bits).count("1")
        return placed

    def remove(self, job_id: int) -> None:
        super().remove(job_id)
        del self.racks[job_id]

    def run(self, rx: Burst, now: float, out: Burst) -> tuple[int, int]:
        """spine_burst, its outputs staged in the spill rows (a spine admits no control datagram)."""
        return spine_burst(rx.data, rx.length, rx.addr, rx.count, now, *self.kernel_tables, self._fabric_arrays,
                           self.batch, self._scratch, self.spill, out.ptr, out.length, out.addr), 0
