"""The host and software-aggregator cost model, calibrated once from measurements on the 2-core build VM
(docs/benchmarks.md; docs/sim.md, "Calibration"), each constant with its source:

* encode, 0.52 ns per element: ``intml-testbed bench codec`` stochastic encode, 1.94 G elements/s (and the perf
  profile of the 4 x 25M loopback allreduce: 13 ms for 25M elements at 0.52 ns). The memory-copy anchor of the same
  run, and of the host codecs' figures below, is ``bench codec``'s copy line.
* decode, 0.29 ns per element: ``bench codec`` decode, 3.40 G elements/s.
* int32 encode and decode, 0.35 and 0.25 ns per element: the int32 loopback allreduce moves 4x the bytes and
  took 0.234-0.243 s against cnat8's 0.114 s; its scaling is a multiply and a byte swap per element, cheaper than
  the C_nat random word (an estimate from that ratio, not a separate benchmark).
* I/O, 1.15 us per datagram each way: ``intml-testbed bench burstio``, sendmmsg/recvmmsg at 0.87 M datagrams/s of
  1050 bytes (GSO + GRO reach 5.17 M/s, 0.19 us: ``HostCosts.gso()``).
* the software aggregator, 0.66 us per cnat8 packet of 1024 codes in its kernel (``bench mac``, 658 ns; integer
  add 0.2 ns and re-encode 0.21 ns per input element from perf) plus the same 1.15 us of I/O per datagram in and
  per result out. The per-core benchmark (``testbed/bench_percore.py``) was not available when this was written.
* host codecs (``HOST_CODEC_COSTS``, one row per family): encode and decode seconds per element from ``intml-testbed
  bench host-codecs`` (docs/codecs.md, "Measured size and error": 2**20 N(0, 1) elements in 16384-element
  packages, one core, 2026-11-27 03:50 UTC, load average 4 to 5), the family's representative row as named. These
  are the numpy kernels of that date; compiled kernels change them, and so the comparison's host-mode times.
* a host codec's float32 RESULT, decoded at the worker: a byte swap per element, int32's 0.25 ns (above);
  encoded at the aggregator: the same.
* host-mode aggregators: ``HOST_AGGREGATORS_PER_WORKERS`` (one per 4 workers, as the simulator's dedicated
  parameter server, sim.models) of ``HOST_AGGREGATOR_CORES`` cores each (16: ASSUMED, a server's cores).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from intml.sim.network import SwitchCosts

IO_PER_DATAGRAM = 1.15e-6
IO_PER_DATAGRAM_GSO = 0.19e-6
KERNEL_FORWARD = 0.65e-6
TESTBED_CPUS = 2  # the VM the netns testbed ran on


@dataclass(frozen=True)
class HostCosts:
    """A worker's CPU: seconds per element encoded and decoded, per datagram sent and received."""

    encode: float = 0.52e-9
    decode: float = 0.29e-9
    io: float = IO_PER_DATAGRAM
    forward: float = 0.0  # per datagram sent: the kernel's forwarding in the netns testbed (KERNEL_FORWARD)

    def gso(self) -> HostCosts:
        return replace(self, io=IO_PER_DATAGRAM_GSO)


HOST_COSTS = {"cnat8": HostCosts(), "int32": HostCosts(encode=0.35e-9, decode=0.25e-9)}
RESULT_FLOAT32 = HOST_COSTS["int32"].decode  # a host codec's float32 RESULT: a byte swap per element


def _rates(encode_m_per_s: float, decode_m_per_s: float) -> HostCosts:
    return HostCosts(encode=1e-6 / encode_m_per_s, decode=1e-6 / decode_m_per_s)


# family: bench host-codecs' encode and decode M elements/s of the row named in the comment (docs/codecs.md)
HOST_CODEC_COSTS = {
    "uniform": _rates(33.8, 19.8),  # uniform8
    "adaptive": _rates(16.6, 9.4),  # adaptive
    "adaptive-huffman": _rates(7.7, 8.8),  # adaptive-huffman
    "lloyd": _rates(1.5, 10.0),  # lloyd3
    "bitmask": _rates(11.8, 7.2),  # bitmask (16)
    "qsgd": _rates(4.0, 7.7),  # qsgd127
    "terngrad": _rates(12.5, 11.4),
    "signsgd": _rates(421.4, 43.9),
    "topk": _rates(4.1, 237.6),  # topk0.01
    "randomk": _rates(331.5, 410.7),  # randomk0.01
    "powersgd": _rates(1459.0, 855.2),  # powersgd4's factor package alone, not its matrix products
}
HOST_AGGREGATORS_PER_WORKERS = 4
HOST_AGGREGATOR_CORES = 16


def host_codec_costs(name: str) -> HostCosts:
    """The costs of host codec ``name``: its family's row (the longest family name it starts with)."""
    for family in sorted(HOST_CODEC_COSTS, key=len, reverse=True):
        if name.startswith(family):
            return HOST_CODEC_COSTS[family]
    raise ValueError(f"no host costs for codec {name!r}: sim.costs has {', '.join(HOST_CODEC_COSTS)}")
FREE_HOST = HostCosts(encode=0.0, decode=0.0, io=0.0)

# The software aggregator of the netns testbed (one core): kernel work per packet and per element, plus I/O.
SOFTWARE_AGGREGATOR = SwitchCosts(latency=5e-6, per_packet=IO_PER_DATAGRAM, per_element=0.41e-9, pipeline=False)
# A switch ASIC (Tofino class): line rate, a fixed pipeline latency.
ASIC = SwitchCosts(latency=1e-6)
ASIC_PIPELINE_PPS = 1.2e9  # packets per second one pipeline starts (a Tofino pipe, order of magnitude; assumed)


def asic(passes: int = 1, pipeline_pps: float = ASIC_PIPELINE_PPS) -> SwitchCosts:
    """A switch ASIC whose aggregation takes ``passes`` passes through a pipeline of ``pipeline_pps`` packets per
    second (a P4 program too large for one pass recirculates, per the P4 resource account): each aggregated packet
    occupies the pipeline ``passes`` / pps seconds, and waits ``passes`` pipeline latencies."""
    if passes < 1 or pipeline_pps <= 0:
        raise ValueError(f"need passes >= 1 and a positive pipeline rate, got {passes}, {pipeline_pps}")
    return SwitchCosts(latency=ASIC.latency * passes, per_packet=passes / pipeline_pps)
