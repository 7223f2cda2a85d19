"""The worker's send window (docs/window.md): how far past the lowest chunk it still waits for a worker may send, set
by the aggregator's congestion marks (aggregator.congestion, protocol.wire.CONGESTED) and by nothing else: a loss,
a timeout or a late round trip never shrinks it, so random loss costs only its retransmissions.

* The slots keep their chunks (chunk c in slot c mod W at every worker): the window holds a slot's next chunk back
  (the slot HELD, no timer) while it lies ``limit`` or more chunks past the lowest chunk this worker waits for.
  Counting from the lowest waiting chunk, rather than limiting the number of slots in flight, keeps every worker
  able to send the chunk every peer waits for: the lowest chunk of all is always inside every worker's window, so
  workers that hold different slots back can never wait for each other.
* The law is DCTCP's: each result not marked grows the window by 1 / window (one slot per round trip); once per
  window's worth of results, alpha, the moving average of the marked fraction (gain ALPHA_GAIN), is updated and,
  if any was marked, the window is multiplied by 1 - alpha / 2, never below FLOOR. A window of the whole pool
  limits nothing: a job that sees no marks runs exactly as it did without a window.
* The window persists over a job's allreduces, as the RTO does, so an allreduce starts with what the previous
  ones learned.
"""

from __future__ import annotations

import numpy as np
from numba import njit

ALPHA_GAIN = 1.0 / 16.0  # DCTCP's g
FLOOR = 1.0  # slots: the lowest chunk waiting can always go
# window (float64): the window in slots, alpha, results and marked results counted since the last update
W_CWND, W_ALPHA, W_RESULTS, W_MARKED = range(4)
UNLIMITED = np.iinfo(np.int64).max // 2  # a limit no chunk reaches (a window of the whole pool)


def window_state(pool_size: int) -> np.ndarray:
    """A job's window before any result: the whole pool, alpha 1 (the first marked window of results halves it)."""
    return np.array([float(pool_size), 1.0, 0.0, 0.0])


@njit(inline="always")
def on_mark(window, marked, pool):
    """A result was taken, ``marked`` congested or not: the window law above, the window at most ``pool``."""
    window[W_RESULTS] += 1.0
    if marked:
        window[W_MARKED] += 1.0
    else:
        window[W_CWND] = min(pool, window[W_CWND] + 1.0 / window[W_CWND])
    if window[W_RESULTS] >= window[W_CWND]:
        window[W_ALPHA] += ALPHA_GAIN * (window[W_MARKED] / window[W_RESULTS] - window[W_ALPHA])
        if window[W_MARKED] > 0.0:
            window[W_CWND] = max(FLOOR, window[W_CWND] * (1.0 - window[W_ALPHA] / 2.0))
        window[W_RESULTS] = 0.0
        window[W_MARKED] = 0.0


@njit(inline="always")
def window_limit(window, slots):
    """How many chunks past the lowest waiting one may be in flight: the window's whole slots, or UNLIMITED if it
    covers all ``slots`` of the allreduce."""
    limit = np.int64(window[W_CWND])
    return UNLIMITED if limit >= slots else limit
