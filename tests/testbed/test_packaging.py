"""Packaging: the repository's folders install as the one namespace ``intml``, and no file imports them by their
bare folder names (which would load a second copy of a module, or only work with the repository on sys.path)."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from support.cluster import REPO_ROOT

FOLDERS = ("protocol", "aggregator", "worker", "burstio", "testbed", "sim", "p4")
BARE_IMPORT = re.compile(rf"^\s*(?:from|import)\s+(?:{'|'.join(FOLDERS)})(?:\.|\s|$)", re.M)
BARE_MODULE_RUN = re.compile(rf"""["']-m["'],\s*["'](?:{'|'.join(FOLDERS)})[."']""")


def python_files() -> list[Path]:
    return [p for p in REPO_ROOT.rglob("*.py") if not {".venv", "build", ".git"} & set(p.parts)]


def test_no_bare_top_level_imports() -> None:
    offenders = [f"{p.relative_to(REPO_ROOT)}: {m.group(0).strip()}" for p in python_files()
                 for m in (*BARE_IMPORT.finditer(p.read_text()), *BARE_MODULE_RUN.finditer(p.read_text()))]
    assert offenders == []


def test_the_scan_catches_bare_imports() -> None:
    """The patterns above are not vacuous."""
    assert BARE_IMPORT.search("from protocol import wire") and BARE_IMPORT.search("    import worker.torch as t")
    assert BARE_MODULE_RUN.search("[sys.executable, '-m', " + "'aggregator', '--port']")
    assert not BARE_IMPORT.search("from intml.protocol import wire\nimport protocolx")


@pytest.mark.process
def test_install_puts_only_intml_in_site_packages(tmp_path: Path) -> None:
    """``pip install .`` (here into a target folder, no dependencies) adds the intml package and its metadata."""
    source = tmp_path / "source"  # a copy, so the build leaves nothing in the repository
    shutil.copytree(REPO_ROOT, source, ignore=shutil.ignore_patterns(".venv", ".git", "build", "*.egg-info",
                                                                      "__pycache__", ".hypothesis", ".pytest_cache"))
    done = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--disable-pip-version-check", "--no-deps",
                           "--no-build-isolation", "--target", str(tmp_path / "site"), str(source)],
                          capture_output=True, text=True, timeout=300, check=False, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    top = sorted(p.name for p in (tmp_path / "site").iterdir() if p.name != "bin")
    assert top == ["intml", "intml-0.1.0.dist-info"]
    packages = sorted(p.name for p in (tmp_path / "site" / "intml").iterdir() if p.is_dir() and p.name != "__pycache__")
    assert packages == ["aggregator", "burstio", "p4", "protocol", "sim", "testbed", "worker"]
    assert (tmp_path / "site" / "intml" / "protocol" / "codecs" / "cnat8.py").exists()
    assert (tmp_path / "site" / "intml" / "worker" / "torch" / "backend.py").exists()
    scripts = (tmp_path / "site" / "intml-0.1.0.dist-info" / "entry_points.txt").read_text()
    assert "intml-aggregator = intml.aggregator.__main__:main" in scripts
    # the installed copy imports on its own, from outside the repository
    probe = subprocess.run([sys.executable, "-c", "import intml, intml.aggregator.core; print(intml.__file__)"],
                           capture_output=True, text=True, timeout=120, check=False, cwd=tmp_path,
                           env={"PYTHONPATH": str(tmp_path / "site"), "PATH": "/usr/bin:/bin"})
    assert probe.returncode == 0, probe.stderr[-2000:]
    assert probe.stdout.strip() == str(tmp_path / "site" / "intml" / "__init__.py")


def test_public_api() -> None:
    import intml
    from intml.worker.api import AllreduceTimeout, JoinError, Worker

    assert (intml.Worker, intml.AllreduceTimeout, intml.JoinError) == (Worker, AllreduceTimeout, JoinError)
