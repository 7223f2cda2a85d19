"""The specs in docs/ stay in step with the code: the wire-format tables of docs/protocol.md list exactly the
fields of protocol/wire.py (name, offset, size, type, byte order), and every counter the cores keep is documented."""

from __future__ import annotations

import re

import numpy as np
import pytest

from support.cluster import REPO_ROOT
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


README = (REPO_ROOT / "README.md").read_text()
CLI_NAMES = ("intml-testbed", "intml-aggregator", "intml-sim")


def readme_command_lines() -> list[str]:
    """Every intml-testbed / intml-aggregator / intml-sim command line of README.md: the lines of its code blocks
    that run one (continuation lines joined, after any VAR=value prefix), and the inline code spans that do."""
    blocks = re.findall(r"^```[a-z]*\n(.*?)^```", README, flags=re.M | re.S)
    lines = [line for block in blocks for line in block.replace("\\\n", " ").splitlines()]
    spans = re.findall(r"(?<!`)`([^`\n]+)`(?!`)", README)
    runs = re.compile(rf"^(?:[A-Z_]+=\S+\s+)*({'|'.join(CLI_NAMES)})\s+\S")  # a name alone is a mention
    return [line.strip() for line in lines + spans if runs.match(line.strip())]


def parse_readme_command(line: str) -> None:
    """Parse ``line`` with its CLI's parser and cross-option checks (SystemExit if refused); runs nothing."""
    import shlex

    from intml.aggregator import __main__ as aggregator_cli
    from intml.sim import __main__ as sim_cli
    from intml.testbed import __main__ as testbed_cli

    words = shlex.split(line, comments=True)
    while "=" in words[0]:  # INTML_AGGREGATOR=... before the command
        words.pop(0)
    name, argv = words[0], [w for w in words[1:] if w != "&"]
    if name == "intml-testbed":
        testbed_cli.check(testbed_cli.build_parser().parse_args(argv))
    elif name == "intml-aggregator":
        aggregator_cli.build_parser().parse_args(argv)
    else:
        sim_cli.build_parser().parse_args(argv)


def test_readme_finds_the_command_lines() -> None:
    lines = readme_command_lines()
    assert {re.search("|".join(CLI_NAMES), line)[0] for line in lines} == set(CLI_NAMES) and len(lines) > 30, lines


@pytest.mark.parametrize("line", readme_command_lines())
def test_readme_command_lines_parse(line: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each command line of the README is accepted by its CLI's parser as written (no [optional] brackets,
    placeholders or out-of-range values), so that a copied example runs."""
    monkeypatch.chdir(REPO_ROOT)  # the examples name repository files (sim/scenarios/..., docs/...)
    parse_readme_command(line)
