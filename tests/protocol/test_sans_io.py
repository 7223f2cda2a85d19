"""The sans-I/O promise, checked: importing a protocol core loads no socket, event-loop, clock or libc-binding code.

Two checks per core. Statically, no intml module the core loads imports an I/O module itself. Dynamically, in a
fresh interpreter, importing the core loads no intml driver module, and no I/O module beyond what numpy and
numba load on their own (numba pulls in ``socket`` through ``importlib.metadata``, which the core cannot help).
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys

import pytest

import intml

CORES = ["intml.aggregator.core", "intml.aggregator.counters", "intml.aggregator.slots", "intml.worker.engine",
         "intml.worker.session", "intml.protocol.codecs", "intml.protocol.slot_reference", "intml.p4.model",
         "intml.p4.engine"]
IO_MODULES = {"socket", "select", "selectors", "asyncio", "uvloop", "ctypes", "time", "threading", "signal",
              "scapy"}  # scapy reads the routing table through a netlink socket when imported
DRIVERS = {"intml.burstio", "intml.burstio.mmsg", "intml.worker.api", "intml.aggregator.dataplane"}

PROBE = """
import json, sys
import numpy, numba
before = set(sys.modules)
import {core}
print(json.dumps({{"new": sorted(set(sys.modules) - before), "intml": sorted(m for m in sys.modules
                                                                    if m.startswith("intml"))}}))
"""


def loaded_by(core: str) -> dict[str, list[str]]:
    done = subprocess.run([sys.executable, "-c", PROBE.format(core=core)], capture_output=True, text=True,
                          timeout=120, check=True)
    return json.loads(done.stdout)


def imported_names(module: str) -> set[str]:
    """Top-level names of the modules that ``module``'s source imports."""
    path = sys.modules[module].__file__ if module in sys.modules else __import__(module, fromlist=["_"]).__file__
    names = set()
    for node in ast.walk(ast.parse(open(path).read())):
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module.split(".")[0])
    return names


@pytest.mark.process
@pytest.mark.parametrize("core", CORES)
def test_core_loads_no_io(core: str) -> None:
    seen = loaded_by(core)
    assert core in seen["intml"]
    assert set(seen["intml"]) & DRIVERS == set()
    assert {m.split(".")[0] for m in seen["new"]} & IO_MODULES == set()
    for module in seen["intml"]:
        if module != "intml":
            assert imported_names(module) & IO_MODULES == set(), module


@pytest.mark.process
def test_the_probe_sees_io() -> None:
    """The check is not vacuous: a driver module is caught by both halves."""
    seen = loaded_by("intml.burstio.mmsg")
    assert "intml.burstio.mmsg" in seen["intml"] and {"ctypes", "socket"} & imported_names("intml.burstio.mmsg")
    assert intml.__name__ == "intml"
    assert "scapy" in {m.split(".")[0] for m in loaded_by("intml.testbed.capture")["new"]}
