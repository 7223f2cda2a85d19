"""``intml-aggregator --engine p4model``: the aggregator core with its data path run through the P4 pipeline
model instead of the Numba burst kernel. The control plane (handshake, membership, teardown, statistics) is the
core's own; after each change it writes the switch's per-job table entries (p4.entries.job_entries) into the
model, as a switch's controller would, and the model counts into the core's counter arrays, so STATS works as
with the kernel. Slow (Python per packet), bit-identical to the kernel engine with ``KeyedRandom``.
"""

from __future__ import annotations

import numpy as np

from intml.aggregator.core import AggregatorCore, JobInfo
from intml.aggregator.counters import EVICTED
from intml.p4.controller import controller_entries
from intml.p4.entries import static_entries
from intml.p4.extern import KeyedRandom, RandomSource
from intml.p4.layout import MAX_JOBS, MAX_WORLD, ROWS, refusal
from intml.p4.model import PipelineModel
from intml.protocol.burst import Burst
from intml.protocol.job import AGGREGATOR_MAX_JOBS, AGGREGATOR_SLOTS, ControlLimits
from intml.protocol.wire import FLAG_DATA_MAC


def engine_problem(rows: int, max_jobs: int) -> str | None:
    """One line on why the P4 switch cannot hold a core of this size, or None."""
    if rows > ROWS:
        return f"--engine p4model: the P4 switch has {ROWS} slot rows; got --slots {rows}"
    if max_jobs > MAX_JOBS:
        return f"--engine p4model: the P4 switch's job table holds {MAX_JOBS} jobs; got --max-jobs {max_jobs}"
    return None


class P4ModelCore(AggregatorCore):
    """An AggregatorCore whose data path is a PipelineModel (``random``: its random extern, KeyedRandom by
    default: bit-equal to the kernel). Options as AggregatorCore's."""

    def __init__(self, *, random: RandomSource | None = None, rows: int = AGGREGATOR_SLOTS,
                 max_jobs: int = AGGREGATOR_MAX_JOBS, control_limits: ControlLimits = ControlLimits(),
                 **options) -> None:
        problem = engine_problem(rows, max_jobs)
        if problem:
            raise ValueError(problem)
        super().__init__(rows=rows, max_jobs=max_jobs, control_limits=control_limits, **options)
        self.model = PipelineModel(random or KeyedRandom(), control_limits, self.jobs.stats, self.jobs.core_stats)
        self.model.install(static_entries())

    def receive(self, rx: Burst, now: float) -> Burst:
        """As AggregatorCore.receive; the output burst has rows of its own."""
        if rx.data is None:
            raise ValueError("receive needs a burst with rows of its own (Burst.rows_of)")
        self.model.new_burst()
        sent: list[tuple[bytes, int]] = []
        for i in range(rx.count):
            length = int(rx.length[i])
            datagram = None if length < 0 else bytes(rx.data[i, :length])
            sent += self.model.receive(datagram, int(rx.addr[i]), now)
        self._control_in += [(datagram, addr, now) for datagram, addr in self.model.control]
        self.model.control.clear()
        self._sync_state()
        out = Burst.rows_of(len(sent), max([1] + [len(d) for d, _ in sent]))
        out.fill(sent)
        return out

    def _sync_state(self) -> None:
        """The registers the control plane reads (statistics, a rejoining rank's resume point, the idle timer)
        copied into the core's table and last-seen arrays."""
        cells, slot_cells = self.model.registers.cells, self.model.slot_cells
        rows = self.table.round_key.shape[0]
        self.table.round_key[:] = slot_cells("round_key", 2 * rows).view(np.int64).reshape(rows, 2)
        self.table.bitmap[:] = slot_cells("worker_bitmap", 2 * rows).reshape(rows, 2)
        self.table.count[:] = slot_cells("worker_count", 2 * rows).reshape(rows, 2)
        jobs = self.jobs.last_seen.shape[0]
        seen = cells["member_seen"][:jobs * MAX_WORLD].reshape(jobs, MAX_WORLD) / 1e6
        np.maximum(self.jobs.last_seen, np.where(seen > 0, seen, -np.inf), out=self.jobs.last_seen)

    # ---- the controller: table entries from the control plane's state ----------------------------------------
    def _check_params(self, p: dict, rank: int) -> str | None:
        return super()._check_params(p, rank) or refusal(p["codec"], p["packet_elements"],
                                                          bool(p["flags"] & FLAG_DATA_MAC))

    def _register(self, job_id: int, params: dict, now: float, token_key: bytes, job_nonce: bytes) -> JobInfo | str:
        info = super()._register(job_id, params, now, token_key, job_nonce)
        if isinstance(info, JobInfo):
            self.model.clear_job(info.index, info.rows)
        return info

    def handle_control(self, datagram: bytes, addr: int, now: float) -> bytes | None:
        reply = super().handle_control(datagram, addr, now)
        self.model.replace_job_entries(controller_entries(self))
        return reply

    def teardown(self, job_id: int, now: float | None = None, reason: str = EVICTED) -> None:
        super().teardown(job_id, now, reason)
        self.model.replace_job_entries(controller_entries(self))


