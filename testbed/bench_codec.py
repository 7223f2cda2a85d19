"""`intml-testbed bench codec`: elements/s of each C_nat kernel on one thread, beside a memory copy.

The anchor is np.copyto of the same float32 array in the same run: a kernel that reads 4 bytes and writes 1
per element cannot beat memory bandwidth by much, so the ratio says how close to the memory wall it runs. The
kernels take turns within each repeat, and stochastic encode's speed against deterministic encode's is the
median over pairs of consecutive repeats of its ratio within the pair, so it holds on a VM whose load comes and
goes. The two encodes swap places in every second repeat: at 4M elements the one that ran first in a repeat, after
the other kernels' arrays went through the caches, was up to a fifth slower, whichever it was (docs/benchmarks.md).
"""

from __future__ import annotations

import platform
import statistics

import numpy as np

from intml.protocol import arith, cnat
from intml.testbed.timing import emit, interleaved_times

TARGETS = {"stochastic encode": "≥ 1.5 G/s, ≥ 35% of copy, ≥ 0.85× deterministic", "decode": "≥ 2 G/s"}


def pair_ratios(numerator: list[float], denominator: list[float]) -> list[float]:
    """numerator's total time over denominator's in each pair of consecutive repeats (one of each order where the two
    alternate), leaving out a last unpaired repeat; a single repeat gives its own ratio."""
    if len(numerator) < 2:
        return [numerator[0] / denominator[0]]
    pairs = range(0, len(numerator) - 1, 2)
    return [(numerator[i] + numerator[i + 1]) / (denominator[i] + denominator[i + 1]) for i in pairs]


def run(elements: int, repeats: int, as_json: bool) -> list[dict]:
    rng = np.random.default_rng(0)
    x = (rng.standard_normal(elements) * 1e-3).astype(np.float32)  # gradient-like magnitudes
    codes = np.empty(elements, np.uint8)
    values = np.empty(elements, np.float32)
    copy = np.empty_like(x)
    acc = np.zeros(elements, np.float32)
    sums = rng.integers(-(2**28), 2**28, elements, dtype=np.int32)
    floor = arith.cnat_floor(int(arith.chunk_exponents(x, x.size, arith.CNAT_RANGE)[0]), arith.value_bits(2))
    cnat.encode(x, seed=1, stream=2, floor=floor, out=codes)

    kernels = {
        "memory copy (anchor)": lambda: np.copyto(copy, x),
        "stochastic encode": lambda: cnat.encode(x, seed=1, stream=2, floor=floor, out=codes),
        "deterministic encode": lambda: cnat.encode_nearest(x, floor=floor, out=codes),
        "decode": lambda: cnat.decode(codes, floor=floor, out=values),
        "decode-accumulate": lambda: cnat.decode_accumulate(codes, acc, floor=floor),
        "integer-sum re-encode": lambda: arith.sum_to_codes(sums, -40, seed=1, stream=3, out=codes),
    }
    times = interleaved_times(kernels, repeats, warmup=2, alternate=("stochastic encode", "deterministic encode"))
    seconds = {name: statistics.median(t) for name, t in times.items()}
    paired = statistics.median(pair_ratios(times["deterministic encode"], times["stochastic encode"]))
    copy_rate = elements / seconds["memory copy (anchor)"]
    rows = [
        {
            "kernel": name,
            "median_ms": 1e3 * t,
            "g_elements_per_s": elements / t / 1e9,
            "ratio_to_copy": elements / t / copy_rate,
            "target": TARGETS.get(name, ""),
        }
        for name, t in seconds.items()
    ]
    emit(
        rows,
        as_json,
        "C_nat codec kernels, one thread",
        [
            ("kernel", "kernel", ""),
            ("median_ms", "median ms", ".2f"),
            ("g_elements_per_s", "G elem/s", ".2f"),
            ("ratio_to_copy", "× copy", ".2f"),
            ("target", "target", ""),
        ],
        {"elements": elements, "repeats": repeats, "cpu": platform.processor() or platform.machine(),
         "stochastic encode × deterministic (median over pairs of repeats)": round(paired, 3)},
    )
    return rows
