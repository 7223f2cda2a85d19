"""A core's counters, in one block of memory that a reader in another thread or process may share (the metrics
endpoint, aggregator.metrics): the kernel's per-job and per-core counter rows and the job table's ids and flags
(the core's Jobs arrays are views of this block), the slot rows in use, and how many jobs ended for each reason.
Sans-I/O: the block is any writable buffer (a numpy array by default; the aggregator's entry point passes an
anonymous shared mmap, so that the parent process can read the counters of every --cores process).

Per job and per core. The kernel counts a datagram that names an active job in the job's row, and one that
names none (and every datagram's ``packets_in``) in the core's row. A job's row is never reset: the job's
counters are its row minus the row's value when the job took it (``base``). So the core's totals, every event
on the core whichever job it was for, live or finished, are the core's row plus the sum of every job row, and
they only ever grow: a job's teardown or a new job's registration changes no total, and needs no lock.

Reading while the core writes (what aggregator.metrics relies on):
* One writer. Each counter is written only by its core: the kernel, or the control plane between bursts, in
  one thread. The kernel's ``+= 1`` is a plain load, add and store; no update is lost, as nobody else stores.
* No torn values. Every counter is an int64 at an 8-byte-aligned offset (the int64 arrays come first; the
  block starts aligned, checked), and an aligned 8-byte load or store is single-copy atomic on x86-64 (and
  AArch64); numpy's copies and sums load aligned int64 elements whole (a wider vector load does not split an
  aligned lane). So a reader sees each counter's old or new value, never a mix. This holds across processes
  too: a shared mapping is the same physical memory.
* Consistent jobs. A job row's identity (id, active, base) changes only at registration and teardown, under a
  per-row sequence number (``generation``, odd while it changes): a reader that copies the row between two
  equal, even reads of it has one job's counters. x86-64 keeps stores in program order, and loads too, so the
  sequence needs no fence; on a weaker memory model (AArch64) a row read during a registration could slip
  through mixed: one scrape's wrong value for a job that just started, never a change to the core.
* Staleness only. Counters only grow and a reader never writes: a value may be a burst old (the compiled
  kernel may hold an increment in a register until it stores it), never wrong for longer, and never changes
  what the core does.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from intml.protocol.stats import N_STATS, PACKETS_IN

END_REASONS = ("leave", "idle", "evicted")  # why a job ended: every rank left, idle_timeout, torn down by the driver
LEAVE, IDLE, EVICTED = END_REASONS
READ_ATTEMPTS = 100  # a row still changing after this many reads (its writer died mid-change) is left out


class JobSample(NamedTuple):
    """One live job's counters as a reader copied them: its job table index, id, tenant and counters."""

    index: int
    job_id: int
    tenant: int
    counters: np.ndarray


class CoreCounters:
    """The counters of one core with ``max_jobs`` job table entries and ``rows`` slot rows, in ``buffer`` (at
    least ``nbytes(max_jobs, rows)`` bytes, 8-byte aligned; a fresh zeroed one by default)."""

    def __init__(self, max_jobs: int, rows: int, buffer=None) -> None:
        self.max_jobs, self.rows = max_jobs, rows
        memory = np.zeros(self.nbytes(max_jobs, rows), np.uint8) if buffer is None else np.frombuffer(buffer, np.uint8)
        if memory.ctypes.data % 8:
            raise ValueError("the counters' buffer must be 8-byte aligned")
        offset = 0

        def take(shape: tuple[int, ...], dtype) -> np.ndarray:
            nonlocal offset
            size = int(np.prod(shape)) * np.dtype(dtype).itemsize
            view = memory[offset:offset + size].view(dtype).reshape(shape)
            offset += size
            return view

        # int64 first: each counter at an 8-byte-aligned offset
        self.job_id = take((max_jobs,), np.int64)
        self.tenant = take((max_jobs,), np.int64)  # each job's tenant (aggregator.datapath.job_key)
        self.generation = take((max_jobs,), np.int64)  # odd while the row's job changes
        self.stats = take((max_jobs, N_STATS), np.int64)  # the kernel's per-job rows, never reset
        self.base = take((max_jobs, N_STATS), np.int64)  # each row's value when its current job took it
        self.core_stats = take((N_STATS,), np.int64)  # the kernel's per-core row
        self.finished = take((len(END_REASONS),), np.int64)  # jobs that ended, by reason
        self.active = take((max_jobs,), np.bool_)
        self.row_used = take((rows,), np.bool_)

    @staticmethod
    def nbytes(max_jobs: int, rows: int) -> int:
        return 8 * (max_jobs * (3 + 2 * N_STATS) + N_STATS + len(END_REASONS)) + max_jobs + rows

    # ---- the writer: the core's control plane ---------------------------------------------------------------
    def start_job(self, j: int, job_id: int, tenant: int = 0) -> None:
        """Tenant ``tenant``'s job ``job_id`` takes table entry ``j``: its counters start at zero from here."""
        self.generation[j] += 1
        self.job_id[j] = job_id
        self.tenant[j] = tenant
        self.base[j] = self.stats[j]
        self.active[j] = True
        self.generation[j] += 1

    def end_job(self, j: int, reason: str) -> np.ndarray:
        """Entry ``j``'s job ended for ``reason`` (END_REASONS); returns its final counters."""
        final = self.job(j)
        self.generation[j] += 1
        self.active[j] = False
        self.generation[j] += 1
        self.finished[END_REASONS.index(reason)] += 1
        return final

    # ---- readers ----------------------------------------------------------------------------------------------
    def job(self, j: int) -> np.ndarray:
        """The counters of entry ``j``'s job (read by its writer: no concurrent change)."""
        return self.stats[j] - self.base[j]

    def totals(self) -> np.ndarray:
        """The core's counters: every event on the core, of every job, live or finished, and of none."""
        totals = self.core_stats + self.stats.sum(axis=0)
        totals[PACKETS_IN] = self.core_stats[PACKETS_IN]  # the core's row counts every datagram already
        return totals

    def live_jobs(self) -> list[JobSample]:
        """Every active job's counters, each copied between two equal, even reads of its row's generation (a
        row that changes meanwhile is read again; see the module docstring)."""
        samples = []
        for j in np.flatnonzero(self.active).tolist():
            for _ in range(READ_ATTEMPTS):
                generation = int(self.generation[j])
                active, job_id, tenant = bool(self.active[j]), int(self.job_id[j]), int(self.tenant[j])
                counters = self.stats[j] - self.base[j]
                if generation % 2 == 0 and int(self.generation[j]) == generation:
                    if active:
                        samples.append(JobSample(j, job_id, tenant, counters))
                    break
        return samples
