"""The interface between an aggregator core's control plane (aggregator.core.AggregatorCore: the JOIN handshake,
membership, teardown, statistics) and its data path: what moves DATA through the slots. The core is constructed
with one ``DataPath``; it never reads the data path's tables. Implementations: the Numba burst kernel
(aggregator.kernel.KernelDataPath), a rack switch's leaf (aggregator.leafspine.LeafDataPath), the switch above
the leaves (aggregator.leafspine.SpineCore, driven by the fabric's controller, not by a core), the P4 pipeline
model (p4.engine.P4DataPath) and the host mode of codecs no switch can sum (aggregator.host.HostDataPath, beside
the kernel in aggregator.host.HostModeDataPath, a core's default). A data path that sums as a switch does refuses
a host codec (``host_refusal``).

Jobs are named by their job key (``job_key``): the tenant (the index of the token the job was created with among
the core's tokens, docs/protocol.md "Tenants") and the job id on the wire, so that two tenants' jobs of one id are
two jobs. A path that cannot tell them apart (its tables match on the wire id alone) refuses the second
(``one_tenant_per_id``).

What an implementation must do (a new one, a software switch for example, implements these and nothing else):

* ``marks``: whether the results it hands back carry a congestion mark of their own (a switch's egress queue,
  protocol.wire.CONGESTED): the driver then adds its socket's mark and keeps theirs (aggregator.congestion).
  False for a data path whose output rows are its stored results, whose mark the driver rewrites on every send.
* ``counters``: the CoreCounters block it counts into (per job entry, and per core for datagrams that name no
  job); the core counts its control-plane events there too, and marks a placed job live in it.
* ``refuse(job, params, slots, rank)`` (``job``: the job key, here and below): one line on why it cannot serve rank
  ``rank`` of a job with these parameters and this share of its slots (a codec or packet size it lacks, a route it
  was not given), or None. The core sends that line back in the JOIN's ERROR.
* ``place(job, params, slots, data_key, now)``: take the job: a free entry of its job table and ``allocate``'s
  slot rows for the slots ``slots`` gives this core, emptied (no round of a previous job may show), with the
  job's parameters and ``data_key`` (the job's 16-byte key of the DATA/RESULT MAC, used with data_mac). Returns a
  ``Placed``, or one line naming the limit that refuses it. The job is live (the data path handles its DATA) once
  the core calls ``counters.start_job``, right after. Two live jobs may share a wire job id (two tenants'): a
  DATA packet belongs to the one whose seat of the packet's rank is the packet's source address (the core never
  seats one address as the same rank of two jobs of one id).
* ``seat(job, rank, addr, now)``: rank ``rank`` of the job sends from address key ``addr`` from now on (a
  rank's first JOIN, or a restarted rank's new address); DATA from any other address is counted and dropped.
* ``remove(job)``: free its entry and rows (the core has already ended its counters).
* ``process(rx, now)``: handle the ``rx.count`` datagrams of a received burst at time ``now``: DATA through the
  slots, counted by reason when dropped; JOIN, LEAVE and STATS_REQUEST admitted by the control admission
  (ControlLimits) and listed, not answered. Returns (the burst to send, valid until the next call; the indices
  in ``rx`` of the admitted control datagrams, in order).
* ``round_state(job)``: the job's ``RoundState`` on this core, read-only (the resume point and the statistics
  read it; they never write it).
* ``last_seen(job)``: per rank (MAX_WORLD entries, seconds on the caller's clock), the latest of the job's
  placement, the rank's seat and the last DATA packet from the rank's address (any, counted or dropped, once
  its rank and address check out), read-only.

The core owns no socket, clock or thread, and so must an implementation: time comes in as ``now``.
"""

from __future__ import annotations

from dataclasses import dataclass
from collections.abc import Iterable
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

    marks: bool
    counters: CoreCounters
    max_elements: int

    def refuse(self, job: int, params: JobParams, slots: Slots, rank: int) -> str | None: ...

    def place(self, job: int, params: JobParams, slots: Slots, data_key: bytes, now: float) -> Placed | str: ...

    def seat(self, job: int, rank: int, addr: int, now: float) -> None: ...

    def remove(self, job: int) -> None: ...

    def process(self, rx: Burst, now: float) -> tuple[Burst, np.ndarray]: ...

    def round_state(self, job: int) -> RoundState: ...

    def last_seen(self, job: int) -> np.ndarray: ...


JOB_ID_BITS = 32  # a job id on the wire


def job_key(tenant: int, job_id: int) -> int:
    """The key of tenant ``tenant``'s job ``job_id``: the job id itself for tenant 0 (the first token, or the
    open mode's only one), so that a core of one tenant names its jobs by their ids."""
    return tenant << JOB_ID_BITS | job_id


def wire_job(key: int) -> int:
    """The job id on the wire of the job whose key is ``key``."""
    return key & ((1 << JOB_ID_BITS) - 1)


def tenant_of(key: int) -> int:
    """The tenant of the job whose key is ``key``."""
    return key >> JOB_ID_BITS


def job_name(key: int) -> str:
    """A job as statistics and logs name it: its id, and the tenant after an @ unless it is tenant 0."""
    return str(wire_job(key)) + (f"@{tenant_of(key)}" if tenant_of(key) else "")


def one_tenant_per_id(placed: Iterable[int], key: int, where: str) -> str | None:
    """For a data path whose tables match a job on its wire id alone: one line refusing job ``key`` while another
    tenant's job of that id is among ``placed`` (job keys), or None."""
    if any(wire_job(k) == wire_job(key) and k != key for k in placed):
        return (f"job {wire_job(key)} already runs on {where} for another token (tenant), and {where} keeps one job "
                f"per job id: use another job id")
    return None


def host_refusal(params: JobParams, where: str) -> str | None:
    """One line refusing a host-codec job on a data path that sums on a switch (``where``): the codec's reason,
    or None for a switch codec."""
    codec = params.host_codec
    if codec is None:
        return None
    return f"JOIN refused: {where} cannot run codec {codec.name}: {codec.switch_reason}"


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


def allocate(counters: CoreCounters, job: int, rows: int, where: str) -> tuple[int, range] | str:
    """A new job's placement, the one every data path uses: the first free job table entry of ``counters``
    and the first fit of ``rows`` consecutive free slot rows, which are marked used. Or one line naming the
    limit that refuses it (``where``: the core, as the line names it)."""
    free = np.flatnonzero(~counters.active)
    if free.size == 0:
        return (f"{where} already holds its maximum of {counters.active.size} jobs (intml-aggregator --max-jobs); "
                f"wait for a job to leave or use another aggregator")
    span = first_fit(counters.row_used, rows)
    if span is None:
        return (f"{where} has no free slots for job {wire_job(job)}: its pool needs {rows} consecutive slot rows here "
                f"and {int((~counters.row_used).sum())} of {counters.row_used.size} are free (intml-aggregator "
                f"--slots); use a smaller pool or another aggregator")
    counters.row_used[span.start:span.stop] = True
    return int(free[0]), span
