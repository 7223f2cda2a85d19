"""Every table entry of the switch pipeline as plain data: the static ones (the next-step table from
protocol.slot_reference.TRANSITIONS, the C_nat decode and bound tables, the leading-one table), which
p4.generate renders as ``const entries``, and the per-job ones (job table, membership, slot table, multicast
replicas, the rank group of reduce-scatter rounds, egress rewrite) from the controller's job state, which ``cli_commands`` writes as simple_switch_CLI
commands. The pipeline model (p4.model) executes exactly these entries.
"""

from __future__ import annotations

import dataclasses

from intml.p4.layout import (
    DATA_K_MAX,
    EVENT_CODES,
    EXPONENTS,
    GROUP_RID,
    LANES_PER_PASS,
    MAX_WORLD,
    NONZERO,
    RANK_GROUP_BASE,
    SIGN,
    STATE_CODES,
    TABLE,
    VALUE_BITS,
)
from intml.p4.layout import K_MAX as CODE_K_MAX
from intml.protocol.arith import cnat_floor, data_k_max, value_bits
from intml.protocol.cnat import F_MAX
from intml.protocol.codec import Codec
from intml.protocol.job import ControlLimits
from intml.protocol.slot_reference import TRANSITIONS

Ternary = tuple[int, int]  # (value, mask) of a ternary key field


@dataclasses.dataclass(frozen=True)
class Entry:
    """One table entry: ``key`` holds one value per key field of the table (a (value, mask) pair for a ternary
    field); ``params`` the action's parameters in layout order. Table ``multicast_group`` is v1model's
    replication engine: key (group,), params the replica ids."""

    table: str
    key: tuple[int | Ternary, ...]
    action: str
    params: tuple[int, ...] = ()


@dataclasses.dataclass(frozen=True)
class SwitchJob:
    """What the controller knows of one job on this switch (core): the JOIN's parameters, the address each rank
    joined from, the results group (0: unicast) and the row of each of its slots here."""

    job_id: int
    index: int
    world: int
    packet_elements: int
    pool: int
    codec: int
    seed: int
    members: dict[int, int]  # rank -> address key
    group: int
    rows: dict[int, int]  # slot -> row
    nearest: bool = False  # the re-encode rounds to nearest (JOIN flags), else stochastically


def u8(value: int) -> int:
    """An int8 field's bits as the switch keys on them."""
    return value & 0xFF


def next_step_entries() -> list[Entry]:
    return [Entry("next_step", (STATE_CODES[state], EVENT_CODES[event]), action)
            for (state, event), action in TRANSITIONS.items()]


def data_bound_entries() -> list[Entry]:
    """(s(n), exp) -> k_limit = data_k_max + 1, and k_finite = F_MAX - floor clamped to the code's k field (a
    result k never exceeds 32, so the clamp changes no comparison)."""
    return [Entry("data_bound", (s, u8(e)), "set_bound",
                  (int(data_k_max(e, s)) + 1, min(CODE_K_MAX, F_MAX - int(cnat_floor(e, s)))))
            for s in VALUE_BITS for e in EXPONENTS]


def decode_entries() -> list[Entry]:
    """Code -> its value +-2**k in the slot's unit as a 32-bit word: the code 0 and every valid code a DATA
    packet may hold (k <= DATA_K_MAX); any other code misses."""
    out = [Entry("cnat_decode", (0,), "decode", (0,))]
    for k in range(DATA_K_MAX + 1):
        out.append(Entry("cnat_decode", (NONZERO | k,), "decode", (1 << k,)))
        out.append(Entry("cnat_decode", (SIGN | NONZERO | k,), "decode", ((-(1 << k)) & 0xFFFFFFFF,)))
    return out


def leading_one_entries() -> list[Entry]:
    """Entry b matches a magnitude whose leading one is bit b: bits above b clear, bit b set."""
    return [Entry("leading_one", ((1 << b, (0xFFFFFFFF << b) & 0xFFFFFFFF),), f"encode_b{b}") for b in range(32)]


def static_entries() -> list[Entry]:
    """The ``const entries`` of the program (lane tables: the entries of every lane's copy)."""
    return next_step_entries() + data_bound_entries() + decode_entries() + leading_one_entries()


def job_entries(job: SwitchJob) -> list[Entry]:
    """The entries the controller writes for one job."""
    s = value_bits(job.world)
    action = "set_job_cnat8" if job.codec == Codec.CNAT8 else "set_job_int32"
    out = [Entry("job_table", (job.job_id,), action,
                 (job.index, job.world, s, job.pool, job.packet_elements, 1 << s, job.group, job.seed,
                  int(job.nearest)))]
    out += [Entry("membership", (job.index, rank, addr), "set_worker", (1 << rank,))
            for rank, addr in sorted(job.members.items()) if addr]
    out += [Entry("slot_table", (job.index, slot), "set_row", (row,)) for slot, row in sorted(job.rows.items())]
    out.append(Entry("multicast_group", (job.index + 1,), "replicate",
                     (GROUP_RID,) if job.group else tuple(range(job.world))))
    out.append(Entry("multicast_group", (RANK_GROUP_BASE + job.index + 1,), "replicate", tuple(range(job.world))))
    out += [Entry("egress_dest", (job.index, rank), "set_dest", (addr,)) for rank, addr in sorted(job.members.items())]
    if job.group:
        out.append(Entry("egress_dest", (job.index, GROUP_RID), "set_dest", (job.group,)))
    return out


NS = 1_000_000_000  # the control meter counts nanoseconds


def limit_entries(limits: ControlLimits) -> list[Entry]:
    """The control meter's intervals and tolerances (ns), the default action of the keyless control_limits."""
    source, core = round(NS / limits.source_rate), round(NS / limits.global_rate)
    return [Entry("control_limits", (), "set_limits",
                  (source, source * (limits.source_burst - 1), core, core * (limits.global_burst - 1)))]


def _key_text(value: int | Ternary) -> str:
    return f"0x{value[0]:x}&&&0x{value[1]:x}" if isinstance(value, tuple) else str(value)


def cli_commands(entries: list[Entry], port: int = 1) -> list[str]:
    """simple_switch_CLI commands that load ``entries`` (lane tables into every lane's copy; multicast groups
    with one node per replica on ``port``; ternary entries with priority = their position)."""
    out: list[str] = []
    nodes = 0  # simple_switch_CLI numbers node handles from 0 in creation order
    for priority, e in enumerate(entries):
        if e.table == "multicast_group":
            out.append(f"mc_mgrp_create {e.key[0]}")
            for rid in e.params:
                out += [f"mc_node_create {rid} {port}", f"mc_node_associate {e.key[0]} {nodes}"]
                nodes += 1
            continue
        params = " ".join(str(p) for p in e.params)
        if not e.key:
            out.append(f"table_set_default {e.table} {e.action} {params}".rstrip())
            continue
        names = [f"{e.table}_{lane}" for lane in range(LANES_PER_PASS)] if TABLE[e.table].lanes else [e.table]
        ternary = any(isinstance(k, tuple) for k in e.key)
        for name in names:
            out.append(f"table_add {name} {e.action} {' '.join(_key_text(k) for k in e.key)} => {params}".rstrip()
                       + (f" {priority}" if ternary else ""))
    return out


assert MAX_WORLD <= GROUP_RID  # a rank's replica id never collides with the group's
