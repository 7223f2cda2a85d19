"""The aggregator's host mode (docs/protocol.md, "Host mode"), driven sans-I/O: host-codec allreduces through
AggregatorCores and HostStreamEngines are bit-identical at every rank and equal to the codec's reference whatever
the loss, duplication and reordering; malformed packages are counted and dropped, never raised, never summed;
switch data paths refuse a host codec at JOIN with its reason. The codec is the tests' stand-in
(support.host_codec), registered for each test: any registered codec takes the same path."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support import harness
from support.harness import Network, core_receive, engine_receive, handshake, header, msg_type, new_core, worker_addr
from support.host_codec import WIRE_ID, HostQ, rank_key, reference, registered

from intml.aggregator.core import AggregatorCore
from intml.aggregator.kernel import KernelDataPath
from intml.aggregator.leafspine import leaf_core
from intml.p4.engine import p4model_core
from intml.protocol import wire
from intml.protocol.burst import Burst
from intml.protocol.codec import Codec
from intml.protocol.codecs.host import parse
from intml.protocol.job import JobParams, host_aggregator_elements, host_package_limit
from intml.protocol.siphash import tag_ref
from intml.protocol.slot_reference import SlotReference
from intml.protocol.wire import NO_EXP, MsgType
from intml.worker.host import HostStreamEngine
from intml.worker.state import HELD
from intml.worker.window import FLOOR

P = 32  # elements per packet: a few chunks per slot
SIZE = 300  # a partial last chunk
AGG = host_aggregator_elements(P)  # the aggregators' --max-packet-elements


@pytest.fixture(autouse=True)
def hostq():
    with registered():
        yield


def _inputs(n: int, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    xs = [rng.standard_normal(SIZE).astype(np.float32) for _ in range(n)]
    xs[0][P:2 * P] = 1.5  # a constant chunk: its package is a header alone
    return xs


def _check(net: Network, xs: list[np.ndarray], allreduce: int, bits: int = 8, mean: bool = False) -> None:
    want = reference(HostQ(bits), xs, seed=net.seed, allreduce=allreduce, packet_elements=net.packet_elements,
                     mean=mean)
    for rank, engine in enumerate(net.engines):
        np.testing.assert_array_equal(engine.result.view(np.uint32), want.view(np.uint32), err_msg=f"rank {rank}")


@pytest.mark.parametrize("n", range(2, 9))
def test_bit_identical_under_loss_duplication_and_reordering(n: int) -> None:
    """Every rank gets the reference's bits, in consecutive allreduces, over a lossy, duplicating, reordering
    network; the faults did happen."""
    net = Network(n, codec="hostq8", packet_elements=P, pool_size=4, drop=0.1, duplicate=0.1, reorder=0.2,
                  fault_seed=n)
    for allreduce in range(2):
        xs = _inputs(n, 10 * n + allreduce)
        net.allreduce(xs)
        _check(net, xs, allreduce)
    faults = net.uplink.counts
    assert faults["dropped"] and faults["duplicated"] and faults["reordered"], faults
    counters = net.job_counters()
    assert counters["completions"] == 2 * -(-SIZE // P) and counters["drop_bad_package"] == 0
    assert counters["results_resent"] > 0 and counters["retransmissions"] > 0
    # a duplicate of a round still filling got its PENDING, which the rank took (none was malformed to it)
    taken = [engine.counters() for engine in net.engines]
    assert counters["drop_duplicate_incomplete"] == 0 or sum(c["pendings"] for c in taken) > 0
    assert sum(c["drop_malformed"] for c in taken) == 0


@pytest.mark.parametrize("mac", [None, (0x0123456789ABCDEF, 0xFEDCBA9876543210)])
@pytest.mark.parametrize("seed", range(4))
def test_a_duplicate_of_an_incomplete_round_gets_the_slot_references_pending(mac, seed: int) -> None:
    """On a random stream of the ranks' DATA with duplicates, in any order, every duplicate of a round still
    filling is answered with the PENDING the slot reference writes (protocol.slot_reference), byte for byte: the
    DATA's header as type PENDING and count 0, the ranks the round has, the tag with the MAC; to that rank alone.
    A duplicate of a complete round gets the stored RESULT."""
    n, pool = 4, 4
    net = Network(n, codec="hostq8", packet_elements=P, pool_size=pool, data_mac_key=mac)
    rng = np.random.default_rng(seed)
    package = HostQ(8).encode(np.ones(P, np.float32), 1, 0)
    sends = [(r, c) for r in range(n) for c in range(pool) for _ in range(int(rng.integers(1, 4)))]
    ranks_in: dict[int, set[int]] = {c: set() for c in range(pool)}
    job = SimpleNamespace(mac_key=mac)
    answered = 0
    for i in rng.permutation(len(sends)):
        r, c = sends[i]
        datagram = _data(net, r, package, slot=c, chunk=c)
        if mac is not None:
            datagram += tag_ref(*mac, datagram)
        out = core_receive(net.cores[0], [(datagram, net.addr(r))], net.now)
        if r not in ranks_in[c]:
            ranks_in[c].add(r)
            assert len(out) == (n if len(ranks_in[c]) == n else 0)
        elif len(ranks_in[c]) < n:
            want = SlotReference._pending(job, SimpleNamespace(ranks=sorted(ranks_in[c])), datagram)
            assert out == [(want, net.addr(r))]
            answered += 1
        else:
            assert [(msg_type(d), dest) for d, dest in out] == [(MsgType.RESULT, net.addr(r))]
    counters = net.job_counters()
    assert answered and counters["drop_duplicate_incomplete"] == answered
    assert counters["retransmissions"] == counters["drop_duplicate_incomplete"] + counters["results_resent"]


# every family of protocol.codecs.host, some with their parameters at the edges
REAL_CODECS = ["uniform2", "uniform16", "adaptive", "adaptive-huffman", "lloyd4", "bitmask", "qsgd15", "terngrad",
               "signsgd", "topk0.1", "randomk0.5", "powersgd4"]


@pytest.mark.parametrize("name", REAL_CODECS)
def test_the_papers_codecs_take_the_same_path(name: str) -> None:
    """The real codecs, not the stand-in: bit-identical at every rank to the codec's own reference, under loss,
    duplication and reordering."""
    net = Network(3, codec=name, packet_elements=P, pool_size=4, drop=0.1, duplicate=0.1, reorder=0.2, fault_seed=7)
    xs = _inputs(3, 5)
    net.allreduce(xs)
    codec = parse(name)
    want = reference(codec, xs, seed=net.seed, allreduce=0, packet_elements=P)
    keys = [rank_key(net.seed, 0, rank) for rank in range(3)]
    result_bytes = sum(len(codec.encode_result(codec.combine([codec.decode(codec.encode(x[lo:lo + P], k, lo),
                                                                            x[lo:lo + P].size)
                                                              for x, k in zip(xs, keys)])))
                       for lo in range(0, SIZE, P))
    for rank, engine in enumerate(net.engines):
        np.testing.assert_array_equal(engine.result.view(np.uint32), want.view(np.uint32), err_msg=f"rank {rank}")
        # the bytes the codec put on the wire: each package once, however often it was resent
        key = rank_key(net.seed, 0, rank)
        assert engine.counters()["package_bytes"] == sum(len(codec.encode(xs[rank][lo:lo + P], key, lo))
                                                         for lo in range(0, SIZE, P)), rank
        # and the result packages it received: each chunk's once, however often the aggregator resent it
        assert engine.counters()["result_bytes"] == result_bytes, rank
    assert net.uplink.counts["dropped"] and net.job_counters()["drop_bad_package"] == 0


def test_two_cores_multicast_mean_and_the_mac() -> None:
    """A job whose slots are split over two cores, with the DATA/RESULT MAC, a mean; and one whose results go to
    a multicast group: the same reference bits."""
    net = Network(3, codec="hostq5", packet_elements=P, pool_size=4, cores=2, drop=0.05, reorder=0.1,
                  data_mac_key=(0x0123456789ABCDEF, 0xFEDCBA9876543210))
    xs = _inputs(3, 1)
    net.start(xs, mean=True)
    net.run()
    _check(net, xs, 0, bits=5, mean=True)
    assert all(net.job_counters(core)["completions"] for core in range(2))
    group = (0xE0000105, 4000)
    multicast = Network(3, codec="hostq8", packet_elements=P, pool_size=4, drop=0.05,
                        aggregators=[new_core(rows=256, max_elements=AGG, results_group=group)])
    assert multicast.group
    multicast.allreduce(xs)
    _check(multicast, xs, 0)


def test_forged_result_is_counted_and_dropped() -> None:
    """A result whose tag is wrong leaves the slot waiting for the real one."""
    net = Network(2, codec="hostq8", packet_elements=P, pool_size=2, data_mac_key=(1, 2))
    xs = _inputs(2, 3)
    net.start(xs)
    results = core_receive(net.cores[0], [(d, src) for d, src, _ in net.up], net.now)  # the first chunks' results
    net.up = []
    forged = bytearray(next(d for d, dst in results if dst == net.addr(0)))
    forged[wire.HEADER_SIZE + 1] ^= 1
    assert engine_receive(net.engines[0], [(bytes(forged), net.core_addrs[0])], net.now) == []
    net.down = [(d, net.core_addrs[0], dst) for d, dst in results]
    net.run()
    _check(net, xs, 0)
    assert net.engines[0].counters()["drop_bad_mac"] == 1


def test_the_send_window_follows_marks(monkeypatch) -> None:
    """Host mode's send window is StreamEngine's (worker.window): results the aggregator marks congested cut it to
    the floor over the first allreduce, and in the second it holds slots back (at most the window in flight, and
    the lowest chunk held when it is lower than every chunk in flight); every rank gets the reference's bits, under
    loss."""
    monkeypatch.setattr(harness, "core_receive", harness.marking(True))
    n, pool = 3, 16
    net = Network(n, codec="hostq8", packet_elements=P, pool_size=pool, drop=0.05, fault_seed=9)
    held = 0
    for allreduce in range(2):
        rng = np.random.default_rng(allreduce)
        xs = [rng.standard_normal(40 * P - 7).astype(np.float32) for _ in range(n)]
        net.start(xs)
        while not net.done:
            if allreduce:
                for e in net.engines:
                    harness.check_window(e.cur_chunk, e.parked, int(FLOOR))
                    held += int((e.cur_chunk == HELD).sum())
            net.step()
        _check(net, xs, allreduce)
        assert all(e.send_window == FLOOR for e in net.engines)
    assert held > 0
    for e in net.engines:
        assert e.counters()["congestion_marks"] == e.counters()["results"] > 0


def _data(net: Network, rank: int, package: bytes, *, count: int = P, slot: int = 0, chunk: int = 0,
          **fields: int) -> bytes:
    h = {"type": int(MsgType.DATA), "job": net.job, "allreduce": 0, "chunk": chunk, "rank": rank, "slot": slot,
         "count": count, "codec": WIRE_ID, "shadow": 0, "exp": NO_EXP, "next_exp": NO_EXP, **fields}
    return wire.pack(h, package)


def test_malformed_packages_are_counted_and_never_summed() -> None:
    """Packages the codec refuses (short, inconsistent, the wrong length, a code out of range, oversized) are
    counted as drop_bad_package and change nothing: the allreduce that follows is the reference's."""
    net = Network(2, codec="hostq8", packet_elements=P, pool_size=2)
    good = HostQ(8).encode(np.linspace(-1, 1, P, dtype=np.float32), 5, 0)
    codes_too_high = HostQ(8).encode(np.linspace(-1, 1, P, dtype=np.float32), 5, 0)[:9] + b"\x01\x00" * P
    bad = [b"", good[:5], good[:-1], good + b"\x00\x00", good + bytes(4000), codes_too_high,
           HostQ(9).encode(np.linspace(-1, 1, P, dtype=np.float32), 5, 0)]
    out = core_receive(net.cores[0], [(_data(net, 0, package), net.addr(0)) for package in bad], net.now)
    assert out == []
    counters = net.job_counters()
    assert counters["drop_bad_package"] == len(bad) and counters["contributions"] == 0
    _, bitmaps, counts = net.cores[0].datapath.round_state(net.job)
    assert not bitmaps.any() and not counts.any()
    xs = _inputs(2, 4)
    net.allreduce(xs)
    _check(net, xs, 0)


def test_a_codec_that_breaks_its_contract_costs_one_package() -> None:
    """A decode that raises something else than MalformedPackage on a hostile package (a codec's bug) is counted as
    drop_bad_package, as a refused one is: no exception leaves process()."""
    net = Network(2, codec="hostq8", packet_elements=P, pool_size=2)
    host = net.cores[0].datapath.host
    host.jobs[net.job].codec.decode = lambda package, count: 1 // 0
    assert core_receive(net.cores[0], [(_data(net, 0, b"\x00" * 20), net.addr(0))], net.now) == []
    assert net.job_counters()["drop_bad_package"] == 1


def test_header_checks_of_a_host_round() -> None:
    """A host round has no exponents, owners or bootstrap chunk, and one count: each is counted by its reason."""
    net = Network(2, codec="hostq8", packet_elements=P, pool_size=2)
    package = HostQ(8).encode(np.ones(P, np.float32), 1, 0)
    cases = {"drop_bad_exponent": _data(net, 0, package, exp=3), "drop_bad_owner": _data(net, 1 << 8, package),
             "drop_wrong_count": _data(net, 0, package, chunk=-1), "drop_wrong_codec": _data(net, 0, package, codec=1),
             "drop_slot_out_of_range": _data(net, 0, package, slot=2)}
    for reason, datagram in cases.items():
        before = net.job_counters()[reason]
        assert core_receive(net.cores[0], [(datagram, net.addr(0))], net.now) == []
        assert net.job_counters()[reason] == before + 1, reason
    core_receive(net.cores[0], [(_data(net, 0, package), net.addr(0))], net.now)
    other = HostQ(8).encode(np.ones(P - 1, np.float32), 1, 0)
    core_receive(net.cores[0], [(_data(net, 1, other, count=P - 1), net.addr(1))], net.now)
    assert net.job_counters()["drop_wrong_count"] == 2  # the round's count is its first contribution's


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(fields=st.fixed_dictionaries({
    "allreduce": st.integers(0, 3), "chunk": st.integers(-2, 12), "rank": st.integers(0, 0x1FF),
    "slot": st.integers(0, 5), "count": st.integers(0, 80), "shadow": st.integers(0, 2),
    "exp": st.sampled_from([NO_EXP, 0, 5]), "next_exp": st.sampled_from([NO_EXP, 1])}),
    package=st.binary(max_size=200), src=st.integers(0, 3))
def test_fuzzed_data_never_raises(fields: dict, package: bytes, src: int) -> None:
    """Any DATA of a host job, from a member or not, is taken or counted: process() never raises, every datagram
    is in packets_in, and what the slots hold stays a round the codec decoded."""
    net = _fuzz_net()
    before = net.core_counters()["packets_in"]
    rank = fields.pop("rank")
    core_receive(net.cores[0], [(_data(net, rank, package, **fields), worker_addr(src))], net.now)
    after = net.core_counters()
    assert after["packets_in"] == before + 1 and after["drop_truncated"] == 0
    host = net.cores[0].datapath.host
    for (row, x), contributions in host.decoded.items():
        assert all(v.dtype == np.float32 and v.size == host.elements[row, x] for v in contributions.values())


_FUZZ: list[Network] = []


def _fuzz_net() -> Network:
    """One joined network for all the fuzz examples (a join costs more than an example)."""
    if not _FUZZ:
        _FUZZ.append(Network(3, codec="hostq8", packet_elements=64, pool_size=4))
    return _FUZZ[0]


def test_a_host_job_beside_a_switch_job() -> None:
    """One core runs a host job and a C_nat job at once: each gets its own results, the kernel never sees the host
    job's DATA (no truncation counted), and the core's packets_in counts every datagram once."""
    core = new_core(rows=256, max_elements=AGG)
    host_net = Network(2, codec="hostq8", packet_elements=P, pool_size=4, job=7, aggregators=[core])
    switch_net = Network(2, codec="cnat8", packet_elements=P, pool_size=4, job=8, aggregators=[core],
                         worker_port=6000)
    xs = _inputs(2, 5)
    host_net.start(xs)
    switch_net.start(xs)
    Network.run_together([host_net, switch_net])
    _check(host_net, xs, 0)
    assert all(np.array_equal(e.result, switch_net.engines[0].result) for e in switch_net.engines)
    totals = host_net.core_counters()
    assert totals["drop_truncated"] == 0 and totals["drop_unknown_job"] == 0
    jobs = [host_net.job_counters(job=j)["packets_in"] for j in (7, 8)]
    assert totals["packets_in"] >= sum(jobs) > 0


def test_control_datagrams_beside_host_data_keep_their_burst_indices() -> None:
    """A burst of host DATA, a truncated datagram and a STATS_REQUEST: the control index the data path returns is
    the request's in that burst (the kernel saw a burst without the host rows), and only the truncated one counts
    as truncated."""
    net = Network(2, codec="hostq8", packet_elements=P, pool_size=2)
    package = HostQ(8).encode(np.ones(P, np.float32), 1, 0)
    datagrams = [(_data(net, 0, package), net.addr(0)), (bytes(5000), net.addr(1)),
                 (_data(net, 1, package), net.addr(1)), (net.stats_request(0), net.addr(0))]
    rx = Burst.rows_of(len(datagrams), 4096)
    rx.fill(datagrams)
    before = net.core_counters()
    out, control = net.cores[0].datapath.process(rx, net.now)
    assert control.tolist() == [3]
    assert out.count == 2 and {msg_type(d) for d, _ in out.datagrams()} == {MsgType.RESULT}
    diff = {k: v - before[k] for k, v in net.core_counters().items()}
    assert diff["packets_in"] == 4 and diff["drop_truncated"] == 1


def _join_error(core, params: dict) -> str:
    [(reply, _)] = handshake(core, worker_addr(0), 0.0, 7, 0, token="harness-token", **params)
    assert msg_type(reply) == MsgType.ERROR, header(reply)
    return reply[wire.HEADER_SIZE:].decode()


def test_switch_data_paths_refuse_a_host_codec_with_its_reason() -> None:
    """The P4 engine and a leaf switch refuse a host codec at JOIN, in one line naming the codec's switch_reason;
    another id's codec or a parameter the codec does not take is refused by the JOIN's checks."""
    params = {"world_size": 2, "packet_elements": P, "pool_size": 2, "codec": WIRE_ID, "codec_param": 8}
    for core in (p4model_core(tokens=["harness-token"], rows=64, max_elements=AGG),
                 leaf_core(rows=64, max_elements=AGG, tokens=["harness-token"]),
                 AggregatorCore(KernelDataPath(rows=64, max_elements=AGG), tokens=["harness-token"])):
        if hasattr(core.datapath, "add_route"):
            core.datapath.add_route(7, leaf=0, ranks=[0, 1], spine=1)
        line = _join_error(core, params)
        assert HostQ.switch_reason in line and "hostq8" in line and "\n" not in line, line
    core = new_core(rows=64, max_elements=AGG)
    assert "parameter 17" in _join_error(core, {**params, "codec_param": 17})
    assert "no host codec has wire id 251" in _join_error(core, {**params, "codec": 251})


def test_a_job_id_runs_in_one_mode_at_a_time() -> None:
    """Two tenants' jobs of one id, one host and one switch codec, would be told apart by the kernel only by their
    seats: the second is refused, in one line, whichever mode comes first."""
    switch = {"world_size": 2, "packet_elements": P, "pool_size": 2, "codec": int(Codec.CNAT8)}
    hosted = {**switch, "codec": WIRE_ID, "codec_param": 8}
    for first, second in ((hosted, switch), (switch, hosted)):
        core = AggregatorCore(tokens=["harness-token", "other"], rows=64, max_elements=AGG)
        [(ack, _)] = handshake(core, worker_addr(0), 0.0, 7, 0, token="harness-token", **first)
        assert msg_type(ack) == MsgType.JOIN_ACK
        [(reply, _)] = handshake(core, worker_addr(1), 0.0, 7, 0, token="other", **second)
        assert msg_type(reply) == MsgType.ERROR
        assert "job 7 already runs on aggregator core 0's" in reply[wire.HEADER_SIZE:].decode()


def test_job_params_of_a_host_codec() -> None:
    """A host codec's name gives its wire id and parameter; a switch codec takes no parameter."""
    params = JobParams.of(world_size=2, codec="hostq6")
    assert (params.codec, params.codec_param, params.host_codec.name) == (WIRE_ID, 6, "hostq6")
    assert JobParams.of(world_size=2, codec="int32").host_codec is None
    with pytest.raises(ValueError, match="unknown codec 1 with parameter 3"):
        JobParams(world_size=2, codec=Codec.INT32, codec_param=3)
    with pytest.raises(ValueError, match="host codec"):
        JobParams.of(world_size=2, codec="nosuch4")


def _first_results(seed: int) -> tuple[Network, list[np.ndarray], list[tuple[bytes, int]], bytes]:
    """Two hostq8 ranks start an allreduce of _inputs(2, seed) and the core answers their first chunks: (the
    network, the inputs, the core's results, undelivered, and rank 0's result)."""
    net = Network(2, codec="hostq8", packet_elements=P, pool_size=2)
    xs = _inputs(2, seed)
    net.start(xs)
    results = core_receive(net.cores[0], [(d, src) for d, src, _ in net.up], net.now)
    net.up = []
    return net, xs, results, next(d for d, dst in results if dst == net.addr(0))


def test_worker_drops_a_result_package_it_cannot_decode() -> None:
    """A RESULT of the awaited round whose package is malformed (or of the wrong count) is drop_malformed at the
    worker, and the slot takes the real result after it."""
    net, xs, results, real = _first_results(6)
    bad = [real[:-1], real + b"\x00" * 4, real[:wire.HEADER_SIZE]]
    assert engine_receive(net.engines[0], [(d, net.core_addrs[0]) for d in bad], net.now) == []
    assert net.engines[0].counters()["drop_malformed"] == len(bad)
    net.down = [(d, net.core_addrs[0], dst) for d, dst in results]
    net.run()
    _check(net, xs, 0)


# a RESULT's header field changed (or its source), and the statistic the worker drops it under
RESULT_FAULTS = [({"magic": 0}, "drop_malformed"), ({"type": int(MsgType.DATA)}, "drop_malformed"),
                 ({"job": 8}, "drop_foreign"), ({"slot": 5}, "drop_foreign"), ({"src": 1}, "drop_foreign"),
                 ({"allreduce": 1}, "drop_stale"), ({"chunk": 2}, "drop_stale"), ({"shadow": 1}, "drop_stale"),
                 ({"codec": WIRE_ID + 1}, "drop_malformed"), ({"count": P - 1}, "drop_malformed"),
                 ({"rank": 1}, "drop_malformed"), ({"exp": 0}, "drop_malformed"), ({"next_exp": 0}, "drop_malformed")]


@pytest.mark.parametrize(("fault", "reason"), RESULT_FAULTS, ids=[next(iter(f)) for f, _ in RESULT_FAULTS])
def test_worker_header_checks_of_a_result(fault: dict, reason: str) -> None:
    """A RESULT with one header field (or its source) not the awaited round's is dropped under StreamEngine's
    reason and counted once; the slot takes the real result after it."""
    net, xs, results, real = _first_results(7)
    fields = {k: v for k, v in fault.items() if k != "src"}
    wrong = wire.pack(dict(zip(wire.HEADER.names, header(real).item())) | fields, real[wire.HEADER_SIZE:])
    engine = net.engines[0]
    assert engine_receive(engine, [(wrong, fault.get("src", net.core_addrs[0]))], net.now) == []
    counters = engine.counters()
    assert counters[reason] == 1 and counters["results"] == 0
    assert sum(v for k, v in counters.items() if k.startswith("drop_")) == 1
    net.down = [(d, net.core_addrs[0], dst) for d, dst in results]
    net.run()
    _check(net, xs, 0)


def test_worker_drops_a_result_of_a_chunk_not_yet_sent() -> None:
    """A second RESULT for a slot in one burst, naming the chunk that burst queued (the slot's next round), is
    drop_unsent: the worker has not sent that chunk."""
    net, _, _, real = _first_results(8)
    fields = dict(zip(wire.HEADER.names, header(real).item())) | {"chunk": 2, "shadow": 1, "count": P}
    ahead = wire.pack(fields, real[wire.HEADER_SIZE:])
    engine = net.engines[0]
    assert len(engine_receive(engine, [(real, net.core_addrs[0]), (ahead, net.core_addrs[0])], net.now)) == 1
    counters = engine.counters()
    assert counters["drop_unsent"] == 1 and counters["results"] == 1


def test_worker_refuses_a_package_no_aggregator_receives() -> None:
    """A package longer than host_package_limit is refused at the worker with a clear error, not sent to be cut;
    and a JOIN whose packages an aggregator could not receive whole is refused."""

    class Bloated(HostQ):
        def encode(self, x: np.ndarray, key: int, offset: int) -> bytes:
            return super().encode(x, key, offset) + bytes(host_package_limit(P))

    engine = HostStreamEngine(job=1, rank=0, world_size=2, codec=Bloated(8), packet_elements=P, pool_size=1, seed=0,
                              agg_addrs=[1])
    with pytest.raises(ValueError, match=f"more than the {host_package_limit(P)} an aggregator receives"):
        engine.start(np.ones(P, np.float32), 0.0)
    params = JobParams.of(world_size=2, codec="hostq8", packet_elements=P + 1)
    assert params.problem(AGG) == (f"packet elements must be in [1, {P}] for hostq8 on this aggregator (its "
                                   f"--max-packet-elements {AGG}: a host package may take 8 bytes per element and "
                                   f"1024 more), got {P + 1}")
    assert params.problem() is None and params.problem(AGG + 2) is None
