"""Timing helpers shared by the benchmarks: figures are medians over repeats, never single runs."""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable


def median_seconds(fn: Callable[[], object], repeats: int, warmup: int = 1) -> float:
    """Median wall time of fn() over `repeats` runs after `warmup` untimed runs (which also compile kernels)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def interleaved_times(fns: dict[str, Callable[[], object]], repeats: int, warmup: int = 1,
                      alternate: tuple[str, str] | None = None) -> dict[str, list[float]]:
    """Wall times of each fn over `repeats` rounds, each round running every fn once in turn (after `warmup`
    untimed rounds): a burst of load from other jobs then slows neighbours in a round alike, so a ratio taken
    within each round holds where one fn's repeats back to back would catch the burst alone. The two fns named in
    `alternate` swap places in every second round, so that neither always finds the caches as the other left them."""
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    swapped = list(fns)
    if alternate:
        i, j = swapped.index(alternate[0]), swapped.index(alternate[1])
        swapped[i], swapped[j] = swapped[j], swapped[i]
    for round_ in range(repeats):
        for name in swapped if round_ % 2 else fns:
            fn = fns[name]
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return times


def emit(rows: list[dict], as_json: bool, title: str, columns: list[tuple[str, str, str]], extra: dict) -> None:
    """Print rows as an aligned table (columns: key, header, format) or, with as_json, as one JSON object."""
    if as_json:
        print(json.dumps({"benchmark": title, **extra, "rows": rows}, indent=2))
        return
    print(title)
    for key, value in extra.items():
        print(f"  {key}: {value}")
    widths = [max(len(header), *(len(format(row[key], fmt)) for row in rows)) for key, header, fmt in columns]
    print("  " + "  ".join(header.rjust(w) for (_, header, _), w in zip(columns, widths)))
    for row in rows:
        print("  " + "  ".join(format(row[key], fmt).rjust(w) for (key, _, fmt), w in zip(columns, widths)))
