"""The body of every action of the generated tables of p4/layout.py, as P4_16 statements: what p4.generate (v1model) and
p4.generate_tna (the Tofino sketch) render under each action's declaration. The ``encode_b<b>`` actions are
``protocol/arith.py::_sum_code`` with the leading one b a constant: constant shifts only, as Tofino requires."""

from __future__ import annotations


def encode_action(b: int) -> str:
    """encode_b<b>: k = b, or b + 1 iff the top b bits of the random word are below the remainder under the
    leading one (protocol.arith._sum_code); constant shifts only."""
    if b == 0:
        k = "8w0"  # nothing below the leading one: never rounds up
    else:
        k = f"(lane.rand >> {32 - b}) < (lane.magnitude & 0x{(1 << b) - 1:x}) ? 8w{b + 1} : 8w{b}"
    return f"lane.code = lane.sign | NONZERO | ({k});"


# The body of every action of the generated tables, by table and action name (the hand-written controls' tables
# carry theirs in their .p4 file).
ACTION_BODIES: dict[str, dict[str, str]] = {
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
}
