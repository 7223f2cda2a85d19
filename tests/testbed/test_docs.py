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
    from intml.protocol.stats import STAT_NAMES as AGGREGATOR
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


CLI_NAMES = ("intml-testbed", "intml-aggregator", "intml-sim")
README = REPO_ROOT / "README.md"
PAGES = [README, *sorted((REPO_ROOT / "docs").glob("*.md"))]  # the front door and every page behind it
README_MAX_LINES = 300
# The project's texts speak of the project, not of the sessions or tickets that built it.
PROVENANCE = re.compile(r"session [0-9]|issue #?[0-9]+", re.I)


def command_lines(text: str) -> list[str]:
    """Every intml-testbed / intml-aggregator / intml-sim command line of a Markdown page: the lines of its code
    blocks that run one (continuation lines joined, after any VAR=value prefix), and the inline code spans that do."""
    blocks = re.findall(r"^```[a-z]*\n(.*?)^```", text, flags=re.M | re.S)
    lines = [line for block in blocks for line in block.replace("\\\n", " ").splitlines()]
    spans = re.findall(r"(?<!`)`([^`\n]+)`(?!`)", text)
    runs = re.compile(rf"^(?:[A-Z_]+=\S+\s+)*({'|'.join(CLI_NAMES)})\s+\S")  # a name alone is a mention
    return [line.strip() for line in lines + spans if runs.match(line.strip())]


def documented_command_lines() -> list[tuple[str, str]]:
    """(page, command line) for every command line of README.md and docs/*.md, the page relative to the repo."""
    return [(str(page.relative_to(REPO_ROOT)), line) for page in PAGES for line in command_lines(page.read_text())]


def parse_documented_command(line: str) -> None:
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


def test_the_pages_show_every_cli() -> None:
    found = documented_command_lines()
    assert {re.search("|".join(CLI_NAMES), line)[0] for _, line in found} == set(CLI_NAMES) and len(found) > 30, found
    assert any(page == "README.md" for page, _ in found), "the README's quick start shows no command"


@pytest.mark.parametrize("page, line", documented_command_lines())
def test_documented_command_lines_parse(page: str, line: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each command line of README.md and docs/*.md is accepted by its CLI's parser as written (no [optional]
    brackets, placeholders or out-of-range values), so that a copied example runs."""
    monkeypatch.chdir(REPO_ROOT)  # the examples name repository files (sim/scenarios/..., docs/...)
    parse_documented_command(line)


def test_command_lines_are_found_where_they_are_written() -> None:
    """The scanner takes code-block lines (joined across backslashes, after VAR=value) and runnable spans, and
    leaves a bare mention of a tool's name alone."""
    page = ("Run `intml-sim bench` or mention `intml-sim` alone.\n\n```sh\nINTML_TOKEN=x intml-aggregator --port 0 \\\n"
            "    --cores 1 &\nls -l\n```\n")
    assert command_lines(page) == ["INTML_TOKEN=x intml-aggregator --port 0      --cores 1 &", "intml-sim bench"]


def test_a_refused_command_line_fails() -> None:
    """The check can fail: a value out of range is refused by the same parsers."""
    with pytest.raises(SystemExit):
        parse_documented_command("intml-testbed bench allreduce --workers 65")


def test_readme_is_a_front_door() -> None:
    lines = README.read_text().splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines; move detail into docs/"


@pytest.mark.parametrize("page", PAGES, ids=lambda page: page.name)
def test_pages_speak_of_the_project(page) -> None:
    found = [(number, line) for number, line in enumerate(page.read_text().splitlines(), 1) if PROVENANCE.search(line)]
    assert not found, f"{page.name}: {found}"


def source_files() -> list:
    """The project's code and configuration: every .py, .p4, .lark and .toml file and the Makefile, outside
    hidden folders (.venv, .git) and build output."""
    suffixes = {".py", ".p4", ".lark", ".toml"}
    return [path for path in sorted(REPO_ROOT.rglob("*"))
            if (path.suffix in suffixes or path.name == "Makefile") and path.is_file()
            and not any(part.startswith(".") or part.endswith(".egg-info") or part == "build"
                        for part in path.relative_to(REPO_ROOT).parts[:-1])]


def test_code_speaks_of_the_project() -> None:
    files = source_files()
    assert REPO_ROOT / "protocol" / "wire.py" in files and REPO_ROOT / "Makefile" in files
    found = [f"{path.relative_to(REPO_ROOT)}:{number}" for path in files
             for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1) if PROVENANCE.search(line)]
    assert not found, found


def anchors(page) -> set[str]:
    """The anchors GitHub gives a page's headings: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.M | re.S)  # a '# comment' in a block is no heading
    slugs = set()
    for heading in re.findall(r"^#{1,6} +(.+?) *$", text, flags=re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")
        slugs.add(slug)
    return slugs


def test_anchor_slugs_follow_github() -> None:
    page = REPO_ROOT / "docs" / "benchmarks.md"
    assert {"link-speed-gsogro-multicast-several-aggregators", "the-dataresult-macs-cost"} <= anchors(page)


@pytest.mark.parametrize("page", PAGES, ids=lambda page: page.name)
def test_relative_links_resolve(page) -> None:
    """Every relative link of README.md and docs/*.md names a file that exists and, with #anchor, a heading of it."""
    text = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.M | re.S)
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+:", target):
            continue  # http:, https:, mailto:
        path, _, anchor = target.partition("#")
        linked = (page.parent / path).resolve() if path else page
        if not linked.exists() or (anchor and linked.suffix == ".md" and anchor not in anchors(linked)):
            broken.append(target)
    assert not broken, f"{page.name}: {broken}"
