"""The specs in docs/ stay in step with the code: the wire-format tables of docs/protocol.md list exactly the
fields of protocol/wire.py (name, offset, size, type, byte order), and every counter the cores keep is documented."""

from __future__ import annotations

import re

import numpy as np
import pytest

from cluster import REPO_ROOT
from intml.protocol import wire

PROTOCOL_MD = (REPO_ROOT / "docs" / "protocol.md").read_text()


def doc_table(heading: str) -> list[list[str]]:
    """The rows of the first Markdown table under the ``## heading`` of docs/protocol.md."""
    section = PROTOCOL_MD.split(f"\n## {heading}\n", 1)[1].split("\n## ", 1)[0]
    lines = [line for line in section.splitlines() if line.startswith("|")]
    return [[cell.strip() for cell in line.strip("|").split("|")] for line in lines[2:]]


def dtype_rows(dtype: np.dtype) -> list[list[str]]:
    rows = []
    for name in dtype.names:
        field, offset = dtype.fields[name][:2]
        raw = field.kind == "V"  # nonces, cookies, MACs: byte strings
        order = "big-endian" if field.itemsize > 1 and not raw else "n/a"
        kind = "raw" if raw else f"{field.kind}{field.itemsize * 8}"
        rows.append([name, str(offset), str(field.itemsize), kind, order])
    return rows


@pytest.mark.parametrize("heading, dtype", [("Header", wire.HEADER), ("JOIN payload", wire.JOIN),
                                            ("CHALLENGE payload", wire.CHALLENGE)])
def test_wire_tables_match_the_dtypes(heading: str, dtype: np.dtype) -> None:
    assert [row[:5] for row in doc_table(heading)] == dtype_rows(dtype)
    assert all(dtype.fields[n][0].byteorder in ">|" for n in dtype.names)  # network order, as documented


def test_every_counter_is_documented() -> None:
    from intml.aggregator.slots import STAT_NAMES as AGGREGATOR
    from intml.worker.engine import STAT_NAMES as WORKER

    documented = set(re.findall(r"`([a-z_]+)`", PROTOCOL_MD))
    assert set(AGGREGATOR) | set(WORKER) <= documented


def test_slot_state_table_matches_the_reference() -> None:
    """docs/protocol.md's transition table lists exactly the (state, event) pairs of slot_reference.TRANSITIONS,
    each with that action."""
    from intml.protocol.slot_reference import RESEND, TRANSITIONS

    section = PROTOCOL_MD.split("### Transitions\n", 1)[1].split("\n#", 1)[0]
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in section.splitlines() if line.startswith("|")]
    documented = {(state, event): action for state, event, action in rows[2:]}
    assert set(documented) == set(TRANSITIONS)
    for pair, action in TRANSITIONS.items():
        assert ("re-send" if action == RESEND else action) in documented[pair], pair
