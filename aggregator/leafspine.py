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
from typing import Any

import numpy as np

from intml.aggregator.core import AggregatorCore
from intml.aggregator.counters import EVICTED, CoreCounters
from intml.aggregator.datapath import Placed, Slots, allocate
from intml.aggregator.kernel import KernelDataPath
from intml.aggregator.slots import STAT_NAMES, new_batch, new_jobs, new_table, place_job, row_width
from intml.aggregator.tiers import leaf_burst, new_fabric, new_routes, spine_burst
from intml.protocol.arith import value_bits
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

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        self.routes: dict[int, tuple[int, int, int]] = {}  # job id -> (leaf index, rack bitmap, spine address key)
        self.route = new_routes(self.jobs.active.size)
        self._route_arrays = tuple(self.route)
        self._scratch = np.zeros(1, np.int64)

    def add_route(self, job_id: int, *, leaf: int, ranks: Iterable[int], spine: int) -> None:
        """The controller's entry for ``job_id``: this leaf is leaf ``leaf`` at the spine whose address key is
        ``spine``, and its rack holds ``ranks``. Before the job's first JOIN (its ranks are refused without it)."""
        bits = rack_bitmap(ranks)
        if not bits or not 0 <= leaf < MAX_WORLD:
            raise ValueError(f"a route needs a leaf index in [0, {MAX_WORLD}) and at least one rank")
        if job_id in self.placed:
            raise ValueError(f"job {job_id} already runs on this leaf; add its route before its first JOIN")
        self.routes[job_id] = (leaf, bits, spine)

    def refuse(self, job_id: int, params: JobParams, slots: Slots, rank: int) -> str | None:
        route = self.routes.get(job_id)
        if route is None:
            return f"this leaf has no route to a spine for job {job_id} (the fabric's controller installs it)"
        if not route[1] >> rank & 1:
            return f"rank {rank} is not in this leaf's rack for job {job_id}: join the leaf of its rack"
        if route[1] >> params.world_size:
            return f"this leaf's rack for job {job_id} names ranks beyond world size {params.world_size}"
        if params.data_mac:
            return "a leaf does not carry the DATA/RESULT MAC: join without data_mac"
        if slots != Slots():
            return "a leaf holds all of a job's slots: list only the leaf as the job's aggregator"
        if params.packet_elements > max_partial_elements():
            return (f"packet elements must be at most {max_partial_elements()} under a leaf (its partial sums, "
                    f"4 bytes each, must fit one datagram), got {params.packet_elements}")
        return None

    def place(self, job_id: int, params: JobParams, slots: Slots, data_key: bytes, now: float) -> Placed | str:
        placed = super().place(job_id, params, slots, data_key, now)
        if isinstance(placed, Placed):
            leaf, bits, spine = self.routes[job_id]
            j = placed.index
            self.route.quorum[j] = bin(bits).count("1")
            self.route.rack[j], self.route.spine[j], self.route.leaf[j] = bits, spine, leaf
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


class SpineCore:
    """The aggregator at the spine: one rank per leaf. No control plane of its own: the controller installs and
    removes jobs; it answers nothing but PARTIALs. ``rows``: its slot memory; ``max_elements``: the largest
    packet; ``burst``: the most datagrams a receive burst is expected to hold."""

    def __init__(self, *, rows: int = AGGREGATOR_SLOTS, max_elements: int = AGGREGATOR_MAX_ELEMENTS,
                 max_jobs: int = AGGREGATOR_MAX_JOBS, burst: int = BURST) -> None:
        self.max_elements = max_elements
        self.entries = CoreCounters(max_jobs, rows)  # its job table's ids and flags, slot rows in use, counters
        c = self.entries
        self.jobs = new_jobs(max_jobs)._replace(job_id=c.job_id, active=c.active, stats=c.stats,
                                                core_stats=c.core_stats)
        width = row_width(max_elements)
        self.table = new_table(rows, max_elements, np.zeros((rows, 2, width), np.uint8))
        self.fabric = new_fabric(max_jobs)
        self.placed: dict[int, tuple[int, range]] = {}  # job id -> (job index, slot rows)
        self._args = (tuple(self.jobs), tuple(self.table), tuple(self.fabric), tuple(new_batch(rows, 1)),
                      np.zeros(1, np.int64))
        self._grow(burst)

    def _grow(self, burst: int) -> None:
        self._stage = np.zeros((burst, self.table.result.shape[2]), np.uint8)
        self._out = Burst(self._stage, burst * MAX_WORLD)

    def install(self, job_id: int, params: JobParams, leaves: Sequence[tuple[int, Iterable[int]]]) -> None:
        """The controller's entries for ``job_id``: leaf l is at address key ``leaves[l][0]`` and sums the ranks
        ``leaves[l][1]``; the racks split the job's ranks 0 .. world_size - 1 exactly."""
        n = params.world_size
        racks = [rack_bitmap(ranks) for _, ranks in leaves]
        problem = None
        if job_id in self.placed:
            problem = f"job {job_id} is already installed"
        elif not 1 <= len(leaves) <= MAX_WORLD:
            problem = f"a job needs 1 to {MAX_WORLD} leaves, got {len(leaves)}"
        elif sum(bin(b).count("1") for b in racks) != n or np.bitwise_or.reduce(racks) != (1 << n) - 1:
            problem = f"the racks must split ranks 0..{n - 1} exactly, each rank in one rack"
        elif params.data_mac:
            problem = "a spine does not carry the DATA/RESULT MAC"
        elif not params.packet_elements <= min(self.max_elements, max_partial_elements()):
            problem = f"packet elements must be at most {min(self.max_elements, max_partial_elements())} here"
        found = problem or allocate(self.entries, job_id, params.pool_size, "the spine")
        if isinstance(found, str):
            raise ValueError(found)
        j, rows = found
        place_job(self.jobs, self.table, j, rows, world=len(leaves), value_bits=value_bits(n),
                  packet_elements=params.packet_elements, pool=params.pool_size, codec=int(params.codec),
                  seed=params.seed)
        self.jobs.group[j] = 0
        self.jobs.data_mac[j] = False
        for leaf, ((addr, _), bits) in enumerate(zip(leaves, racks)):
            self.jobs.members[j, leaf] = addr
            self.fabric.racks[j, leaf] = bits
            self.fabric.sizes[j, leaf] = bin(bits).count("1")
        self.placed[job_id] = (j, rows)
        self.entries.start_job(j, job_id)

    def remove(self, job_id: int) -> None:
        """The controller ends the job: its rows and entry are free again."""
        j, rows = self.placed.pop(job_id)
        self.entries.end_job(j, EVICTED)
        self.entries.row_used[rows.start:rows.stop] = False

    def receive(self, rx: Burst, now: float) -> Burst:
        """Handle a receive burst (rows of its own); returns the RESULTs to send (valid until the next call)."""
        if rx.data is None:
            raise ValueError("receive needs a burst with rows of its own (Burst.rows_of)")
        if self._stage.shape[0] < rx.rows:
            self._grow(rx.rows)
        out = self._out
        out.count = spine_burst(rx.data, rx.length, rx.addr, rx.count, now, *self._args, self._stage, out.ptr,
                                out.length, out.addr)
        return out

    def take_replies(self) -> list[tuple[bytes, int]]:
        """A spine has no control plane to answer (the same interface as AggregatorCore)."""
        return []

    def counters(self, job_id: int | None = None) -> dict[str, int]:
        """A job's counters, or (None) the core's: every datagram that named no installed job."""
        cells = self.jobs.core_stats if job_id is None else self.entries.job(self.placed[job_id][0])
        return dict(zip(STAT_NAMES, cells.tolist()))
