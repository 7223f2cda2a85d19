"""End-to-end tests: a real aggregator process (``python -m intml.aggregator``) and real worker processes exchanging
UDP datagrams on 127.0.0.1. Every result is compared bit for bit with protocol.reference.allreduce (the same
inputs and seeds), which is the fault-free result by the design's determinism requirement.

The harness (aggregator and worker processes, always killed at teardown) is tests/support/cluster.py; the jobs
and their oracle are tests/support/allreduce.py.
"""

from __future__ import annotations

import os
import queue
import random
import re
import socket
import threading
import time
from collections import Counter

import numpy as np
import pytest
from support.allreduce import (
    CODECS,
    PACKET,
    PLAN,
    POOL,
    SMALL_PLAN,
    Spec,
    allreduce_worker,
    assert_bits_equal,
    check_results,
    make_input,
    new_job,
    run_job,
)
from support.cluster import (
    HOST,
    Aggregator,
    Procs,
    aggregator,
    free_udp_port,
    join_over,
    run_cli,
    run_ok,
    run_procs,
)

from intml.burstio.mmsg import offload_default
from intml.protocol import reference, wire
from intml.protocol.arith import EXP_MAX, EXP_MIN, data_k_max, value_bits
from intml.protocol.cnat import K_MASK, NAN_FLAGS, NONZERO, SIGN
from intml.protocol.codec import Codec
from intml.protocol.wire import NO_EXP, MsgType

pytestmark = pytest.mark.process

# ---- fixtures -----------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def agg():
    """One aggregator shared by the tests that only need a correct one (each test uses its own job ids)."""
    with aggregator(idle_timeout=10) as a:
        yield a
        assert a.alive(), f"the shared aggregator died:\n{a.stderr()}"


# ---- correctness ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("codec", CODECS)
@pytest.mark.parametrize("n", [2, 4, 8])
def test_allreduce_matches_reference(agg: Aggregator, n: int, codec: str) -> None:
    seed = 11 * n + len(codec)
    results = run_job(agg.port, n, codec, seed, PLAN)
    check_results(results, n, codec, seed, PLAN, f"n={n} {codec}")


def test_mean_is_sum_over_n(agg: Aggregator) -> None:
    """op="mean" is the float32 sum divided by n: two jobs with the same seed and inputs, one summing and one
    averaging, at once."""
    n, seed = 3, 5
    plans = {"sum": (Spec((4099,)), Spec((1,))), "mean": (Spec((4099,), op="mean"), Spec((1,), op="mean"))}
    jobs = {op: new_job() for op in plans}
    args = [(agg.port, jobs[op], r, n, "cnat8", seed, plans[op]) for op in plans for r in range(n)]
    results = run_ok(allreduce_worker, args, timeout=90)
    sums, means = results[:n], results[n:]
    check_results(sums, n, "cnat8", seed, plans["sum"], "sum")
    for rank in range(n):
        for k in range(2):
            want = sums[rank]["outs"][k] / np.float32(n)
            assert_bits_equal(means[rank]["outs"][k], want, f"mean #{k} at rank {rank}")


@pytest.mark.parametrize("codec", CODECS)
def test_loss_duplication_reordering(agg: Aggregator, codec: str) -> None:
    n, seed = 4, 77
    results = run_job(agg.port, n, codec, seed, SMALL_PLAN, faults=0.1)
    check_results(results, n, codec, seed, SMALL_PLAN, f"faulty {codec}")
    faults = Counter()
    for res in results:
        faults.update(res["faults"])
    assert faults["dropped"] > 0 and faults["duplicated"] > 0 and faults["reordered"] > 0, faults
    assert sum(res["counters"]["retransmissions"] for res in results) > 0, [r["counters"] for r in results]


def test_out_and_in_place(agg: Aggregator) -> None:
    """allreduce(x, out=buf) returns buf holding the same bits, in place (out=x) too."""
    n, seed = 3, 13
    results = run_job(agg.port, n, "cnat8", seed, PLAN, into=True)
    check_results(results, n, "cnat8", seed, PLAN, "out=")


def test_two_jobs_at_once(agg: Aggregator) -> None:
    jobs = [(new_job(), "cnat8", 21), (new_job(), "int32", 22)]
    args = [(agg.port, job, r, 2, codec, seed, SMALL_PLAN) for job, codec, seed in jobs for r in range(2)]
    results = run_ok(allreduce_worker, args, timeout=90)  # all four processes at once
    for i, (job, codec, seed) in enumerate(jobs):
        check_results(results[2 * i: 2 * i + 2], 2, codec, seed, SMALL_PLAN, f"job {job}")


def test_two_cores() -> None:
    """--cores 2: slots are split over two processes and ports; both jobs (one per codec) still match."""
    with aggregator(cores=2) as agg2:
        jobs = [(new_job(), "cnat8", 31), (new_job(), "int32", 32)]
        args = [(agg2.port, job, r, 3, codec, seed, SMALL_PLAN) for job, codec, seed in jobs for r in range(3)]
        results = run_ok(allreduce_worker, args, timeout=90)
        for i, (job, codec, seed) in enumerate(jobs):
            check_results(results[3 * i: 3 * i + 3], 3, codec, seed, SMALL_PLAN, f"2 cores job {job}")
        replies = agg2.stats()
        assert [r["core"] for r in replies] == [0, 1]
        for reply in replies:  # each core really carried data
            assert reply["core_counters"]["packets_in"] > 10, reply


@pytest.mark.parametrize("multicast", [False, True])
def test_two_aggregators(multicast: bool) -> None:
    """A job over two aggregator processes (1 and 2 cores, "h:p1,h:p2"): the results are the reference's (those
    of one aggregator with 3 cores), also under loss, duplication and reordering; every core carried data."""
    groups = [f"239.{252 - k}.{os.getpid() % 250}.0" for k in range(2)] if multicast else []
    extra = [("--multicast", g) for g in groups] or [(), ()]
    with aggregator(*extra[0], cores=1) as one, aggregator(*extra[1], cores=2) as two:
        both = f"{HOST}:{one.port},{HOST}:{two.port}"
        n, seed = 3, 41
        check_results(run_job(both, n, "cnat8", seed, SMALL_PLAN), n, "cnat8", seed, SMALL_PLAN, "2 aggregators")
        faulty = run_job(both, n, "int32", seed, SMALL_PLAN, faults=0.1)
        check_results(faulty, n, "int32", seed, SMALL_PLAN, "2 aggregators with faults")
        replies = one.stats() + two.stats()
        assert [r["cores"] for r in replies] == [1, 2, 2]
        for reply in replies:
            assert reply["core_counters"]["packets_in"] > 10, reply
        if multicast:  # each aggregator's group, each with its own port
            assert all(res["groups"] == sorted([f"{groups[0][:-1]}0:{one.port}", f"{groups[1][:-1]}0:{two.port}"])
                       for res in faulty), [res["groups"] for res in faulty]


@pytest.mark.parametrize("cores", [1, 2])
def test_multicast_results(cores: int) -> None:
    """--multicast: every completion is one datagram to the job's group, which every worker joined; results
    are the reference's, also under loss, duplication and reordering on each worker's sockets, sync and async."""
    group = f"239.254.{os.getpid() % 250}.0"  # tests running at once must not share a group and port
    with aggregator("--multicast", group, cores=cores) as agg_mc:
        n, seed = 4, 61
        results = run_job(agg_mc.port, n, "cnat8", seed, SMALL_PLAN)
        check_results(results, n, "cnat8", seed, SMALL_PLAN, f"multicast, {cores} cores")
        faulty = run_job(agg_mc.port, n, "int32", seed, SMALL_PLAN, faults=0.1, use_async=True)
        check_results(faulty, n, "int32", seed, SMALL_PLAN, "multicast with faults, async")
        groups = [res["groups"] for res in results + faulty]
        assert all(g and all(a.startswith(group[:-1]) for a in g) for g in groups), groups  # each worker joined
        # a group socket's rows fit one result, so GRO is on by default: replicated GSO batches come in one read
        gro = offload_default(wire.element_datagram_size(Codec.CNAT8, PACKET))[1]
        assert [res["group_gro"] for res in results] == [[gro]] * n


def test_multicast_cores_naming_different_groups() -> None:
    """Cores place jobs in their tables independently: a job already on core 1 only makes the next job's group
    differ between the cores. Workers join every group named and get every result by multicast."""
    group = f"239.253.{os.getpid() % 250}.0"
    with aggregator("--multicast", group, cores=2) as agg_mc:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            reply = join_over(s, (HOST, agg_mc.port + 1), new_job(), 0, timeout=5, world_size=2,
                              packet_elements=PACKET, pool_size=4, codec=0, seed=1)
            assert reply[wire.OFFSETS["type"]] == MsgType.JOIN_ACK
            n, seed = 3, 17
            results = run_job(agg_mc.port, n, "cnat8", seed, SMALL_PLAN)
        check_results(results, n, "cnat8", seed, SMALL_PLAN, "two groups")
        prefix = group.rsplit(".", 1)[0]
        assert all(res["groups"] == [f"{prefix}.0:{agg_mc.port}", f"{prefix}.1:{agg_mc.port}"] for res in results)


def test_multicast_group_failure_leaves_the_job(monkeypatch) -> None:
    """A worker that joined but cannot open the results group raises JoinError naming the group, and leaves the
    job, so that a second try is not refused as an already joined rank."""
    import errno

    import intml.worker.api
    from intml.worker import JoinError, Worker

    def refuse(group, host, port):
        raise OSError(errno.EADDRINUSE, "Address already in use")

    group = f"239.252.{os.getpid() % 250}.0"
    with aggregator("--multicast", group) as agg_mc:
        job = new_job()
        with monkeypatch.context() as m:
            m.setattr(intml.worker.api, "_group_socket", refuse)
            with pytest.raises(JoinError, match=f"multicast group {group}:{agg_mc.port}: Address already in use"):
                Worker(agg_mc.address, job=job, rank=0, world_size=1, token="t", codec="int32", timeout=5)
        with Worker(agg_mc.address, job=job, rank=0, world_size=1, token="t", codec="int32", timeout=5) as w:
            x = np.arange(7, dtype=np.float32)
            assert w.results_groups == [f"{group}:{agg_mc.port}"]
            assert np.array_equal(w.allreduce(x, op="sum"), x)  # int32 carries small integers exactly


def test_multicast_cli_errors() -> None:
    for args, message in ((["--multicast", "224.0.0.5"], "from 224.0.1.0"),
                          (["--multicast", "239.1.1.1", "--host", "0.0.0.0"], "--multicast needs --host")):
        done = run_cli(*args, "--port", "0")
        assert done.returncode == 2 and message in done.stderr and len(done.stderr.strip().splitlines()) == 1, done


def test_allreduce_async_equals_allreduce(agg: Aggregator) -> None:
    n, seed = 3, 41
    plan = (Spec((5003,)), Spec((1,)), Spec((2001,), op="mean"))
    sync = run_job(agg.port, n, "cnat8", seed, plan)
    asyn = run_job(agg.port, n, "cnat8", seed, plan, use_async=True)
    check_results(asyn, n, "cnat8", seed, plan, "allreduce_async")
    for rank in range(n):
        for k in range(len(plan)):
            assert_bits_equal(asyn[rank]["outs"][k], sync[rank]["outs"][k], f"async vs sync rank {rank} #{k}")
    assert all(res["ticks"] > 0 for res in asyn), "the event loop ran no other task during allreduce_async"


# ---- failures ------------------------------------------------------------------------------------------------
def join_and_wait(port: int, job: int, rank: int, n: int, timeout: float) -> tuple[str, str, float]:
    """Join, then allreduce once; returns (exception type or 'ok', message, seconds the call took)."""
    from intml.worker import AllreduceTimeout, JoinError, Worker

    start = time.monotonic()
    try:
        with Worker(f"{HOST}:{port}", job=job, rank=rank, world_size=n, token="t", timeout=timeout,
                    packet_elements=PACKET, pool_size=POOL) as w:
            w.allreduce(np.ones(10, np.float32))
    except (AllreduceTimeout, JoinError) as exc:
        return type(exc).__name__, str(exc), time.monotonic() - start
    return "ok", "", time.monotonic() - start


def test_unreachable_aggregator_times_out() -> None:
    port = free_udp_port()
    [(kind, message, elapsed)] = run_ok(join_and_wait, [(port, 5, 0, 2, 1.0)], timeout=30)
    assert kind == "AllreduceTimeout", (kind, message)
    assert elapsed < 1.0 + 1.5, elapsed
    assert f"127.0.0.1:{port}" in message, message


def mismatched_join(port: int, job: int) -> dict:
    """Rank 0 joins with world_size 2; rank 1 tries world_size 3, then a wrong token."""
    from intml.worker import JoinError, Worker

    errors = {}
    with Worker(f"{HOST}:{port}", job=job, rank=0, world_size=2, token="right", timeout=5):
        for label, kwargs in (("world_size", {"world_size": 3, "token": "right"}),
                              ("token", {"world_size": 2, "token": "wrong"})):
            try:
                Worker(f"{HOST}:{port}", job=job, rank=1, timeout=5, **kwargs).close()
                errors[label] = None
            except JoinError as exc:
                errors[label] = str(exc)
    return errors


def test_join_error_on_mismatched_params(agg: Aggregator) -> None:
    job = new_job()
    [errors] = run_ok(mismatched_join, [(agg.port, job)], timeout=30)
    assert errors["world_size"] is not None, "a JOIN with another world_size was accepted"
    assert "world_size" in errors["world_size"] and str(job) in errors["world_size"], errors
    assert errors["token"] is not None, "a JOIN with another token was accepted"


# ---- a worker that dies mid-job --------------------------------------------------------------------------------
DEAD_TIMEOUT = 3.0  # Worker(timeout=...) of the surviving ranks
SLOTS = 64  # the aggregator's whole slot table: a job with pool SLOTS fits only when no other job holds rows


def doomed_rank(port: int, job: int, rank: int, n: int, mode: str, joined) -> None:
    """Join; then die ('exit': at once, without LEAVE) or do allreduce #0 and wait to be killed ('kill')."""
    from intml.worker import Worker

    w = Worker(f"{HOST}:{port}", job=job, rank=rank, world_size=n, token="t", timeout=30,
               packet_elements=PACKET, pool_size=SLOTS)
    if mode == "exit":
        joined.set()
        os._exit(0)
    w.allreduce(make_input(1, rank, 0, Spec((3001,))))
    joined.set()
    time.sleep(120)


def surviving_rank(port: int, job: int, rank: int, n: int, mode: str, go) -> dict:
    from intml.worker import AllreduceTimeout, Worker

    with Worker(f"{HOST}:{port}", job=job, rank=rank, world_size=n, token="t", timeout=DEAD_TIMEOUT,
                packet_elements=PACKET, pool_size=SLOTS) as w:
        first = w.allreduce(make_input(1, rank, 0, Spec((3001,)))) if mode == "kill" else None
        assert go.wait(60)
        start = time.monotonic()
        try:
            w.allreduce(make_input(1, rank, 1, Spec((3001,))))
        except AllreduceTimeout as exc:
            return {"timeout": True, "message": str(exc), "elapsed": time.monotonic() - start, "first": first}
        return {"timeout": False, "elapsed": time.monotonic() - start, "first": first}


def run_dead_worker(agg_: Aggregator, procs: Procs, job: int, mode: str, n: int = 3):
    """Rank 2 of `job` joins and dies; ranks 0 and 1 then allreduce without it. Returns the survivors'
    outcomes and the job's stats 0.5 s before their timeout (they are still retransmitting then)."""
    joined, go = procs.ctx.Event(), procs.ctx.Event()
    procs.start("dead", doomed_rank, agg_.port, job, 2, n, mode, joined)
    if mode == "exit":
        assert joined.wait(60), "rank 2 never joined"
    for r in (0, 1):
        procs.start(r, surviving_rank, agg_.port, job, r, n, mode, go)
    if mode == "kill":
        assert joined.wait(60), "rank 2 never finished allreduce #0"
        procs.kill("dead")
    go.set()
    time.sleep(DEAD_TIMEOUT - 0.5)
    waiting = agg_.stats(job)[0]["jobs"].get(str(job))
    outcomes = procs.collect([0, 1], timeout=60)
    return {r: outcomes[r].unwrap() for r in (0, 1)}, waiting


@pytest.mark.parametrize("mode, idle_timeout", [("exit", 10.0), ("kill", 10.0), ("exit", 2.0)],
                         ids=["exit-idle10", "kill-idle10", "exit-idle2"])
def test_dead_worker_named_in_timeout(mode: str, idle_timeout: float) -> None:
    """The survivors raise AllreduceTimeout within their timeout, naming the job and the missing rank 2."""
    n, job = 3, new_job()
    with aggregator("--slots", str(SLOTS), idle_timeout=idle_timeout) as agg_, Procs() as procs:
        results, waiting = run_dead_worker(agg_, procs, job, mode, n)
    for r in (0, 1):
        assert results[r]["timeout"], f"rank {r} finished an allreduce without rank 2"
        assert results[r]["elapsed"] < DEAD_TIMEOUT + 2.0, results[r]
    if mode == "kill":  # allreduce #0 had all three ranks
        want = reference.allreduce([make_input(1, r, 0, Spec((3001,))) for r in range(n)], codec="cnat8",
                                   seed=0, allreduce_seq=0, packet_elements=PACKET)
        for r in (0, 1):
            assert_bits_equal(results[r]["first"], want, f"allreduce #0 at rank {r}")
    # While ranks 0 and 1 still retransmit (0.5 s before their timeout) the job is not idle: the aggregator
    # still holds its incomplete rounds, which are what name the missing rank.
    assert waiting is not None, (f"job {job} was torn down after {idle_timeout} s while ranks 0 and 1 were still "
                                 f"retransmitting to it")
    assert waiting["pending"] and all(p["missing_ranks"] == [2] for p in waiting["pending"]), waiting
    for r in (0, 1):
        message = results[r]["message"]
        assert f"job {job}" in message, message
        assert re.search(r"\branks? \[?2\b", message), f"the message does not name the missing rank 2: {message}"


def test_dead_workers_job_freed_after_idle_timeout() -> None:
    """Rank 2 never leaves, so only the idle timeout tears the job down; then its slots are free again."""
    n, job, idle_timeout = 3, new_job(), 2.0
    with aggregator("--slots", str(SLOTS), idle_timeout=idle_timeout) as agg_, Procs() as procs:
        results, _ = run_dead_worker(agg_, procs, job, "exit", n)
        for r in (0, 1):
            assert results[r]["timeout"] and results[r]["elapsed"] < DEAD_TIMEOUT + 2.0, results[r]
            assert f"job {job}" in results[r]["message"], results[r]["message"]
        deadline = time.monotonic() + idle_timeout + 5.0
        while job in agg_.job_ids():
            assert time.monotonic() < deadline, f"job {job} still listed {idle_timeout + 5} s after it went idle"
            time.sleep(0.2)
        assert f"job {job} idle" in agg_.stdout(), agg_.stdout()
        # Its rows are free again: a job needing the whole slot table runs.
        job2 = new_job()
        args = [(agg_.port, job2, r, 2, "cnat8", 3, SMALL_PLAN) for r in range(2)]
        outcomes = run_procs(allreduce_worker, args, timeout=60, pool=SLOTS)
        for o in outcomes:
            assert o.ok, f"a job with pool {SLOTS} did not run after the teardown: {o.exc_type}: {o.message}"
        check_results([o.value for o in outcomes], 2, "cnat8", 3, SMALL_PLAN, "job after the teardown")

# ---- fuzzing the live aggregator ---------------------------------------------------------------------------
WORKER_CAUSED = ("drop_stale", "drop_duplicate_incomplete")  # normal retransmissions produce these
FUZZ_REASONS = {"drop_short", "drop_bad_control", "drop_truncated", "drop_bad_magic", "drop_bad_version", "drop_unknown_type",
                "drop_unknown_job", "drop_rank_out_of_range", "drop_unregistered_source", "drop_slot_out_of_range",
                "drop_wrong_codec", "drop_wrong_count", "drop_bad_shadow", "drop_bad_exponent", "drop_invalid_code",
                "drop_bad_owner"}
FOREIGN, REGISTERED = "foreign", "registered"
CONTROL = (MsgType.DATA, MsgType.JOIN, MsgType.LEAVE, MsgType.STATS_REQUEST)
OVERSIZE = (26 + 4 * 8192 + 1, 65000)  # beyond the default --max-packet-elements: truncated on receipt


class Fuzzer:
    """A seeded generator of bad datagrams for one live cnat8 job. Each datagram is built to fail exactly one
    known check, so the aggregator counter it must land in is known. 'registered' datagrams are sent from
    the socket rank `rank` joined from (they get past the membership check), 'foreign' ones from a socket
    that joined nothing."""

    def __init__(self, seed: int, *, job: int, world: int, rank: int, pool: int, packet: int) -> None:
        self.rng = random.Random(seed)
        self.job, self.world, self.rank, self.pool, self.packet = job, world, rank, pool, packet
        self.vbits = value_bits(world)
        self.real: bytes | None = None  # a real DATA datagram of `rank`, used as a template when known
        self.kinds = [name[5:] for name in dir(self) if name.startswith("kind_")]

    # a DATA datagram that passes every check before the round-key check
    def base(self) -> tuple[dict, bytes]:
        r = self.rng
        if self.real is not None and r.random() < 0.5:
            header = np.frombuffer(self.real[: wire.HEADER_SIZE], wire.HEADER)[0]
            return {name: int(header[name]) for name in wire.HEADER.names}, self.real[wire.HEADER_SIZE:]
        count = r.randint(0, self.packet)
        header = {"type": int(MsgType.DATA), "job": self.job, "allreduce": r.randint(0, 20),
                  "chunk": r.randint(-8, 40), "rank": self.rank, "slot": r.randrange(self.pool), "count": count,
                  "codec": int(Codec.CNAT8), "shadow": r.randint(0, 1),
                  "exp": r.choice([NO_EXP, r.randint(EXP_MIN, EXP_MAX)]),
                  "next_exp": r.choice([NO_EXP, r.randint(EXP_MIN, EXP_MAX)])}
        return header, bytes(count)  # zero codes are valid at every exponent

    def rand_bytes(self, n: int) -> bytes:
        return bytes(self.rng.getrandbits(8) for _ in range(n))

    def make(self) -> tuple[bytes, str, str]:
        """(datagram, which socket sends it, the counter it must increment)."""
        kind = self.rng.choice(self.kinds)
        return getattr(self, "kind_" + kind)()

    def either(self) -> str:
        return self.rng.choice([FOREIGN, REGISTERED])

    # ---- malformed before any job lookup (per-core counters)
    def kind_random_short(self):
        return self.rand_bytes(self.rng.randint(0, wire.HEADER_SIZE - 1)), FOREIGN, "drop_short"

    def kind_random_long(self):
        data = bytearray(self.rand_bytes(self.rng.randint(wire.HEADER_SIZE, 1400)))
        if data[0] == wire.MAGIC >> 8 and data[1] == wire.MAGIC & 0xFF:
            data[0] ^= 0x80
        return bytes(data), FOREIGN, "drop_bad_magic"

    def kind_truncated_header(self):
        header, payload = self.base()
        return wire.pack(header, payload)[: self.rng.randint(1, wire.HEADER_SIZE - 1)], self.either(), "drop_short"

    def kind_oversize(self):
        header, _ = self.base()
        return wire.pack(header, self.rand_bytes(self.rng.randint(*OVERSIZE) - wire.HEADER_SIZE)), FOREIGN, \
            "drop_truncated"

    def kind_bad_magic(self):
        header, payload = self.base()
        header["magic"] = self.rng.choice([m for m in (0, 0xFFFF, wire.MAGIC ^ 1, self.rng.getrandbits(16))
                                           if m != wire.MAGIC])
        return wire.pack(header, payload), self.either(), "drop_bad_magic"

    def kind_bad_version(self):
        header, payload = self.base()
        header["version"] = self.rng.choice([v for v in range(256) if v != wire.VERSION])
        return wire.pack(header, payload), self.either(), "drop_bad_version"

    def kind_unknown_type(self):
        header, payload = self.base()
        header["type"] = self.rng.choice([t for t in range(256) if t not in CONTROL])
        return wire.pack(header, payload), self.either(), "drop_unknown_type"

    def kind_unknown_job(self):
        header, payload = self.base()
        header["job"] = self.rng.choice([j for j in (0, self.job + 1, 0xFFFFFFFF, self.rng.getrandbits(32))
                                         if j != self.job])
        return wire.pack(header, payload), self.either(), "drop_unknown_job"

    def kind_join_garbage(self):
        body = self.rand_bytes(self.rng.choice([0, 1, wire.JOIN_SIZE - 1, wire.JOIN_SIZE + 1, 100]))
        return wire.pack({"type": int(MsgType.JOIN), "job": self.job, "rank": 0}, body), FOREIGN, "drop_bad_control"

    # ---- the live job's own checks (per-job counters)
    def kind_rank_out_of_range(self):
        header, payload = self.base()
        header["rank"] = self.rng.randint(0, 255) << 8 | self.rng.randint(self.world, 255)  # any owners byte
        return wire.pack(header, payload), self.either(), "drop_rank_out_of_range"

    def kind_bad_owner(self):
        """An owners code (the rank field's high byte) that names a rank >= n."""
        header, payload = self.base()
        code = self.rng.choice([1 + self.rng.randint(self.world, 63), 1 + 64 * 3 + self.world - 1, 255])
        header["rank"] = code << 8 | self.rank
        return wire.pack(header, payload), REGISTERED, "drop_bad_owner"

    def kind_foreign_source(self):
        header, payload = self.base()
        header["rank"] = self.rng.randrange(self.world)
        return wire.pack(header, payload), FOREIGN, "drop_unregistered_source"

    def kind_spoofed_rank(self):
        header, payload = self.base()
        header["rank"] = self.rng.choice([r for r in range(self.world) if r != self.rank])
        return wire.pack(header, payload), REGISTERED, "drop_unregistered_source"

    def kind_slot_out_of_range(self):
        header, payload = self.base()
        header["slot"] = self.rng.choice([self.pool, self.pool + 1, 0xFFFF, self.rng.randint(self.pool, 0xFFFF)])
        return wire.pack(header, payload), REGISTERED, "drop_slot_out_of_range"

    def kind_wrong_codec(self):
        header, payload = self.base()
        header["codec"] = self.rng.choice([int(Codec.INT32), 2, 255])
        return wire.pack(header, payload), REGISTERED, "drop_wrong_codec"

    def kind_count_too_big(self):
        header, _ = self.base()
        header["count"] = count = self.rng.randint(self.packet + 1, self.packet + 600)
        return wire.pack(header, bytes(count)), REGISTERED, "drop_wrong_count"

    def kind_length_mismatch(self):
        header, payload = self.base()
        count = len(payload)
        delta = self.rng.choice([d for d in (-count, -1, 1, 7, -(count // 2)) if d != 0 and count + d >= 0] or [3])
        return wire.pack(header, bytes(count + delta)), REGISTERED, "drop_wrong_count"

    def kind_bad_shadow(self):
        header, payload = self.base()
        header["shadow"] = self.rng.randint(2, 255)
        return wire.pack(header, payload), REGISTERED, "drop_bad_shadow"

    def kind_bad_exponent(self):
        header, payload = self.base()
        bad = self.rng.choice(list(range(-127, EXP_MIN)) + list(range(EXP_MAX + 1, 128)))
        header[self.rng.choice(["exp", "next_exp"])] = bad
        return wire.pack(header, payload), REGISTERED, "drop_bad_exponent"

    def kind_invalid_code(self):
        """Passes every check up to the codes, with a round key far ahead of any the job used (a fresh round,
        so it is neither stale nor a duplicate), and one code the slot's range cannot hold."""
        r = self.rng
        header, _ = self.base()
        header["allreduce"] = r.randint(1_000_000, 2**31 - 1)
        count = r.randint(1, self.packet)
        exp = r.choice([NO_EXP, r.randint(EXP_MIN, EXP_MAX)])
        header.update(count=count, codec=int(Codec.CNAT8), exp=exp)
        # no NONZERO bit, and not a non-finite code (0x01-0x03: valid, its chunk would open the far round)
        choices = [r.choice(list(range(NAN_FLAGS + 1, NONZERO)) + list(range(SIGN, SIGN | NONZERO)))]
        if exp == NO_EXP:
            choices.append(NONZERO | r.randint(0, K_MASK))  # any nonzero code: the chunk has no exponent
        else:  # above the agreed exponent: k > T - f
            choices.append(NONZERO | r.randint(data_k_max(exp, self.vbits) + 1, K_MASK))
        codes = bytearray(count)
        codes[r.randrange(count)] = r.choice(choices) | r.choice([0, SIGN])
        return wire.pack(header, bytes(codes)), REGISTERED, "drop_invalid_code"


def _send_all(batch, registered: socket.socket, foreign: socket.socket, target) -> None:
    for i, (data, via, _) in enumerate(batch):
        sock = registered if via == REGISTERED else foreign
        while True:
            try:
                sock.sendto(data, target)
                break
            except BlockingIOError:  # the worker's socket is non-blocking
                time.sleep(0.001)
        if i % 8 == 7:
            time.sleep(0.001)  # paced: the point is the aggregator's accounting, not its receive buffer


def fuzzing_rank(port: int, job: int, rank: int, n: int, seed: int, plan, fuzz_seed: int, per_batch: int,
                 report, release) -> str:
    """Rank `rank` of the live job: allreduces the plan like the others while throwing bad datagrams at the
    aggregator before each allreduce and (from a thread) during it. Reports, then waits for `release`
    before leaving, so the job's counters can still be read."""
    from intml.worker import Worker

    fuzzer = Fuzzer(fuzz_seed, job=job, world=n, rank=rank, pool=POOL, packet=PACKET)
    sent = Counter()
    xs = [make_input(seed, rank, k, spec) for k, spec in enumerate(plan)]
    target = (HOST, port)
    with Worker(f"{HOST}:{port}", job=job, rank=rank, world_size=n, token="t", codec="cnat8",
                packet_elements=PACKET, pool_size=POOL, seed=seed, timeout=30) as w, \
            socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as foreign:
        foreign.bind((HOST, 0))
        outs = []
        sent_last: list[bytes] = []  # the last datagram the engine sent, copied out of its output burst
        send = w.io.send

        def keep_last(burst):
            if burst.count:
                sent_last[:] = [burst.datagrams()[-1][0]]
            return send(burst)

        w.io.send = keep_last
        for x, spec in zip(xs, plan):
            between = [fuzzer.make() for _ in range(per_batch)]
            within = [fuzzer.make() for _ in range(per_batch)]
            _send_all(between, w.io.sock, foreign, target)
            thread = threading.Thread(target=_send_all, args=(within, w.io.sock, foreign, target))
            thread.start()
            outs.append(w.allreduce(x, op=spec.op))
            thread.join()
            sent.update(reason for _, _, reason in between + within)
            if sent_last and sent_last[0][wire.OFFSETS["type"]] == MsgType.DATA:
                fuzzer.real = sent_last[0]  # mutate real traffic from now on too
        report.put({"outs": outs, "sent": dict(sent), "counters": w.counters(), "real": fuzzer.real is not None})
        assert release.wait(60), "never released"
    return "left"


def test_fuzz_live_aggregator() -> None:
    """Bad datagrams thrown at a live job never change its result, and every one of them is counted under
    the reason it was built for."""
    n, seed, job = 4, 91, new_job()
    plan = (Spec((5003,)), Spec((1,)), Spec((37, 101)), Spec((3001,), zero_head=True), Spec((2001,)))
    with aggregator() as agg_, Procs() as procs:
        report, release = procs.ctx.Queue(), procs.ctx.Event()
        for r in range(n - 1):
            procs.start(r, allreduce_worker, agg_.port, job, r, n, "cnat8", seed, plan)
        procs.start("fuzzer", fuzzing_rank, agg_.port, job, n - 1, n, seed, plan, 1234, 40, report, release)
        try:
            fuzz = report.get(timeout=90)
        except queue.Empty:
            raise AssertionError(f"the fuzzing rank did not report: {procs.collect(['fuzzer'], 5)}") from None
        replies = agg_.stats()  # before the last rank leaves: the job's counters go with the job
        release.set()
        outcomes = procs.collect([0, 1, 2, "fuzzer"], timeout=60)

    results = [outcomes[r].unwrap() for r in range(n - 1)] + [fuzz]
    assert outcomes["fuzzer"].unwrap() == "left"
    check_results(results, n, "cnat8", seed, plan, "fuzzed job")

    [reply] = replies
    assert str(job) in reply["jobs"], reply
    counted = Counter({k: v for k, v in reply["core_counters"].items() if k.startswith("drop_")})  # its jobs' too
    sent = Counter(fuzz["sent"])
    total = sum(sent.values())
    assert total == 2 * 40 * len(plan)
    assert fuzz["real"], "no real DATA datagram was mutated"
    assert set(sent) == FUZZ_REASONS, sent  # every reason was exercised
    mismatches = {reason: (counted[reason], sent[reason]) for reason in counted.keys() | sent.keys()
                  if reason not in WORKER_CAUSED and counted[reason] != sent[reason]}
    assert not mismatches, f"drop counters (counted, sent) that do not match the fuzz datagrams: {mismatches}"
    assert sum(counted.values()) - sum(counted[r] for r in WORKER_CAUSED) == total


# ---- command line --------------------------------------------------------------------------------------------
def _stderr_lines(proc) -> list[str]:
    return [line for line in proc.stderr.splitlines() if line.strip()]


@pytest.mark.parametrize("args, option", [(("--cores", "0"), "--cores"), (("--port", "99999"), "--port"),
                                          (("--max-jobs", "0"), "--max-jobs"), (("--max-pool", "-2"), "--max-pool"),
                                          (("--max-jobs", "300000000", "--multicast", "239.255.42.0"),
                                           "--multicast")])
def test_cli_rejects_bad_option(args, option) -> None:
    proc = run_cli(*args)
    assert proc.returncode != 0
    lines = _stderr_lines(proc)
    assert len(lines) == 1, f"expected one line on stderr, got {len(lines)}:\n{proc.stderr}"
    assert option in lines[0], lines[0]
    assert "listening" not in proc.stdout


def test_cli_port_in_use() -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as busy:
        busy.bind((HOST, 0))
        port = busy.getsockname()[1]
        proc = run_cli("--host", HOST, "--port", str(port))
    assert proc.returncode != 0
    lines = _stderr_lines(proc)
    assert len(lines) == 1, f"expected one line on stderr, got {len(lines)}:\n{proc.stderr}"
    assert str(port) in lines[0], lines[0]
    assert "listening" not in proc.stdout


def test_timeout_after_idle_teardown_says_the_job_is_gone() -> None:
    """A pause longer than the aggregator's idle timeout loses the job; the next allreduce says so."""
    from intml.worker import AllreduceTimeout, Worker

    with aggregator(idle_timeout=1) as agg:
        with Worker(f"{HOST}:{agg.port}", job=11, rank=0, world_size=1, token="t", codec="int32", timeout=2.0) as w:
            np.testing.assert_array_equal(w.allreduce(np.arange(10, dtype=np.float32)), np.arange(10))
            time.sleep(2.5)
            with pytest.raises(AllreduceTimeout, match="no longer knows job 11"):
                w.allreduce(np.ones(10, np.float32))
