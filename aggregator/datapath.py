"""The interface between an aggregator core's control plane (aggregator.core.AggregatorCore: the JOIN handshake,
membership, teardown, statistics) and its data path: what moves DATA through the slots. The core is constructed
with one ``DataPath``; it never reads the data path's tables. Implementations: the Numba burst kernel
(aggregator.kernel.KernelDataPath), a rack switch's leaf (aggregator.leafspine.LeafDataPath), the switch above
the leaves (aggregator.leafspine.SpineCore, driven by the fabric's controller, not by a core) and the P4 pipeline
model (p4.engine.P4DataPath).

What an implementation must do (a new one, a software switch for example, implements these and nothing else):

* ``counters``: the CoreCounters block it counts into (per job entry, and per core for datagrams that name no
  job); the core counts its control-plane events there too, and marks a placed job live in it.
* ``refuse(job_id, params, slots, rank)``: one line on why it cannot serve rank ``rank`` of a job with these
  parameters and this share of its slots (a codec or packet size it lacks, a route it was not given), or None.
  The core sends that line back in the JOIN's ERROR.
* ``place(job_id, params, slots, data_key, now)``: take the job: a free entry of its job table and ``allocate``'s
  slot rows for the slots ``slots`` gives this core, emptied (no round of a previous job may show), with the
  job's parameters and ``data_key`` (the job's 16-byte key of the DATA/RESULT MAC, used with data_mac). Returns a
  ``Placed``, or one line naming the limit that refuses it. The job is live (the data path handles its DATA) once
  the core calls ``counters.start_job``, right after.
* ``seat(job_id, rank, addr, now)``: rank ``rank`` of the job sends from address key ``addr`` from now on (a
  rank's first JOIN, or a restarted rank's new address); DATA from any other address is counted and dropped.
* ``remove(job_id)``: free its entry and rows (the core has already ended its counters).
* ``process(rx, now)``: handle the ``rx.count`` datagrams of a received burst at time ``now``: DATA through the
  slots, counted by reason when dropped; JOIN, LEAVE and STATS_REQUEST admitted by the control admission
  (ControlLimits) and listed, not answered. Returns (the burst to send, valid until the next call; the indices
  in ``rx`` of the admitted control datagrams, in order).
* ``round_state(job_id)``: the job's ``RoundState`` on this core, read-only (the resume point and the statistics
  read it; they never write it).
* ``last_seen(job_id)``: per rank (MAX_WORLD entries, seconds on the caller's clock), the latest of the job's
  placement, the rank's seat and the last DATA packet from the rank's address (any, counted or dropped, once
  its rank and address check out), read-only.

The core owns no socket, clock or thread, and so must an implementation: time comes in as ``now``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Protocol

import numpy as np

from intml.aggregator.counters import CoreCounters
from intml.protocol.burst import Burst
from intml.protocol.job import JobParams


@dataclass(frozen=True)
class Slots:
    """Which of a job's slots a core holds: those s with s % stride == offset (stride: the job's cores over
    all its aggregators; offset: this core's index among them)."""

    stride: int = 1
    offset: int = 0

    def of(self, pool: int) -> range:
        """This core's slots of a pool of ``pool`` slots."""
        return range(self.offset, pool, self.stride)


class Placed(NamedTuple):
    """Where a data path put a job: its job table entry, its slot rows (slot s at row rows.start + s // stride)
    and its results group's address key (0: unicast)."""

    index: int
    rows: range
    group: int


class RoundState(NamedTuple):
    """A job's slot rows on one core, two shadow sets each (arrays of shape (rows, 2)): the round key each set
    holds (-1: none yet; aggregator.slots), its contributors bitmap and their count."""

    round_key: np.ndarray
    bitmap: np.ndarray
    count: np.ndarray


class DataPath(Protocol):
    """See the module docstring."""

    counters: CoreCounters
    max_elements: int

    def refuse(self, job_id: int, params: JobParams, slots: Slots, rank: int) -> str | None: ...

    def place(self, job_id: int, params: JobParams, slots: Slots, data_key: bytes, now: float) -> Placed | str: ...

    def seat(self, job_id: int, rank: int, addr: int, now: float) -> None: ...

    def remove(self, job_id: int) -> None: ...

    def process(self, rx: Burst, now: float) -> tuple[Burst, np.ndarray]: ...

    def round_state(self, job_id: int) -> RoundState: ...

    def last_seen(self, job_id: int) -> np.ndarray: ...


def check_results_group(results_group: tuple[int, int] | None, max_jobs: int) -> None:
    """Raise ValueError unless ``results_group`` (first IPv4 multicast group as an integer, UDP port) leaves a
    group for each of ``max_jobs`` job entries (or is None: results by unicast)."""
    if results_group is not None and not (0xE0000000 <= results_group[0] <= 0xF0000000 - max_jobs
                                          and 0 < results_group[1] <= 0xFFFF):
        raise ValueError(f"results group must leave {max_jobs} IPv4 multicast groups (224.0.0.0/4) and a port")


def group_of(results_group: tuple[int, int] | None, index: int) -> int:
    """The address key job entry ``index`` multicasts its results to (group + index), 0 without a group."""
    return 0 if results_group is None else (results_group[0] + index) << 16 | results_group[1]


def first_fit(used: np.ndarray, size: int) -> range | None:
    """The first run of `size` free rows (an empty range for a job with no slot here)."""
    if size == 0:
        return range(0, 0)
    run = 0
    for r in range(used.size):
        run = 0 if used[r] else run + 1
        if run == size:
            return range(r - size + 1, r + 1)
    return None


def allocate(counters: CoreCounters, job_id: int, rows: int, where: str) -> tuple[int, range] | str:
    """A new job's placement, the one every data path uses: the first free job table entry of ``counters``
    and the first fit of ``rows`` consecutive free slot rows, which are marked used. Or one line naming the
    limit that refuses it (``where``: the core, as the line names it)."""
    free = np.flatnonzero(~counters.active)
    if free.size == 0:
        return (f"{where} already holds its maximum of {counters.active.size} jobs (intml-aggregator --max-jobs); "
                f"wait for a job to leave or use another aggregator")
    span = first_fit(counters.row_used, rows)
    if span is None:
        return (f"{where} has no free slots for job {job_id}: its pool needs {rows} consecutive slot rows here and "
                f"{int((~counters.row_used).sum())} of {counters.row_used.size} are free (intml-aggregator "
                f"--slots); use a smaller pool or another aggregator")
    counters.row_used[span.start:span.stop] = True
    return int(free[0]), span
