"""The host and software-aggregator cost model, calibrated once from measurements on the 2-core build VM
(docs/benchmarks.md; docs/sim.md, "Calibration"), each constant with its source:

* a worker's CPU (encode, decode, a datagram each way, and a host codec's rates): ``worker.costs``, the table the
  tuner predicts from, with each figure's source (``bench codec``, ``bench burstio``, ``bench host-codecs``).
* the software aggregator, 0.66 us per cnat8 packet of 1024 codes in its kernel (``bench mac``, 658 ns; integer
  add 0.2 ns and re-encode 0.21 ns per input element from perf) plus the same 1.15 us of I/O per datagram in and
  per result out. The per-core benchmark (``testbed/bench_percore.py``) was not available when this was written.
* host-mode aggregators: ``HOST_AGGREGATORS_PER_WORKERS`` (one per 4 workers, as the simulator's dedicated
  parameter server, sim.models) of ``HOST_AGGREGATOR_CORES`` cores each (16: ASSUMED, a server's cores).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from intml.sim.network import SwitchCosts
from intml.worker.costs import HOST_CODEC_RATES, IO_PER_DATAGRAM, IO_PER_DATAGRAM_GSO, SWITCH_CPU, host_codec_seconds

KERNEL_FORWARD = 0.65e-6
TESTBED_CPUS = 2  # the VM the netns testbed ran on


@dataclass(frozen=True)
class HostCosts:
    """A worker's CPU: seconds per element encoded and decoded, per datagram sent and received."""

    encode: float = SWITCH_CPU["cnat8"][0]
    decode: float = SWITCH_CPU["cnat8"][1]
    io: float = IO_PER_DATAGRAM
    forward: float = 0.0  # per datagram sent: the kernel's forwarding in the netns testbed (KERNEL_FORWARD)

    def gso(self) -> HostCosts:
        return replace(self, io=IO_PER_DATAGRAM_GSO)


HOST_COSTS = {name: HostCosts(encode=encode, decode=decode) for name, (encode, decode) in SWITCH_CPU.items()}
RESULT_FLOAT32 = HOST_COSTS["int32"].decode  # a host codec's float32 RESULT: a byte swap per element
HOST_CODEC_COSTS = {family: HostCosts(*host_codec_seconds(family)) for family in HOST_CODEC_RATES}
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
