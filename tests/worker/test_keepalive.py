"""Jobs live as long as their ranks do: a worker's session sends a keepalive (a STATS_REQUEST of a header and a
MAC, no reply) to every core once a third of the cores' idle timeout (stated in the JOIN_ACK) has passed without
an allreduce progressing. The core counts a member's authenticated keepalive as activity; a job whose ranks are
gone is still torn down after the idle timeout. A keepalive flood goes through the control admission like every
control datagram, and a stranger's keepalive keeps nothing alive.

Sans-I/O (WorkerSession against AggregatorCore, injected time), then live: a torch group that pauses three idle
timeouts between two allreduces, and ranks killed without leaving.
"""

from __future__ import annotations

import os
import socket
import threading
import time
import weakref

import numpy as np
import pytest
from support.cluster import Procs, aggregator, run_ok
from support.harness import Network, msg_type

from intml.protocol.stats import STAT_NAMES
from intml.protocol import keys, wire
from intml.protocol.job import ControlLimits
from intml.protocol.packet import HDR
from intml.protocol.wire import MsgType
from intml.worker.api import Worker

IDLE = 3.0


def _run_sessions(net: Network, ranks: list[int], until: float, step: float = 0.05) -> list[tuple[bytes, int, float]]:
    """Drive the ranks' sessions and the core's idle timer from net.now to `until`, delivering what the sessions
    send; returns the keepalives sent and asserts the core answered none."""
    sent = []
    t = net.now
    while t < until:
        t = min(until, t + step)
        net.now = t
        for rank in ranks:
            session = net.sessions[rank]
            if (timer := session.get_timer()) is not None and timer <= t:
                session.handle_timer(t)
            for data, dst in session.datagrams_to_send(t):
                sent.append((data, rank, t))
                assert net.to_core(net.core_of[dst], [(data, net.addr(rank))]) == []  # no reply to a keepalive
        net.cores[0].handle_timer(t)
    return sent


def test_keepalive_keeps_the_job_while_its_ranks_live_and_not_after() -> None:
    net = Network(2, idle_timeout=IDLE)
    assert all(s.keepalive_every == IDLE / 3 for s in net.sessions.values())  # from the JOIN_ACK
    sent = _run_sessions(net, [0, 1], 3 * IDLE)  # a pause three idle timeouts long
    assert net.job in net.cores[0].info
    assert all(msg_type(d) == MsgType.STATS_REQUEST and len(d) == HDR + keys.MAC_SIZE for d, _, _ in sent)
    per_rank = [sum(r == rank for _, r, _ in sent) for rank in (0, 1)]
    assert per_rank[0] == per_rank[1] >= 8, per_rank  # one per IDLE / 3 of the 9 s
    last = max(t for _, _, t in sent)  # then the ranks are gone: nobody sends
    _run_sessions(net, [], last + IDLE - 0.1)
    assert net.job in net.cores[0].info
    _run_sessions(net, [], last + IDLE + 0.1)
    assert net.job not in net.cores[0].info
    assert net.cores[0].history[-1]["ended"] == "idle"


def test_one_live_rank_keeps_the_job() -> None:
    """The job is idle only when every rank is: a rank paused in a debugger keeps it for the others."""
    net = Network(2, idle_timeout=IDLE)
    _run_sessions(net, [1], 3 * IDLE)
    assert net.job in net.cores[0].info


def test_keepalives_cost_nothing_while_allreduces_progress() -> None:
    net = Network(1, idle_timeout=IDLE)
    session = net.sessions[0]
    for t in np.arange(0.0, 3 * IDLE, 0.5):  # an allreduce progresses every 0.5 s, less than IDLE / 3
        session.watch_progress(float(t))
        if session.get_timer() <= t:
            session.handle_timer(float(t))
        assert session.datagrams_to_send(float(t)) == []
    session.unwatch_progress()
    session.handle_timer(3 * IDLE - 0.5 + IDLE / 3)  # the first keepalive comes a third of IDLE after the last
    assert len(session.datagrams_to_send(3 * IDLE)) == 1


def test_a_strangers_keepalive_keeps_nothing_alive() -> None:
    net = Network(2, idle_timeout=IDLE)
    core = net.cores[0]
    good = net.sessions[0].sealed(MsgType.STATS_REQUEST, net.core_addrs[0])
    forged = [
        keys.seal(keys.session_key(keys.token_key("guess"), net.job, 0, b"n" * 16, b"c" * 16), good, len(good) - 16),
        good[:-1] + bytes([good[-1] ^ 1]),  # a bit of the MAC flipped
        good,  # a member's own keepalive, replayed from another address
    ]
    sources = [net.addr(0), net.addr(0), net.addr(1) + 1000]
    before = core.stats(0.0)["core_counters"]["drop_bad_mac"]
    t = 0.0
    while t < IDLE - 0.5:
        t += 0.5
        net.now = t
        for data, src in zip(forged, sources, strict=True):
            assert net.to_core(0, [(data, src)]) == []
        core.handle_timer(t)
    assert core.stats(t)["core_counters"]["drop_bad_mac"] - before == 3 * len(range(int((IDLE - 0.5) / 0.5)))
    core.handle_timer(IDLE)
    assert net.job not in core.info  # torn down as if nobody had sent anything


def test_a_keepalive_flood_is_rate_limited_like_other_control_traffic() -> None:
    limits = ControlLimits()
    net = Network(1, idle_timeout=IDLE)
    keepalive = net.sessions[0].sealed(MsgType.STATS_REQUEST, net.core_addrs[0])
    before = dict(zip(STAT_NAMES, net.cores[0].counters.totals().tolist()))
    flood = 10 * limits.per_burst
    net.to_core(0, [(keepalive, net.addr(0))] * flood)
    after = dict(zip(STAT_NAMES, net.cores[0].counters.totals().tolist()))
    admitted = flood - (after["drop_control_rate"] - before["drop_control_rate"])
    assert 0 < admitted <= min(limits.per_burst, limits.source_burst), admitted


# ---- live ------------------------------------------------------------------------------------------------------
LIVE_IDLE = 1.0
TOKEN = "test-keepalive"


def paused_rank(address: str, rank: int, n: int, pause: float) -> list[np.ndarray]:
    with Worker(address, job=4242, rank=rank, world_size=n, token=TOKEN, timeout=20) as w:
        w.start_keepalive()
        first = w.allreduce(np.ones(1000, np.float32))  # powers of two: C_nat sums them exactly
        time.sleep(pause)  # an evaluation, a checkpoint: no allreduce for three idle timeouts
        second = w.allreduce(np.ones(1000, np.float32))
        return [first, second]


@pytest.mark.process
def test_live_job_survives_a_pause_of_three_idle_timeouts() -> None:
    with aggregator(idle_timeout=LIVE_IDLE, tokens=(TOKEN,)) as agg:
        results = run_ok(paused_rank, [(agg.address, r, 2, 3 * LIVE_IDLE + 0.5) for r in range(2)], timeout=120)
        for first, second in results:
            assert (first == 2.0).all() and (second == 2.0).all()
        assert agg.alive()


@pytest.mark.process
def test_close_ends_the_keepalive_thread_so_the_closer_frees_the_worker() -> None:
    """The worker's last reference must not die on its keepalive thread: there, at interpreter exit, freeing the
    torch tensors its arrays view aborted DDP ranks (Worker.close). close() returns once the thread has ended."""
    with aggregator(idle_timeout=LIVE_IDLE, tokens=(TOKEN,)) as agg:
        for job in range(4444, 4452):  # a thread left running may still end during close() now and then: try a few
            w = Worker(agg.address, job=job, rank=0, world_size=1, token=TOKEN, timeout=20)
            w.start_keepalive()
            assert (w.allreduce(np.ones(1000, np.float32)) == 1.0).all()
            freed = weakref.ref(w)
            w.close()
            assert not [t.name for t in threading.enumerate() if t.name.startswith("intml-keepalive")]
            del w
            assert freed() is None  # freed here, by the closer dropping the last reference


def killed_rank(address: str, rank: int, n: int, ready: str) -> None:
    w = Worker(address, job=4343, rank=rank, world_size=n, token=TOKEN, timeout=20)
    w.start_keepalive()
    w.allreduce(np.ones(1000, np.float32))
    open(f"{ready}.{rank}", "w").close()
    time.sleep(60)  # killed meanwhile, never leaving


@pytest.mark.process
def test_live_job_whose_ranks_were_killed_is_reclaimed(tmp_path) -> None:
    ready = str(tmp_path / "ready")
    with aggregator(idle_timeout=LIVE_IDLE, tokens=(TOKEN,)) as agg, Procs() as procs:
        for r in range(2):
            procs.start(r, killed_rank, agg.address, r, 2, ready)
        deadline = time.monotonic() + 60
        while not all(os.path.exists(f"{ready}.{r}") for r in range(2)):
            assert time.monotonic() < deadline, "the ranks did not finish their allreduce"
            time.sleep(0.05)
        time.sleep(2 * LIVE_IDLE)  # alive and idle: kept
        assert 4343 in agg.job_ids()
        for r in range(2):
            procs.kill(r)
        time.sleep(LIVE_IDLE + 1.0)  # the keepalives stop; the idle timeout reclaims the job
        assert 4343 not in agg.job_ids()
        [core0] = agg.stats()
        assert any(f["job"] == 4343 and f["ended"] == "idle" for f in core0["finished"]), core0["finished"]


@pytest.mark.process
def test_live_stranger_keepalives_keep_nothing_alive() -> None:
    """Keepalives for a live job's id from an address that is no member, with a MAC under no session key: the job
    still ends on its idle timeout once its only rank is gone."""
    with aggregator(idle_timeout=LIVE_IDLE, tokens=(TOKEN,)) as agg:
        w = Worker(agg.address, job=4444, rank=0, world_size=1, token=TOKEN, timeout=20)
        w.allreduce(np.ones(10, np.float32))
        w._closed = True  # gone without a LEAVE, as if killed (the test's own socket is closed below)
        w.io.sock.close()
        forged = keys.seal(os.urandom(32), wire.pack({"type": int(MsgType.STATS_REQUEST), "job": 4444, "rank": 0},
                                                     bytes(keys.MAC_SIZE)), HDR)
        end = time.monotonic() + 3 * LIVE_IDLE
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            while time.monotonic() < end:
                s.sendto(forged, ("127.0.0.1", agg.port))
                time.sleep(0.05)
        assert 4444 not in agg.job_ids()
        [core0] = agg.stats()
        assert core0["core_counters"]["drop_bad_mac"] > 0


def torch_paused_rank(port: int, address: str, rank: int, n: int, pause: float) -> list[np.ndarray]:
    import torch
    import torch.distributed as dist
    from support.torch_ranks import init_rank

    init_rank(port, rank, n, "intml", {"INTML_AGGREGATOR": address, "INTML_TOKEN": TOKEN, "INTML_MIN_ELEMENTS": "100",
                                      "INTML_TIMEOUT": "20"})
    got = []
    for _ in range(2):
        t = torch.ones(1000)
        dist.all_reduce(t)
        got.append(t.numpy().copy())
        time.sleep(pause)  # between steps: evaluation, a checkpoint
    got.append(dist.distributed_c10d._get_default_group().traffic.intml_allreduces)
    dist.destroy_process_group()
    return got


@pytest.mark.process
@pytest.mark.torch
def test_live_torch_group_survives_a_pause_of_three_idle_timeouts() -> None:
    pytest.importorskip("torch")
    from intml.testbed.procs import free_port

    with aggregator(idle_timeout=LIVE_IDLE, tokens=(TOKEN,)) as agg:
        port = free_port()
        results = run_ok(torch_paused_rank, [(port, agg.address, r, 2, 3 * LIVE_IDLE + 0.5) for r in range(2)],
                         timeout=120)
        for first, second, through_intml in results:
            assert (first == 2.0).all() and (second == 2.0).all() and through_intml == 2
