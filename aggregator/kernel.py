"""The Numba burst kernel (aggregator.slots.process_burst) as an aggregator core's data path
(aggregator.datapath): the job table, the slot table and the output memory the kernel runs over."""

from __future__ import annotations

import numpy as np

from intml.aggregator.counters import CoreCounters
from intml.aggregator.datapath import (
    Placed,
    RoundState,
    Slots,
    allocate,
    check_results_group,
    group_of,
    host_refusal,
)
from intml.aggregator.slots import (
    Jobs,
    Table,
    new_batch,
    new_jobs,
    new_limiter,
    new_table,
    place_job,
    process_burst,
    row_width,
)
from intml.protocol.arith import value_bits
from intml.protocol.burst import Burst
from intml.protocol.job import (
    AGGREGATOR_MAX_ELEMENTS,
    AGGREGATOR_MAX_JOBS,
    AGGREGATOR_SLOTS,
    BURST,
    MAX_WORLD,
    ControlLimits,
    JobParams,
)
from intml.protocol.siphash import key_words


def read_only(array: np.ndarray) -> np.ndarray:
    """A view of ``array`` that cannot write it."""
    view = array.view()
    view.flags.writeable = False
    return view


class KernelDataPath:
    """The kernel's tables for ``rows`` slot rows of packets of up to ``max_elements`` elements and
    ``max_jobs`` jobs, counting into ``counters`` (a private block by default). ``burst``: the most datagrams a
    receive burst is expected to hold (a larger one grows the output memory). ``results_group`` = (first IPv4
    multicast group as an integer, UDP port): job entry j sends its results to group + j in one datagram per
    completion, as a switch's multicast replication does, instead of one datagram per worker; retransmitted
    results still go to the one worker that asked. ``control_limits``: how many JOIN, LEAVE and STATS_REQUEST
    datagrams the kernel lets through to the control plane (its control admission). ``name``: the core as a
    refusal names it."""

    marks = False  # its output rows are its stored results: the driver's mark is rewritten on each send

    def __init__(self, *, rows: int = AGGREGATOR_SLOTS, max_elements: int = AGGREGATOR_MAX_ELEMENTS,
                 max_jobs: int = AGGREGATOR_MAX_JOBS, burst: int = BURST,
                 results_group: tuple[int, int] | None = None, control_limits: ControlLimits = ControlLimits(),
                 counters: CoreCounters | None = None, name: str = "this aggregator core") -> None:
        check_results_group(results_group, max_jobs)
        self.results_group = results_group
        self.max_elements = max_elements
        self.name = name
        self.counters = CoreCounters(max_jobs, rows) if counters is None else counters
        if (self.counters.max_jobs, self.counters.rows) != (max_jobs, rows):
            raise ValueError(f"the counters block is for {self.counters.max_jobs} jobs and {self.counters.rows} rows, "
                             f"not {max_jobs} and {rows}")
        c = self.counters
        self.jobs: Jobs = new_jobs(max_jobs)._replace(job_id=c.job_id, active=c.active, stats=c.stats,
                                                       core_stats=c.core_stats)
        self.placed: dict[int, Placed] = {}  # by job key (aggregator.datapath.job_key)
        self.limiter = tuple(new_limiter(control_limits))
        self.table: Table = new_table(rows, max_elements, np.zeros((rows, 2, row_width(max_elements)), np.uint8))
        self._grow(burst)

    def _grow(self, burst: int) -> None:
        """Size the output memory and the scratch for received bursts of up to `burst` datagrams. One block
        holds the stored results and `burst` spill rows, so the output Burst's datagrams all lie in its memory;
        the results already stored move along (only rows in use are copied: untouched pages stay unmapped)."""
        rows, _, width = self.table.result.shape
        memory = np.zeros((2 * rows + burst) * width, np.uint8)
        result = memory[: 2 * rows * width].reshape(rows, 2, width)
        used = self.counters.row_used
        result[used] = self.table.result[used]
        self.table = self.table._replace(result=result)
        self.spill = memory[2 * rows * width:].reshape(burst, width)
        self.spill_len = np.zeros(burst, np.int64)
        self.kernel_tables = (tuple(self.jobs), tuple(self.table))  # see process_burst on why tuples
        self.batch = tuple(new_batch(rows, burst))
        self.control = np.empty(burst, np.int64)
        self._out = Burst(memory, burst * MAX_WORLD)  # a completion sends up to MAX_WORLD results

    # ---- aggregator.datapath.DataPath ---------------------------------------------------------------------
    def refuse(self, job: int, params: JobParams, slots: Slots, rank: int) -> str | None:
        # every switch-codec job the core's checks pass; a host codec's is aggregator.host's (a core's default)
        return host_refusal(params, self.name)

    def place(self, job: int, params: JobParams, slots: Slots, data_key: bytes, now: float) -> Placed | str:
        found = allocate(self.counters, job, len(slots.of(params.pool_size)), self.name)
        if isinstance(found, str):
            return found
        j, rows = found
        jobs = self.jobs
        place_job(jobs, self.table, j, rows, world=self.contributors(job, params),
                  value_bits=value_bits(params.world_size),
                  packet_elements=params.packet_elements, pool=params.pool_size, codec=int(params.codec),
                  seed=params.seed, stride=slots.stride, offset=slots.offset, nearest=params.nearest)
        group = group_of(self.results_group, j)
        jobs.group[j] = group
        jobs.last_seen[j] = now
        jobs.data_mac[j] = params.data_mac
        jobs.mac_key[j] = key_words(data_key)
        self.placed[job] = Placed(j, rows, group)
        return self.placed[job]

    def contributors(self, job: int, params: JobParams) -> int:
        """How many senders complete a round of the job (its key) here: its ranks (the spine: its leaves)."""
        return params.world_size

    def seat(self, job: int, rank: int, addr: int, now: float) -> None:
        j = self.placed[job].index
        self.jobs.members[j, rank] = addr
        self.jobs.last_seen[j, rank] = now

    def remove(self, job: int) -> None:
        rows = self.placed.pop(job).rows
        self.counters.row_used[rows.start:rows.stop] = False

    def process(self, rx: Burst, now: float) -> tuple[Burst, np.ndarray]:
        if rx.data is None:
            raise ValueError("receive needs a burst with rows of its own (Burst.rows_of)")
        if self.control.size < rx.rows:
            self._grow(rx.rows)
        out = self._out
        out.count, n_ctl = self.run(rx, now, out)
        return out, self.control[:n_ctl]

    def round_state(self, job: int) -> RoundState:
        rows = self.placed[job].rows
        span = slice(rows.start, rows.stop)
        return RoundState(*(read_only(a[span]) for a in (self.table.round_key, self.table.bitmap, self.table.count)))

    def last_seen(self, job: int) -> np.ndarray:
        return read_only(self.jobs.last_seen[self.placed[job].index])

    # ---- the kernel -------------------------------------------------------------------------------------------
    def run(self, rx: Burst, now: float, out: Burst) -> tuple[int, int]:
        """Run the burst kernel over ``rx`` into ``out``: (datagrams described in ``out``, control datagrams
        listed in ``control``). A kernel of another tier (aggregator.leafspine) replaces this."""
        return process_burst(rx.data, rx.length, rx.addr, rx.count, now, *self.kernel_tables, self.batch, self.spill,
                             self.spill_len, out.ptr, out.length, out.addr, self.control, self.limiter)
