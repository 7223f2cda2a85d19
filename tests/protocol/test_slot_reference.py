"""The Numba aggregator core against protocol.slot_reference, its packet-at-a-time reference, bit for bit: the
same datagrams out in the same order, the same per-reason counters, the same slot state and sums. Streams come
from (a) the in-process harness with faults (both codecs, several jobs, 2..8 workers, two cores, multicast),
replayed in bursts of random sizes, and (b) hypothesis, with malformed packets of every drop reason."""

from __future__ import annotations

import numpy as np
import pytest
from support.harness import new_core, worker_addr
from hypothesis import HealthCheck, Phase, find, given, settings
from hypothesis import strategies as st

from intml.protocol.stats import STAT_NAMES
from intml.protocol import wire
from intml.protocol.slot_reference import TRANSITIONS, Job, SlotReference
from intml.protocol.wire import NO_EXP, Codec, MsgType
from support.slot_streams import GROUP, JOBS, MAC_KEY, P, Item, joined_pair, packets, recorded, replay, spec_of

@pytest.mark.parametrize("codec", ["cnat8", "int32"])
@pytest.mark.parametrize("n", [2, 3, 5, 8])
def test_recorded_stream_matches_reference(codec, n):
    net, sent = recorded(n, codec, seed=n)
    rng = np.random.default_rng(n)
    stream = [(d, s) for d, s, _ in sent]
    # scrambled within windows of 30, past what the protocol allows: stale rounds, sets reopened in a burst
    scrambled = [stream[k] for w in range(0, len(stream), 30) for k in w + rng.permutation(min(30, len(stream) - w))]
    for s in (stream, scrambled):
        replay(*joined_pair([spec_of(net)]), s, [int(k) for k in rng.integers(1, 100, 20)])
    counters = net.job_counters()
    assert counters["completions"] > 0 and counters["retransmissions"] > 0


@pytest.mark.parametrize("codec", ["cnat8", "int32"])
@pytest.mark.parametrize("group", [None, GROUP])
def test_recorded_stream_of_two_jobs_matches_reference(codec, group):
    shared = new_core(rows=64, max_elements=P, results_group=group)
    runs = [recorded(n, codec, seed=job, job=job, port=5000 + 100 * job, aggregators=[shared])
            for job, n in ((1, 2), (2, 4))]
    a, b = ([(d, s) for d, s, _ in sent] for _, sent in runs)
    stream = [item for pair in zip(a, b) for item in pair] + a[len(b):] + b[len(a):]
    replay(*joined_pair([spec_of(net) for net, _ in runs], group=group), stream, [64, 7, 128, 1])


@pytest.mark.parametrize("codec", ["cnat8", "int32"])
def test_recorded_stream_with_the_mac_matches_reference(codec):
    """A job with the DATA/RESULT MAC: the tagged stream, scrambled, with every tenth packet's tag broken or
    stripped, gives the reference's tagged results and counters."""
    net, sent = recorded(3, codec, seed=5, data_mac_key=MAC_KEY)
    rng = np.random.default_rng(5)
    stream = []
    for k, (d, s, _) in enumerate(sent):
        if k % 10 == 3:
            stream.append((d[:-1] + bytes([d[-1] ^ 0x10]) if k % 20 == 3 else d[:-8], s))
        stream.append((d, s))
    stream = [stream[k] for w in range(0, len(stream), 30) for k in w + rng.permutation(min(30, len(stream) - w))]
    agg, ref = joined_pair([{**spec_of(net), "mac_key": MAC_KEY}])
    replay(agg, ref, stream, [int(k) for k in rng.integers(1, 100, 20)])
    counters = agg.stats(1.0)["jobs"][str(net.job)]["counters"]
    assert counters["completions"] > 0 and counters["drop_bad_mac"] == len(sent[3::10])


def test_recorded_stream_on_a_core_of_the_second_aggregator_matches_reference():
    """A job over two aggregators (1 and 2 cores): core 1 of the second holds slots s % 3 == 2."""
    net, sent = recorded(3, "cnat8", seed=13, cores=3)
    stream = [(d, s) for d, s, dst in sent]  # every core's packets: the others' slots are out of range here
    replay(*joined_pair([spec_of(net)], core=1, cores=2, layout=(1, 3)), stream, [50, 3])


def test_recorded_stream_on_the_second_core_matches_reference():
    net, sent = recorded(3, "cnat8", seed=11, cores=2)
    stream = [(d, s) for d, s, dst in sent]  # both cores' packets: core 1 drops core 0's slots as out of range
    replay(*joined_pair([spec_of(net)], core=1, cores=2), stream, [50, 3])


# ---- (b) random streams ------------------------------------------------------------------------------------

@pytest.mark.slow
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(stream=st.lists(packets(), min_size=1, max_size=80), sizes=st.lists(st.integers(1, 40), min_size=1,
                                                                           max_size=5),
       group=st.sampled_from([None, GROUP]))
def test_random_stream_matches_reference(stream, sizes, group):
    replay(*joined_pair(list(JOBS), group=group), stream, sizes)


@pytest.mark.slow
def test_random_streams_reach_every_transition_and_drop_reason():
    """The generator is strong enough: a few of its streams take every transition of the table and count every
    drop reason of the data path in the reference."""
    control_plane = {"drop_bad_control", "drop_refused_join", "drop_leave_non_member", "drop_control_rate"}
    host_mode = {"drop_bad_package"}  # a host codec's package: not the switch's path (tests/aggregator/test_host_mode)
    leaf = {"drop_duplicate_resent"}  # a leaf's, not one switch's (tests/aggregator/test_leafspine)
    reasons = {name for name in STAT_NAMES if name.startswith("drop_")} - control_plane - host_mode - leaf
    seen: set = set()

    def covers_everything(stream: list[Item]) -> bool:
        ref = SlotReference()
        for spec in JOBS:
            ref.join(Job(spec["job"], spec["world"], P, spec["pool"], int(spec["codec"]), spec["seed"],
                         {r: spec["addr"](r) for r in range(spec["world"])}, mac_key=spec.get("mac_key")))
        for datagram, src in stream:
            ref.receive(datagram, src)
        seen.update(name for counter in [ref.core_stats] + [j.stats for j in ref.jobs.values()]
                    for name, v in counter.items() if v)
        seen.update(ref.transitions)
        return reasons | set(TRANSITIONS) <= seen

    find(st.lists(packets(), min_size=80, max_size=80), covers_everything,
         settings=settings(max_examples=80, derandomize=True, database=None, phases=[Phase.generate], deadline=None,
                           suppress_health_check=[HealthCheck.too_slow]))  # a loaded machine changes no outcome


# ---- the allreduce counter's wrap ---------------------------------------------------------------------------


def _int32_data(allreduce: int, rank: int, values: np.ndarray, slot: int = 0) -> bytes:
    header = {"type": int(MsgType.DATA), "job": 7, "allreduce": allreduce, "chunk": 0, "rank": rank, "slot": slot,
              "count": values.size, "codec": int(Codec.INT32), "shadow": allreduce % 2, "exp": 0,
              "next_exp": NO_EXP}
    return wire.pack(header, values)


@pytest.mark.parametrize("start", [2**31 - 2, 2**32 - 2])
def test_rounds_across_the_allreduce_wrap_complete(start):
    """Allreduces past 2**31 (the signed 64-bit round key's sign bit) and across 2**32 -> 0 (the wire's u32 wraps)
    still open new rounds and complete; a delayed packet of an earlier round is still stale."""
    spec = {"job": 7, "world": 2, "codec": Codec.INT32, "pool": 1, "seed": 3, "addr": worker_addr}
    agg, ref = joined_pair([spec])
    rng = np.random.default_rng(start)
    seqs = [(start + k) % 2**32 for k in range(5)]
    stream = []
    for seq in seqs:
        stream += [(_int32_data(seq, r, rng.integers(-99, 99, P).astype(np.int32)), worker_addr(r)) for r in (0, 1)]
    stale = (_int32_data(seqs[2], 0, np.zeros(P, np.int32)), worker_addr(0))  # same set as seqs[4], older
    replay(agg, ref, stream + [stale], [1, 3])
    counters = agg.stats(1.0)["jobs"]["7"]["counters"]
    assert counters["completions"] == len(seqs)
    assert counters["drop_stale"] == 1
