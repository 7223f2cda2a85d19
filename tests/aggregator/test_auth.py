"""The authenticated control plane, against a live aggregator on loopback where the behaviour
needs one: squatting, replayed JOINs, no amplification, forged and spoofed control messages, statistics
without a credential, rejoining after a crash, a failed join cleaning up, and the token options."""

from __future__ import annotations

import os
import signal
import socket
import time

import numpy as np
import pytest
from support.cluster import HOST, Procs, aggregator, join_over, operator_stats, run_cli
from support.harness import TOKEN, Network, core_receive, handshake, join_datagram, msg_type, new_core, worker_addr
from test_aggregator_core import STRANGER, error_text

from intml.aggregator.__main__ import OPEN_WARNING
from intml.aggregator.core import UNPROVED, AggregatorCore
from intml.aggregator.datapath import job_key
from intml.protocol import keys, reference, wire
from intml.protocol.job import ControlLimits
from intml.protocol.siphash import key_words
from intml.protocol.wire import MsgType

PARAMS = {"world_size": 2, "packet_elements": 64, "pool_size": 4, "codec": 0, "seed": 9}


def _recv(sock: socket.socket, timeout: float) -> bytes | None:
    sock.settimeout(timeout)
    try:
        return sock.recv(1 << 16)
    except TimeoutError:
        return None


def _jobs(agg) -> dict:
    return agg.stats()[0]["jobs"]


def _counters(agg, core: int = 0) -> dict[str, int]:
    return agg.stats()[core]["core_counters"]


# ---- in-process: keys and the handshake's properties ----------------------------------------------------------


def test_keys_are_domain_separated_and_the_data_key_is_two_little_endian_words():
    tk = keys.token_key("s3cret")
    nonce, cookie = b"n" * 16, b"c" * 16
    derived = {keys.session_key(tk, 7, 0, nonce, cookie), keys.session_key(tk, 7, 1, nonce, cookie),
               keys.data_key(tk, 7, keys.job_nonce(tk, nonce, cookie, 1)), keys.job_nonce(tk, nonce, cookie, 1), tk,
               keys.token_key("s3cret!")}
    assert len(derived) == 6 and all(len(k) == 16 for k in derived)
    data = keys.data_key(tk, 7, b"j" * 16)
    assert list(key_words(data)) == [int.from_bytes(data[:8], "little"),
                                                                     int.from_bytes(data[8:], "little")]
    datagram = keys.seal(tk, bytes(40), 24)
    assert keys.verify(tk, datagram, 24) and not keys.verify(tk, datagram[:-1] + b"\1", 24)
    assert not keys.verify(keys.token_key("other"), datagram, 24) and not keys.verify(tk, datagram, 30)




@pytest.mark.parametrize("pool", [1, 8, 9, 256])
def test_challenge_and_join_ack_are_never_larger_than_their_join(pool):
    core = new_core(rows=512, max_elements=64, max_pool=256)
    params = {**PARAMS, "pool_size": pool}
    join = join_datagram(7, 0, **params)
    [(challenge, _)] = core_receive(core, [(join, worker_addr(0))], 0.0)
    assert msg_type(challenge) == MsgType.CHALLENGE and len(challenge) < len(join)
    [(ack, _)] = handshake(core, worker_addr(0), 0.0, 7, 0, token=TOKEN, **params)
    assert msg_type(ack) == MsgType.JOIN_ACK and len(ack) <= len(join)


def test_nothing_is_reserved_before_the_proof():
    core = new_core(rows=16, max_elements=64)
    core_receive(core, [(join_datagram(7, 0, **PARAMS), worker_addr(0))], 0.0)  # first round: a CHALLENGE
    assert core.info == {} and not core.counters.row_used.any()
    (reply, _), = handshake(core, worker_addr(0), 0.0, 7, 0, token="guess", **PARAMS)
    assert error_text(reply) == UNPROVED and core.info == {} and not core.counters.row_used.any()
    assert core.stats(0.0)["core_counters"]["drop_bad_mac"] == 1


def test_a_wrong_token_cannot_join_an_existing_job_nor_learn_its_parameters():
    net = Network(2, join=False, seed=12345)
    net.join(0)
    (reply, _), = net.join(1, token="guess", world_size=3)
    assert error_text(reply) == UNPROVED and "12345" not in error_text(reply) and "world" not in error_text(reply)
    (reply, _), = net.join(1, world_size=3)  # with the token, the refusal may name what differs
    assert "world_size=3 (job has 2)" in error_text(reply)


def test_a_job_belongs_to_the_token_that_created_it():
    """Two tenants' tokens on one core: tenant b's JOIN of tenant a's job id joins (creates) b's own job of that
    id, never a's (tests/aggregator/test_tenants.py runs both)."""
    core = AggregatorCore(rows=16, max_elements=64, tokens=["tenant-a", "tenant-b"])
    (reply, _), = handshake(core, worker_addr(0), 0.0, 7, 0, token="tenant-a", **PARAMS)
    assert msg_type(reply) == MsgType.JOIN_ACK
    (reply, _), = handshake(core, worker_addr(1), 0.0, 7, 1, token="tenant-b", **PARAMS)
    assert msg_type(reply) == MsgType.JOIN_ACK
    assert core.info[7].members == {0: worker_addr(0)}  # a's job (tenant 0's key is its id) has only a's rank
    assert core.info[job_key(1, 7)].members == {1: worker_addr(1)}
    (reply, _), = handshake(core, worker_addr(1), 0.0, 7, 1, token="tenant-a", nonce=bytes(range(2, 18)), **PARAMS)
    assert "already holds rank 1 of another token's job 7" in error_text(reply)
    (reply, _), = handshake(core, worker_addr(2), 0.0, 7, 1, token="tenant-a", **PARAMS)
    assert msg_type(reply) == MsgType.JOIN_ACK and core.info[7].members == {0: worker_addr(0), 1: worker_addr(2)}


def test_cookies_expire_and_bind_the_address():
    # the clock goes back below: a source bucket deep enough that control admission lets every JOIN through
    core = new_core(rows=16, max_elements=64, control_limits=ControlLimits(source_burst=1000, global_burst=100_000))
    [(challenge, _)] = core_receive(core, [(join_datagram(7, 0, **PARAMS), worker_addr(0))], 0.0)
    cookie = bytes(wire.unpack_challenge(challenge)[1]["cookie"])
    proved = join_datagram(7, 0, cookie=cookie, token=TOKEN, **PARAMS)
    for src, now in ((STRANGER, 0.0), (worker_addr(0), 2 * keys.COOKIE_EPOCH)):  # elsewhere; too late
        [(reply, _)] = core_receive(core, [(proved, src)], now)
        assert msg_type(reply) == MsgType.CHALLENGE and core.info == {}
    [(reply, _)] = core_receive(core, [(proved, worker_addr(0))], keys.COOKIE_EPOCH)  # the next epoch: still good
    assert msg_type(reply) == MsgType.JOIN_ACK
    assert core.stats(0.0)["core_counters"]["drop_bad_mac"] == 2


@pytest.mark.parametrize("first", [0, 2**31 + 5])  # past 2**31 the round keys are negative int64s
def test_resume_point_of_a_rank_joining_a_running_job(first):
    """The JOIN_ACK names the allreduce the peers are in and each slot's next shadow set; a rank that joins a
    job two allreduces old (a restarted one) completes the next allreduce bit-exact with its peers."""
    net = Network(2, pool_size=3)
    for engine in net.engines:
        engine.resume(first, engine.parity)
    for seq in range(2):
        xs = [np.random.default_rng(seq * 2 + r).standard_normal(100).astype(np.float32) for r in range(2)]
        net.allreduce(xs)
    parity = net.engines[1].parity.copy()
    fresh = Network(2, pool_size=3, aggregators=net.cores, join=False)  # a new engine for rank 1, same address
    session = fresh.session(1)
    session.connect(net.now)
    while not session.joined:
        for data, dst in session.datagrams_to_send(net.now):
            for reply, _ in core_receive(net.cores[0], [(data, net.addr(1))], net.now):
                session.receive(reply, dst, net.now)
    [joined] = [e for e in iter(session.next_event, None) if hasattr(e, "shadow_sets")]
    assert joined.allreduce == first + 2 and (joined.shadow_sets == parity).all()
    engine = fresh.engines[1]
    engine.resume(joined.allreduce, joined.shadow_sets)
    net.engines[1] = engine
    xs = [np.random.default_rng(50 + r).standard_normal(100).astype(np.float32) for r in range(2)]
    got = net.allreduce(xs)
    expected = reference.allreduce(xs, codec="cnat8", seed=net.seed, allreduce_seq=first + 2, packet_elements=64)
    assert all(np.array_equal(g.view(np.uint32), expected.view(np.uint32)) for g in got)


# ---- live: squatting, replay, spoofing, statistics --------------------------------------------------------------


@pytest.mark.process
def test_squatting_with_a_wrong_token_reserves_nothing_live():
    from intml.worker import Worker

    with aggregator() as agg, socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.bind((HOST, 0))
        target = (HOST, agg.port)
        reply = join_over(s, target, 31, 0, token="squatter", **{**PARAMS, "pool_size": 256})
        assert reply[wire.HEADER_SIZE:].decode() == UNPROVED
        assert _jobs(agg) == {}  # the job id and the rows are still free
        with Worker(agg.address, job=31, rank=0, world_size=1, token="t", timeout=5) as w:
            np.testing.assert_array_equal(w.allreduce(np.ones(8, np.float32), op="sum"), np.ones(8))
            reply = join_over(s, target, 31, 0, token="squatter", **{**PARAMS, "world_size": 1})
            assert reply[wire.HEADER_SIZE:].decode() == UNPROVED  # no parameter of the real job in it
            # another of the aggregator's tokens is another tenant: its job 31 is its own, beside the first
            with Worker(agg.address, job=31, rank=0, world_size=1, token="right", timeout=5) as other:
                np.testing.assert_array_equal(other.allreduce(np.full(8, 4, np.float32), op="sum"), np.full(8, 4))
            np.testing.assert_array_equal(w.allreduce(np.ones(8, np.float32), op="sum"), np.ones(8))
        assert _counters(agg)["drop_bad_mac"] == 2


@pytest.mark.process
def test_a_replayed_join_from_another_address_gets_nothing_live():
    with aggregator() as agg, socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as a, \
            socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as b:
        for s in (a, b):
            s.bind((HOST, 0))
        target = (HOST, agg.port)
        header = {"type": int(MsgType.JOIN), "job": 32, "rank": 0}
        nonce = os.urandom(16)
        a.sendto(wire.pack_join(header, {**PARAMS, "nonce": nonce}), target)
        cookie = bytes(wire.unpack_challenge(_recv(a, 2.0))[1]["cookie"])
        proved = keys.seal(keys.token_key("t"), wire.pack_join(header, {**PARAMS, "nonce": nonce, "cookie": cookie}),
                           wire.JOIN_MAC)
        b.sendto(proved, target)  # the captured proof, replayed from another address
        reply = _recv(b, 2.0)
        assert msg_type(reply) == MsgType.CHALLENGE and len(reply) < len(proved)
        assert _jobs(agg) == {} and _counters(agg)["drop_bad_mac"] == 1
        a.sendto(proved, target)  # from its own address it is good
        assert msg_type(_recv(a, 2.0)) == MsgType.JOIN_ACK and list(_jobs(agg)) == ["32"]


@pytest.mark.process
def test_a_spoofed_leave_is_dropped_and_counted_and_the_job_keeps_running(raw_udp):
    from intml.worker import Worker

    with aggregator() as agg, Worker(agg.address, job=33, rank=0, world_size=1, token="t", timeout=5) as w:
        np.testing.assert_array_equal(w.allreduce(np.full(8, 2, np.float32)), np.full(8, 2))
        port = w.io.sock.getsockname()[1]
        for mac in (bytes(16), os.urandom(16)):
            leave = wire.pack({"type": int(MsgType.LEAVE), "job": 33, "rank": 0}, mac)
            raw_udp.sendto(port.to_bytes(2, "big") + agg.port.to_bytes(2, "big") + (8 + len(leave)).to_bytes(2, "big")
                           + bytes(2) + leave, (HOST, 0))  # from the member's own address
        time.sleep(0.2)
        assert _counters(agg)["drop_bad_mac"] == 2 and list(_jobs(agg)) == ["33"]
        np.testing.assert_array_equal(w.allreduce(np.full(8, 4, np.float32)), np.full(8, 4))


@pytest.mark.process
def test_stats_without_a_credential_reveal_nothing_live():
    from intml.worker import Worker

    with aggregator() as agg, Worker(agg.address, job=34, rank=0, world_size=1, token="t", seed=4242,
                                     timeout=5) as w, socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        w.allreduce(np.ones(8, np.float32))
        s.bind((HOST, 0))
        for job in (34, 0xFFFFFFFF):
            for payload in (b"", bytes(16), bytes(4000)):
                s.sendto(wire.pack({"type": int(MsgType.STATS_REQUEST), "job": job, "rank": 0}, payload),
                         (HOST, agg.port))
                reply = _recv(s, 0.3)
                assert reply is None, reply
        stats = agg.stats()[0]  # the operator's view (a token's MAC): counters, no addresses, no seed
        assert stats["core_counters"]["drop_bad_mac"] == 6
        job = stats["jobs"]["34"]
        assert "members" not in job and "seed" not in job["params"] and "4242" not in str(stats)
        port = str(w.io.sock.getsockname()[1])
        assert port not in str(stats)


@pytest.mark.process
def test_operator_stats_need_one_of_the_tokens():
    with aggregator() as agg:
        with pytest.raises(AssertionError, match="no STATS_REPLY"):
            operator_stats(agg.port, 1, "guess", timeout=0.3, attempts=1)
        assert _counters(agg)["drop_bad_mac"] == 1


# ---- rejoin after a crash, failed joins -------------------------------------------------------------------------

CRASH_JOB = 35
CRASH_ELEMENTS = 3000


def _inputs(rank: int, seq: int) -> np.ndarray:
    return np.random.default_rng(1000 * seq + rank).standard_normal(CRASH_ELEMENTS).astype(np.float32)


def _rank(address: str, rank: int, allreduces: int, crash_after: int | None = None) -> dict:
    """Join, run allreduces from where the job is up to ``allreduces``; with ``crash_after``, die (SIGKILL, no
    LEAVE) after that many."""
    from intml.worker import Worker

    w = Worker(address, job=CRASH_JOB, rank=rank, world_size=2, token="t", seed=7, timeout=20,
               packet_elements=256, pool_size=4)
    start = w.engine.allreduce_seq + 1
    results = {}
    for seq in range(start, allreduces):
        results[seq] = w.allreduce(_inputs(rank, seq)).copy()
        if crash_after is not None and seq + 1 == crash_after:
            os.kill(os.getpid(), signal.SIGKILL)
    w.close()
    return {"start": start, "results": results}


@pytest.mark.process
def test_a_crashed_rank_rejoins_from_a_new_port_and_the_job_completes_bit_exact():
    with aggregator() as agg, Procs() as procs:
        procs.start(0, _rank, agg.address, 0, 3)
        procs.start("1a", _rank, agg.address, 1, 3, crash_after=1)
        deadline = time.monotonic() + 30
        while procs.procs["1a"].exitcode is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert procs.procs["1a"].exitcode == -signal.SIGKILL
        procs.start("1b", _rank, agg.address, 1, 3)
        outcomes = procs.collect([0, "1b"], 60)
        first, again = outcomes[0].unwrap(), outcomes["1b"].unwrap()
    assert first["start"] == 0 and again["start"] == 1
    for seq in range(3):
        expected = reference.allreduce([_inputs(r, seq) for r in range(2)], codec="cnat8", seed=7,
                                       allreduce_seq=seq, packet_elements=256)
        assert np.array_equal(first["results"][seq].view(np.uint32), expected.view(np.uint32)), seq
        if seq >= 1:
            assert np.array_equal(again["results"][seq].view(np.uint32), expected.view(np.uint32)), seq


@pytest.mark.process
def test_a_join_refused_by_one_core_leaves_no_binding_on_the_others():
    """Core 1 has no free slot row (another job holds it); core 0 accepts the JOIN, core 1 refuses it, and the
    Worker's LEAVE frees core 0 again."""
    from intml.worker import JoinError, Worker

    with aggregator("--slots", "1", cores=2) as agg, socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.bind((HOST, 0))
        reply = join_over(s, (HOST, agg.port + 1), 36, 0, **{**PARAMS, "pool_size": 2})  # a job on core 1 only
        assert msg_type(reply) == MsgType.JOIN_ACK
        with pytest.raises(JoinError, match="core|slots"):
            Worker(agg.address, job=37, rank=0, world_size=2, token="t", pool_size=2, timeout=5)
        time.sleep(0.2)
        assert agg.stats()[0]["jobs"] == {} and list(agg.stats()[1]["jobs"]) == ["36"]


# ---- the aggregator's token options -------------------------------------------------------------------------------


@pytest.mark.process
def test_open_mode_warns_in_one_line_and_accepts_only_the_empty_token():
    from intml.worker import JoinError, Worker

    with aggregator(tokens=()) as agg:
        lines = [line for line in agg.stderr().splitlines() if line.strip()]
        assert lines == [OPEN_WARNING]
        with Worker(agg.address, job=38, rank=0, world_size=1, timeout=5) as w:
            np.testing.assert_array_equal(w.allreduce(np.ones(4, np.float32)), np.ones(4))
        with pytest.raises(JoinError, match="token is wrong"):
            Worker(agg.address, job=39, rank=0, world_size=1, token="t", timeout=5)
    with aggregator() as agg:
        assert OPEN_WARNING not in agg.stderr()


@pytest.mark.process
def test_token_file_errors_are_one_line(tmp_path):
    missing = run_cli("--token-file", str(tmp_path / "nope"), "--port", "0")
    empty = tmp_path / "empty"
    empty.write_text("\n  \n")
    blank = run_cli("--token-file", str(empty), "--port", "0")
    for proc, needle in ((missing, "No such file"), (blank, "holds no token")):
        lines = [line for line in proc.stderr.splitlines() if line.strip()]
        assert proc.returncode == 2 and len(lines) == 1 and needle in lines[0] and "--token-file" in lines[0], \
            proc.stderr
        assert "Traceback" not in proc.stderr and "listening" not in proc.stdout


def test_intml_token_and_the_token_file_both_count(tmp_path):
    from intml.aggregator.__main__ import _tokens, build_parser

    path = tmp_path / "tokens"
    path.write_text("alpha\n\nbeta  \n")
    parser = build_parser()
    assert _tokens(parser, str(path), {"INTML_TOKEN": "gamma"}) == ["alpha", "beta", "gamma"]
    assert _tokens(parser, None, {"INTML_TOKEN": "gamma"}) == ["gamma"]

