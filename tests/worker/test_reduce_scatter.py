"""Reduce-scatter through the aggregator (docs/protocol.md, "Reduce-scatter"): each rank's shard is bit for bit the
allreduce of the same input restricted to it, and a rank downloads the payload only of the chunks that overlap
its shard (header-only completions for the others). (a) The sans-I/O harness with loss, duplication and
reordering, counting every byte each rank receives; (b) the kernel against protocol.slot_reference on recorded
reduce-scatter streams; (c) real Worker processes and an aggregator process on 127.0.0.1; (d) the P4 pipeline
model as the aggregator, datagram for datagram the kernel."""

from __future__ import annotations


import numpy as np
import pytest
from support.harness import TOKEN, Network, make_inputs, msg_type, new_core

from intml.p4.engine import p4model_core
from intml.protocol import reference, wire
from intml.protocol.packet import owner_range
from intml.protocol.wire import HEADER_SIZE, TAG_SIZE, MsgType
from support.slot_streams import MAC_KEY, joined_pair, replay, spec_of
from support.allreduce import RS_PLAN, assert_bits_equal, expected_results, new_job, reduce_scatter_worker, shard_of

P = 32




def run_both(n: int, codec: str, size: int, *, seed: int = 3, record: bool = False, faults: float = 0.1,
             group: tuple[int, int] | None = None, **options) -> tuple[Network, Network, list[np.ndarray]]:
    """The same inputs through an allreduce and a reduce-scatter (two jobs with the same seed, each its first
    collective on its own core, so the same random bits): (allreduce net, reduce-scatter net, inputs).
    ``group``: the cores' results multicast group."""
    xs = make_inputs(n, size, P, "normal", seed=seed)
    nets = []
    for scatter in (False, True):
        cores = [new_core(rows=64, max_elements=P, results_group=group)] if group else None
        net = Network(n, codec=codec, packet_elements=P, pool_size=4, seed=seed, drop=faults, duplicate=faults,
                      reorder=faults, fault_seed=seed + scatter, record=record, aggregators=cores, **options)
        net.start(xs, scatter=scatter)
        net.run()
        nets.append(net)
    return nets[0], nets[1], xs


def results_to(net: Network, rank: int) -> list[bytes]:
    return [d for d, _, dst in net.sent_down if dst == net.addr(rank) and msg_type(d) == MsgType.RESULT]


def owners_of(datagram: bytes, n: int) -> tuple[int, int]:
    return owner_range(datagram[wire.OFFSETS["rank"]], n)


# ---- (a) the harness: bit-exactness and the bytes each rank downloads -----------------------------------------


@pytest.mark.parametrize("codec", ["cnat8", "int32"])
@pytest.mark.parametrize("n, size", [(2, 2 * 5 * P), (3, 3 * 77), (4, 4 * 45), (5, 5 * 300), (8, 8 * 7)])
def test_shards_equal_the_allreduce_restricted(codec, n, size):
    """Shards of 77 or 45 elements straddle chunks of 32 (and 7 spans up to 4 shards' worth of a chunk): under
    loss, duplication and reordering every rank's shard is the allreduce's, bit for bit."""
    full, rs, _ = run_both(n, codec, size)
    for r in range(n):
        shard = rs.engines[r].result
        assert shard.size == size // n
        assert_bits_equal(shard, shard_of(full.engines[r].result, r, n), f"rank {r}")
    assert rs.job_counters()["retransmissions"] > 0


@pytest.mark.parametrize("data_mac", [False, True])
def test_non_owners_get_header_only_completions(data_mac):
    """Without faults: each rank gets the payload of exactly the chunks its shard overlaps (a straddling chunk goes
    to both its owners) and a header-only completion (26 bytes, 34 with the tag) of every other chunk: of the allreduce's payload bytes it
    downloads those of its own chunks."""
    n, shard = 4, 3 * P + 5  # shards straddle chunks
    key = MAC_KEY if data_mac else None
    full, rs, _ = run_both(n, "cnat8", n * shard, record=True, faults=0.0, data_mac_key=key)
    tag = TAG_SIZE if data_mac else 0
    chunks = -(-n * shard // P)
    for r in range(n):
        got = results_to(rs, r)
        data = [d for d in got if int(wire.unpack(d[:len(d) - tag])[0]["chunk"]) >= 0]
        assert len(data) == chunks
        owned = {c for c in range(chunks) if c * P < (r + 1) * shard and (c + 1) * P > r * shard}
        for d in data:
            header = wire.unpack(d[:len(d) - tag])[0]
            first, last = owners_of(d, n)
            c = int(header["chunk"])
            assert (first <= r <= last) == (c in owned)
            assert len(d) == (HEADER_SIZE + min(P, n * shard - c * P) if c in owned else HEADER_SIZE) + tag
        payload = [sum(len(d) - HEADER_SIZE - tag for d in results_to(net, r)) for net in (rs, full)]
        assert payload == [sum(min(P, n * shard - c * P) for c in owned), n * shard]  # CNAT8: a byte an element
    counters = rs.job_counters()
    assert counters["packets_out"] == n * counters["completions"]


def test_mixed_allreduce_and_reduce_scatter_in_one_job():
    """Allreduces and reduce-scatters alternate in one job (slots and shadow sets shared): each result is the one
    of a job that ran only that collective at that position."""
    n, size = 3, 3 * 100
    xs = [make_inputs(n, size, P, "normal", seed=k) for k in range(4)]
    kinds = [False, True, True, False]
    mixed = Network(n, packet_elements=P, pool_size=3, seed=9, drop=0.1, reorder=0.1, duplicate=0.1)
    plain = Network(n, packet_elements=P, pool_size=3, seed=9, job=8)
    for x, scatter in zip(xs, kinds):
        mixed.start(x, scatter=scatter)
        mixed.run()
        plain.start(x)
        plain.run()
        for r in range(n):
            want = plain.engines[r].result
            assert_bits_equal(mixed.engines[r].result, shard_of(want, r, n) if scatter else want, f"rank {r}")


def test_multicast_job_sends_reduce_scatter_rounds_by_unicast():
    """With a results group, allreduce rounds go once to the group, reduce-scatter rounds to each rank."""
    n = 3
    full, rs, _ = run_both(n, "cnat8", n * 50, record=True, faults=0.0, group=(0xEFFF0000, 4000))
    assert full.group and any(dst == full.group for _, _, dst in full.sent_down)
    assert rs.group and all(dst != rs.group for d, _, dst in rs.sent_down if owners_of(d, n) != (0, n - 1))
    for r in range(n):
        assert_bits_equal(rs.engines[r].result, shard_of(full.engines[r].result, r, n), f"rank {r}")


def test_reduce_scatter_needs_a_multiple_of_the_world_size():
    net = Network(3, packet_elements=P)
    with pytest.raises(ValueError, match="multiple of the world size 3"):
        net.start(make_inputs(3, 10, P, "normal", seed=0), scatter=True)


# ---- (b) the kernel against the reference -------------------------------------------------------------------


@pytest.mark.parametrize("codec", ["cnat8", "int32"])
@pytest.mark.parametrize("mac", [False, True])
def test_recorded_reduce_scatter_stream_matches_reference(codec, mac):
    """A faulty run's DATA (straddling chunks, re-sends after completion, a mixed allreduce), in order and
    scrambled past what the protocol allows, gives the reference's results, header-only completions and state."""
    n = 4
    net = Network(n, codec=codec, packet_elements=P, pool_size=4, drop=0.1, duplicate=0.1, reorder=0.2,
                  fault_seed=5, record=True, data_mac_key=MAC_KEY if mac else None)
    for k, scatter in enumerate((True, False, True)):
        net.start(make_inputs(n, n * 45, P, "normal", seed=k), scatter=scatter)
        net.run()
    stream = [(d, s) for d, s, _ in net.sent_up if msg_type(d) == MsgType.DATA]
    rng = np.random.default_rng(1)
    scrambled = [stream[k] for w in range(0, len(stream), 30) for k in w + rng.permutation(min(30, len(stream) - w))]
    spec = {**spec_of(net), "mac_key": MAC_KEY} if mac else spec_of(net)
    for s in (stream, scrambled):
        agg, ref = joined_pair([spec])
        replay(agg, ref, s, [int(k) for k in rng.integers(1, 60, 10)])
        rs_sets = [x for x in ref.sets.values() if x.owners]
        assert rs_sets and all(x.completion for x in rs_sets if len(x.ranks) == n)
    assert net.job_counters()["results_resent"] > 0


# ---- (c) real workers and aggregator ------------------------------------------------------------------------

@pytest.mark.process
@pytest.mark.parametrize("codec, use_async", [("cnat8", False), ("int32", False), ("cnat8", True)])
def test_live_reduce_scatter_under_faults(codec, use_async):
    from support.cluster import aggregator, run_ok

    n, seed = 4, 21
    with aggregator(idle_timeout=10) as agg:
        job = new_job()
        results = run_ok(reduce_scatter_worker, [(agg.port, job, r, n, codec, seed, RS_PLAN, 0.1, use_async)
                                                 for r in range(n)], timeout=90)
    want = expected_results(n, codec, seed, [spec for _, spec in RS_PLAN])
    for r, res in enumerate(results):
        for k, ((kind, spec), got, w) in enumerate(zip(RS_PLAN, res["outs"], want)):
            assert_bits_equal(got, shard_of(w, r, n) if kind == "rs" else w, f"rank {r} #{k} {kind} {spec}")
    assert sum(res["faults"].get("dropped", 0) for res in results) > 0


# ---- (d) the P4 pipeline model ------------------------------------------------------------------------------


@pytest.mark.parametrize("codec", ["cnat8", "int32"])
def test_p4_model_serves_reduce_scatter_as_the_kernel(codec):
    """The P4 pipeline model as the aggregator, under loss, duplication and reordering: the kernel's datagrams to
    every rank (payloads to the owners, header-only completions to the others, re-sends by the same rule), its
    counters, and each rank's shard of the allreduce."""
    n = 3
    nets = []
    for core in (new_core(rows=64, max_elements=P), p4model_core(rows=64, max_elements=P, tokens=[TOKEN])):
        net = Network(n, codec=codec, packet_elements=P, pool_size=4, seed=3, drop=0.1, duplicate=0.1, reorder=0.1,
                      fault_seed=4, aggregators=[core], record=True)
        net.start(make_inputs(n, n * 45, P, "normal", seed=3), scatter=True)
        net.run()
        nets.append(net)
    kernel, model = nets
    assert model.sent_down == kernel.sent_down
    assert model.job_counters() == kernel.job_counters() and model.job_counters()["results_resent"] > 0
    assert any(len(d) == HEADER_SIZE and msg_type(d) == MsgType.RESULT for d, _, _ in model.sent_down)
    full, _, _ = run_both(n, codec, n * 45, faults=0.0)
    for r in range(n):
        assert_bits_equal(model.engines[r].result, shard_of(full.engines[r].result, r, n), f"rank {r}")


# ---- (e) the benchmark's ranks --------------------------------------------------------------------------------


@pytest.mark.process
def test_benchmark_ranks_reduce_scatter_on_loopback():
    """bench cluster --collective reduce_scatter's programs: Gloo's ranks check their shard of the exact sum, and
    intml's ranks' shard hashes are those of the allreduce's result restricted to each shard."""
    import hashlib

    from intml.testbed import gloo, rank
    from intml.testbed.bench_allreduce import aggregator, run_ranks_intml
    from intml.testbed.procs import free_port, run_ranks

    n, elements = 2, 2 * 40_000
    port = free_port()
    argvs = [gloo.command(r, n, "127.0.0.1", port, elements, 0, 1, ifname="lo", collective="reduce_scatter")
             for r in range(n)]
    ring = gloo.summarize(run_ranks(argvs, "gloo", 120), elements, "reduce_scatter")
    assert ring["bytes_per_worker"] == gloo.ring_bytes(elements, n) / 2
    with aggregator(1, 1024) as agg_port:
        results = {c: run_ranks_intml([f"127.0.0.1:{agg_port}"] * n, elements, "cnat8", 1024, 16, 0, 1, job=j,
                                      collective=c)
                   for j, c in enumerate(rank.COLLECTIVES, start=1)}
    xs = [rank.rank_input(r, elements, 1) for r in range(n)]  # each timed round is the job's second collective
    total = reference.allreduce(xs, codec="cnat8", seed=1, allreduce_seq=1, packet_elements=1024)
    assert results["allreduce"]["hashes"] == [hashlib.sha256(total).hexdigest()[:16]]
    shards = [hashlib.sha256(shard_of(total, r, n)).hexdigest()[:16] for r in range(n)]
    assert results["reduce_scatter"]["hashes"] == [[h] for h in shards]


def test_gloo_check_sum_of_a_shard():
    from intml.testbed import gloo

    n, size = 3, 5
    total = gloo.rank_input(0, n * size).mul_(n).add_(n * (n - 1) // 2)
    gloo.check_sum(total[size:2 * size].clone(), n, shard=1)
    with pytest.raises(RuntimeError, match="wrong at element"):
        gloo.check_sum(total[:size].clone(), n, shard=1)
