"""The optional DATA/RESULT MAC (docs/protocol.md, "DATA/RESULT MAC"): SipHash-2-4 against the paper's test
vectors and the Numba functions against the plain-Python reference; the aggregator core drops and counts a forged
or altered DATA packet without a change of state and tags every result; the engine refuses a forged RESULT and
completes bit-exact once the real one arrives; whole allreduces with the MAC, in process under faults and against
a live aggregator, also with an on-path host altering results (which, without the MAC, makes the ranks diverge).
(The kernel is held to protocol.slot_reference with the MAC on in tests/protocol/test_slot_reference.py.)
"""

from __future__ import annotations

import select
import socket
import threading

import numpy as np
import pytest
from support.cluster import aggregator, run_ok
from support.harness import (
    Network,
    agg_addr,
    assert_table_equal,
    counter_diff,
    engine_receive,
    header,
    make_inputs,
    stored,
    table_snapshot,
    with_header,
)
from hypothesis import given, settings
from hypothesis import strategies as st

from intml.protocol import reference
from intml.protocol.packet import HDR
from intml.protocol.siphash import key_words, put_tag, siphash24, siphash24_ref, tag_ok, tag_ref
from intml.protocol.wire import TAG_SIZE, MsgType, max_packet_elements
from intml.worker.engine import StreamEngine

# SipHash-2-4 of the messages 00, 00 01, ..., 00 .. 3e under the key 00 .. 0f, each tag little-endian: the paper's
# Appendix A vectors (the reference implementation's vectors.h), as published with Rust's former std::hash::sip.
VECTORS = """
310e0edd47db6f72 fd67dc93c539f874 5a4fa9d909806c0d 2d7efbd796666785 b7877127e09427cf 8da699cd64557618
cee3fe586e46c9cb 37d1018bf50002ab 6224939a79f5f593 b0e4a90bdf82009e f3b9dd94c5bb5d7a a7ad6b22462fb3f4
fbe50e86bc8f1e75 903d84c02756ea14 eef27a8e90ca23f7 e545be4961ca29a1 db9bc2577fcc2a3f 9447be2cf5e99a69
9cd38d96f0b3c14b bd6179a71dc96dbb 98eea21af25cd6be c7673b2eb0cbf2d0 883ea3e395675393 c8ce5ccd8c030ca8
94af49f6c650adb8 eab8858ade92e1bc f315bb5bb835d817 adcf6b0763612e2f a5c91da7acaa4dde 716595876650a2a6
28ef495c53a387ad 42c341d8fa92d832 ce7cf2722f512771 e37859f94623f3a7 381205bb1ab0e012 ae97a10fd434e015
b4a31508beff4d31 81396229f0907902 4d0cf49ee5d4dcca 5c73336a76d8bf9a d0a704536ba93e0e 925958fcd6420cad
a915c29bc8067318 952b79f3bc0aa6d4 f21df2e41d4535f9 87577519048f53a9 10a56cf5dfcd9adb eb75095ccd986cd0
51a9cb9ecba312e6 96afadfc2ce666c7 72fe52975a4364ee 5a1645b276d592a1 b274cb8ebf87870a 6f9bb4203de7b381
eaecb2a30b22a87f 9924a43cc1315724 bd838d3aafbf8db7 0b1a2a3265d51aea 135079a3231ce660 932b2846e4d70666
e1915f5cb1eca46c f325965ca16d629f 575ff28e60381be5 724506eb4c328a95
"""
PAPER_KEY = key_words(bytes(range(16)))
KEY = key_words(bytes(range(100, 116)))


def vectors() -> list[bytes]:
    return [bytes.fromhex(w) for w in VECTORS.split()]


def test_reference_matches_the_papers_vectors():
    tags = vectors()
    assert len(tags) == 64
    for n, want in enumerate(tags):
        assert tag_ref(*PAPER_KEY, bytes(range(n))) == want, n
    assert siphash24_ref(*PAPER_KEY, bytes(range(15))) == 0xA129CA6149BE45E5  # the paper's worked example


@pytest.mark.slow
@settings(max_examples=300, deadline=None)
@given(data=st.binary(max_size=2100), k0=st.integers(0, 2**64 - 1), k1=st.integers(0, 2**64 - 1))
def test_numba_matches_reference(data, k0, k1):
    p = np.zeros(len(data) + TAG_SIZE, np.uint8)
    p[:len(data)] = np.frombuffer(data, np.uint8)
    assert int(siphash24(p, len(data), np.uint64(k0), np.uint64(k1))) == siphash24_ref(k0, k1, data)
    assert put_tag(p, len(data), np.uint64(k0), np.uint64(k1)) == len(data) + TAG_SIZE
    assert p[len(data):].tobytes() == tag_ref(k0, k1, data)
    assert tag_ok(p, p.size, np.uint64(k0), np.uint64(k1))
    for i in {0, p.size // 2, p.size - 1}:  # any flipped bit, in the message or the tag, fails
        p[i] ^= 1
        assert not tag_ok(p, p.size, np.uint64(k0), np.uint64(k1))
        p[i] ^= 1
    assert not tag_ok(p, TAG_SIZE - 1, np.uint64(k0), np.uint64(k1))


def test_a_tagged_datagram_fits_one_udp_payload():
    for codec in (0, 1):
        assert max_packet_elements(codec, data_mac=True) < max_packet_elements(codec)
        width = 1 if codec == 0 else 4
        assert HDR + width * max_packet_elements(codec, data_mac=True) + TAG_SIZE <= 65507


# ---- the aggregator core -------------------------------------------------------------------------------------


def first_packets(codec: str, seed: int, key=KEY) -> tuple[Network, list[np.ndarray], list, list]:
    """A two-worker job with the MAC, one slot: the bootstrap round completed, each rank's chunk-0 packet."""
    net = Network(2, codec=codec, packet_elements=32, pool_size=1, data_mac_key=key)
    xs = make_inputs(2, 100, 32, "normal", seed)
    net.start(xs)
    boot = [(d, net.addr(r)) for r, (d, _, _) in enumerate(net.up)]
    net.up.clear()
    results = net.to_core(0, boot)
    data = [engine_receive(net.engines[r], [(d, agg_addr(0))], net.now)[0][0] for r, (d, _) in enumerate(results)]
    return net, xs, results, data


def reference_results(xs, codec: str) -> np.ndarray:
    return reference.allreduce(xs, codec=codec, seed=123, allreduce_seq=0, packet_elements=32)


def deliver_and_check(net: Network, results: list, xs, codec: str) -> None:
    """The core's results go down to the ranks; the allreduce then ends with the reference's bits at every rank."""
    for data, dst in results:
        net.down.append((data, agg_addr(0), dst))
    net.run()
    want = reference_results(xs, codec)
    for e in net.engines:
        assert e.result.view(np.uint32).tolist() == want.view(np.uint32).tolist()


@pytest.mark.parametrize("codec", ["cnat8", "int32"])
def test_forged_or_altered_data_is_dropped_and_counted_without_a_change(codec):
    net, xs, _, (d0, d1) = first_packets(codec, seed=1)
    assert len(d0) == HDR + header(d0)["count"] * (1 if codec == "cnat8" else 4) + TAG_SIZE
    assert d0[-TAG_SIZE:] == tag_ref(*KEY, d0[:-TAG_SIZE])
    body = d0[:-TAG_SIZE]
    flipped = bytearray(d0)
    flipped[HDR + 3] ^= 0x01
    forged = [
        body,  # no tag
        body + bytes(TAG_SIZE),  # a wrong tag
        bytes(flipped),  # a payload altered on the way
        with_header(d0, next_exp=5),  # a header altered on the way, old tag
        body + tag_ref(KEY[0] ^ 1, KEY[1], body),  # another key's tag
        d0 + b"\x00",  # a stray byte after the tag
        body[:HDR],  # a bare header
    ]
    snap = table_snapshot(net.cores[0], net.job)
    before = net.job_counters()
    assert net.to_core(0, [(d, net.addr(0)) for d in forged]) == []
    assert counter_diff(before, net.job_counters()) == {"packets_in": len(forged), "drop_bad_mac": len(forged)}
    assert_table_equal(snap, table_snapshot(net.cores[0], net.job))
    # the real packets complete the round; the result carries its tag, and a re-send the same bytes but the STORED
    # mark, which the tag does not cover (the ranks check it without: deliver_and_check gives rank 0 the re-send)
    results = net.to_core(0, [(d0, net.addr(0)), (d1, net.addr(1))])
    assert len(results) == 2 and results[0][0] == results[1][0]
    result = results[0][0]
    assert result[-TAG_SIZE:] == tag_ref(*KEY, result[:-TAG_SIZE])
    assert net.to_core(0, [(d0, net.addr(0))]) == [(stored(result), net.addr(0))]
    results[0] = (stored(result), results[0][1])
    deliver_and_check(net, results, xs, codec)


def test_job_without_the_mac_drops_a_tagged_packet_as_the_wrong_length():
    """The tag is there exactly when the job has data_mac: a job without it counts 8 stray bytes as usual."""
    mac, _, _, (d0, _) = first_packets("cnat8", seed=2)
    plain = Network(2, codec="cnat8", packet_elements=32, pool_size=1)
    before = plain.job_counters()
    assert plain.to_core(0, [(d0, plain.addr(0))]) == []
    assert counter_diff(before, plain.job_counters()) == {"packets_in": 1, "drop_wrong_count": 1}


# ---- the engine ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("codec", ["cnat8", "int32"])
def test_engine_refuses_a_forged_result_and_completes_with_the_real_one(codec):
    """A RESULT from the aggregator's own address with a wrong tag (forged, or altered on the way) changes
    nothing at the rank; the real one, when it comes, completes the allreduce bit-exact at every rank."""
    net, xs, results, (d0, d1) = first_packets(codec, seed=3)
    real = net.to_core(0, [(d0, net.addr(0)), (d1, net.addr(1))])
    result = real[0][0]
    body = result[:-TAG_SIZE]
    altered = bytearray(result)
    altered[HDR] ^= 0x40
    forged = [body, body + bytes(TAG_SIZE), bytes(altered), body + tag_ref(KEY[0], KEY[1] ^ 1, body)]
    engine = net.engines[0]
    state = engine.state.cur_chunk.copy(), engine.parity.copy(), engine.result.copy()
    before = engine.counters()
    assert engine_receive(engine, [(f, agg_addr(0)) for f in forged], net.now) == []
    assert counter_diff(before, engine.counters()) == {"packets_in": len(forged), "drop_bad_mac": len(forged)}
    assert all(np.array_equal(a, b) for a, b in zip(state, (engine.state.cur_chunk, engine.parity, engine.result)))
    deliver_and_check(net, real, xs, codec)


def test_engine_tags_each_slot_with_its_cores_key():
    keys = np.array([key_words(bytes([c]) * 16) for c in range(3)], np.uint64)
    engine = StreamEngine(job=7, rank=0, world_size=2, codec=0, packet_elements=8, pool_size=6, seed=1,
                          agg_addrs=[agg_addr(c) for c in range(3)], data_mac_keys=keys)
    sent = engine.start(np.ones(48, np.float32), 0.0).datagrams()
    assert len(sent) == 6
    for s, (data, dst) in enumerate(sent):
        assert dst == agg_addr(s % 3)
        assert data[-TAG_SIZE:] == tag_ref(*map(int, keys[s % 3]), data[:-TAG_SIZE])


def test_engine_rejects_keys_of_the_wrong_shape():
    with pytest.raises(ValueError, match="one .k0, k1. row per aggregator core"):
        StreamEngine(job=7, rank=0, world_size=2, codec=0, packet_elements=8, pool_size=2, seed=1,
                     agg_addrs=[agg_addr(0), agg_addr(1)], data_mac_keys=np.zeros((1, 2), np.uint64))


# ---- whole allreduces ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("codec", ["cnat8", "int32"])
@pytest.mark.parametrize("cores", [1, 2])
def test_allreduce_with_the_mac_under_faults_is_bit_exact(codec, cores):
    """The MAC changes no bit of any result: the same inputs give the reference's results with faults in both
    directions, over one core and two."""
    n, size = 3, 9 * 32 + 5
    net = Network(n, codec=codec, packet_elements=32, pool_size=4, cores=cores, data_mac_key=KEY, drop=0.1,
                  duplicate=0.1, reorder=0.2, fault_seed=cores)
    for seq in range(2):
        xs = make_inputs(n, size, 32, "normal", seed=seq)
        got = net.allreduce(xs)
        want = reference.allreduce(xs, codec=codec, seed=net.seed, allreduce_seq=seq, packet_elements=32)
        for r in range(n):
            assert got[r].view(np.uint32).tolist() == want.view(np.uint32).tolist()
    assert net.total_job_counters()["drop_bad_mac"] == 0
    assert sum(e.counters()["drop_bad_mac"] for e in net.engines) == 0


def live_worker(port: int, rank: int, n: int, seed: int, job: int = 300, data_mac: bool = True) -> dict:
    from intml.worker import Worker

    x = make_inputs(n, 5000, 256, "normal", seed)[rank]
    with Worker(f"127.0.0.1:{port}", job=job, rank=rank, world_size=n, token="t", packet_elements=256,
                pool_size=8, seed=seed, timeout=30, data_mac=data_mac) as w:
        out = w.allreduce(x)
        return {"out": out, "counters": w.counters(), "sent_bytes": w.engine.packet.shape[2]}


@pytest.mark.process
def test_live_allreduce_with_the_mac():
    """A live aggregator and worker processes of a job with data_mac, keyed by the JOIN handshake: the allreduce
    is the reference's, which it can only be if the aggregator took the tagged DATA and the workers the tagged
    RESULTs, all under the data key each side derived."""
    n, seed = 3, 9
    with aggregator(idle_timeout=10) as agg:
        results = run_ok(live_worker, [(agg.port, r, n, seed) for r in range(n)], timeout=90)
    want = reference.allreduce(make_inputs(n, 5000, 256, "normal", seed), codec="cnat8", seed=seed,
                               allreduce_seq=0, packet_elements=256)
    for res in results:
        assert res["out"].view(np.uint32).tolist() == want.view(np.uint32).tolist()
        assert res["sent_bytes"] == HDR + 256 + TAG_SIZE  # the engine's datagrams carry the tag
        assert res["counters"]["drop_bad_mac"] == 0


class ResultTamperer:
    """An on-path host between each rank and a one-core aggregator (each rank talks to a port of its own here, and
    the aggregator sees each rank's traffic come from a socket of its own): it forwards everything, but in the
    first copy of every `every`-th RESULT a rank is sent it flips the sign of one nonzero C_nat code, a valid code
    of a wrong value. Retransmitted results pass unchanged."""

    def __init__(self, agg_port: int, n: int, every: int = 3) -> None:
        self.agg = ("127.0.0.1", agg_port)
        self.every = every
        self.pairs = []
        for _ in range(n):
            down, up = (socket.socket(socket.AF_INET, socket.SOCK_DGRAM) for _ in range(2))
            down.bind(("127.0.0.1", 0))
            up.bind(("127.0.0.1", 0))
            self.pairs.append((down, up))
        self.workers: list[tuple | None] = [None] * n
        self.seen: set = set()
        self.tampered = 0
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def port(self, rank: int) -> int:
        return self.pairs[rank][0].getsockname()[1]

    def __enter__(self) -> ResultTamperer:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join()
        for pair in self.pairs:
            for sock in pair:
                sock.close()

    def _run(self) -> None:
        side = {sock: (r, k) for r, pair in enumerate(self.pairs) for k, sock in enumerate(pair)}
        while not self.stop.is_set():
            for sock in select.select(list(side), [], [], 0.05)[0]:
                data, addr = sock.recvfrom(65535)
                rank, k = side[sock]
                down, up = self.pairs[rank]
                if k == 0:  # from the rank
                    self.workers[rank] = addr
                    up.sendto(data, self.agg)
                elif self.workers[rank] is not None:
                    down.sendto(self._tamper(rank, data), self.workers[rank])

    def _tamper(self, rank: int, data: bytes) -> bytes:
        h = header(data)
        key = (rank, int(h["allreduce"]), int(h["chunk"]))
        if h["type"] != MsgType.RESULT or h["count"] == 0 or key in self.seen:
            return data
        self.seen.add(key)
        if len(self.seen) % self.every:
            return data
        out = bytearray(data)
        i = next((HDR + k for k in range(int(h["count"])) if out[HDR + k] & 0x40), None)  # a nonzero code
        if i is None:
            return data
        out[i] ^= 0x80  # its sign
        self.tampered += 1
        return bytes(out)


@pytest.mark.process
@pytest.mark.parametrize("mac", [True, False], ids=["mac", "no mac"])
def test_live_results_altered_on_the_path(mac):
    """An on-path host alters results (a forged RESULT makes the ranks diverge). With the MAC every
    altered result is counted and dropped, the rank's retransmission brings the real one, and every rank gets
    the reference's bits; without it (the control) the altered results are taken and some rank's result is wrong."""
    n, seed = 3, 10
    with aggregator(idle_timeout=10) as agg, ResultTamperer(agg.port, n) as path:
        results = run_ok(live_worker, [(path.port(r), r, n, seed, 301 + mac, mac) for r in range(n)], timeout=90)
    assert path.tampered > 0
    want = reference.allreduce(make_inputs(n, 5000, 256, "normal", seed), codec="cnat8", seed=seed,
                               allreduce_seq=0, packet_elements=256).view(np.uint32).tolist()
    exact = [res["out"].view(np.uint32).tolist() == want for res in results]
    dropped = sum(res["counters"]["drop_bad_mac"] for res in results)
    if mac:
        assert all(exact) and dropped == path.tampered
    else:
        assert not all(exact) and dropped == 0
