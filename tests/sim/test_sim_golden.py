"""A golden check of the packet-level engine: scenarios' full output (every allreduce's virtual time to the last bit,
retransmissions, losses, queue drops, packet events, the engines' counters, and exactness against
protocol.reference) equals what the engine gave before its hot path was batched (``sim/data/
golden_packet_level.json``, recorded at commit cb9f91d: per-datagram ``Link.send``, ``Simulator.deliver`` and
``Burst.datagrams()``), re-recorded when the worker's retransmission timer changed (the RTO counts an aggregator
core's silence, a silent core is probed one slot at a time; only the lossy scenarios moved, and the
``spurious_retransmissions`` counter was added; later the ``nonfinite_elements`` and ``drop_unsent`` counters, 0
throughout; and once more when the worker session gained its keepalive timer: an extra timer event reorders float
additions at equal instants, moving two lossy scenarios' times by at most 5.4e-16 relative, every other field
unchanged; and when the JOIN grew by its 4-byte codec parameter, which shifts every later instant by nanoseconds
and so the rounding of the times' differences, by at most 5.6e-16 relative, every other field unchanged; and the
``congestion_marks`` counter, 0 throughout: no scenario marks; and when a silent core's probes came to take turns
over its slots, and overtaken slots' round trips stopped being sampled: only ``cnat8_loss_software``'s second
allreduce (252 ms, a timeout of 200 ms, to 52 ms) and ``p4model_loss``'s (by 3.5 us) moved, still exact); and when the
aggregator came to answer a duplicate of an incomplete round with a PENDING, which the ranks take (the ``pendings``
counter): the PENDINGs ride the lossy links, so the random losses fall on other datagrams, and the three lossy
scenarios moved by timeouts of 50 ms either way (docs/window.md, "4 workers"), still exact; and when a silent core's
first probe after a result came 2 SRTT into the silence (a tail loss probe): the lossy scenarios lost timeouts of
50-100 ms and ``cnat8_queue_drops`` took 3 us more, still exact (docs/window.md, "The first probe"); and when that
probe came to wait SRTT + 4 RTTVAR where longer: ``cnat8_loss_software``'s second allreduce took 0.15 ms more and
``int32_unicast_loss``'s two 26-29 us more, still exact; and when a slot answered by a PENDING got a tail probe of
its own: ``p4model_loss``'s second allreduce took 26 us less and ``int32_unicast_loss`` resent 2 datagrams more, at
the same times, still exact (docs/window.md, "A tail loss after a PENDING"); and when a silence got a second tail
probe before the RTO: ``int32_unicast_loss``'s second allreduce lost its 100 ms stall (101.7 to 1.82 ms, 4 resends
fewer), still exact (docs/window.md, "A second tail probe"). A change to the
engine that moves any virtual instant fails here."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from intml.sim.packet_level import PacketRun, simulate

pytestmark = pytest.mark.slow

GOLDEN = json.loads((Path(__file__).resolve().parents[2] / "sim" / "data" / "golden_packet_level.json")
                    .read_text())


@pytest.mark.parametrize("name", sorted(GOLDEN))
def test_same_output_as_recorded(name):
    want = GOLDEN[name]
    r = simulate(PacketRun(**want["run"]))
    got = dict(run=want["run"], times=[repr(t) for t in r.times], retransmissions=r.retransmissions, lost=r.lost,
               queue_drops=r.queue_drops, packet_events=r.packet_events, counters=r.counters, exact=r.exact)
    assert got == want
    assert r.exact
