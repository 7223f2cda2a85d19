"""The engine's TCP (sim.tcp) by hand-computed cases, its loss recovery, and the packet-level Gloo ring and
parameter server (sim.collectives) against the flow models where both run."""

from __future__ import annotations

import dataclasses
import functools
import pathlib
from collections import Counter

import pytest

from intml.sim import models, validate
from intml.sim.collectives import PREAMBLE, TcpRun, gloo_segments, simulate_tcp
from intml.sim.costs import ASIC
from intml.sim.engine import Simulator
from intml.sim.network import WIRE_OVERHEAD, Link, Switch
from intml.sim.tcp import JIFFY, MIN_RTO, TLP_SLACK, Network, TcpHost, mss
from intml.worker.costs import ETHERNET, TCP_IP

DATA = pathlib.Path(__file__).resolve().parents[2] / "sim" / "data"


class DropOnce(Link):
    """A link that drops the data segments starting at the given sequence numbers, the first time each passes (a
    number given k times: the first k times)."""

    def __init__(self, *args, drop, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.drop = Counter(drop)

    def send_many(self, datagrams, now):
        keep = []
        for d in datagrams:
            if d[0].size and self.drop[d[0].seq] > 0:
                self.drop[d[0].seq] -= 1
                continue
            keep.append(d)
        super().send_many(keep, now)


def _one_flow(nbytes, rate=1e9, delay=10e-6, drop=(), cwnd=None, congestion="reno", watch=None):
    sim = Simulator()
    switch = Switch(sim, None, ASIC)
    a, b = TcpHost(sim, 1), TcpHost(sim, 2)
    for h in (a, b):
        h.uplink = Link(sim, switch, rate=rate, delay=delay, queue_bytes=1 << 40)
    switch.attach(1, Link(sim, a, rate=rate, delay=delay))
    switch.attach(2, DropOnce(sim, b, rate=rate, delay=delay, drop=drop))
    flow = Network(sim, switch, [a, b], 1500, congestion=congestion).flow(0, 1)
    if cwnd is not None:
        flow.cwnd = cwnd
    done = []
    flow.write(nbytes, 0.0)
    flow.when_received(nbytes, done.append)
    for offset, fn in watch or ():
        flow.when_received(offset, lambda now, fn=fn: fn(flow))
    sim.run()
    return flow, done[0]


def test_initial_window_hand_computed():
    """Ten full segments (the initial window) leave back to back: the last is in after ten serialisations on the
    host's link, a link delay, the switch, its own serialisation on the switch's port and a link delay."""
    seg = mss(1500)
    flow, t = _one_flow(10 * seg)
    wire = (seg + 66) * 8 / 1e9
    assert seg + 66 == 1500 + 14 and 66 == TCP_IP + ETHERNET
    assert t == pytest.approx(10 * wire + 10e-6 + ASIC.latency + wire + 10e-6)
    assert flow.retransmits == 0 and flow.una == 10 * seg  # every segment acknowledged


def test_a_single_loss_is_recovered_by_sack_in_one_round_trip():
    """Segment 5 of 40 lost: the SACKs of the next three mark it lost (RACK with no reordering window once
    DupThresh segments are SACKed), it is resent at once, and the flow ends less than a round trip later than
    without the loss (the resend's own trip), with no timer and no probe."""
    seg = mss(1500)
    _, clean = _one_flow(40 * seg)
    flow, t = _one_flow(40 * seg, drop={5 * seg})
    assert (flow.retransmits, flow.timeouts, flow.probes) == (1, 0, 0)
    assert clean < t < clean + flow.min_rtt
    assert flow.recover is None and flow.cwnd >= flow.ssthresh  # recovery ended on the full acknowledgement
    assert not flow.scoreboard and flow.sacked == flow.lost == 0


def test_a_small_window_recovers_without_duplicate_counting():
    """A window of three with the first segment lost: the two SACKed segments let two new ones out (pipe, as
    Limited Transmit), their SACKs reach DupThresh and the hole is resent, not left to the timer."""
    seg = mss(1500)
    flow, t = _one_flow(20 * seg, drop={0}, cwnd=3 * seg)
    assert (flow.retransmits, flow.timeouts) == (1, 0) and t < 0.01


def test_a_lost_retransmission_is_recovered_by_rack_without_the_timer():
    """Segment 5 lost twice: its resend is lost too; the segments sent after the resend are SACKed, and one
    RACK.rtt after the resend it is marked lost again and resent (NewReno would wait for the 200 ms timer)."""
    seg = mss(1500)
    _, clean = _one_flow(40 * seg)
    flow, t = _one_flow(40 * seg, drop=[5 * seg, 5 * seg])
    assert (flow.retransmits, flow.timeouts, flow.probes) == (2, 0, 0)
    assert clean < t < clean + 3 * flow.min_rtt  # two more trips for the hole, far below MIN_RTO


def test_a_lost_tail_is_recovered_by_a_probe():
    """The last two of ten segments lost: no later segment brings SACKs, so 2 SRTT (0.2 ms, rounded up to one
    jiffy) + TLP_SLACK (two jiffies) after the last acknowledgement the probe resends the last segment; its SACK
    makes RACK mark the other lost, and it is resent: three jiffies plus a few round trips, no timeout. With a
    single segment out the probe waits as long as the timer would (Linux adds the peer's delayed-acknowledgement
    allowance, MIN_RTO) but is still a probe."""
    seg = mss(1500)
    flow, t = _one_flow(10 * seg, drop={8 * seg, 9 * seg})
    assert (flow.retransmits, flow.timeouts, flow.probes) == (2, 0, 1)
    assert 2 * flow.srtt < JIFFY and TLP_SLACK == 2 * JIFFY
    assert 3 * JIFFY < t < 3 * JIFFY + 6 * flow.srtt
    flow, t = _one_flow(10 * seg, drop={9 * seg})
    assert (flow.retransmits, flow.timeouts, flow.probes) == (1, 0, 1)
    assert MIN_RTO < t < MIN_RTO + 0.01


def test_the_timer_is_the_last_resort():
    """The tail and its probe both lost: the retransmission timer fires (at least MIN_RTO after the probe), the
    window falls to one segment and the unSACKed segments are resent."""
    seg = mss(1500)
    flow, t = _one_flow(10 * seg, drop=[8 * seg, 9 * seg, 9 * seg])
    assert flow.timeouts == 1 and flow.probes == 1
    assert TLP_SLACK + MIN_RTO < t < TLP_SLACK + MIN_RTO + 0.01


@pytest.mark.slow
@pytest.mark.parametrize("case", [
    dict(workers=4, elements=1_000_000, rate=10e9),
    dict(workers=2, elements=3_750_000, rate=100e6, delay=20e-6),  # the testbed's link-bound point
    dict(workers=16, elements=1_000_000, rate=10e9, mtu=9000),
])
def test_ring_against_the_flow_model(case):
    """Within 5% and above it: the packet-level ring also carries an acknowledgement (66 bytes) per segment on
    each link's other direction (no delayed acknowledgements), which the flow model leaves out (1500 MTU: +4.4%)."""
    r = simulate_tcp(TcpRun(algorithm="ring", rounds=2, **case))
    net = models.Net(case["workers"], case["rate"], case.get("delay", 1e-6), case.get("mtu", 1500), 20e-6)
    model = models.ring(net, case["elements"])
    assert model < r.times[-1] < 1.05 * model
    assert r.retransmissions == 0 and r.queue_drops == 0


def test_gloo_segments_as_gloo_cuts_the_tensor():
    """gloo/allreduce.cc: ceil(bytes / 1 MiB) segments, at least 2 per rank, rounded up to a multiple of n; each
    ceil(bytes / segments) rounded up to whole float32s. The testbed's 15 MB tensor: 15 -> 16 segments of 937,500
    bytes at n = 2 and 4; 4 MB at n = 4: 4 -> 8 (the minimum 2n) of 500,000; 50 bytes at n = 3: 6 of 12 (9 -> 12)."""
    assert gloo_segments(15_000_000, 2) == (16, 937_500)
    assert gloo_segments(15_000_000, 4) == (16, 937_500)
    assert gloo_segments(4_000_000, 4) == (8, 500_000)
    assert gloo_segments(50, 3) == (6, 12)


@pytest.mark.parametrize("workers", [2, 3, 4])
def test_gloo_ring_waits_for_ready_notices(workers):
    """A tiny tensor (2 segments of 8 bytes per rank) on 1 ms links: every pair of iterations costs a ready
    notice's one-way trip and then the data's, L = 2 x 1 ms + the switch's 1 us each (serialisation at 10 Gbit
    is 0.1 us), and a phase has n - 1 such pairs: 4 (n - 1) L in all, not the 2 (n - 1) L of one trip per step."""
    r = simulate_tcp(TcpRun(workers=workers, elements=4 * workers, rate=10e9, delay=1e-3, alpha=0.0, rounds=2))
    trip = 2 * 1e-3 + ASIC.latency
    for t in r.times:
        assert 4 * (workers - 1) * trip < t < 4 * (workers - 1) * (trip + 1e-6)


@pytest.mark.parametrize("workers, expected", [
    # n = 2: one connection; each rank sends 4 segments of 300,000 (2 per phase), each with a send notice and a
    # preamble, and 4 ready notices, all on its one flow: 2 x (4 x (300,000 + 2 x 48) + 4 x 48)
    (2, 2 * (4 * (300_000 + 2 * PREAMBLE) + 4 * PREAMBLE)),
    # n = 4: 8 segments of 150,000; 6 iterations a phase send and receive one each: per rank 12 x (150,000 + 96)
    # to r - 1 and 12 ready notices of 48 to r + 1
    (4, 4 * (12 * (150_000 + 2 * PREAMBLE) + 12 * PREAMBLE)),
])
def test_gloo_ring_bytes(workers, expected):
    r = simulate_tcp(TcpRun(workers=workers, elements=300_000, rate=1e9, delay=20e-6, rounds=1))
    assert r.app_bytes == expected


@pytest.mark.slow
def test_parameter_server_against_the_flow_model_without_incast():
    """Two colocated shards: each rank pushes half to the other and pulls it back, one flow each way per link."""
    run = TcpRun(algorithm="ps-colocated", workers=2, elements=3_750_000, rate=100e6, delay=20e-6, rounds=2)
    r = simulate_tcp(run)
    model = models.parameter_server(models.Net(2, 100e6, 20e-6, 1500, 20e-6), 3_750_000)
    assert model < r.times[-1] < 1.05 * model


@pytest.mark.slow
def test_ring_under_loss_is_deterministic_and_recovers():
    base = TcpRun(algorithm="ring", workers=4, elements=400_000, rate=1e9, delay=20e-6, loss=0.01, seed=3)
    a, b = simulate_tcp(base), simulate_tcp(base)
    c = simulate_tcp(dataclasses.replace(base, seed=4))
    clean = simulate_tcp(dataclasses.replace(base, loss=0.0))
    assert (a.times, a.retransmissions, a.lost) == (b.times, b.retransmissions, b.lost)
    assert a.times != c.times
    assert a.lost > 0 and a.retransmissions > 0  # (losses count acknowledgements too, which need no resend)
    assert a.times[0] > clean.times[0]


def test_tcp_run_refuses_bad_input():
    with pytest.raises(ValueError, match="algorithm"):
        TcpRun(algorithm="tree")
    with pytest.raises(ValueError, match="2 workers"):
        TcpRun(workers=1)
    assert TcpRun(algorithm="ps-dedicated", workers=8).servers == 2
    assert WIRE_OVERHEAD + 24 == 66  # a segment's len() adds the TCP header beyond what Link counts


def test_the_receiver_joins_held_data_across_moved_segment_boundaries():
    sim = Simulator()
    switch = Switch(sim, None, ASIC)
    a, b = TcpHost(sim, 1), TcpHost(sim, 2)
    for h in (a, b):
        h.uplink = Link(sim, switch, rate=1e9, delay=0.0)
        switch.attach(h.addr, Link(sim, h, rate=1e9, delay=0.0))
    flow = Network(sim, switch, [a, b], 1500).flow(0, 1)
    flow.on_data(1000, 500, 0.0, 0.0)  # held beyond a hole at 0
    flow.on_data(2000, 100, 0.0, 0.0)
    assert flow.rcv_nxt == 0
    flow.on_data(0, 1200, 0.0, 0.0)  # a resent segment ending inside the held one
    assert flow.rcv_nxt == 1500 and set(flow.ooo) == {2000}
    flow.on_data(1500, 500, 0.0, 0.0)
    assert flow.rcv_nxt == 2100 and not flow.ooo


def test_bbr_finds_the_bottleneck_and_keeps_its_window():
    """Loss-free at 100 Mbit: BBR leaves startup, its bandwidth estimate is the link's data rate (1448 data bytes
    in 1514 on the wire) within 10%, its TSO burst is 1/1024 s of its pacing rate (7 segments at 99% of it), and its window
    target 2 BDP + 3 bursts (+ 2 segments in ProbeBW's first phase), rounded up to even; the window never exceeds
    it in ProbeBW and the transfer runs near the link's rate."""
    seg = mss(1500)
    flow, t = _one_flow(600 * seg, rate=100e6, congestion="bbr")
    bbr = flow.cc
    assert bbr.mode == "probe_bw" and bbr.full
    data_rate = 100e6 / 8 * seg / (seg + 66)
    assert bbr.bw == pytest.approx(data_rate, rel=0.10)
    assert bbr.burst() == int(bbr.pacing_rate / 1024) // seg == 7
    bdp = -(-int(2 * bbr.bw * flow.min_rtt) // seg)
    assert bbr.target() == ((bdp + 21 + 1) // 2 * 2 + (2 if bbr.phase == 0 else 0)) * seg
    assert flow.cwnd <= bbr.target()
    assert t < 1.05 * 600 * (seg + 66) * 8 / 100e6


def test_a_loss_halves_renos_window_but_not_bbrs():
    """One segment lost in the middle of a long transfer: Reno leaves its recovery at half the flight; BBR keeps
    its flight through the recovery (packet conservation) and ends it with the window it had before."""
    seg = mss(1500)
    before = {}
    watch = [(1000 * seg, lambda f: before.setdefault("cwnd", f.cwnd))]
    for congestion in ("reno", "bbr"):
        before.clear()
        flow, _ = _one_flow(1400 * seg, drop={1100 * seg}, congestion=congestion, watch=watch)
        assert (flow.retransmits, flow.timeouts) == (1, 0)
        if congestion == "reno":
            assert flow.ssthresh < before["cwnd"]
        else:
            assert flow.cwnd >= before["cwnd"] and flow.ssthresh == float("inf")


@functools.cache
def _gloo_median(workers, elements, loss, congestion, seeds=(1, 2, 3)):
    """The median over seeds of one simulated ring allreduce on the testbed's links (both dates share points)."""
    times = [simulate_tcp(TcpRun(workers=workers, elements=elements, rate=100e6, delay=20e-6, loss=loss,
                                 congestion=congestion, seed=seed)).times[0] for seed in seeds]
    return sorted(times)[len(times) // 2]


@pytest.mark.slow
@pytest.mark.parametrize("name", ["cluster_loss1_2026-11-23.json", "cluster_loss5_2026-11-23.json",
                                  "cluster_loss1_2026-11-25.json", "cluster_loss5_2026-11-25.json"])
def test_gloo_under_loss_against_the_testbed(name):
    """The testbed's Gloo ring under loss (n = 2, 100 Mbit, MTU 1500), over the testbed kernel's congestion
    control, BBR (`sysctl net.ipv4.tcp_congestion_control` in the namespaces: bbr), with Gloo's rendezvous: the
    median of three seeds is faster than the testbed by 20-29%, never more than 35% (the remaining gap is not
    explained: the testbed has no timeouts there, yet loses a quarter of the link; see docs/benchmarks.md).
    With Reno the same point takes over 5x the measurement at 5% loss (the testbed with Reno set in its
    namespaces: 16.1, 17.4 and 22.1 s on 2026-11-25), as this model's Reno does: the cause of the former 12x
    error was the congestion control, not the loss granularity (nftables dropped 4.9-5.0% of TCP packets and
    the senders retransmitted 9.1-9.3% of their segments at 5%, as two lossy hops give)."""
    data = validate.load(str(DATA / name))
    row = next(r for r in data["rows"] if r["system"] == "gloo ring" and r["workers"] == 2)
    point = (row["workers"], row["elements"], row["loss"])
    error = _gloo_median(*point, "bbr") / row["median_s"] - 1
    assert -0.35 < error < 0
    if row["loss"] == 0.05:
        assert _gloo_median(*point, "reno", seeds=(1,)) > 5 * row["median_s"]
