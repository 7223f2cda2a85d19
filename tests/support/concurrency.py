"""Running a kernel over halves of an array from two threads at once (the kernels release the GIL)."""

from __future__ import annotations

import threading
from collections.abc import Callable

import numpy as np


def run_halves_concurrently(n: int, call: Callable[[int, int], int]) -> int:
    """Two threads, started together, each run call(a, b) over uneven cuts of one half of [0, n) (cuts that
    straddle 4096-element blocks); returns the sum of call's results and re-raises a thread's exception."""
    counts = [0, 0]
    errors: list[BaseException] = []
    barrier = threading.Barrier(2)

    def work(k: int, lo: int, hi: int) -> None:
        try:
            barrier.wait()
            cuts = np.linspace(lo, hi, 8).astype(int) + np.array([0, 17, 4097, 3, 99, 12345, 1, 0])
            cuts[-1] = hi
            for a, b in zip(cuts[:-1], cuts[1:]):
                counts[k] += call(int(a), int(b))
        except Exception as e:  # noqa: BLE001 - re-raised in the main thread
            errors.append(e)

    threads = [threading.Thread(target=work, args=(0, 0, n // 2)), threading.Thread(target=work, args=(1, n // 2, n))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return sum(counts)
