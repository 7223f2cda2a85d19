"""The body of every action of every table in p4/layout.py, as P4_16 statements: what p4.generate (v1model) and
p4.generate_tna (the Tofino sketch) render under each action's declaration. The ``encode_b<b>`` actions are
``protocol/arith.py::_sum_code`` with the leading one b a constant: constant shifts only, as Tofino requires."""

from __future__ import annotations

from intml.p4 import layout as L


def encode_action(b: int) -> str:
    """encode_b<b>: k = b, or b + 1 iff the top b bits of the random word are below the remainder under the
    leading one (protocol.arith._sum_code); constant shifts only."""
    if b == 0:
        k = "8w0"  # nothing below the leading one: never rounds up
    else:
        k = f"(lane.rand >> {32 - b}) < (lane.magnitude & 0x{(1 << b) - 1:x}) ? 8w{b + 1} : 8w{b}"
    return f"lane.code = lane.sign | NONZERO | ({k});"


_SET_JOB = "\n".join(f"meta.{name} = {name};" for name, _ in L.JOB_PARAMS)

# The body of every action of every layout table, by table and action name.
ACTION_BODIES: dict[str, dict[str, str]] = {
    "control_limits": {
        "set_limits": "source_interval_ns = source_interval;\nsource_tolerance_ns = source_tolerance;\n"
                      "core_interval_ns = core_interval;\ncore_tolerance_ns = core_tolerance;"},
    "job_table": {
        "set_job_cnat8": _SET_JOB + "\nmeta.codec = CODEC_CNAT8;",
        "set_job_int32": _SET_JOB + "\nmeta.codec = CODEC_INT32;",
        "unknown_job": "meta.drop_stat = STAT_DROP_UNKNOWN_JOB;"},
    "membership": {
        "set_worker": "meta.worker_bit = worker_bit;",
        "not_member": "meta.drop_stat = STAT_DROP_UNREGISTERED_SOURCE;"},
    "slot_table": {
        "set_row": "meta.row = row;",
        "slot_out_of_range": "meta.drop_stat = STAT_DROP_SLOT_OUT_OF_RANGE;"},
    "next_step": {
        "open": "meta.step = STEP_OPEN;",
        "add": "meta.step = STEP_ADD;",
        "resend": "meta.step = STEP_RESEND;",
        "drop_stale": "meta.drop_stat = STAT_DROP_STALE;",
        # a later pass may still lack the rank (a packet lost between passes): go on, decide at the last pass
        "drop_duplicate_incomplete": "meta.duplicate = true;"},
    "data_bound": {
        "set_bound": "meta.k_limit = k_limit;\nmeta.k_finite = k_finite;\nmeta.bound_hit = true;",
        "no_bound": "meta.bound_hit = false;"},
    "cnat_decode": {
        "decode": "lane.value = value;",
        "invalid_code": "lane.value = 0;"},
    "leading_one": {f"encode_b{b}": encode_action(b) for b in range(32)} | {"encode_zero": "lane.code = 0;"},
    "egress_dest": {
        "set_dest": "hdr.ipv4.src_addr = hdr.ipv4.dst_addr;\nhdr.udp.src_port = hdr.udp.dst_port;\n"
                    "hdr.ipv4.dst_addr = addr[47:16];\nhdr.udp.dst_port = addr[15:0];\nhdr.udp.checksum = 0;",
        "no_dest": "mark_to_drop(sm);"},
}
