"""The switch program meets the real compilers: p4c's ``p4test`` (front and mid end) and ``p4c-bm2-ss`` (BMv2's
back end) compile the v1model program, and ``p4test`` the Tofino sketch against Tofino's ``tna.p4``. Each runs
under a memory cap and a timeout, so that a program too large for the compiler fails this test instead of taking
the machine. The tools come from ``../shared/p4tools`` (or PATH); without them the tests are skipped, saying so."""

from __future__ import annotations

import os
import re
import resource
import shutil
import subprocess
from pathlib import Path

import pytest

from intml.p4 import generate

pytestmark = [pytest.mark.process, pytest.mark.slow]

P4 = generate.HERE
ROOT = next(d for d in Path(__file__).resolve().parents if (d / "pyproject.toml").exists())  # the checkout
TOOLS = ROOT.parent / "shared" / "p4tools"  # beside the checkout, as make test expects it
MEMORY_CAP = 4 << 30  # bytes: the brief's budget; p4c that needs more is a regression
TIMEOUT_S = 300  # a loaded 2-core machine; unloaded the compiles take well under this


def tool(name: str) -> Path | None:
    """``name`` from ../shared/p4tools/bin, else from PATH. The compilers find their include files relative to
    their own path, so they are run by their full path."""
    local = TOOLS / "bin" / name
    if local.exists():
        return local
    found = shutil.which(name)
    return Path(found) if found else None


def include_dir(program: Path) -> Path:
    return program.parent.parent / "share" / "p4c"


def _cap() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_CAP, MEMORY_CAP))


def compile_(name: str, *args: str, cwd: Path, warnings: bool = False) -> str:
    """Runs compiler ``name`` under the cap; fails the test on a non-zero exit or (unless ``warnings``) an
    unjustified warning, and returns its output."""
    program = tool(name)
    if program is None:
        pytest.skip(f"{name} is neither in {TOOLS}/bin nor on PATH: the program is checked by p4/syntax.py only")
    env = dict(os.environ, P4C_16_INCLUDE_PATH=str(include_dir(program) / "p4include"))
    try:
        result = subprocess.run([str(program), *args], capture_output=True, text=True, timeout=TIMEOUT_S,
                                cwd=cwd, env=env, preexec_fn=_cap)
    except subprocess.TimeoutExpired:
        pytest.fail(f"{name} took more than {TIMEOUT_S} s")
    output = result.stdout + result.stderr
    assert result.returncode == 0, f"{name} failed (exit {result.returncode}):\n{output[-4000:]}"
    if not warnings:
        found = [line for line in output.splitlines() if re.search(r"\[--W\w+=[\w-]+\] warning", line)
]
        assert found == [], "\n".join(found)
    return output


def test_v1model_program_passes_p4test(tmp_path: Path):
    compile_("p4test", "--std", "p4-16", str(P4 / "intml.p4"), cwd=tmp_path)


def test_v1model_program_compiles_for_bmv2(tmp_path: Path):
    compile_("p4c-bm2-ss", "-o", str(tmp_path / "intml.json"), str(P4 / "intml.p4"), cwd=tmp_path)
    assert (tmp_path / "intml.json").stat().st_size > 0


def test_tna_sketch_passes_p4test(tmp_path: Path):
    program = tool("p4test")
    if program is None:
        pytest.skip("p4test is neither in ../shared/p4tools/bin nor on PATH")
    tofino = include_dir(program) / "tofino-include"
    if not (tofino / "tna.p4").exists():
        pytest.skip(f"no tna.p4 in {tofino}: the TNA sketch is checked by p4/syntax.py only")
    # a sketch for the front end only (no Tofino back end here): its warnings (p4/README.md) do not fail it
    compile_("p4test", "--std", "p4-16", "-I", str(tofino), "-D__TARGET_TOFINO__=1",
             str(P4 / "tna" / "intml_tna.p4"), cwd=tmp_path, warnings=True)


def test_a_failing_program_fails(tmp_path: Path):
    """The harness itself: a program with a type error fails compile_ (so a green run means the compiler agreed)."""
    bad = tmp_path / "bad.p4"
    bad.write_text("#include <core.p4>\ncontrol C() { apply { bit<8> x = 1w1 + 8w1; } }\n")
    with pytest.raises(AssertionError, match="operands have different types"):
        compile_("p4test", "--std", "p4-16", str(bad), cwd=tmp_path)
