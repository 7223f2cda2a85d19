"""The switch program meets the real compilers: ``p4c-bm2-ss`` (p4c's front and mid end and BMv2's back end)
compiles the v1model program, and ``p4test`` the Tofino sketch against Tofino's ``tna.p4``. Each runs
under a memory cap and a timeout, so that a program too large for the compiler fails this test instead of taking
the machine. The tools come from ``../shared/p4tools`` (or PATH); without them the tests are skipped, saying so."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from support.p4build import compile_, compiled, tna_front_end, tofino_include, tool

pytestmark = [pytest.mark.process, pytest.mark.slow]


def test_v1model_program_compiles_for_bmv2():
    """p4c-bm2-ss runs p4c's front and mid end (what p4test runs) and BMv2's back end, warnings failing it: a
    separate p4test of the v1model program would repeat the first two (a minute of a CPU each run)."""
    assert compiled().stat().st_size > 0


def test_tna_sketch_passes_p4test():
    if tool("p4test") is None:
        pytest.skip("p4test is neither in ../shared/p4tools/bin nor on PATH")
    if tofino_include() is None:
        pytest.skip("no tofino-include/tna.p4 beside p4test: the TNA sketch is checked by p4/syntax.py only")
    # a sketch for the front end only (no Tofino back end here): the warnings p4/README.md names are its
    # unwritten judging tables' fields; any other kind fails it
    kinds = set(re.findall(r"\[--Wwarn=([\w-]+)\] warning", tna_front_end()))
    assert kinds <= {"uninitialized-use", "unused", "uninitialized-out-param"}, kinds


def test_a_failing_program_fails(tmp_path: Path):
    """The harness itself: a program with a type error fails compile_ (so a green run means the compiler agreed)."""
    bad = tmp_path / "bad.p4"
    bad.write_text("#include <core.p4>\ncontrol C() { apply { bit<8> x = 1w1 + 8w1; } }\n")
    with pytest.raises(AssertionError, match="operands have different types"):
        compile_("p4test", "--std", "p4-16", str(bad), cwd=tmp_path)
