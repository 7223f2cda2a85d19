"""Two-level aggregation (leaf-spine): the cores (aggregator.leafspine) driven packet by packet, malformed partials,
the packet-level leaf-spine against the one-switch result and against the analytic model, and the shipped
scenario."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from support.harness import (
    TOKEN,
    addr_key,
    core_receive,
    handshake,
    header,
    msg_type,
    new_core,
    stored,
    with_header,
    worker_addr,
)
from intml.aggregator.core import AggregatorCore
from intml.aggregator.leafspine import SpineCore, leaf_core
from intml.protocol.codec import Codec
from intml.protocol.job import JobParams
from intml.protocol.packet import HDR, O_SHADOW
from intml.protocol.wire import CONGESTED, NO_EXP, MsgType, pack
from intml.sim import models
from intml.sim.__main__ import main
from intml.sim.packet_level import PacketRun, simulate

JOB = 7
SPINE = addr_key(0x0A000301, 48879)
LEAVES = [addr_key(0x0A000201, 48879), addr_key(0x0A000202, 48879)]
RACKS = [[0, 1], [2, 3]]
PARAMS = dict(world_size=4, packet_elements=8, pool_size=4, codec=int(Codec.INT32), seed=5)
X = {r: (np.arange(8) * (r + 1) - 3 * r).astype(np.int32) for r in range(4)}  # rank r's int32 values
SCENARIO = Path(__file__).resolve().parents[2] / "sim" / "scenarios" / "leaf_spine.toml"


def data(rank: int, values: np.ndarray, **fields) -> bytes:
    """Rank ``rank``'s int32 DATA of round (0, 0) in slot 0, set 0."""
    head = {"type": MsgType.DATA, "job": JOB, "rank": rank, "slot": 0, "count": values.size, "codec": Codec.INT32,
            "shadow": 0, "exp": 0, "next_exp": NO_EXP, **fields}
    return pack(head, values)


def joined(core, ranks) -> None:
    for r in ranks:
        [(ack, _)] = handshake(core, worker_addr(r), 0.0, JOB, r, token=TOKEN, **PARAMS)
        assert msg_type(ack) == MsgType.JOIN_ACK, ack


def fabric(racks: list[list[int]] = RACKS, hold: float = 0.0) -> tuple[list[AggregatorCore], SpineCore]:
    """Two leaves (of two ranks each by default; every rank joined), the job routed at the leaves (with ``hold``)
    and installed at the spine."""
    params = {**PARAMS, "world_size": sum(map(len, racks))}
    leaves = []
    for k, ranks in enumerate(racks):
        leaf = leaf_core(tokens=[TOKEN], rows=16, max_elements=8, random_bytes=bytes)
        leaf.datapath.add_route(JOB, leaf=k, ranks=ranks, spine=SPINE, hold=hold)
        for r in ranks:
            [(ack, _)] = handshake(leaf, worker_addr(r), 0.0, JOB, r, token=TOKEN, **params)
            assert msg_type(ack) == MsgType.JOIN_ACK, ack
        leaves.append(leaf)
    spine = SpineCore(rows=16, max_elements=8)
    spine.install(JOB, JobParams(**{**params, "codec": Codec.INT32}), list(zip(LEAVES, racks)))
    return leaves, spine


def counters(core, job=JOB) -> dict[str, int]:
    cells = core.job_counters(job) if isinstance(core, SpineCore) else core.stats(0.0, job)["jobs"][str(job)]["counters"]
    return {k: v for k, v in cells.items() if v}


def test_partial_result_and_recovery_at_both_levels():
    (a, b), spine = fabric()
    assert core_receive(a, [(data(0, X[0]), worker_addr(0))], 1.0) == []
    [(partial_a, dest)] = core_receive(a, [(data(1, X[1]), worker_addr(1))], 1.0)
    h = header(partial_a)
    assert dest == SPINE and msg_type(partial_a) == MsgType.PARTIAL and (h["rank"], h["count"]) == (0, 8)
    assert np.array_equal(np.frombuffer(partial_a, ">i4", 8, HDR), X[0] + X[1])
    assert len(partial_a) == HDR + 32 + 8 and int.from_bytes(partial_a[-8:], "big") == 0b0011
    # a rank retransmits before the spine answered: the leaf sends its stored partial again, the same bytes
    assert core_receive(a, [(data(0, X[0]), worker_addr(0))], 2.0) == [(partial_a, SPINE)]
    # the spine holds leaf a's partial once: the copy is dropped while the set waits for leaf b
    assert core_receive(spine, [(partial_a, LEAVES[0]), (partial_a, LEAVES[0])], 2.0) == []
    [(partial_b, _)] = core_receive(b, [(data(2, X[2]), worker_addr(2)), (data(3, X[3]), worker_addr(3))], 2.0)
    assert int.from_bytes(partial_b[-8:], "big") == 0b1100
    out = core_receive(spine, [(partial_b, LEAVES[1])], 3.0)
    assert [dest for _, dest in out] == LEAVES and out[0][0] == out[1][0]
    result = out[0][0]
    assert msg_type(result) == MsgType.RESULT
    assert np.array_equal(np.frombuffer(result, ">i4", 8, HDR), sum(X.values()))
    # leaf a's partial again (the result to it was lost): the stored result, to leaf a alone
    assert core_receive(spine, [(partial_a, LEAVES[0])], 4.0) == [(stored(result), LEAVES[0])]
    # a RESULT from anywhere but the spine changes nothing at the leaf
    assert core_receive(a, [(result, worker_addr(9))], 4.0) == []
    # the leaf keeps the spine's result and replicates it to its rack (unicast: the job has no multicast group)
    assert core_receive(a, [(result, SPINE)], 4.0) == [(result, worker_addr(0)), (result, worker_addr(1))]
    assert core_receive(a, [(result, SPINE)], 4.0) == []  # a duplicate: no round waits for it
    assert core_receive(a, [(data(1, X[1]), worker_addr(1))], 5.0) == [(stored(result), worker_addr(1))]
    assert counters(spine) == {"packets_in": 4, "packets_out": 3, "contributions": 2, "completions": 1,
                               "retransmissions": 2, "results_resent": 1, "drop_duplicate_incomplete": 1}
    assert counters(a) == {"packets_in": 7, "packets_out": 5, "contributions": 2, "completions": 1,
                           "retransmissions": 2, "results_resent": 2, "drop_unregistered_source": 1,
                           "drop_stale": 1}
    # the same contributions on one switch give the same result datagram, byte for byte
    one = new_core(rows=16, max_elements=8, random_bytes=bytes)
    joined(one, range(4))
    out = core_receive(one, [(data(r, X[r]), worker_addr(r)) for r in range(4)], 1.0)
    assert [d for _, d in out] == [worker_addr(r) for r in range(4)] and {p for p, _ in out} == {result}


def test_a_racks_duplicates_send_its_partial_up_once_per_hold():
    """The ranks of a complete rack resend one round before the spine answered: the first duplicate sends the stored
    partial up again, the rest within the route's hold are counted and dropped (the spine's one answer goes to the
    whole rack). A duplicate after the hold, or a rank's second since the last re-send (its own timer saying that
    re-send brought nothing: lost on the way up, or its result on the way down), sends it again, and the hold
    restarts. No rank waits on another's duplicate. With no hold (the default) each duplicate sends it."""
    values = {r: np.full(8, r + 1, np.int32) for r in range(5)}
    (a, b), spine = fabric([[0, 1, 2, 3], [4]], hold=1.0)
    assert core_receive(a, [(data(r, values[r]), worker_addr(r)) for r in range(3)], 1.0) == []
    [(partial, _)] = core_receive(a, [(data(3, values[3]), worker_addr(3))], 1.0)

    def duplicates(*ranks: int) -> list[tuple[bytes, int]]:
        return [(data(r, values[r]), worker_addr(r)) for r in ranks]

    # k = 3 duplicates within the hold: one partial up, k - 1 dropped, in one burst or over several
    assert core_receive(a, duplicates(2, 0), 2.0) == [(partial, SPINE)]
    assert core_receive(a, duplicates(3), 2.5) == []
    assert counters(a)["drop_duplicate_resent"] == 2
    # that re-send was lost: rank 1, new, is dropped; rank 0's second duplicate sends it again, and 1 and 3,
    # within the new hold, are dropped
    assert core_receive(a, duplicates(1, 0, 1, 3), 2.8) == [(partial, SPINE)]
    assert counters(a)["drop_duplicate_resent"] == 5
    assert core_receive(a, duplicates(3), 3.5) == [(partial, SPINE)]  # 3's second since: lost again, up again
    assert core_receive(a, duplicates(1), 4.6) == [(partial, SPINE)]  # after the hold: up again
    assert core_receive(spine, [(partial, LEAVES[0])], 5.0) == []
    [(partial_b, _)] = core_receive(b, duplicates(4), 5.0)
    result = core_receive(spine, [(partial_b, LEAVES[1])], 5.0)[0][0]
    assert core_receive(a, [(result, SPINE)], 5.0) == [(result, worker_addr(r)) for r in range(4)]
    assert np.array_equal(np.frombuffer(result, ">i4", 8, HDR), np.full(8, 15))
    assert core_receive(a, duplicates(2, 2), 5.0) == [(stored(result), worker_addr(2))] * 2  # results: never held back
    assert counters(a) == {"packets_in": 16, "packets_out": 11, "contributions": 4, "completions": 1,
                           "retransmissions": 11, "results_resent": 6, "drop_duplicate_resent": 5}
    # the set's next round starts with no hold: its first duplicate sends its partial up at once
    key = {"chunk": 8}
    assert core_receive(a, [(data(r, values[r], **key), worker_addr(r)) for r in range(4)], 5.2)[0][1] == SPINE
    [(again, dest)] = core_receive(a, [(data(0, values[0], **key), worker_addr(0))], 5.3)
    assert dest == SPINE and msg_type(again) == MsgType.PARTIAL
    # no hold: a partial per duplicate
    (a, _), _ = fabric()
    [(partial, _)] = core_receive(a, [(data(r, X[r]), worker_addr(r)) for r in (0, 1)], 1.0)
    assert core_receive(a, [(data(r, X[r]), worker_addr(r)) for r in (0, 1)], 1.0) == [(partial, SPINE)] * 2


def test_a_leaf_answers_a_duplicate_into_its_incomplete_rack_with_pending():
    """As one switch answers: the DATA's header as type PENDING, count 0, then the rack's ranks the set has."""
    (a, _), _ = fabric()
    first = data(0, X[0])
    assert core_receive(a, [(first, worker_addr(0))], 1.0) == []
    [(answer, dest)] = core_receive(a, [(first, worker_addr(0))], 2.0)
    want = bytearray(first[:HDR])
    want[3], want[20:22] = MsgType.PENDING, b"\0\0"
    assert dest == worker_addr(0) and answer == bytes(want) + (0b0001).to_bytes(8, "big")
    assert counters(a) == {"packets_in": 2, "packets_out": 1, "contributions": 1, "retransmissions": 1,
                           "drop_duplicate_incomplete": 1}


def test_the_spines_congestion_mark_reaches_the_rack():
    """A RESULT that a queue between the spine and the leaf marked (docs/window.md) goes on to the rack marked; the
    leaf stores it unmarked, so a re-send carries only the marks of the queues it meets itself. So does a result the
    spine re-sent (STORED). Any other bit beyond the shadow set is still malformed."""
    (a, b), spine = fabric()
    core_receive(a, [(data(0, X[0]), worker_addr(0))], 1.0)
    [(partial_a, _)] = core_receive(a, [(data(1, X[1]), worker_addr(1))], 1.0)
    [(partial_b, _)] = core_receive(b, [(data(2, X[2]), worker_addr(2)), (data(3, X[3]), worker_addr(3))], 1.0)
    assert core_receive(spine, [(partial_a, LEAVES[0])], 2.0) == []
    result = core_receive(spine, [(partial_b, LEAVES[1])], 2.0)[0][0]
    marked, bad = bytearray(result), bytearray(result)
    marked[O_SHADOW] |= CONGESTED
    bad[O_SHADOW] |= 8
    assert core_receive(b, [(bytes(bad), SPINE)], 3.0) == [] and counters(b)["drop_bad_shadow"] == 1
    assert core_receive(a, [(bytes(marked), SPINE)], 3.0) == [(bytes(marked), worker_addr(r)) for r in (0, 1)]
    assert core_receive(a, [(data(1, X[1]), worker_addr(1))], 4.0) == [(stored(result), worker_addr(1))]
    assert core_receive(b, [(stored(result), SPINE)], 3.0) == [(stored(result), worker_addr(r)) for r in (2, 3)]


def marked(datagram: bytes) -> bytes:
    """``datagram`` with the congestion mark, as a deep egress queue sets it."""
    copy = bytearray(datagram)
    copy[O_SHADOW] |= CONGESTED
    return bytes(copy)


def test_the_spine_echoes_a_marked_partial():
    """A PARTIAL that a deep queue on the leaf's port up marked (docs/window.md) counts as the unmarked one, and
    the spine echoes the mark: the round's result leaves for every leaf marked, and so does a stored result
    re-sent in answer to a marked partial; the stored result stays unmarked, and the set's next round starts
    without the mark."""
    (a, b), spine = fabric()
    [(partial_a, _)] = core_receive(a, [(data(r, X[r]), worker_addr(r)) for r in RACKS[0]], 1.0)
    [(partial_b, _)] = core_receive(b, [(data(r, X[r]), worker_addr(r)) for r in RACKS[1]], 1.0)
    assert core_receive(spine, [(marked(partial_a), LEAVES[0])], 2.0) == []
    out = core_receive(spine, [(partial_b, LEAVES[1])], 2.0)
    result = out[0][0]
    assert result[O_SHADOW] == CONGESTED and out == [(result, leaf) for leaf in LEAVES]
    # bit for bit the result of unmarked partials, but for the mark
    _, plain = fabric()
    [(unmarked, _)] = core_receive(plain, [(partial_a, LEAVES[0]), (partial_b, LEAVES[1])], 2.0)[:1]
    assert result == marked(unmarked) and unmarked[O_SHADOW] == 0
    # a re-send carries the mark of the partial it answers
    assert core_receive(spine, [(partial_a, LEAVES[0])], 3.0) == [(stored(unmarked), LEAVES[0])]
    assert core_receive(spine, [(marked(partial_b), LEAVES[1])], 3.0) == [(stored(result), LEAVES[1])]
    # the set's next round (slot 0, set 0 again, two allreduces on), its partials unmarked: its result is unmarked
    nxt = [data(r, X[r], allreduce=2) for r in range(4)]
    [(next_a, _)] = core_receive(a, [(nxt[r], worker_addr(r)) for r in RACKS[0]], 4.0)
    [(next_b, _)] = core_receive(b, [(nxt[r], worker_addr(r)) for r in RACKS[1]], 4.0)
    out = core_receive(spine, [(next_a, LEAVES[0]), (next_b, LEAVES[1])], 5.0)
    assert len(out) == 2 and out[0][0][O_SHADOW] == 0
    assert counters(spine)["contributions"] == 4 and "drop_bad_shadow" not in counters(spine)


def _replace_sum(partial: bytes, value: int) -> bytes:
    return partial[:HDR] + value.to_bytes(4, "big", signed=True) + partial[HDR + 4:]


LIMIT = 2 * (1 << 28)  # a rack of 2 ranks, each value within 2**s(4) = 2**28


@pytest.mark.parametrize("mutate, src, reason", [
    (lambda p: p, addr_key(0x0A000299, 48879), "drop_unregistered_source"),  # an unknown leaf
    (lambda p: p, LEAVES[1], "drop_unregistered_source"),  # leaf b's address with leaf a's index
    (lambda p: with_header(p, rank=2), LEAVES[0], "drop_rank_out_of_range"),  # a third leaf of a two-leaf job
    (lambda p: p[:-1], LEAVES[0], "drop_wrong_count"),  # wrong size
    (lambda p: with_header(p, count=7), LEAVES[0], "drop_wrong_count"),  # the count does not match the size
    (lambda p: p[:-8] + (0b01).to_bytes(8, "big"), LEAVES[0], "drop_wrong_count"),  # one contributor missing
    (lambda p: p[:-8] + (0b111).to_bytes(8, "big"), LEAVES[0], "drop_wrong_count"),  # another rack's rank
    (lambda p: _replace_sum(p, LIMIT + 1), LEAVES[0], "drop_invalid_code"),  # more than 2 ranks could sum
    (lambda p: _replace_sum(p, -LIMIT - 1), LEAVES[0], "drop_invalid_code"),
    (lambda p: with_header(p, codec=Codec.CNAT8), LEAVES[0], "drop_wrong_codec"),
    (lambda p: with_header(p, shadow=4), LEAVES[0], "drop_bad_shadow"),  # bit 1 (CONGESTED) is the only other
    (lambda p: with_header(p, shadow=CONGESTED | 4), LEAVES[0], "drop_bad_shadow"),
    (lambda p: with_header(p, slot=4), LEAVES[0], "drop_slot_out_of_range"),
    (lambda p: with_header(p, exp=127, next_exp=-127), LEAVES[0], "drop_bad_exponent"),
    (lambda p: with_header(p, rank=1 << 8), LEAVES[0], "drop_bad_owner"),
])
def test_malformed_partials_are_counted_and_dropped(mutate, src, reason):
    (a, b), spine = fabric()
    [(partial_a, _)] = core_receive(a, [(data(r, X[r]), worker_addr(r)) for r in RACKS[0]], 1.0)
    [(partial_b, _)] = core_receive(b, [(data(r, X[r]), worker_addr(r)) for r in RACKS[1]], 1.0)
    table = [arr.copy() for arr in spine.table]
    assert core_receive(spine, [(mutate(partial_a), src)], 2.0) == []
    assert counters(spine) == {"packets_in": 1, reason: 1}
    assert all(np.array_equal(x, y) for x, y in zip(table, spine.table))
    # nothing stalled: the good partials still complete the round, with the right sum
    out = core_receive(spine, [(partial_a, LEAVES[0]), (partial_b, LEAVES[1])], 3.0)
    assert len(out) == 2 and np.array_equal(np.frombuffer(out[0][0], ">i4", 8, HDR), sum(X.values()))


def test_a_spine_takes_partials_only_and_counts_strangers():
    _, spine = fabric()
    core_receive(spine, [(data(0, X[0]), LEAVES[0]), (b"\x00" * 4, LEAVES[0]),
                         (with_header(data(0, X[0]), type=MsgType.PARTIAL, job=99), LEAVES[0])], 1.0)
    assert {k: v for k, v in spine.job_counters().items() if v} == {
        "packets_in": 3, "drop_unknown_type": 1, "drop_short": 1, "drop_unknown_job": 1}


def test_leaf_refuses_what_it_cannot_route():
    leaf = leaf_core(tokens=[TOKEN], rows=16, max_elements=8, random_bytes=bytes)
    [(error, _)] = handshake(leaf, worker_addr(0), 0.0, JOB, 0, token=TOKEN, **PARAMS)
    assert msg_type(error) == MsgType.ERROR and b"no route to a spine for job 7" in error
    leaf.datapath.add_route(JOB, leaf=0, ranks=[0, 1], spine=SPINE)
    [(error, _)] = handshake(leaf, worker_addr(2), 0.0, JOB, 2, token=TOKEN, **PARAMS)
    assert b"rank 2 is not in this leaf's rack" in error
    [(error, _)] = handshake(leaf, worker_addr(0), 0.0, JOB, 0, token=TOKEN, **{**PARAMS, "flags": 1})
    assert b"data_mac" in error
    joined(leaf, [0, 1])
    with pytest.raises(ValueError, match="before its first JOIN"):
        leaf.datapath.add_route(JOB, leaf=0, ranks=[0, 1], spine=SPINE)
    spine = SpineCore(rows=16, max_elements=8)
    with pytest.raises(ValueError, match="split ranks 0..3 exactly"):
        spine.install(JOB, JobParams(world_size=4, packet_elements=8), [(LEAVES[0], [0, 1]), (LEAVES[1], [1, 2])])
    # a job of MAX_WORLD ranks: its racks' bitmaps use the 64th bit
    spine.install(JOB, JobParams(world_size=64, packet_elements=8, pool_size=4),
                  [(LEAVES[0], range(63)), (LEAVES[1], [63])])


@pytest.mark.slow
@pytest.mark.parametrize("codec", ["cnat8", "int32"])
@pytest.mark.parametrize("workers, racks, loss, uplink_loss, multicast", [
    (6, 2, 0.0, 0.0, True),
    (7, 3, 0.02, 0.0, True),  # racks of 2, 2 and 3; loss on the hosts' links only
    (5, 5, 0.0, 0.05, False),  # a rank per rack; loss on the leaves' uplinks only; unicast results
    (8, 2, 0.02, 0.05, True),  # loss at both levels
])
def test_leaf_spine_result_is_the_one_switch_result(codec, workers, racks, loss, uplink_loss, multicast):
    """Every rank's result of every allreduce equals protocol.reference's bit for bit, as the one-switch run's
    does (on the same inputs and seed), whatever was lost at either level."""
    run = dict(workers=workers, elements=30_000, codec=codec, check=True, host_costs=False, rounds=2, seed=3,
               rto=1e-3, min_rto=1e-3)
    two = simulate(PacketRun(racks=racks, loss=loss, uplink_loss=uplink_loss, multicast=multicast, **run))
    one = simulate(PacketRun(**run))
    assert one.exact and two.exact
    assert (two.lost > 0 and two.retransmissions > 0) == bool(loss or uplink_loss)


@pytest.mark.slow
@pytest.mark.parametrize("codec, workers, racks, rate, uplink_rate, pool, delay", [
    ("cnat8", 8, 2, 10e9, 10e9, 64, 1e-6),  # the uplinks set the pace (int32 partials)
    ("cnat8", 8, 4, 10e9, 2.5e9, 64, 1e-6),  # oversubscribed uplinks
    ("int32", 6, 3, 10e9, 10e9, 64, 1e-6),
    ("cnat8", 4, 2, 10e9, 10e9, 4, 5e-6),  # pool-bound: the window is smaller than the two-level round trip
    ("cnat8", 8, 2, 10e9, 40e9, 64, 1e-6),  # the hosts' links set the pace
])
def test_packet_level_agrees_with_the_model(codec, workers, racks, rate, uplink_rate, pool, delay):
    """Within 3%, as the one-switch model (tests/sim/test_sim_models.py); measured 0.1-1.5% on these points."""
    elements = 200_000
    r = simulate(PacketRun(workers=workers, racks=racks, elements=elements, codec=codec, rate=rate,
                           uplink_rate=uplink_rate, pool=pool, delay=delay, host_costs=False, inputs="shared"))
    fabric_ = models.LeafSpine(workers, racks, rate, uplink_rate, delay, mtu=1500)
    model = models.leaf_spine_in_network(fabric_, elements, 1 if codec == "cnat8" else 4, pool=pool)
    assert r.times[0] == pytest.approx(model, rel=0.03)


def test_leaf_spine_model_hand_computed():
    t = models.LeafSpine(workers=64, racks=8, rate=100e9, uplink_rate=100e9, delay=1e-6, mtu=9000,
                         switch_latency=1e-6)
    # packets of 2234 elements: a partial of 2234 int32 sums, HDR and the 8-byte bitmap fill 8972 of 9000 bytes
    assert t.packet_elements(1) == 2234 == (9000 - 28 - HDR - 8) // 4
    host = (2234 + HDR + 42) * 8 / 100e9  # 184.16 ns a packet on a host's link (and a result on the uplink down)
    up = (4 * 2234 + HDR + 8 + 42) * 8 / 100e9  # 720.96 ns a partial on the uplink
    rtt = 4e-6 + 3e-6 + 2 * host + up + host  # 8.27344 us
    boot = (HDR + 8 + 42) * 8 / 100e9  # an empty partial is the longest bootstrap packet
    assert models.leaf_spine_in_network(t, 2234 * 100) == pytest.approx(100 * up + 100 * boot + rtt)
    assert models.leaf_spine_in_network(t, 2234 * 100) == pytest.approx(80.97744e-6)
    assert up > host  # leaves forward int32 partials: the spine level is the slower one at equal rates
    # a pool of 1: one packet per two-level round trip
    assert models.leaf_spine_in_network(t, 2234 * 100, pool=1) == pytest.approx(100 * rtt + boot + rtt)
    # one rack is one switch
    one = models.LeafSpine(workers=8, racks=1, rate=100e9, uplink_rate=1e9)
    assert models.leaf_spine_in_network(one, 2234 * 100) == models.in_network(
        models.Net(8, 100e9, mtu=9000), 2234 * 100, 2234, 256)


@pytest.mark.process
def test_shipped_scenario_runs_at_packet_level(capsys):
    assert main(["sweep", str(SCENARIO), "--set", "elements=20000", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["rows"]
    assert [(r["system"], r["method"], r["racks"], r["uplink_rate"]) for r in rows] == [
        (system, method, 4, uplink) for uplink in (10e9, 40e9)
        for system, method in (("intml-cnat8", "packet"), ("switchml-int32", "packet"), ("gloo-ring", "flow model"))]


def test_scenario_leaf_spine_errors(tmp_path, capsys):
    scenario = tmp_path / "s.toml"
    for text, message in [('racks = 8\nworkers = 4\n', "racks must be at most workers (4), got 8"),
                          ('racks = 2\nsystems = ["ps-colocated"]\n', "ps-colocated has no leaf-spine model"),
                          ('racks = 2\nmode = "packet"\nengine = "p4model"\n', "a packet-level leaf-spine runs"),
                          ('racks = 0\n', "racks must be an integer >= 1")]:
        scenario.write_text(text)
        assert main(["run", str(scenario)]) == 2
        err = capsys.readouterr().err
        assert message in err and err.count("\n") == 1, err
