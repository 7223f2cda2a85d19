"""The switch's controller: the per-job table entries (p4.entries.job_entries) of a job as the control plane
placed it, which the controller of a real switch writes through its runtime API when a job is placed, a rank
takes its seat or the job ends."""

from __future__ import annotations

from intml.aggregator.core import AggregatorCore
from intml.aggregator.datapath import Slots, wire_job
from intml.p4.entries import Entry, SwitchJob, job_entries
from intml.protocol.job import JobParams


def switch_job(job_id: int, index: int, params: JobParams, slots: Slots, rows: range, group: int,
               members: dict[int, int]) -> SwitchJob:
    """A job as the switch sees it: parameters, members, results group, the row of each of its slots here."""
    return SwitchJob(job_id, index, params.world_size, params.packet_elements, params.pool_size, int(params.codec),
                     params.seed, dict(members), group,
                     {s: rows.start + s // slots.stride for s in slots.of(params.pool_size)}, params.nearest)


def controller_entries(core: AggregatorCore) -> list[Entry]:
    """Every per-job entry for ``core``'s jobs, from its control plane's view of them (p4.entries.cli_commands
    renders them for an operator). The switch's job table matches the wire job id alone: one tenant per id
    (aggregator.datapath.one_tenant_per_id)."""
    return [e for key, info in core.info.items()
            for e in job_entries(switch_job(wire_job(key), info.index, info.params, info.slots, info.rows, info.group,
                                            info.members))]
