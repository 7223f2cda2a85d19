"""Two-level aggregation (leaf-spine): the cores (aggregator.leafspine) driven packet by packet, malformed partials."""

from __future__ import annotations

import numpy as np
import pytest

from harness import TOKEN, addr_key, core_receive, handshake, header, msg_type, new_core, with_header, worker_addr
from intml.aggregator.leafspine import LeafCore, SpineCore
from intml.protocol.job import JobParams
from intml.protocol.packet import HDR
from intml.protocol.wire import NO_EXP, Codec, MsgType, pack

JOB = 7
SPINE = addr_key(0x0A000301, 48879)
LEAVES = [addr_key(0x0A000201, 48879), addr_key(0x0A000202, 48879)]
RACKS = [[0, 1], [2, 3]]
PARAMS = dict(world_size=4, packet_elements=8, pool_size=4, codec=int(Codec.INT32), seed=5)
X = {r: (np.arange(8) * (r + 1) - 3 * r).astype(np.int32) for r in range(4)}  # rank r's int32 values


def data(rank: int, values: np.ndarray, **fields) -> bytes:
    """Rank ``rank``'s int32 DATA of round (0, 0) in slot 0, set 0."""
    head = {"type": MsgType.DATA, "job": JOB, "rank": rank, "slot": 0, "count": values.size, "codec": Codec.INT32,
            "shadow": 0, "exp": 0, "next_exp": NO_EXP, **fields}
    return pack(head, values)


def joined(core, ranks) -> None:
    for r in ranks:
        [(ack, _)] = handshake(core, worker_addr(r), 0.0, JOB, r, token=TOKEN, **PARAMS)
        assert msg_type(ack) == MsgType.JOIN_ACK, ack


def fabric() -> tuple[list[LeafCore], SpineCore]:
    """Two leaves of two ranks each (every rank joined), the job routed at the leaves and installed at the spine."""
    leaves = []
    for k, ranks in enumerate(RACKS):
        leaf = LeafCore(tokens=[TOKEN], rows=16, max_elements=8, random_bytes=bytes)
        leaf.add_route(JOB, leaf=k, ranks=ranks, spine=SPINE)
        joined(leaf, ranks)
        leaves.append(leaf)
    spine = SpineCore(rows=16, max_elements=8)
    spine.install(JOB, JobParams(**{**PARAMS, "codec": Codec.INT32}), list(zip(LEAVES, RACKS)))
    return leaves, spine


def counters(core, job=JOB) -> dict[str, int]:
    cells = core.counters(job) if isinstance(core, SpineCore) else core.stats(0.0, job)["jobs"][str(job)]["counters"]
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
    assert core_receive(spine, [(partial_a, LEAVES[0])], 4.0) == [(result, LEAVES[0])]
    # a RESULT from anywhere but the spine changes nothing at the leaf
    assert core_receive(a, [(result, worker_addr(9))], 4.0) == []
    # the leaf keeps the spine's result and replicates it to its rack (unicast: the job has no multicast group)
    assert core_receive(a, [(result, SPINE)], 4.0) == [(result, worker_addr(0)), (result, worker_addr(1))]
    assert core_receive(a, [(result, SPINE)], 4.0) == []  # a duplicate: no round waits for it
    assert core_receive(a, [(data(1, X[1]), worker_addr(1))], 5.0) == [(result, worker_addr(1))]
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
    (lambda p: with_header(p, shadow=2), LEAVES[0], "drop_bad_shadow"),
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
    assert {k: v for k, v in spine.counters().items() if v} == {
        "packets_in": 3, "drop_unknown_type": 1, "drop_short": 1, "drop_unknown_job": 1}


def test_leaf_refuses_what_it_cannot_route():
    leaf = LeafCore(tokens=[TOKEN], rows=16, max_elements=8, random_bytes=bytes)
    [(error, _)] = handshake(leaf, worker_addr(0), 0.0, JOB, 0, token=TOKEN, **PARAMS)
    assert msg_type(error) == MsgType.ERROR and b"no route to a spine for job 7" in error
    leaf.add_route(JOB, leaf=0, ranks=[0, 1], spine=SPINE)
    [(error, _)] = handshake(leaf, worker_addr(2), 0.0, JOB, 2, token=TOKEN, **PARAMS)
    assert b"rank 2 is not in this leaf's rack" in error
    [(error, _)] = handshake(leaf, worker_addr(0), 0.0, JOB, 0, token=TOKEN, **{**PARAMS, "flags": 1})
    assert b"data_mac" in error
    joined(leaf, [0, 1])
    with pytest.raises(ValueError, match="before its first JOIN"):
        leaf.add_route(JOB, leaf=0, ranks=[0, 1], spine=SPINE)
    spine = SpineCore(rows=16, max_elements=8)
    with pytest.raises(ValueError, match="split ranks 0..3 exactly"):
        spine.install(JOB, JobParams(world_size=4, packet_elements=8), [(LEAVES[0], [0, 1]), (LEAVES[1], [1, 2])])
