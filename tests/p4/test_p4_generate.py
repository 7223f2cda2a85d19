"""p4.generate: the committed .p4 files are what the generator writes, they parse with the P4_16 grammar, pass
the structural checks, and declare exactly p4/layout.py's tables, registers and constants (the layout the
pipeline model executes). tests/p4/test_p4_compile.py compiles them with p4c."""

from pathlib import Path

import pytest

from intml.p4 import entries, generate, layout, syntax

P4 = generate.HERE
PROGRAMS = {"v1model": P4 / "intml.p4", "tna": P4 / "tna" / "intml_tna.p4"}


@pytest.fixture(scope="module")
def trees():
    return {name: syntax.parse(path) for name, path in PROGRAMS.items()}


def test_committed_files_are_what_the_generator_writes():
    assert generate.differing() == [], "run: python -m intml.p4.generate"
    assert generate.main(["--check"]) == 0


def test_check_names_a_file_that_differs(tmp_path: Path, capsys):
    generate.write(tmp_path)
    assert generate.differing(tmp_path) == []
    (tmp_path / "next_step.p4").write_text((tmp_path / "next_step.p4").read_text().replace("drop_stale()", "add()"))
    (tmp_path / "lanes.p4").unlink()
    assert generate.differing(tmp_path) == [Path("next_step.p4"), Path("lanes.p4")]


def test_the_intml_header_is_the_wire_layout():
    """headers.p4's intml_h, field by field, lies at protocol.wire's offsets; the wire's 16-bit rank is the
    owners code (its high byte: first in network order) and the rank (its low byte)."""
    import re

    from intml.protocol import wire

    body = re.search(r"header intml_h \{(.*?)\}", (P4 / "headers.p4").read_text(), re.S)[1]
    fields = [(name, int(bits)) for bits, name in re.findall(r"bit<(\d+)> (\w+);", body)]
    offsets, bit = {}, 0
    for name, bits in fields:
        offsets[name] = (bit // 8, bits)
        bit += bits
    assert bit == 8 * wire.HEADER_SIZE
    split = {"owners": (wire.OFFSETS["rank"], 8), "rank": (wire.OFFSETS["rank"] + 1, 8)}
    assert wire.OWNERS_SHIFT == 8 and wire.RANK_MASK == 0xFF
    assert offsets == {name: split.get(name, (wire.OFFSETS[name], 8 * wire.HEADER.fields[name][0].itemsize))
                       for name in wire.HEADER.names if name != "rank"} | split


def test_every_file_is_part_of_a_program():
    committed = {p.relative_to(P4) for p in P4.rglob("*.p4")}
    included = {path.relative_to(P4) for program in PROGRAMS.values()
                for path, _ in syntax.Source(program).origin}
    generated = set(generate.files())
    assert committed == included and generated <= committed
    assert committed - generated == {Path(f"{name}.p4") for name in generate.HAND_WRITTEN}


def test_generated_files_are_marked_so():
    """.gitattributes marks exactly the generated files linguist-generated (a reviewer's diff folds them)."""
    lines = (P4.parent / ".gitattributes").read_text().splitlines()
    marked = {Path(line.split()[0]).relative_to("p4") for line in lines if "linguist-generated=true" in line}
    assert marked == set(generate.files())


@pytest.mark.slow
def test_the_test_build_takes_its_random_words_from_the_packet():
    """-DINTML_TEST_RANDOM replaces v1model's random() by the words the packet carries, one per lane, and passes the
    structural checks; the shipped program has none of it."""
    shipped, test = (syntax.Source(PROGRAMS["v1model"], defines).text for defines in ((), (generate.TEST_RANDOM,)))
    assert "random<bit<32>>(lane.rand" in shipped and "hdr.test_random.words" not in shipped
    assert "random<bit<32>>" not in test and test.count("hdr.test_random.words[") == layout.LANES_PER_PASS
    tree = syntax.parse(PROGRAMS["v1model"], [generate.TEST_RANDOM])
    assert syntax.check_applies(tree) == [] and syntax.check_register_indexes(tree) == []


@pytest.mark.slow
@pytest.mark.parametrize("program", PROGRAMS)
def test_structural_checks_pass(trees, program):
    tree = trees[program]
    assert syntax.check_applies(tree) == []
    assert syntax.check_register_indexes(tree) == []
    # headers.p4 declares the layout constants the v1model program names (p4c warns of an unused const), the
    # sketch's types the ones only it names; the sketch includes headers.p4
    files = [path for path in P4.rglob("*.p4") if path.name != "headers.p4" and (program == "tna" or
                                                                                 path.parent == P4)]
    expected = generate.used_constants(path.read_text() for path in files)
    assert len(expected) > 40
    assert syntax.check_constants(tree, expected) == []


@pytest.mark.slow
def test_tables_are_the_layouts(trees):
    found = syntax.tables(trees["v1model"])
    assert set(found) == {t.name for t in layout.TABLES}
    static = entries.static_entries()
    for table in layout.TABLES:
        p4 = found[table.name]
        assert p4["keys"] == [(k.field, k.match) for k in table.keys], table.name
        assert p4["actions"] == [a.name for a in table.actions], table.name
        count = sum(e.table == table.name for e in static)
        assert p4["size"] == (None if table.const else table.size), table.name
        assert p4["entries"] == (count if table.const else 0) and count <= table.size, table.name


@pytest.mark.slow
def test_registers_are_the_layouts(trees):
    found = syntax.registers(trees["v1model"])
    assert set(found) == {r.name for r in layout.REGISTERS}
    controls = syntax.instances(trees["v1model"])
    for register in layout.REGISTERS:
        p4 = found[register.name]
        assert (p4["width"], p4["size"]) == (register.width, register.entries), register.name
        # a per-lane register lives in a lane control instantiated once per lane of a pass; "": at top level
        assert (controls[p4["control"]] if p4["control"] else 1) == (register.lanes or 1), register.name


@pytest.mark.slow
def test_lane_tables_are_one_per_lane(trees):
    found, controls = syntax.tables(trees["v1model"]), syntax.instances(trees["v1model"])
    for table in layout.TABLES:
        assert controls[found[table.name]["control"]] == (table.lanes or 1), table.name


def test_const_entries_are_rendered_from_entries_py():
    text = (P4 / "next_step.p4").read_text()
    for e in entries.next_step_entries():
        assert syntax_entry(e) in text
    text = (P4 / "cnat_encode.p4").read_text()
    assert "(8w1 &&& 8w1)" not in text  # ternary keys are rendered with the key's width, 32 bits
    assert "32w0x80000000 &&& 32w0x80000000 : encode_b31();" in text


def syntax_entry(e) -> str:
    from intml.p4.p4text import entry_text
    return entry_text(layout.TABLE[e.table], e)


def test_readme_lists_the_layout():
    rows = {line.split("|")[1].strip(): line for line in (P4 / "README.md").read_text().splitlines()
            if line.startswith("| `")}
    for register in layout.REGISTERS:
        cells = [c.strip() for c in rows[f"`{register.name}`"].split("|")]
        assert cells[2:5] == [f"{register.entries:,}", str(register.width), str(register.lanes or "")], register.name
    for table in layout.TABLES:
        cells = [c.strip() for c in rows[f"`{table.name}`"].split("|")]
        assert cells[3] == f"{table.size:,}" and cells[5] == str(table.lanes or ""), table.name


def _run_encode(magnitude: int, negative: bool, rand: int) -> int:
    """The code the program's leading_one entries and encode_b<b> actions give, read from their generated text."""
    import re

    from intml.p4.actions import ACTION_BODIES
    hits = [e.action for e in entries.leading_one_entries() if magnitude & e.key[0][1] == e.key[0][0]]
    assert len(hits) <= 1
    if not hits:
        return 0  # encode_zero
    body = ACTION_BODIES["leading_one"][hits[0]]
    b = int(hits[0].removeprefix("encode_b"))
    k = b
    rounding = re.fullmatch(r"lane\.code = lane\.sign \| NONZERO \| \(\(lane\.rand >> (\d+)\) < \(lane\.magnitude "
                            r"& (0x[0-9a-f]+)\) \? 8w(\d+) : 8w(\d+)\);", body)
    if rounding:  # b > 0
        shift, mask, up, down = int(rounding[1]), int(rounding[2], 16), int(rounding[3]), int(rounding[4])
        assert (shift, mask, up, down) == (32 - b, (1 << b) - 1, b + 1, b)
        k = up if rand >> shift < magnitude & mask else down
    else:
        assert body == "lane.code = lane.sign | NONZERO | (8w0);" and b == 0
    return (layout.SIGN if negative else 0) | layout.NONZERO | k


@pytest.mark.slow
def test_encode_actions_are_the_kernels_rounding():
    """leading_one + encode_b<b>, as generated, give the code protocol.arith._sum_code gives, bit for bit."""
    import numpy as np

    from intml.protocol.arith import _sum_code
    rng = np.random.default_rng(12)
    sums = [0, 1, -1, 2, -2, 3, (1 << 30), -(1 << 30), (1 << 30) - 1, 5, -7]
    sums += [int(x) for x in rng.integers(-(1 << 30), 1 << 30, 3000)]
    shifts = rng.integers(0, 31, 3000)  # small magnitudes too: every leading-one position
    sums += [int(s) >> int(shift) for s, shift in zip(rng.integers(-(1 << 30), 1 << 30, 3000), shifts)]
    for s in sums:
        r = int(rng.integers(0, 1 << 32))
        neg, a, k = (int(v) for v in _sum_code(np.int32(s), np.uint32(r)))
        expected = 0 if a == 0 else (neg << 7) | layout.NONZERO | k
        assert _run_encode(abs(s), s < 0, r) == expected, (s, r)


def test_lane_check_is_the_layouts():
    """The program's code_ok (every pass's check of each C_nat element) is layout.lane_ok or a non-finite flags
    code, for every code and bound: its return expression, read from the generated text, evaluated as Python."""
    import re
    text = (P4 / "cnat_decode.p4").read_text()
    expression = re.search(r"bool code_ok\(in bit<8> code, in bit<8> k_limit\) \{\s*return (.*?);\s*\}", text, re.S)[1]
    python = expression.replace("||", " or ").replace("&&", " and ")
    constants = {"NONZERO": layout.NONZERO, "K_MASK": layout.K_MASK}
    for k_limit in range(0, 33):
        for code in range(256):
            admitted = layout.lane_ok(code, k_limit) or code in layout.FLAG_CODES
            assert eval(python, {}, {**constants, "code": code, "k_limit": k_limit}) == admitted
