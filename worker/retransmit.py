"""The streaming engine's retransmission policy: when a slot whose result is late is sent again (the stored
datagram, byte for byte), as Numba kernels over the engine's state (worker.state). Sans-I/O: ``now`` comes from the
driver.

* Adaptive RTO, as TCP's (RFC 6298): SRTT + 4 RTTVAR from round-trip samples of slots that were not retransmitted
  (Karn's rule) nor overtaken by a later-sent slot's result, bounded by [min_rto, max_rto]. A slot's round ends
  when its last rank's datagram arrives, so an overtaken slot's round trip includes a peer's recovery (a fast
  retransmission or a timeout): sampled, such round trips drove the RTO of 64 ranks under 1% loss to its 1 s
  maximum (docs/window.md). A fixed RTO either fires spuriously when the aggregator's CPU is
  busy, which adds load exactly when it hurts, or waits too long after a real loss.
* Fast retransmit (TCP's duplicate-ACK rule, per slot): a slot overtaken by FAST_RETRANSMIT results of slots sent
  after it to the same aggregator core is presumed lost and retransmitted at once, so a loss costs about one round
  trip instead of an RTO; it recurs while results flow, so losses amid a stream need no timer.
* The timer is for a silent aggregator core, and it measures silence, as TCP's does (RFC 6298 5.3: restarted by
  every result): a slot is due once its RTO passed since the later of its own sending and its core's last result
  or probe. A busy, queueing core keeps answering, so its queue's delay fires nothing however far it exceeds the
  RTO. When a core does fall silent (a peer that has not sent yet, a process off the CPU), every slot in flight
  there is due at once: the timer retransmits one, a probe. The probes take turns over the core's slots in
  flight, least recently sent (or answered) first; once each has had its turn, the core is backed off, its
  slots' RTOs doubled (up to ``max_rto``) until it answers. Retransmitting every due slot (as each slot's own
  timer did) multiplied a silence of k RTOs by the window, into the queue of the aggregator it waited on. Taking
  turns matters when a core is silent because a peer's datagram was lost: a probe of a slot whose own datagram
  arrived is never answered, and probing the slot due first (the one armed with the shortest RTO) again and
  again, the backoff doubling each time, left the slot this rank had lost waiting for seconds.
* The first probe of a silence that follows a result of this allreduce comes TAIL_PROBE (2) SRTT into it, or SRTT
  + 4 RTTVAR if later (the RTO without its floor: a round's result waits on the slowest peer, whose lateness the
  variance measures), if that is sooner than the RTO: TCP's tail loss probe (RFC 8985). A stream whose slots all
  wait (a lost datagram at the end of the window, nothing left to overtake it) is so recovered in round trips, not
  at the RTO's floor: 64 ranks under 1% loss spent most of their stalls there (docs/window.md). The second probe
  of such a silence waits as long again after the first (TAIL_PROBES), whatever answered the first: at 4 ranks and
  5% loss most stalls left were a first probe spent on a slot whose round waits on a peer (a PENDING answers it),
  or lost with its answer, then the RTO's floor (docs/window.md, "A second tail probe"). Withholding it after a
  PENDING was slower: the ranks a PENDING's ``have`` lacks may be held by this rank's own loss in another slot (a
  send window full of slots that wait on it). Later probes wait
  the RTO, backed off. Not at an allreduce's start, before the core's first result: there the silence is the
  peers' start or a queue the round trips have yet to show (with a tail probe there too, the slowed aggregator of
  the overload test got spurious ones, over its bound). There the first probe waits at least TAIL_PROBE SRTT: where
  the round trip is a queue's with little variance, the RTO is under that, and the first result, which waits on
  every rank's window in the queue and on the last rank's start, came after it once an allreduce.
* A core whose last answer was to a retransmission is alive and was not waiting for a peer (a late peer's slots
  complete together, so a probe's answer comes with the other slots' results, not retransmitted): the slots sent
  before that answer are due SRTT after it, all at once, as losses at the end of a stream need; at most the send
  window's worth of them (worker.window: all, unless the aggregator marked congestion), so that a congested
  aggregator's drops are not resent in one burst that its full queue drops again. Not while this rank's recent
  retransmissions were all but never needed (bursts: their average outcome under BURST_NEEDED; a PENDING, or a
  STORED duplicate, says one was not): on a loss-free link, a probe that the original's result crossed on its way
  back set off such a burst, whose resends' results, each an answer to a retransmission, set off the next, 5,000
  resends in one run; under random loss some retransmissions are needed, and the bursts recover the other lost
  datagrams a round trip sooner than probes taking turns (docs/window.md).
* A slot whose retransmission the aggregator answered with a PENDING (its round has this rank's datagram and waits on
  peers': protocol.wire) is *answered* until it is sent again, and backs off: it is not probed (once its core
  answered in the allreduce: below), and it is fast-retransmitted only once overtaken by FAST_RETRANSMIT x 2**k
  results of slots sent after the PENDING, its k-th for the chunk (the round's result may have been lost on the way
  back: then the later slots' results overtake it at once). It also has a timer of its own, its RTO after the later
  of the PENDING and the start of its core's silence (a core that keeps answering is busy, not waiting: its queue
  holds the peers' datagrams), and its RTO doubles when that fires; after the chunk's first PENDING, once its core
  has answered in this allreduce, a tail probe's wait instead, if sooner (the round's result may be lost on the way
  back, and at a stream's end no later result overtakes it: waiting the own timer's RTO floor was most of 4 workers'
  stalls at 5% loss, docs/window.md); and it is resent with the due slots of a core whose last answer, after its
  PENDING, was to a retransmission (the end of a stream: its result may be the one lost). A round that waits long on
  a peer so costs this rank a few resends, not one per FAST_RETRANSMIT results. Before its core's first result in the
  allreduce, a PENDING says the core waits on its peers' start, not on a loss: it doubles the core's backoff (once
  per probe), and the answered slots have no timer of their own yet: they take their turns with the core's other
  slots, counted from their PENDING. Probes taking turns at the RTO cost a rank a datagram per RTO of a late peer's
  start, and own timers beside the probes about doubled what the backoff left (docs/window.md, "A late peer's
  start"). A PENDING is taken only once per transmission and never restarts its core's silence: a forged or replayed
  one (without the MAC) delays a slot's next resend, and the slot is still resent, at least every twice max_rto once
  its core answered, in its turn before (docs/window.md, "A duplicate answered with the ranks it lacks").
* A result that a slot already took, sent again marked STORED (protocol.wire: the aggregator's answer to a
  duplicate of a complete round), proves a retransmission spurious, as a DSACK does (RFC 3708): counted as
  spurious_retransmissions (worker.engine.take_stale), and as a retransmission not needed.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from intml.worker.state import (
    FAST_RETRANSMISSIONS,
    FAST_RETRANSMIT,
    IDLE,
    P_CORES,
    P_WINDOW,
    RETRANSMISSIONS,
    SPURIOUS,
    State,
    queue_slot,
)
from intml.worker.window import window_limit

# timing (float64): smoothed RTT, RTT variance, current RTO, min RTO, max RTO, and the recent share of this rank's
# retransmissions that may have been needed (an average over their outcomes, 1 at first: needed, bursts)
T_SRTT, T_RTTVAR, T_RTO, T_MIN, T_MAX, T_NEEDED = range(6)
# silence (float64): (cores, 8), per aggregator core: since when it is silent (the allreduce's start, its last
# result taken, or its last probe), the backoff its slots' RTOs are multiplied by (1, doubled by each round of
# probes), 1 if its last result answered a retransmission (its next timeout resends every due slot), else 0, the
# probes of the current round (one per slot in flight there), 1 once it answered in this allreduce, else 0, 1
# once a PENDING doubled its backoff since its last probe (on_pending), else 0, its probes since its last result
# (TAIL_PROBES once it burst: the first TAIL_PROBES are tail probes), and the time of its first result in this
# allreduce if a PENDING came before that result (+inf until the result), else -inf: the slots sent before it
# waited on a peer's start, and their round trips are no samples (on_result)
S_SINCE, S_BACKOFF, S_ALIVE, S_PROBES, S_HEARD, S_PENDED, S_TAILS, S_START = range(8)
MAX_BACKOFF = 20  # the most doublings of an answered slot's fast-retransmit threshold
TAIL_PROBE = 2.0  # SRTTs into a silence after a result, the first probe (the module docstring)
TAIL_PROBES = 2  # probes of a silence after a result at a tail probe's wait, before the RTO (the module docstring)
NEEDED_GAIN = 1.0 / 8  # the weight of a retransmission's outcome in T_NEEDED (as RFC 6298's alpha)
BURST_NEEDED = 0.05  # T_NEEDED below which answers set off no burst: about 7 unneeded in a row after a needed one


def timing_state(rto: float, min_rto: float, max_rto: float) -> np.ndarray:
    """A job's timing array, before any round trip: it persists, so later allreduces start adapted."""
    return np.array([0.0, 0.0, rto, min_rto, max_rto, 1.0])


def silence_state(cores: int) -> np.ndarray:
    """A job's silence array (set by each allreduce's start, restart_silences)."""
    return np.zeros((cores, 8))


@njit(inline="always")
def restart_silences(silence, now):
    """An allreduce starts: every core is silent since now, not backed off."""
    silence[:, S_SINCE] = now
    silence[:, S_BACKOFF] = 1.0
    silence[:, S_ALIVE] = 0.0
    silence[:, S_PROBES] = 0.0
    silence[:, S_HEARD] = 0.0
    silence[:, S_PENDED] = 0.0
    silence[:, S_TAILS] = 0.0
    silence[:, S_START] = -np.inf


@njit(inline="always")
def arm(st, s, now):
    """Slot s sent a new chunk at now: its timer runs at the current RTO, with no retries or overtaking marks."""
    st.sent_at[s] = now
    st.retries[s] = 0
    st.overtaken[s] = 0
    st.rto[s] = st.timing[T_RTO]
    st.answered[s] = -np.inf
    st.pendings[s] = 0


@njit(inline="always")
def answered(st, s):
    """A PENDING answered slot s's latest transmission: its datagram is in its round, which waits on peers."""
    return st.answered[s] > -np.inf


@njit(inline="always")
def on_pending(st, s, now):
    """Slot s's latest transmission was answered by a PENDING at now: it waits on its own timer (the module
    docstring); False, changing nothing, if one already answered it."""
    if answered(st, s):
        return False
    st.answered[s] = now
    st.overtaken[s] = 0
    st.pendings[s] = min(st.pendings[s] + 1, MAX_BACKOFF)
    quiet = st.silence[s % st.params[P_CORES]]
    if not quiet[S_HEARD]:  # no result yet in this allreduce: the core waits on its peers' start, not on a loss
        quiet[S_START] = np.inf
        if not quiet[S_PENDED]:  # once per probe, however many PENDINGs answer it
            quiet[S_BACKOFF] *= 2.0
            quiet[S_PENDED] = 1.0
    return True


@njit(inline="always")
def own_timer(st, s, quiet):
    """Whether slot s, whose core has silence row ``quiet``, waits on a timer of its own: a PENDING answered it and
    its core answered in this allreduce (before that, it takes its turn with the core's probes)."""
    return answered(st, s) and quiet[S_HEARD]


@njit(inline="always")
def since(st, s):
    """When slot s was last sent, or answered if it is: the results of slots sent later overtake it."""
    return st.answered[s] if answered(st, s) else st.sent_at[s]


@njit(inline="always")
def disarm(st, s):
    """Slot s has nothing sent (parked): no retransmission, RTT or overtaking of it."""
    st.sent_at[s] = np.inf
    st.overtaken[s] = 0
    st.answered[s] = -np.inf


@njit(inline="always")
def needed(timing, maybe):
    """A retransmission's outcome into the average of T_NEEDED: it may have been needed (its slot's result came
    fresh, and no PENDING answered it), or it was not (a PENDING answered it: the round had this rank's datagram;
    or the round's result came again marked STORED, after the slot took it)."""
    timing[T_NEEDED] += ((1.0 if maybe else 0.0) - timing[T_NEEDED]) * NEEDED_GAIN


@njit(inline="always")
def bursts(st, quiet):
    """Whether the core of silence row ``quiet`` resends its due slots at once: its last answer was to a
    retransmission, and this rank's retransmissions may have been needed of late (the module docstring)."""
    return quiet[S_ALIVE] and st.timing[T_NEEDED] >= BURST_NEEDED


@njit(inline="always")
def _unbounded_rto(timing):
    """RFC 6298's RTO before its bounds: SRTT + 4 RTTVAR."""
    return timing[T_SRTT] + 4.0 * timing[T_RTTVAR]


@njit(inline="always")
def _tail_wait(timing):
    """A tail probe's wait into a silence: TAIL_PROBE SRTT, or SRTT + 4 RTTVAR if later (the module docstring)."""
    return max(TAIL_PROBE * timing[T_SRTT], _unbounded_rto(timing))


@njit(cache=True, nogil=True, boundscheck=False, _nrt=False)
def _rtt_sample(timing, sample):
    """RFC 6298 smoothing of one round-trip sample."""
    if timing[T_SRTT] == 0.0:
        timing[T_SRTT] = sample
        timing[T_RTTVAR] = sample / 2
    else:
        timing[T_RTTVAR] = 0.75 * timing[T_RTTVAR] + 0.25 * abs(timing[T_SRTT] - sample)
        timing[T_SRTT] = 0.875 * timing[T_SRTT] + 0.125 * sample
    timing[T_RTO] = min(timing[T_MAX], max(timing[T_MIN], _unbounded_rto(timing)))


@njit(cache=True, nogil=True, boundscheck=False, _nrt=False)
def _resend(st, s, now, tx_ptr, tx_len, tx_addr, n_tx):
    queue_slot(st, s, tx_ptr, tx_len, tx_addr, n_tx)
    st.sent_at[s] = now
    st.retries[s] += 1
    st.answered[s] = -np.inf
    return n_tx + 1


@njit(cache=True, nogil=True, boundscheck=False, _nrt=False)
def _count_overtaking(st, s):
    """The result of slot s overtook every slot still in flight that was sent before it to the same aggregator
    core. Cores are separate processes that run at their own pace, so results from different cores overtake
    each other without any loss."""
    sent = st.sent_at[s]
    cores = st.params[P_CORES]
    for other in range(s % cores, st.params[P_WINDOW], cores):
        if other != s and st.cur_chunk[other] != IDLE and since(st, other) < sent:
            st.overtaken[other] += 1


@njit(inline="always")
def on_result(st, s, now):
    """Slot s's result was taken at now: sample the round trip, mark the slots it overtook, restart its core's
    silence. A slot sent before its core's first result in the allreduce, where a PENDING came before that result,
    waited on a peer's start: the job's first sample was the last process's start, 360 ms, and the RTO took
    allreduces to come down from it (docs/window.md, "A late peer's start")."""
    quiet = st.silence[s % st.params[P_CORES]]
    if not quiet[S_HEARD] and quiet[S_START] == np.inf:
        quiet[S_START] = now
    if st.retries[s] == 0:
        if st.overtaken[s] == 0 and st.sent_at[s] >= quiet[S_START]:
            _rtt_sample(st.timing, now - st.sent_at[s])
        _count_overtaking(st, s)
    # (Karn: a retransmitted slot's result may answer the original, so neither its round trip nor its order is
    # known; counted as overtaking, the probes answered after a late peer's silence fast-retransmitted the window)
    quiet[S_SINCE] = now
    quiet[S_BACKOFF] = 1.0
    quiet[S_ALIVE] = st.retries[s] > 0
    if st.retries[s] > 0:
        needed(st.timing, not answered(st, s))
    quiet[S_PROBES] = 0.0
    quiet[S_HEARD] = 1.0
    quiet[S_TAILS] = 0.0


@njit(cache=True, nogil=True, boundscheck=False, _nrt=False)
def fast_retransmit(st, now, tx_ptr, tx_len, tx_addr, n_tx):
    """After a burst of results: resend the slots still in flight that FAST_RETRANSMIT results overtook (a slot
    whose own result came later in the burst is not resent). Returns the new tx count."""
    for s in range(st.params[P_WINDOW]):
        due = FAST_RETRANSMIT << st.pendings[s] if answered(st, s) else FAST_RETRANSMIT
        if st.cur_chunk[s] != IDLE and st.overtaken[s] >= due and n_tx < tx_len.size:
            n_tx = _resend(st, s, now, tx_ptr, tx_len, tx_addr, n_tx)
            st.overtaken[s] = 0
            st.stats[FAST_RETRANSMISSIONS] += 1
    return n_tx


@njit(inline="always")
def _own_deadline(st, s, quiet):
    """An answered slot's own timer, once its core answered in this allreduce: its RTO after the later of its
    PENDING and the start of its core's silence. A core that keeps answering other slots is busy, its queue holding
    the peers' datagrams that the round waits on (fast retransmit covers a result lost on the way back)."""
    return max(st.answered[s], quiet[S_SINCE]) + st.rto[s]


@njit(inline="always")
def _deadline(st, s):
    """When slot s (in flight) is due: its RTO, backed off as its core is, after the later of its sending and the
    start of its core's silence; SRTT after it, if sooner, when the core's last answer was to a retransmission
    and s was sent before it; else, if sooner, max(2 SRTT, SRTT + 4 RTTVAR) after it when the core answered in
    this allreduce and was probed fewer than TAIL_PROBES times since, without a burst (the tail probes); at least
    2 SRTT after it (up to max_rto) before the core's first result in this allreduce, where an answered slot takes
    its turn as the others do, counted from its PENDING.
    An answered slot once its core answered in this allreduce: its own timer (_own_deadline), or, if sooner, SRTT
    after such a result that came after its PENDING (its round may have completed, and its result been lost); else,
    if sooner, after the chunk's first PENDING, the tail probe's wait after the later of the PENDING and the start
    of its core's silence."""
    quiet = st.silence[s % st.params[P_CORES]]
    if own_timer(st, s, quiet):
        if quiet[S_ALIVE] and st.answered[s] < quiet[S_SINCE] and st.timing[T_SRTT] > 0.0:
            return min(_own_deadline(st, s, quiet), quiet[S_SINCE] + st.timing[T_SRTT])
        if st.pendings[s] == 1 and st.timing[T_SRTT] > 0.0:  # its tail probe
            return min(_own_deadline(st, s, quiet), max(st.answered[s], quiet[S_SINCE]) + _tail_wait(st.timing))
        return _own_deadline(st, s, quiet)
    wait = min(st.timing[T_MAX], st.rto[s] * quiet[S_BACKOFF])
    if bursts(st, quiet) and st.sent_at[s] < quiet[S_SINCE] and st.timing[T_SRTT] > 0.0:
        wait = min(wait, st.timing[T_SRTT])
    elif quiet[S_HEARD] and quiet[S_TAILS] < TAIL_PROBES and st.timing[T_SRTT] > 0.0:  # the TLP
        wait = min(wait, _tail_wait(st.timing))
    elif not quiet[S_HEARD]:  # the allreduce's first result waits on every rank's window and the last one's start
        wait = min(st.timing[T_MAX], max(wait, TAIL_PROBE * st.timing[T_SRTT]))
    return max(since(st, s), quiet[S_SINCE]) + wait


@njit(cache=True, nogil=True, boundscheck=False, _nrt=False)
def timer_kernel(state, now, tx_ptr, tx_len, tx_addr):
    """Retransmit each answered slot that is due, doubling its RTO if its own timer fired (once its core answered
    in this allreduce; before, it takes its turn with the core's other slots). Then on each silent aggregator core
    with slots due, retransmit its slot in flight least recently sent or answered (the probe: its slots take
    turns, and the core's backoff doubles once each has had one), or every due one (at most the send window's
    worth) if the core's last answer was to a retransmission, and then double its backoff; restart the core's
    silence. Returns datagrams written to tx."""
    st = State(*state)
    n_tx = 0
    cores = st.params[P_CORES]
    for k in range(cores):
        probe, first, waiting = -1, np.inf, 0
        for s in range(k, st.params[P_WINDOW], cores):
            if st.cur_chunk[s] != IDLE and st.sent_at[s] < np.inf and own_timer(st, s, st.silence[k]):
                if _deadline(st, s) <= now:
                    if _own_deadline(st, s, st.silence[k]) <= now:  # its own timer: back off
                        st.rto[s] = min(st.timing[T_MAX], 2.0 * st.rto[s])
                    n_tx = _resend(st, s, now, tx_ptr, tx_len, tx_addr, n_tx)
                    st.stats[RETRANSMISSIONS] += 1
            elif st.cur_chunk[s] != IDLE and st.sent_at[s] < np.inf:  # (a held or parked slot has nothing sent)
                waiting += 1
                first = min(first, _deadline(st, s))
                if probe < 0 or since(st, s) < since(st, probe):
                    probe = s
        if first > now or n_tx == tx_len.size:
            continue
        quiet = st.silence[k]
        budget = window_limit(st.window, st.params[P_WINDOW])
        if bursts(st, quiet):
            for s in range(k, st.params[P_WINDOW], cores):
                if st.cur_chunk[s] != IDLE and not answered(st, s) and _deadline(st, s) <= now and budget > 0:
                    budget -= 1
                    n_tx = _resend(st, s, now, tx_ptr, tx_len, tx_addr, n_tx)
                    st.stats[RETRANSMISSIONS] += 1
            quiet[S_BACKOFF] *= 2.0
            quiet[S_TAILS] = TAIL_PROBES
        else:
            quiet[S_TAILS] += 1.0
            n_tx = _resend(st, probe, now, tx_ptr, tx_len, tx_addr, n_tx)
            st.stats[RETRANSMISSIONS] += 1
            quiet[S_PROBES] += 1.0
            if quiet[S_PROBES] >= waiting:
                quiet[S_BACKOFF] *= 2.0
                quiet[S_PROBES] = 0.0
        quiet[S_SINCE] = now
        quiet[S_ALIVE] = 0.0
        quiet[S_PENDED] = 0.0
    return n_tx


@njit(cache=True, nogil=True, boundscheck=False, _nrt=False)
def next_deadline(state):
    """The earliest retransmission time, or +inf with nothing in flight."""
    st = State(*state)
    t = np.inf
    for s in range(st.params[P_WINDOW]):
        if st.cur_chunk[s] != IDLE:
            t = min(t, _deadline(st, s))
    return t
