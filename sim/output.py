"""Output: the terminal table, JSON and CSV (each carrying the scenario's hash, its seeds and the code version),
and the optional PNG plots (matplotlib is the ``plot`` extra)."""

from __future__ import annotations

import csv
import io
import json
import subprocess
from importlib.metadata import version
from pathlib import Path


class PlotUnavailable(RuntimeError):
    pass


def code_version() -> str:
    """The package version and, in a git checkout, its commit (with -dirty for local changes)."""
    try:
        here = Path(__file__).resolve().parent
        rev = subprocess.run(["git", "describe", "--always", "--dirty"], cwd=here, capture_output=True, text=True,
                             timeout=5).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        rev = ""
    package = version("intml")  # the installed distribution's, not intml.__version__: sim/ sits below the top package
    return f"{package}+{rev}" if rev else package


def _cell(v: object) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


def table(rows: list[dict], columns: tuple[str, ...]) -> str:
    cells = [[_cell(r.get(c, "")) for c in columns] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) if cells else len(c) for i, c in enumerate(columns)]
    lines = ["  ".join(c.rjust(w) for c, w in zip(columns, widths))]
    lines += ["  ".join(v.rjust(w) for v, w in zip(row, widths)) for row in cells]
    return "\n".join(lines)


def as_json(meta: dict, rows: list[dict]) -> str:
    return json.dumps({**meta, "rows": rows}, indent=2)


def as_csv(meta: dict, rows: list[dict]) -> str:
    out = io.StringIO()
    keys = list(dict.fromkeys(k for r in rows for k in r))
    w = csv.DictWriter(out, fieldnames=list(meta) + keys)
    w.writeheader()
    for r in rows:
        w.writerow({**{k: json.dumps(v) if isinstance(v, (list, dict)) else v for k, v in meta.items()}, **r})
    return out.getvalue()


def pyplot():
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise PlotUnavailable("plots need matplotlib: pip install 'intml[plot]'") from None
    return plt


def plot_lines(path: str, series: dict[str, list[tuple[float, float]]], *, xlabel: str, ylabel: str, title: str,
               logx: bool = False, logy: bool = False, symlogx: bool = False) -> None:
    """One line per series of (x, y) points."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for name, pts in series.items():
        pts = sorted(pts)
        ax.plot([x for x, _ in pts], [y for _, y in pts], marker="o", label=name)
    ax.set(xlabel=xlabel, ylabel=ylabel, title=title)
    if logx:
        ax.set_xscale("log", base=2)
    if symlogx:  # loss rates from 0 up: linear near 0, logarithmic beyond
        ax.set_xscale("symlog", linthresh=1e-4)
    if logy:
        ax.set_yscale("log")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
