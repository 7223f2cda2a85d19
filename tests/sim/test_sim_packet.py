"""The packet-level engine drives the real cores: its allreduces are bit-identical to protocol.reference, under
loss too, and a scenario with a seed gives the same output every time."""

from __future__ import annotations

import dataclasses

import pytest

from intml.sim.packet_level import PacketRun, simulate


@pytest.mark.parametrize("codec", ["cnat8", "int32"])
@pytest.mark.parametrize("loss", [0.0, 0.05])
def test_results_are_bit_identical_to_the_reference(codec, loss):
    run = PacketRun(workers=4, elements=6000, codec=codec, packet_elements=256, pool=8, rate=1e9, loss=loss,
                    rounds=2, check=True, seed=3, switch="software")
    r = simulate(run)
    assert r.exact
    if loss:
        assert r.lost > 0 and r.retransmissions > 0


@pytest.mark.parametrize("codec", ["cnat8", "int32"])
@pytest.mark.parametrize("where", [{}, {"engine": "p4model", "passes": 1}, {"racks": 2}])
def test_non_finite_inputs_pass_through_under_loss(codec, where):
    """NaN, +Inf and -Inf at seeded positions of every rank's input, with 5% loss, through the kernel, the P4
    pipeline model and a leaf-spine: every rank's result is the reference's, bit for bit (non-finite lanes
    included), and the ranks count what they sent."""
    run = PacketRun(workers=4, elements=3000, codec=codec, packet_elements=128, pool=4, rate=1e9, loss=0.05,
                    rounds=2, check=True, seed=6, nonfinite=40, **where)
    r = simulate(run)
    assert r.exact and r.lost > 0
    assert r.counters["nonfinite_elements"] == 4 * 40 * 2  # two rounds of the same inputs


@pytest.mark.parametrize("racks", [1, 2])
def test_nearest_rounding_under_loss(racks):
    """rounding "nearest" through the kernel and a leaf-spine (whose spine re-encodes), with loss: the
    reference's deterministic result, bit for bit, with non-finite values too."""
    run = PacketRun(workers=4, elements=3000, codec="cnat8", packet_elements=128, pool=4, rate=1e9, loss=0.05,
                    rounds=2, check=True, seed=8, rounding="nearest", nonfinite=5, racks=racks)
    r = simulate(run)
    assert r.exact and r.lost > 0


@pytest.mark.parametrize("codec", ["cnat8", "int32"])
def test_the_p4_pipeline_model_as_the_switch(codec):
    """engine="p4model": the P4 pipeline model is the switch's data path. Under loss its allreduces equal the
    reference bit for bit, and with the same passes they take exactly the kernel's virtual time (the same
    datagrams at the same instants); by default the ASIC takes the P4 program's passes for the packet size."""
    run = PacketRun(workers=3, elements=3000, codec=codec, packet_elements=128, pool=4, rate=1e9, loss=0.05,
                    rounds=2, check=True, seed=4, passes=1)
    model, kernel = simulate(dataclasses.replace(run, engine="p4model")), simulate(run)
    assert model.exact and model.lost > 0
    assert (model.times, model.retransmissions, model.counters) == (kernel.times, kernel.retransmissions,
                                                                    kernel.counters)
    assert PacketRun(engine="p4model", packet_elements=256).passes == 4
    assert PacketRun(engine="p4model").packet_elements == 1024  # the parser's limit, though MTU 1500 allows more
    with pytest.raises(ValueError, match="engine"):
        PacketRun(engine="bmv2")


def test_same_scenario_same_output_and_seed_matters():
    run = PacketRun(workers=3, elements=20_000, packet_elements=512, pool=4, rate=1e9, loss=0.02, rounds=2, seed=5)
    a, b = simulate(run), simulate(run)
    c = simulate(dataclasses.replace(run, seed=6))
    fields = lambda r: (r.times, r.retransmissions, r.lost, r.events, r.packet_events, r.counters)  # noqa: E731
    assert fields(a) == fields(b)
    assert fields(a) != fields(c)


def test_hosts_cpu_and_software_switch_slow_it_down():
    base = PacketRun(workers=4, elements=100_000, rate=10e9, host_costs=False, inputs="shared")
    free = simulate(base).times[0]
    busy = simulate(dataclasses.replace(base, host_costs=True, switch="software")).times[0]
    assert busy > 1.5 * free


@pytest.mark.slow
def test_recirculation_passes_make_the_pipeline_the_bottleneck():
    from intml.sim.costs import ASIC_PIPELINE_PPS, asic
    assert asic(3).per_packet == 3 / ASIC_PIPELINE_PPS and asic(3).latency == 3e-6
    # a pool of 256 covers the round trip even through 16 passes (16 us of pipeline latency)
    base = PacketRun(workers=16, elements=2_000_000, rate=100e9, pool=256, host_costs=False, inputs="shared")
    one = simulate(base).times[0]
    # 16 passes: a chunk's 16 packets hold the pipeline 16 x 16 / pps = 213 ns, more than a packet's 121 ns on a
    # 100 Gbit link, so the pipeline sets the pace: 213 ns for each chunk and each slot's empty bootstrap packet,
    # plus a round trip with its 16 us of pipeline latency
    many = simulate(dataclasses.replace(base, passes=16)).times[0]
    chunks = -(-2_000_000 // base.packet_elements)
    assert many == pytest.approx((chunks + 256) * 16 * 16 / ASIC_PIPELINE_PPS + 18e-6, rel=0.02)
    assert one == pytest.approx(chunks * 1514 * 8 / 100e9, rel=0.1)  # link-bound with one pass


def test_a_shared_machine():
    """cpus: every rank and the software aggregator on one machine. With a CPU for each and no forwarding cost it
    is the model of own CPUs, to the bit; with one CPU the same work takes longer, and forwarding adds to it."""
    base = PacketRun(workers=4, elements=200_000, rate=10e9, switch="software", rounds=2, seed=2)
    own = simulate(base)
    plenty = simulate(dataclasses.replace(base, cpus=5, forward_cost=0.0))
    assert plenty.times == own.times and plenty.counters == own.counters
    one = simulate(dataclasses.replace(base, cpus=1, forward_cost=0.0))
    assert one.times[0] > 1.5 * own.times[0]
    forwarding = simulate(dataclasses.replace(base, cpus=1, forward_cost=1e-6))
    assert forwarding.times[0] > one.times[0]
    # every data and result copy sent was charged once (results are multicast: the switch pays a copy per port)
    data = forwarding.counters["packets_out"] + forwarding.counters["results"]
    extra = sum(forwarding.cpu_seconds.values()) - sum(one.cpu_seconds.values())
    assert extra == pytest.approx(data * 1e-6, rel=0.02)
    # what one CPU must do bounds the time from below
    work = sum(one.cpu_seconds.values())
    assert sum(one.times) >= work * 0.9
