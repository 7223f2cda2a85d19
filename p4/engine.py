"""``intml-aggregator --engine p4model``: an aggregator core whose data path (aggregator.datapath) is the P4
pipeline model instead of the Numba burst kernel. The control plane (handshake, membership, teardown, statistics)
is the core's own. As a switch's controller would, ``P4DataPath`` writes the per-job table entries
(p4.controller) when a job is placed, a rank takes its seat or the job ends; the model's registers are the slot
state the control plane reads, and the model counts into the core's counters, so STATS works as with the
kernel. Slow (Python per packet), bit-identical to the kernel engine with ``KeyedRandom``.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import numpy as np

from intml.aggregator.core import AggregatorCore
from intml.aggregator.counters import CoreCounters
from intml.aggregator.datapath import (
    Placed,
    RoundState,
    Slots,
    allocate,
    check_results_group,
    group_of,
    host_refusal,
    one_tenant_per_id,
    wire_job,
)
from intml.aggregator.kernel import read_only
from intml.p4.controller import switch_job
from intml.p4.entries import SwitchJob, job_entries, static_entries
from intml.p4.extern import KeyedRandom, RandomSource
from intml.p4.layout import MAX_JOBS, MAX_WORLD, ROWS, refusal
from intml.p4.model import PipelineModel
from intml.protocol.burst import Burst
from intml.protocol.job import (
    AGGREGATOR_MAX_ELEMENTS,
    AGGREGATOR_MAX_JOBS,
    AGGREGATOR_SLOTS,
    ControlLimits,
    JobParams,
)


def engine_problem(rows: int, max_jobs: int, engine: str = "p4model") -> str | None:
    """One line on why the P4 switch (``--engine engine``) cannot hold a core of this size, or None."""
    if rows > ROWS:
        return f"--engine {engine}: the P4 switch has {ROWS} slot rows; got --slots {rows}"
    if max_jobs > MAX_JOBS:
        return f"--engine {engine}: the P4 switch's job table holds {MAX_JOBS} jobs; got --max-jobs {max_jobs}"
    return None


def switch_refusal(placed: Iterable[int], job: int, params: JobParams, where: str) -> str | None:
    """One line on why the P4 program (run ``where``) cannot serve job key ``job`` with these parameters beside
    the ``placed`` job keys, or None."""
    return host_refusal(params, where) or refusal(params.codec, params.packet_elements, params.data_mac) or (
        # the job table matches the wire job id alone (p4/job_table.p4)
        one_tenant_per_id(placed, job, where))


class P4DataPath:
    """A PipelineModel and its controller as an aggregator core's data path (``random``: the model's random
    extern, KeyedRandom by default: bit-equal to the kernel). Options as aggregator.kernel.KernelDataPath's."""

    marks = False  # the model runs with an empty egress queue (queue_depth 0): it never marks

    def __init__(self, *, random: RandomSource | None = None, rows: int = AGGREGATOR_SLOTS,
                 max_elements: int = AGGREGATOR_MAX_ELEMENTS, max_jobs: int = AGGREGATOR_MAX_JOBS,
                 results_group: tuple[int, int] | None = None, control_limits: ControlLimits = ControlLimits(),
                 counters: CoreCounters | None = None, name: str = "this aggregator core") -> None:
        problem = engine_problem(rows, max_jobs)
        if problem:
            raise ValueError(problem)
        check_results_group(results_group, max_jobs)
        self.results_group = results_group
        self.max_elements = max_elements
        self.name = name
        self.counters = CoreCounters(max_jobs, rows) if counters is None else counters
        self.model = PipelineModel(random or KeyedRandom(), control_limits, self.counters.stats,
                                   self.counters.core_stats)
        self.model.install(static_entries())
        self.jobs: dict[int, SwitchJob] = {}  # what the controller wrote, by job key (aggregator.datapath.job_key)
        self.placed: dict[int, Placed] = {}
        self._seated = np.zeros((max_jobs, MAX_WORLD))  # when each rank took its seat (a job's placement: all)

    def _write_entries(self) -> None:
        """The controller writes every job's entries (a switch's runtime API: a batch of table writes)."""
        self.model.replace_job_entries([e for job in self.jobs.values() for e in job_entries(job)])

    # ---- aggregator.datapath.DataPath ---------------------------------------------------------------------
    def refuse(self, job: int, params: JobParams, slots: Slots, rank: int) -> str | None:
        return switch_refusal(self.placed, job, params, "the P4 pipeline (--engine p4model)")

    def place(self, job: int, params: JobParams, slots: Slots, data_key: bytes, now: float) -> Placed | str:
        found = allocate(self.counters, job, len(slots.of(params.pool_size)), self.name)
        if isinstance(found, str):
            return found
        j, rows = found
        self.model.clear_job(j, rows)
        self._seated[j] = now
        placed = self.placed[job] = Placed(j, rows, group_of(self.results_group, j))
        self.jobs[job] = switch_job(wire_job(job), j, params, slots, rows, placed.group, {})
        self._write_entries()
        return placed

    def seat(self, job: int, rank: int, addr: int, now: float) -> None:
        self.jobs[job].members[rank] = addr
        self._seated[self.placed[job].index, rank] = now
        self._write_entries()

    def remove(self, job: int) -> None:
        rows = self.placed.pop(job).rows
        del self.jobs[job]
        self.counters.row_used[rows.start:rows.stop] = False
        self._write_entries()

    def process(self, rx: Burst, now: float) -> tuple[Burst, np.ndarray]:
        """As aggregator.kernel.KernelDataPath.process; the output burst has rows of its own."""
        if rx.data is None:
            raise ValueError("receive needs a burst with rows of its own (Burst.rows_of)")
        self.model.new_burst()
        sent: list[tuple[bytes, int]] = []
        control = []
        for i in range(rx.count):
            length = int(rx.length[i])
            sent += self.model.receive(None if length < 0 else bytes(rx.data[i, :length]), int(rx.addr[i]), now)
            if self.model.control:  # admitted by the control meter: the core copies it out of rx
                control.append(i)
                self.model.control.clear()
        out = Burst.rows_of(len(sent), max([1] + [len(d) for d, _ in sent]))
        out.fill(sent)
        return out, np.array(control, np.int64)

    def round_state(self, job: int) -> RoundState:
        rows = self.placed[job].rows
        span = slice(2 * rows.start, 2 * rows.stop)

        def cells(name: str) -> np.ndarray:  # pass 0's cells of the job's (row, set)s: where a round opens first
            return self.model.slot_cells(name, span.stop)[span]

        return RoundState(read_only(cells("round_key").view(np.int64).reshape(-1, 2)),
                          read_only(cells("worker_bitmap").reshape(-1, 2)),
                          read_only(cells("worker_count").reshape(-1, 2)))

    def last_seen(self, job: int) -> np.ndarray:
        j = self.placed[job].index
        seen = self.model.registers.cells["member_seen"][j * MAX_WORLD:(j + 1) * MAX_WORLD] / 1e6  # microseconds
        return read_only(np.maximum(self._seated[j], np.where(seen > 0, seen, -np.inf)))


def p4model_core(*, random: RandomSource | None = None, rows: int = AGGREGATOR_SLOTS,
                 max_elements: int = AGGREGATOR_MAX_ELEMENTS, max_jobs: int = AGGREGATOR_MAX_JOBS,
                 results_group: tuple[int, int] | None = None, control_limits: ControlLimits = ControlLimits(),
                 counters: CoreCounters | None = None, **options: Any) -> AggregatorCore:
    """An AggregatorCore with a P4DataPath (its ``datapath``). ``options``: AggregatorCore's."""
    return AggregatorCore(P4DataPath(random=random, rows=rows, max_elements=max_elements, max_jobs=max_jobs,
                                     results_group=results_group, control_limits=control_limits,
                                     counters=counters, name=f"aggregator core {options.get('core', 0)}"),
                          **options)
