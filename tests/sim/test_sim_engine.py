"""intml-sim's event loop and links: ordering, same-instant bursts, serialisation, queues, seeded loss."""

from __future__ import annotations

import numpy as np
import pytest

from intml.protocol.burst import Burst
from intml.sim.engine import Simulator
from intml.sim.network import WIRE_OVERHEAD, Copier, Link, Processor, Receiver


class Sink:
    def __init__(self) -> None:
        self.got: list[tuple[float, list]] = []

    def arrive(self, datagrams, now):
        self.got.append((now, [d[0] for d in datagrams]))


def test_events_run_in_time_then_schedule_order():
    sim, seen = Simulator(), []
    for t, tag in [(2.0, "c"), (1.0, "a"), (2.0, "d"), (1.0, "b"), (0.5, "first")]:
        sim.at(t, seen.append, tag)
    sim.run()
    assert seen == ["first", "a", "b", "c", "d"]
    assert sim.now == 2.0
    with pytest.raises(ValueError):
        sim.at(1.0, seen.append, "past")


def test_run_stops_at_until_and_on_stop():
    sim, seen = Simulator(), []
    for t in range(10):
        sim.at(float(t), seen.append, t)
    sim.run(until=3.5)
    assert seen == [0, 1, 2, 3]
    sim.run(stop=lambda: len(seen) >= 6)
    assert seen == [0, 1, 2, 3, 4, 5]


def test_same_instant_arrivals_are_one_burst_per_node_in_order():
    sim, a, b = Simulator(), Sink(), Sink()
    sim.deliver(1.0, a, (b"1", 0, 0))
    sim.deliver(1.0, b, (b"x", 0, 0))
    sim.deliver(1.0, a, (b"2", 0, 0))
    sim.deliver(2.0, a, (b"3", 0, 0))
    sim.run()
    assert a.got == [(1.0, [b"1", b"2"]), (2.0, [b"3"])]
    assert b.got == [(1.0, [b"x"])]
    assert sim.packet_events == 4


def test_link_serialises_queues_and_delays():
    sim, sink = Simulator(), Sink()
    link = Link(sim, sink, rate=8e6, delay=0.5, queue_bytes=3 * (1000 + WIRE_OVERHEAD))  # 1 byte per us
    for i in range(4):
        link.send((bytes([i]) * 1000, 0, 0), 0.0)
    sim.run()
    wire = (1000 + WIRE_OVERHEAD) * 1e-6
    assert [t for t, _ in sink.got] == pytest.approx([wire + 0.5, 2 * wire + 0.5, 3 * wire + 0.5])
    assert link.stats.queue_drops == 1  # the fourth found three datagrams queued
    assert link.sent == 3 and link.bytes == 3 * (1000 + WIRE_OVERHEAD)
    link.send((bytes(1500), 0, 0), sim.now)  # 1500 + 28 > MTU 1500
    assert link.stats.too_big == 1


def test_ecn_marks_above_the_threshold():
    sim, sink = Simulator(), Sink()
    link = Link(sim, sink, rate=8e6, delay=0.0, ecn_bytes=1500)
    for _ in range(4):
        link.send((bytes(1000), 0, 0), 0.0)
    assert link.stats.ecn_marked == 2  # the third and fourth found more than 1500 bytes queued


def _losses(seed):
    sim, sink = Simulator(), Sink()
    link = Link(sim, sink, rate=1e9, delay=0.0, loss=0.3, seed=seed)
    for i in range(200):
        link.send((i.to_bytes(2, "big"), 0, 0), i * 1e-3)
    sim.run()
    return [d for _, ds in sink.got for d in ds]


def test_loss_is_seeded():
    a, b, c = _losses(1), _losses(1), _losses(2)
    assert a == b and a != c
    assert 100 < len(a) < 180  # about 70% of 200 survive


@pytest.mark.parametrize("merge, expected", [
    (True, [(0.0, ["a"]), (1.0, ["b", "c"]), (2.0, ["d"])]),  # a CPU: all that waited, in one burst
    (False, [(0.0, ["a"]), (1.0, ["b"]), (2.0, ["c"]), (3.0, ["d"])]),  # a pipeline: an arrival instant at a time
])
def test_processor_takes_what_arrived_while_busy(merge, expected):
    sim, bursts = Simulator(), []

    def handle(items, now):
        bursts.append((now, list(items)))
        return 1.0, lambda done: None
    cpu = Processor(sim, handle, merge=merge)
    cpu.submit(["a"], 0.0)
    for t, x in [(0.2, "b"), (0.5, "c"), (1.5, "d")]:
        sim.at(t, cpu.submit, [x], t)
    sim.run()
    assert bursts == expected
    assert cpu.busy == len(expected)


def test_switch_takes_any_aggregator_and_multicasts():
    """The engine alone (sim.bench): a counting aggregator behind the same Switch interface the real cores use."""
    from intml.sim import bench
    got = bench.engine_alone(workers=4, window=4, rounds=10, rate=1e9)
    assert got["packet_events"] == 2 * 4 * 4 * 10  # every packet up, and every result down to each of 4 hosts
    # link-bound (a round trip of one packet, 27 us, is shorter than a window's 4 x 12.1 us): each uplink sends its
    # 40 packets (1472 + 42 bytes) back to back, then the last one's result takes a link delay, the pipeline, its
    # serialisation down and a link delay
    packet = 1514 * 8 / 1e9
    assert got["virtual_s"] == pytest.approx(40 * packet + 1e-6 + 1e-6 + packet + 1e-6)


def _fan(batched: bool):
    """Three rounds of a datagram to four equally-configured links, with a queue, ECN and loss; one link made
    busier in the middle round (the fan-out's general path)."""
    from intml.sim.network import fan_out
    sim, sinks = Simulator(), [Sink() for _ in range(4)]
    links = [Link(sim, s, rate=8e6, delay=0.1, queue_bytes=2500, ecn_bytes=500, loss=0.3, seed=i)
             for i, s in enumerate(sinks)]
    for t, extra in [(0.0, False), (0.0005, True), (0.0007, False), (0.0009, False)]:
        if extra:
            links[2].send((bytes(100), 0, 0), t)
        if batched:
            fan_out(sim, links, (bytes(1000), 0, 0), t)
        else:
            for link in links:
                link.send((bytes(1000), 0, 0), t)
    sim.run()
    return [s.got for s in sinks], [(link.stats, link.sent, link.bytes, link.busy_until) for link in links]


def test_fan_out_is_a_send_on_each_link():
    assert _fan(True) == _fan(False)
    stats = _fan(True)[1]
    assert sum(s.queue_drops for s, *_ in stats) > 0 and sum(s.ecn_marked for s, *_ in stats) > 0
    assert sum(s.lost for s, *_ in stats) > 0


def test_a_machine_shares_its_cpus_among_processors():
    from intml.sim.network import Machine
    for cpus, done in [(1, [1.0, 2.0, 3.0]), (2, [1.0, 1.0, 2.0]), (3, [1.0, 1.0, 1.0])]:
        sim, finished = Simulator(), []
        machine = Machine(cpus)

        def handle(items, now):
            return 1.0, finished.append
        for _ in range(3):  # three processors, each given one burst of 1 s at time 0
            Processor(sim, handle, machine=machine).submit(["x"], 0.0)
        sim.run()
        assert sorted(finished) == done and machine.busy == 3.0


def test_a_multicast_then_more_datagrams_at_the_same_instant():
    """deliver_all shares one burst among its nodes until another datagram reaches one of them at that instant;
    each node still gets its own datagrams in the order delivered, and a node listed twice gets one twice."""
    sim, a, b, c = Simulator(), Sink(), Sink(), Sink()
    sim.deliver_all(1.0, [a, b], (b"m", 0, 0))
    sim.deliver(1.0, b, (b"u", 0, 0))
    sim.deliver_all(1.0, [c, b], (b"n", 0, 0))
    sim.deliver_all(2.0, [a, a, c], (b"t", 0, 0))
    sim.deliver_all(3.0, [], (b"z", 0, 0))
    sim.run()
    assert a.got == [(1.0, [b"m"]), (2.0, [b"t", b"t"])]
    assert b.got == [(1.0, [b"m", b"u", b"n"])]
    assert c.got == [(1.0, [b"n"]), (2.0, [b"t"])]
    assert sim.packet_events == 8


def _datagrams(rng, sizes):
    return [(rng.integers(0, 256, size, dtype=np.uint8).tobytes(), int(rng.integers(1, 1 << 48)), 7)
            for size in sizes]


@pytest.mark.parametrize("sizes", [[300] * 5, [300, 120, 300, 0, 64], [2000, 300]])
def test_receiver_fills_as_burst_fill_does(sizes):
    """Receiver.fill against Burst.fill (the slow, obvious reference): the same rows, lengths (a datagram longer
    than the row truncated: -1) and addresses, whether the datagrams have one length or several."""
    rng = np.random.default_rng(len(sizes) + sum(sizes))
    datagrams = _datagrams(rng, sizes)
    got = Receiver(1500).fill(datagrams)
    want = Burst.rows_of(8, 1500)
    want.fill([(p, a) for p, a, _ in datagrams])
    assert got.count == want.count == len(sizes)
    assert got.length[:got.count].tolist() == want.length[:want.count].tolist()
    assert got.addr[:got.count].tolist() == want.addr[:want.count].tolist()
    for i, size in enumerate(want.length[:want.count].tolist()):
        size = max(size, 0) or min(sizes[i], 1500)
        assert got.data[i, :size].tobytes() == want.data[i, :size].tobytes()


def test_a_shared_receiver_copies_an_equal_burst_once():
    rng = np.random.default_rng(5)
    x, y = _datagrams(rng, [200] * 3), _datagrams(rng, [200] * 4)
    shared, alone = Receiver(1500, shared=True), Receiver(1500)
    first = shared.fill(tuple(x))
    assert shared.fill(list(x)) is first  # the next rank's equal burst: not copied again
    for burst in (y, x, x[:2], [(bytes(p), a, d) for p, a, d in x]):  # other bursts, then x again by content
        got, want = shared.fill(burst), alone.fill(burst)
        k = want.count
        assert got.count == k and got.addr[:k].tolist() == want.addr[:k].tolist()
        assert got.data[:k, :200].tobytes() == want.data[:k, :200].tobytes()


def test_copier_takes_a_bursts_datagrams_as_burst_datagrams_does():
    memory = np.arange(4 * 2 * 100, dtype=np.uint32).view(np.uint8).reshape(4, 2, 400)
    burst = Burst(memory, 8)
    rows = [(3, 1, 400), (0, 0, 17), (2, 1, 0), (1, 0, 399)]
    for i, (s, p, size) in enumerate(rows):
        burst.ptr[i] = memory[s, p].ctypes.data
        burst.length[i] = size
        burst.addr[i] = 1000 + i
    burst.count = len(rows)
    copy = Copier()
    assert copy(burst, 9) == [(d, 9, a) for d, a in burst.datagrams()]
    burst.count = 0
    assert copy(burst, 9) == []
    burst.count, burst.length[0] = 1, 401  # one byte past the block
    with pytest.raises(ValueError, match="outside"):
        copy(burst, 9)


def test_bench_reports_both_rates_and_their_ratio():
    from intml.sim import bench
    rows = bench.table(workers=4, elements=20_000)
    assert [r["what"] for r in rows] == ["engine alone", "real cores, 4 x 20000 cnat8"]
    for r in rows:
        assert r["events_per_cpu_s"] == pytest.approx(r["packet_events"] / r["loop_cpu_s"])
        assert r["of_engine"] == pytest.approx(r["events_per_cpu_s"] / rows[0]["events_per_cpu_s"])
    chunks = -(-20_000 // 1472)  # 14, and as many bootstrap packets (the window); each up and its result down,
    # and per rank the JOIN, its challenge, the answered JOIN and the JOIN_ACK
    assert rows[1]["packet_events"] == 4 * (2 * (chunks + chunks) + 4)
