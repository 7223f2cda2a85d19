"""The switch's controller: the per-job table entries (p4.entries.job_entries) of an aggregator core's control
plane state, which the controller of a real switch would write through its runtime API."""

from __future__ import annotations

from intml.aggregator.core import AggregatorCore
from intml.p4.entries import Entry, SwitchJob, job_entries


def switch_jobs(core: AggregatorCore) -> list[SwitchJob]:
    """Every job of ``core`` as the switch sees it: parameters, members, results group, the row of each slot."""
    out = []
    for job_id, info in core.info.items():
        j, p = info.index, info.params
        stride, offset = core.layout(p)
        members = {r: int(a) for r, a in enumerate(core.jobs.members[j, :p["world_size"]]) if a}
        rows = {s: info.rows.start + s // stride for s in range(offset, p["pool_size"], stride)}
        out.append(SwitchJob(job_id, j, p["world_size"], p["packet_elements"], p["pool_size"], p["codec"],
                             p["seed"], members, int(core.jobs.group[j]), rows))
    return out


def controller_entries(core: AggregatorCore) -> list[Entry]:
    """Every per-job entry for ``core``'s jobs (p4.entries.cli_commands renders them for an operator)."""
    return [e for job in switch_jobs(core) for e in job_entries(job)]
