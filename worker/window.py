"""The worker's send window (docs/window.md): how many of its slots a worker keeps in flight, set by the aggregator's
congestion marks (aggregator.congestion, protocol.wire.CONGESTED) and by nothing else: a loss, a timeout or a late
round trip never shrinks it, so random loss costs only its retransmissions.

* The slots keep their chunks (chunk c in slot c mod W at every worker): the window holds a slot's next chunk back
  (the slot HELD, no timer) while as many slots as the window are in flight, and releases held chunks lowest first,
  the order every worker uses. The lowest chunk held goes anyway if it is lower than every chunk in flight: workers
  that hold different chunks back can so never wait for each other (the lowest chunk not yet summed is always
  sendable by every worker), at the cost of one slot over the window for a moment. Limiting the slots in flight,
  rather than how far past its lowest waiting chunk a worker may send, keeps a lost result from stalling its peers:
  they go on with their other slots, whose results trigger its fast retransmit.
* The law is DCTCP's (RFC 8257), in slots: a job starts with its whole pool, so that a job that sees no marks
  runs exactly as without a window (slow start from FLOOR spared 64 workers their first allreduce's overflow, but
  made a lossy 4-worker job's first allreduce four times slower: docs/window.md). A marked result cuts the window
  by half the marked share of results (``alpha``, a moving average over windows' worth of results, gain G,
  starting at 1: the first cuts halve, as ECN's), at most once per window's worth of results (a round trip: the
  marks of one queue reach every worker together), never below FLOOR (nor the pool); each result not marked adds
  1 / window (one slot per round trip, up to the pool). Halving at every mark left a shallow queue idle: cut from
  the mark depth to half of it, below the round trip's slots (a leaf's port up, docs/window.md). A retransmission
  is sent as before (the window only caps how many slots a core's timer resends at once, worker.retransmit).
* Bootstrap rounds carry no elements: on a switch's port, which queues bytes, one weighs a few percent of a data
  round, on a software aggregator's socket, which queues datagrams, as much. They go outside the window until a
  bootstrap result comes marked (a queue that counts them), and count as any round from then on, for the job's
  life.
* The window persists over a job's allreduces, as the RTO does, so an allreduce starts with what the previous
  ones learned.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from intml.worker.state import FAST_RETRANSMIT, HELD, IDLE, PARKED

G = 1.0 / 16.0  # alpha's gain per window's worth of results (DCTCP's g)
# the window's floor, in slots: enough for a lost datagram to be overtaken by FAST_RETRANSMIT results and so resent
# within a round trip; below it every loss waits for a timeout, tens of round trips
FLOOR = FAST_RETRANSMIT + 1.0
# window (float64): the window in slots, results taken since its last cut, alpha (the marked share's moving average),
# results and marked results since alpha's last update, and 1.0 once a bootstrap result came marked (0.0: bootstrap
# rounds go outside the window)
W_CWND, W_SINCE, W_ALPHA, W_RESULTS, W_MARKS, W_BOOTSTRAPS = range(6)
UNLIMITED = np.iinfo(np.int64).max // 2  # the limit of a window of the whole pool: no count of slots reaches it


def window_state(pool_size: int) -> np.ndarray:
    """A job's window before any result: the whole pool; the first mark halves it."""
    return np.array([float(pool_size), np.inf, 1.0, 0.0, 0.0, 0.0])


@njit(inline="always")
def on_mark(window, marked, pool):
    """A result was taken, ``marked`` congested or not: the window law above, the window at most ``pool``."""
    window[W_SINCE] += 1.0
    window[W_RESULTS] += 1.0
    window[W_MARKS] += marked
    cwnd = window[W_CWND]
    if window[W_RESULTS] >= cwnd:
        window[W_ALPHA] += G * (window[W_MARKS] / window[W_RESULTS] - window[W_ALPHA])
        window[W_RESULTS] = window[W_MARKS] = 0.0
    if not marked:
        window[W_CWND] = min(pool, cwnd + 1.0 / cwnd)
    elif window[W_SINCE] >= cwnd:
        window[W_CWND] = max(min(FLOOR, pool), cwnd * (1.0 - window[W_ALPHA] / 2.0))
        window[W_SINCE] = 0.0


@njit(inline="always")
def on_bootstrap_mark(window):
    """A bootstrap round's result came marked: the queue counts bootstrap rounds, which are in the window from now
    on."""
    window[W_BOOTSTRAPS] = 1.0


@njit(inline="always")
def window_limit(window, slots):
    """How many slots may be in flight: the window's whole slots, or UNLIMITED if it covers all ``slots`` of the
    allreduce."""
    limit = np.int64(window[W_CWND])
    return UNLIMITED if limit >= slots else limit


@njit(inline="always")
def holds(window, slots):
    """Whether a slot's next chunk waits to be admitted (``admitted``) rather than going at once: the window is
    below the allreduce's ``slots``."""
    return window_limit(window, slots) < slots


@njit(inline="always")
def admitted(window, cur_chunk, parked, answered, slots):
    """The held slot whose chunk the window admits next, or -1: of slots 0..slots-1 (``cur_chunk`` HELD, its
    chunk in ``parked``; a PARKED slot is in flight with its chunk there), the lowest chunk held, while fewer
    slots than the window are in flight, and in any case if it is lower than every chunk in flight. A slot whose
    latest datagram a PENDING answered (``answered`` above -inf, worker.retransmit) is not in flight: its datagram
    has left the aggregator's queue, and its round waits on peers. Until a bootstrap result comes marked, a
    bootstrap round (chunk < 0) is not in flight either, and goes at once. The caller sends the slot (it leaves
    HELD) and asks again, until -1."""
    limit = window_limit(window, slots)
    outside = window[W_BOOTSTRAPS] == 0.0  # bootstrap rounds go outside the window
    in_flight, lowest, pick = 0, np.iinfo(np.int64).max, -1
    for s in range(slots):
        c = cur_chunk[s]
        if c == HELD:
            if pick < 0 or parked[s] < parked[pick]:
                pick = s
        elif c != IDLE:
            chunk = parked[s] if c == PARKED else c
            in_flight += answered[s] == -np.inf and not (outside and chunk < 0)
            lowest = min(lowest, chunk)
    if pick < 0 or (in_flight >= limit and parked[pick] > lowest and not (outside and parked[pick] < 0)):
        return -1
    return pick
