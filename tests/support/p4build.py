"""The real P4 compilers, run once per program: ``tool`` finds p4c's binaries (``../shared/p4tools/bin``, else PATH),
``compile_`` runs one under a memory cap and a timeout, ``compiled`` returns the BMv2 JSON of the v1model program
and ``tna_front_end`` p4test's output on the Tofino sketch, each made only when no earlier run (this process,
another test process, an earlier run of the suite) compiled the same sources with the same defines and the same
compiler. The cache is keyed by a hash of the ``.p4`` files, so an edited program is always recompiled; a file lock
keeps two processes from compiling it twice."""

from __future__ import annotations

import fcntl
import hashlib
import os
import re
import resource
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import pytest
from support.background import start

from intml.p4 import generate

P4 = generate.HERE
ROOT = next(d for d in Path(__file__).resolve().parents if (d / "pyproject.toml").exists())  # the checkout
TOOLS = ROOT.parent / "shared" / "p4tools"  # beside the checkout, as make test expects it
MEMORY_CAP = 4 << 30  # bytes: the brief's budget; p4c that needs more is a regression
TIMEOUT_S = 300  # a loaded 2-core machine; unloaded the compiles take well under this
CACHE = Path(tempfile.gettempdir()) / f"intml-p4build-{os.getuid()}"


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
        found = [line for line in output.splitlines() if re.search(r"\[--W\w+=[\w-]+\] warning", line)]
        assert found == [], "\n".join(found)
    return output


def _key(compiler_name: str, sources: list[Path], defines: tuple[str, ...]) -> str:
    digest = hashlib.sha256()
    for source in sources:
        digest.update(str(source.relative_to(P4)).encode() + b"\0" + source.read_bytes())
    compiler = tool(compiler_name)
    if compiler is not None:
        stat = compiler.stat()
        digest.update(f"{compiler}:{stat.st_size}:{stat.st_mtime_ns}".encode())
    digest.update("\0".join(defines).encode())
    return digest.hexdigest()[:20]


def _once(key: str, name: str, make: Callable[[Path, Path], None]) -> Path:
    """CACHE/key/name, made by ``make(partial, folder)`` (and renamed, so that a killed compile leaves nothing)
    unless an earlier run made it."""
    folder = CACHE / key
    folder.mkdir(parents=True, exist_ok=True)
    target = folder / name
    with (folder / "lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # a second process waits for the first one's compile
        if not target.exists():
            partial = folder / f"{name}.partial"
            make(partial, folder)
            partial.rename(target)
    return target


def compiled(*defines: str) -> Path:
    """The BMv2 JSON of ``p4/intml.p4`` compiled by ``p4c-bm2-ss`` with ``-D`` ``defines``, from the cache when
    these exact sources were compiled before."""
    return _once(_key("p4c-bm2-ss", sorted(P4.glob("*.p4")), defines), "intml.json",
                 lambda partial, folder: compile_("p4c-bm2-ss", *(f"-D{d}" for d in defines), "-o", str(partial),
                                                  str(P4 / "intml.p4"), cwd=folder))


def tofino_include() -> Path | None:
    """Tofino's include files beside p4test (tna.p4), or None where p4test or they are missing."""
    program = tool("p4test")
    folder = None if program is None else include_dir(program) / "tofino-include"
    return folder if folder is not None and (folder / "tna.p4").exists() else None


def tna_front_end() -> str:
    """p4test's output, warnings included, on the Tofino sketch ``p4/tna/intml_tna.p4`` (p4c's front and mid end
    only: there is no Tofino back end here), from the cache when these exact sources were checked before. Needs
    ``tofino_include()``."""
    tofino = tofino_include()
    assert tofino is not None, "no p4test with tofino-include/tna.p4"
    defines = ("__TARGET_TOFINO__=1",)
    sources = sorted(P4.glob("*.p4")) + sorted((P4 / "tna").glob("*.p4"))
    return _once(_key("p4test", sources, defines), "p4test.out",
                 lambda partial, folder: partial.write_text(compile_(
                     "p4test", "--std", "p4-16", "-I", str(tofino), *(f"-D{d}" for d in defines),
                     str(P4 / "tna" / "intml_tna.p4"), cwd=folder, warnings=True))).read_text()


PROGRAMS = ((), (generate.TEST_RANDOM,))  # the shipped program and the BMv2 tests' build: the defines of each


def compile_in_background() -> subprocess.Popen | None:
    """Start compiling every program in PROGRAMS, then checking the Tofino sketch, into the cache in the cores'
    idle time (support/background.py), or None without p4c. A test that needs a program first waits on its lock
    (``compiled``, ``tna_front_end``); a killed compile leaves nothing."""
    if tool("p4c-bm2-ss") is None:
        return None
    return start([sys.executable, "-m", "support.p4build"], cwd=ROOT / "tests")


if __name__ == "__main__":
    for defines in PROGRAMS:
        compiled(*defines)
    if tofino_include() is not None:
        tna_front_end()
