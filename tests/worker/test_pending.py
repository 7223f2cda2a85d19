"""The worker's reaction to a PENDING (protocol.wire; worker.retransmit): the aggregator's answer to a retransmission
whose round is incomplete, naming the ranks the round has. The slot it answers stops being probed and waits on a
timer of its own, its RTO after the PENDING, doubling at each resend (before its core's first result in the
allreduce, it takes its turn with the core's probes instead); a second answer to one transmission is stale;
a malformed, foreign or forged one is counted and dropped; and PENDINGs forged without end (a job without the MAC)
delay a slot's resends but never stop them."""

import numpy as np
import pytest
from support.harness import agg_addr, counter_diff, engine_receive, engine_timer, stored
from test_engine import AGG, JOB, N, RANK, lone_engine, result_for

from intml.protocol import wire
from intml.protocol.codec import Codec
from intml.protocol.siphash import key_words, tag_ref
from intml.protocol.wire import MsgType
from intml.worker import retransmit
from intml.worker.engine import StreamEngine

MINE = 1 << RANK  # the ranks of a round that has this rank's datagram and waits on the other
PEER = 1 << (1 - RANK)


def pending_for(data: bytes, have: int = MINE, **fields) -> bytes:
    """The PENDING the aggregator sends for DATA datagram ``data`` (without its tag): its header, type PENDING,
    count 0, then ``have``."""
    header = np.frombuffer(data[:wire.HEADER_SIZE], wire.HEADER).copy()
    header["type"], header["count"] = MsgType.PENDING, 0
    for name, value in fields.items():
        header[name] = value
    return header.tobytes() + have.to_bytes(wire.HAVE_SIZE, "big")


def test_before_its_cores_first_result_an_answered_slot_takes_its_turn():
    """Slot 0 is answered by a PENDING at 0.5, before its core's first result: the core waits on its peers' start,
    so its backoff doubles (on_pending), and the probe is slot 1, the slot least recently sent or answered, at 2.0,
    not at its RTO (1.0). Slot 0 has no timer of its own yet: it takes its turn, the backed-off RTO (2.0) after the
    probe restarted the core's silence, alone, at 4.0 (an own timer beside the probes doubled a late peer's cost).
    The PENDING is no round trip, and the turn is no own timer: both RTOs are unchanged."""
    engine, _, sent = lone_engine(rto=1.0, min_rto=0.25, max_rto=8.0)
    before = engine.counters()
    assert engine_receive(engine, [(pending_for(sent[0][0]), AGG)], 0.5) == []
    assert counter_diff(before, engine.counters()) == {"packets_in": 1, "pendings": 1}
    assert engine.get_timer() == 2.0 and engine_timer(engine, 2.0) == [sent[1]]  # the core's probe
    # a second answer to the same transmission is stale
    before = engine.counters()
    engine_receive(engine, [(pending_for(sent[0][0]), AGG)], 2.1)
    assert counter_diff(before, engine.counters()) == {"packets_in": 1, "drop_stale": 1}
    assert engine.get_timer() == 4.0 and engine_timer(engine, 4.0) == [sent[0]]
    assert engine.state.rto[0] == 1.0 and engine.rto == 1.0 and engine.counters()["retransmissions"] == 2


def _probe_after(pending_at: float | None) -> float:
    """When the silent core of a 4-slot engine (RTO 1.0) is next probed after the result of slot 3 at 0.1 and the
    probe of slot 0 at 1.2, with slot 0's probe answered by a PENDING at ``pending_at`` (None: not answered)."""
    engine, _, sent = lone_engine(rto=1.0, min_rto=0.25, max_rto=8.0, pool=4, size=32)
    engine_receive(engine, [(result_for(sent[3][0], next_exp=3), AGG)], 0.1)
    assert engine_timer(engine, engine.get_timer()) == [sent[0]]
    if pending_at is not None:
        engine_receive(engine, [(pending_for(sent[0][0]), AGG)], pending_at)
    return engine.get_timer()


def test_a_pending_after_the_cores_first_result_leaves_its_probes_alone():
    """Once the core answered in this allreduce, a PENDING says a peer is late, not that every peer has yet to
    start: the core's next probe comes when it would without the PENDING."""
    assert _probe_after(1.3) == _probe_after(None)


def test_a_pending_before_the_cores_first_result_backs_off_its_probes():
    """The start of an allreduce whose peers start late (the overload test's ranks start up to a second apart):
    every transmission is answered by a PENDING 0.1 later. Each doubles the core's backoff, once per probe, so the
    timer fires at 1, 3, 7 and 15, where turns over the four slots at the RTO would fire at 1, 2, 3 and 4; and it
    sends one datagram each time, the answered slots waiting their turns (own timers beside the probes sent two at
    7 and 15)."""
    engine, _, sent = lone_engine(rto=1.0, min_rto=0.25, max_rto=8.0, pool=4, size=32)
    fired = []
    while len(fired) < 4:
        now = engine.get_timer()
        out = engine_timer(engine, now)
        assert len(out) == 1, (now, out)
        fired.append(now)
        engine_receive(engine, [(pending_for(d), AGG) for d, _ in out], now + 0.1)
    assert fired == [1.0, 3.0, 7.0, 15.0]


def test_an_answered_slot_gets_a_tail_probe_after_its_first_pending():
    """The core answered slot 0 at 0.1 (SRTT 0.1: a tail probe's wait is SRTT + 4 RTTVAR = 0.3), then fell silent:
    the tail probe of slot 1 at 0.4 is answered by a PENDING at 0.45. Slot 1's round may complete while this
    rank's copy of its result is lost, with no later result to overtake it (a stream's end), so it is resent a
    tail probe's wait after the later of its PENDING and the core's last probe, not its own RTO after it: the
    core's second tail probe (slot 2) at 0.7 puts it at 1.0 (0.75 without that probe), not 1.7. Its RTO is not
    doubled, and a second PENDING of the chunk leaves it its own timer: the next retransmission is slot 3's probe,
    an RTO after the core's last probe (1.7)."""
    engine, _, sent = lone_engine(rto=1.0, min_rto=1.0, max_rto=8.0, pool=4, size=64)
    engine_receive(engine, [(result_for(sent[0][0], next_exp=3), AGG)], 0.1)
    assert engine.get_timer() == pytest.approx(0.4) and engine_timer(engine, 0.4) == [sent[1]]
    engine_receive(engine, [(pending_for(sent[1][0]), AGG)], 0.45)
    assert engine.get_timer() == pytest.approx(0.7) and engine_timer(engine, engine.get_timer()) == [sent[2]]
    assert engine.get_timer() == pytest.approx(1.0) and engine_timer(engine, engine.get_timer()) == [sent[1]]
    engine_receive(engine, [(pending_for(sent[1][0]), AGG)], 1.05)
    assert engine.get_timer() == pytest.approx(1.7) and engine_timer(engine, engine.get_timer()) == [sent[3]]
    assert engine.state.rto[1] == 1.0 and engine.counters()["retransmissions"] == 4


def _silent_core_probes(answer_first: bool) -> list[tuple[float, int]]:
    """(time, slot) of the first three probes of a 4-slot engine's core (RTO 1.0, its floor; SRTT 0.1: a tail
    probe's wait is 0.3), silent after slot 0's result at 0.1, its first probe answered by a PENDING 0.05 later
    (``answer_first``) or by nothing (lost with its answer). The answered slot's own tail probe is left out."""
    engine, _, sent = lone_engine(rto=1.0, min_rto=1.0, max_rto=8.0, pool=4, size=64)
    engine_receive(engine, [(result_for(sent[0][0], next_exp=3), AGG)], 0.1)
    probes: list[tuple[float, int]] = []
    while len(probes) < 3:
        now = engine.get_timer()
        for d, _ in engine_timer(engine, now):
            slot = next(s for s in range(4) if sent[s][0] == d)
            if not probes or slot != probes[0][1]:  # (the first probe's slot, resent on its own PENDING)
                probes.append((round(now, 9), slot))
            if answer_first and len(probes) == 1 and slot == probes[0][1]:
                engine_receive(engine, [(pending_for(d), AGG)], now + 0.05)
    return probes


@pytest.mark.parametrize("answer_first", [False, True])
def test_a_silence_gets_a_second_tail_probe_whatever_answered_the_first(answer_first):
    """The first probe of a silence (slot 1 at 0.4) may be spent: on a slot whose round waits on a peer (a PENDING
    answers it) or lost with its answer. The second (slot 2) comes a tail probe's wait after it (0.7), where it
    came an RTO after it (1.4) before TAIL_PROBES; the third (slot 3) waits the RTO (1.7). 4 workers at 5% loss
    stalled at the RTO's floor after a spent first probe in most of the stalls left (docs/window.md, "A second
    tail probe")."""
    assert _silent_core_probes(answer_first) == [(0.4, 1), (0.7, 2), (1.7, 3)]


def test_a_busy_core_defers_an_answered_slots_own_timer():
    """A core that keeps answering other slots is busy, its queue holding the peers' datagrams: slot 0, answered
    at 0.5, is not resent at 1.5 while results come (the last at 1.2), but its RTO after that last result."""
    engine, _, sent = lone_engine(pool=4, size=64, rto=1.0, min_rto=0.25, max_rto=8.0)
    assert engine_receive(engine, [(pending_for(sent[0][0]), AGG)], 0.5) == []
    engine_receive(engine, [(result_for(sent[1][0], next_exp=3), AGG)], 1.2)
    assert engine.get_timer() == pytest.approx(2.2)
    assert sent[0] in engine_timer(engine, 2.2)
    assert engine.state.rto[0] == 2.0  # its own timer fired: it backs off


def test_an_answered_slot_is_not_fast_retransmitted():
    """Slot 0 waits on a peer (answered); the results of the three slots sent after it would fast-retransmit it,
    and do not."""
    engine, _, sent = lone_engine(pool=4, size=64, rto=1.0, min_rto=0.25, max_rto=8.0)
    assert engine_receive(engine, [(pending_for(sent[0][0]), AGG)], 0.1) == []
    out = engine_receive(engine, [(result_for(d, next_exp=3), AGG) for d, _ in sent[1:]], 0.2)
    assert sent[0] not in out and engine.counters()["fast_retransmissions"] == 0


def _tagged(datagram: bytes, key: bytes) -> bytes:
    return datagram + tag_ref(*key_words(key), datagram)


KEY = bytes(range(16))


@pytest.mark.parametrize("why, make, counter", [
    ("without this rank", lambda d: pending_for(d, have=PEER), "drop_malformed"),
    ("every rank: complete, no PENDING", lambda d: pending_for(d, have=MINE | PEER), "drop_malformed"),
    ("a rank beyond the world", lambda d: pending_for(d, have=MINE | 1 << N), "drop_malformed"),
    ("short", lambda d: pending_for(d)[:-1], "drop_malformed"),
    ("a count", lambda d: pending_for(d, count=1), "drop_malformed"),
    ("another rank's", lambda d: pending_for(d, rank=1 - RANK), "drop_malformed"),
    ("another codec", lambda d: pending_for(d, codec=int(Codec.INT32)), "drop_malformed"),
    ("another chunk", lambda d: pending_for(d, chunk=5), "drop_stale"),
    ("another job", lambda d: pending_for(d, job=JOB + 1), "drop_foreign"),
])
def test_a_malformed_or_foreign_pending_is_counted_and_changes_nothing(why, make, counter):
    engine, _, sent = lone_engine(rto=1.0, min_rto=0.25, max_rto=8.0)
    before = engine.counters()
    assert engine_receive(engine, [(make(sent[0][0]), AGG)], 0.5) == []
    assert counter_diff(before, engine.counters()) == {"packets_in": 1, counter: 1}, why
    assert engine.get_timer() == 1.0 and engine_timer(engine, 1.0) == [sent[0]]  # probed as before: not answered


def test_a_pending_from_another_core_is_foreign():
    engine, _, sent = lone_engine(rto=1.0, min_rto=0.25, max_rto=8.0)
    before = engine.counters()
    engine_receive(engine, [(pending_for(sent[0][0]), agg_addr(1))], 0.5)
    assert counter_diff(before, engine.counters()) == {"packets_in": 1, "drop_foreign": 1}


def test_with_the_mac_only_a_tagged_pending_is_taken():
    engine = StreamEngine(job=JOB, rank=RANK, world_size=N, codec=Codec.CNAT8, packet_elements=8, pool_size=2,
                          seed=5, agg_addrs=[AGG], rto=1.0, min_rto=0.25, max_rto=8.0,
                          data_mac_keys=np.array([key_words(KEY)], np.uint64))
    sent = engine.start(np.ones(20, np.float32), 0.0).datagrams()
    data = sent[0][0][:-wire.TAG_SIZE]
    before = engine.counters()
    engine_receive(engine, [(pending_for(data), AGG), (_tagged(pending_for(data), bytes(16)), AGG)], 0.5)
    assert counter_diff(before, engine.counters()) == {"packets_in": 2, "drop_bad_mac": 2}
    engine_receive(engine, [(_tagged(pending_for(data), KEY), AGG)], 0.6)
    assert engine.counters()["pendings"] == 1


def test_pendings_forged_without_end_delay_a_slot_but_never_stall_it():
    """Without the MAC, an on-path forger answers every transmission of slot 0 with a PENDING at once. Each
    transmission takes one (the rest are stale), so the slot is still resent. Its core never answers, so the slot
    takes turns with slot 1, the core's probes backed off up to max_rto (a PENDING before the core's first result
    doubles the backoff once per probe, and each round of turns once more): never more than the core's two slots
    times max_rto between two resends."""
    engine, _, sent = lone_engine(rto=1.0, min_rto=0.25, max_rto=8.0)
    resends, now = [0.0], 0.0
    while now < 120.0:
        engine_receive(engine, [(pending_for(sent[0][0]), AGG)], now + 0.01)
        now = engine.get_timer()
        if sent[0] in engine_timer(engine, now):
            resends.append(now)
    gaps = np.diff(resends)
    assert len(resends) > 8 and gaps.max() <= 2 * 8.0 + 1e-9
    assert list(gaps[:5]) == pytest.approx([4.0, 16.0, 16.0, 16.0, 16.0])


@pytest.mark.parametrize("answered", [False, True])
def test_a_rank_whose_retransmissions_were_not_needed_sets_off_no_burst(answered):
    """Slots 0-2 wait on a silent core; slot 0's probe is answered at 1.25. Its retransmissions of late were all
    but never needed (their average outcome, 0.04, under BURST_NEEDED). If a PENDING answered the probe first, this
    one was not needed either: no burst, the core's slots are probed in turn. If none did, it may have been: the
    average rises over BURST_NEEDED and slots 1 and 2 go out together SRTT later. A STORED duplicate of the round
    lowers the average as a PENDING does."""
    engine, _, sent = lone_engine(rto=1.0, min_rto=0.25, max_rto=8.0, pool=4, size=32)
    (chunk3, _), = engine_receive(engine, [(result_for(sent[3][0], next_exp=3), AGG)], 0.1)
    engine_receive(engine, [(result_for(chunk3, next_exp=wire.NO_EXP), AGG)], 0.2)
    assert engine_timer(engine, 1.2) == [sent[0]]
    engine.timing[retransmit.T_NEEDED] = low = 0.04
    if answered:
        engine_receive(engine, [(pending_for(sent[0][0]), AGG)], 1.22)
    result = result_for(sent[0][0], next_exp=3)
    engine_receive(engine, [(result, AGG)], 1.25)
    g = retransmit.NEEDED_GAIN
    assert engine.timing[retransmit.T_NEEDED] == pytest.approx(low * (1 - g) + (0 if answered else g))
    if answered:
        assert engine.timing[retransmit.T_NEEDED] < retransmit.BURST_NEEDED
        assert engine_timer(engine, engine.get_timer()) == [sent[1]]
    else:
        assert engine.get_timer() == pytest.approx(1.25 + 0.1)
        assert engine_timer(engine, 1.35) == [sent[1], sent[2]]
    before = engine.timing[retransmit.T_NEEDED]
    engine_receive(engine, [(stored(result), AGG)], 1.4)
    assert engine.timing[retransmit.T_NEEDED] == pytest.approx(before * (1 - g))


@pytest.mark.parametrize("pended", [False, True])
def test_a_start_that_waited_on_a_peer_gives_no_round_trip_sample(pended):
    """Slots 0-3 start an allreduce; slot 0's probe at 1.0 is answered by a PENDING at 1.1 (``pended``): the core
    waits on a peer's start. The results of slots 1 and 2 come at 3.0, so their round trips (3.0) measured the last
    process's start, not the network: no sample. Without the PENDING the core was only slow, and they are samples.
    A chunk sent after the core's first result is one either way: 0.2."""
    engine, _, sent = lone_engine(rto=1.0, min_rto=0.25, max_rto=8.0, pool=4, size=64)
    assert engine.get_timer() == 1.0 and engine_timer(engine, 1.0) == [sent[0]]
    if pended:
        engine_receive(engine, [(pending_for(sent[0][0]), AGG)], 1.1)
    later = engine_receive(engine, [(result_for(d, next_exp=3), AGG) for d, _ in sent[1:3]], 3.0)
    assert len(later) == 2
    assert engine.timing[retransmit.T_SRTT] == (0.0 if pended else pytest.approx(3.0))
    engine_receive(engine, [(result_for(later[0][0], next_exp=3), AGG)], 3.2)
    assert engine.timing[retransmit.T_SRTT] == pytest.approx(0.2 if pended else 0.875 * 3.0 + 0.125 * 0.2)
