"""The packages form a straight line, read from the source: every import of an intml module (at the top of a file,
inside a function, under ``if TYPE_CHECKING``) is an edge of the import graph, and

* folder by folder, every edge points down the line protocol <- burstio <- {aggregator, worker} <- p4 <- sim <-
  testbed: a folder imports only folders on lower layers (aggregator and worker share a layer, and neither imports
  the other), so the folders form no cycle;
* the application layer sits on top: the ``__main__`` modules (the console scripts) and the public entry,
  ``intml/__init__.py`` (``from intml import Worker``), may import any folder, except that a folder's
  ``__main__`` imports not its sibling on the same layer either; no folder imports them;
* module by module, the graph has no cycle either (a deferred import that breaks one at run time still counts).

The folders are the packages pyproject.toml installs; a package folder that has no layer here fails the test, so a
new one is placed on the line when it is added.
"""

from __future__ import annotations

import ast
import tomllib
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path

import pytest

REPO_ROOT = next(p for p in Path(__file__).resolve().parents if (p / "pyproject.toml").is_file())
LAYERS = {"protocol": 0, "burstio": 1, "aggregator": 2, "worker": 2, "p4": 3, "sim": 4, "testbed": 5}
APPLICATION = "application"  # every __main__ module and the top package itself
LAYERS_WITH_APPLICATION = {**LAYERS, APPLICATION: max(LAYERS.values()) + 1}


def package_dirs() -> dict[str, Path]:
    """Installed package -> its folder, as pyproject.toml maps them (``intml.protocol`` -> ``protocol/``)."""
    config = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    return {package: REPO_ROOT / config["package-dir"][package] for package in config["packages"]}


def source_modules(dirs: Mapping[str, Path]) -> dict[str, str]:
    """Module name -> source text of every module of the packages (``intml.protocol.codecs`` for its
    ``__init__.py``)."""
    modules = {}
    for package, folder in dirs.items():
        for path in sorted(folder.glob("*.py")):
            name = package if path.stem == "__init__" else f"{package}.{path.stem}"
            modules[name] = path.read_text()
    return modules


def imports(module: str, source: str, known: Iterable[str], packages: Iterable[str]) -> Iterator[str]:
    """The intml modules (of ``known``) that ``module`` imports, anywhere in its source: ``from P import x``
    imports the module ``P.x`` where that is a module, else ``P``."""
    known = set(known)
    package = module if module in set(packages) else module.rpartition(".")[0]  # what relative imports start from
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names if alias.name in known)
        elif isinstance(node, ast.ImportFrom):
            base = package.rsplit(".", node.level - 1)[0] if node.level else ""  # a relative import's package
            target = ".".join(filter(None, (base, node.module)))
            for alias in node.names:
                if f"{target}.{alias.name}" in known:
                    yield f"{target}.{alias.name}"
                elif target in known:
                    yield target


def import_graph(modules: Mapping[str, str], packages: Iterable[str]) -> dict[str, set[str]]:
    """Module -> the modules it imports."""
    packages = set(packages)
    return {module: set(imports(module, source, modules, packages)) - {module} for module, source in modules.items()}


def folder(module: str) -> str:
    """The layer's name of a module: its top folder under intml, or the application layer."""
    parts = module.split(".")
    return APPLICATION if len(parts) == 1 or parts[-1] == "__main__" else parts[1]


def allowed(module: str, target: str) -> bool:
    """An import across folders points to a lower layer, and never to the sibling on the importer's own layer
    (for a __main__: its folder's layer)."""
    here, there = folder(module), folder(target)
    if here == there:
        return True
    home = module.split(".")[1] if here == APPLICATION and module != "intml" else here
    sibling = there != home and there in LAYERS and LAYERS[there] == LAYERS.get(home)
    return LAYERS_WITH_APPLICATION[there] < LAYERS_WITH_APPLICATION[here] and not sibling


def layer_violations(graph: Mapping[str, set[str]]) -> list[str]:
    """Every import that ``allowed`` refuses, one line each."""
    return [f"{module} ({folder(module)}) imports {target} ({folder(target)})"
            for module, targets in sorted(graph.items()) for target in sorted(targets) if not allowed(module, target)]


def cycles(graph: Mapping[str, Iterable[str]]) -> list[list[str]]:
    """The strongly connected components of more than one node (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in graph.get(node, ()):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while not component or component[-1] != node:
                component.append(stack.pop())
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def folder_graph(graph: Mapping[str, set[str]]) -> dict[str, set[str]]:
    """Layer name -> the other layers its modules import."""
    edges: dict[str, set[str]] = {}
    for module, targets in graph.items():
        edges.setdefault(folder(module), set()).update(folder(t) for t in targets if folder(t) != folder(module))
    return edges


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    dirs = package_dirs()
    return import_graph(source_modules(dirs), dirs)


def test_every_package_folder_has_a_layer() -> None:
    folders = {folder(package) for package in package_dirs()}
    assert folders == set(LAYERS_WITH_APPLICATION)


def test_the_scan_reads_every_source_file() -> None:
    """Every .py file under the package folders belongs to a package the scan reads (none hides in a folder that
    pyproject.toml does not list)."""
    dirs = package_dirs()
    scanned = {path for folder in dirs.values() for path in folder.glob("*.py")}
    on_disk = {path for folder in dirs.values() for path in folder.rglob("*.py") if "__pycache__" not in path.parts}
    assert on_disk - scanned == set()
    assert len(scanned) == len(source_modules(dirs))


def test_the_scan_sees_every_module(graph: dict[str, set[str]]) -> None:
    """Not vacuous: the graph holds the modules and edges this test is about."""
    assert {"intml", "intml.protocol.wire", "intml.protocol.codecs.cnat8", "intml.worker.torch.backend",
            "intml.aggregator.__main__"} <= set(graph)
    assert "intml.protocol.codec" in graph["intml.protocol.codecs.cnat8"]
    assert "intml.worker.api" in graph["intml"]  # under TYPE_CHECKING and inside __getattr__
    assert "intml.p4.engine" in graph["intml.aggregator.__main__"]  # deferred, inside a function


def test_folders_follow_the_line(graph: dict[str, set[str]]) -> None:
    assert layer_violations(graph) == []


def test_folders_form_no_cycle(graph: dict[str, set[str]]) -> None:
    assert cycles(folder_graph(graph)) == []


def test_modules_form_no_cycle(graph: dict[str, set[str]]) -> None:
    assert cycles(graph) == []


def test_the_checks_catch_what_they_forbid() -> None:
    """Each check fails on a tree that breaks it: an upward import, a sideways one between aggregator and worker
    (from a module or from a __main__), a folder that imports a __main__, and a cycle that a deferred or relative
    import hides."""
    sources = {
        "intml.protocol": "",
        "intml.protocol.wire": "def payload_dtype():\n    from intml.protocol.codecs import BY_ID\n",
        "intml.protocol.codecs": "from .wire import Codec\n",
        "intml.aggregator.core": "from intml.worker.session import MAX_CORES\nimport intml.p4.model\n",
        "intml.aggregator.__main__": "from intml.p4 import model\nfrom intml.worker.session import MAX_CORES\n",
        "intml.worker.session": "from intml.aggregator import __main__\n",
        "intml.p4.model": "from intml.protocol import wire\nfrom intml.aggregator import core\n",
    }
    graph = import_graph(sources, ["intml.protocol"])
    assert graph["intml.protocol.codecs"] == {"intml.protocol.wire"}
    assert graph["intml.aggregator.__main__"] == {"intml.p4.model", "intml.worker.session"}
    assert layer_violations(graph) == [
        "intml.aggregator.__main__ (application) imports intml.worker.session (worker)",
        "intml.aggregator.core (aggregator) imports intml.p4.model (p4)",
        "intml.aggregator.core (aggregator) imports intml.worker.session (worker)",
        "intml.worker.session (worker) imports intml.aggregator.__main__ (application)",
    ]
    assert sorted(cycles(graph)) == [
        ["intml.aggregator.__main__", "intml.aggregator.core", "intml.p4.model", "intml.worker.session"],
        ["intml.protocol.codecs", "intml.protocol.wire"],
    ]
    assert cycles(folder_graph(graph)) == [["aggregator", "application", "p4", "worker"]]
