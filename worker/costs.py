"""The CPU costs of a rank that the tuner predicts allreduce times from (worker.tuner.Costs): one table for the DDP
hook's tuner (worker.torch.auto) and the simulator (sim.costs builds its HostCosts on it, sim.tuning its tuner).
Each constant with its source, all on the shared 2-core build VM:

* cnat8 encode 0.52 and decode 0.29 ns per element: ``intml-testbed bench codec``, stochastic encode 1.94 G
  elements/s and decode 3.40 G/s (docs/benchmarks.md).
* int32 encode and decode, 0.35 and 0.25 ns per element: the int32 loopback allreduce moves 4x the bytes and
  took 0.234-0.243 s against cnat8's 0.114 s; its scaling is a multiply and a byte swap per element, cheaper than
  the C_nat random word (an estimate from that ratio, not a separate benchmark).
* a host codec's float32 RESULT, decoded at the worker: a byte swap per element, int32's decode.
* I/O, 1.15 us per datagram each way: ``intml-testbed bench burstio``, sendmmsg/recvmmsg at 0.87 M datagrams/s of
  1050 bytes; with GSO and GRO 5.17 M/s, 0.19 us.
* the host codecs (``HOST_CODEC_RATES``, one row per family: its slowest measured codec, so that a prediction never
  flatters a member): ``intml-testbed bench host-codecs --repeats 5`` with the compiled (Numba) kernels, 2**20
  N(0, 1) elements in 16384-element packages, one thread, 2026-11-27 09:30 UTC, load average 3.4; the same run's
  ``bench codec --elements 8388608 --repeats 5`` ran its memory copy (anchor) at 1.42 G elements/s and the
  stochastic encode at 1.08 G/s (docs/tuner.md, "Costs").
* host mode at the software aggregator, 0.32 ms per package of one rank beyond the codec's decode (its Python
  path: handle, combine, encode and send the result): ``intml-testbed bench host-codecs --codec uniform4 uniform8
  --allreduce --workers 4 --elements 262144``, 2026-11-27 09:51 UTC, load average 4-6: uniform4's allreduce took
  41.0 ms for 4 x 33 packages of 8056 elements (uniform8's 19.1 ms, cnat8's through the kernel 5.2 ms); the
  slower codec's figure, so that host mode is never flattered.
* the tuner's own measuring, 7.8 ns per element: ``worker.tuner.measure`` of 2**22 N(0, 1) float32 (no residual;
  9.5 ns with one), median of 5, one thread, 2026-11-27 09:33 UTC, load average 2.4 (docs/tuner.md, "Costs").

And the network's two models (alpha-beta, on one link of ``rate`` bit/s per rank to one switch and a round trip
``rtt`` between them), the one copy that the DDP hook's tuner and the simulator (sim.models, sim.training) price
with; all sizes count the bytes on the wire, headers included:

* Gloo's ring (``ring_seconds``): 2(n-1) steps, each sending a 1/n segment over TCP: 2(n-1)·(alpha + rtt/2) +
  2(n-1)/n · S·(1 + h_tcp)/B, with S = 4N, h_tcp the TCP/IP/Ethernet header share of an MSS and alpha a step's
  software latency. A flow-level model (TCP at line rate once its window opens), validated against the testbed
  (``sim.validate``).
* in-network (intml cnat8, SwitchML int32; ``in_network_seconds``): each rank sends and receives S_c = N·w bytes
  (w = 1 or 4) in packets of P payload and H header bytes: S_c·(P+H)/P / B, as long as the pool covers the
  bandwidth-delay product (pool·(P+H) >= B·RTT, RTT counting a packet's serialisation each way); with a smaller
  pool, the rate is pool·(P+H)/RTT instead. The first round of each slot carries no elements (the exponent
  bootstrap), and the last packet's round trip ends it.
"""

from __future__ import annotations

import math

from intml.protocol.codecs.host.adaptive import Adaptive, AdaptiveHuffman
from intml.protocol.codecs.host.bitmask import Bitmask
from intml.protocol.codecs.host.lloyd import Lloyd
from intml.protocol.codecs.host.qsgd import QSGD
from intml.protocol.codecs.host.randomk import RandomK
from intml.protocol.codecs.host.terngrad import TernGrad
from intml.protocol.codecs.host.topk import TopK
from intml.protocol.codecs.host.uniform import Uniform
from intml.protocol.packet import HDR
from intml.worker.tuner import Costs, Network

SWITCH_CPU = {"cnat8": (0.52e-9, 0.29e-9), "int32": (0.35e-9, 0.25e-9)}  # seconds per element: encode, decode
RESULT_FLOAT32 = SWITCH_CPU["int32"][1]
IO_PER_DATAGRAM = 1.15e-6
IO_PER_DATAGRAM_GSO = 0.19e-6
WIRE_OVERHEAD = 42  # IPv4 20 + UDP 8 + Ethernet 14 bytes per datagram
IP_UDP = 28  # the part of the overhead the MTU counts
MEASURE = 7.8e-9  # seconds per element of measure(), at each measured step
HOST_PACKAGE = 0.32e-3  # seconds per package of one rank at the software aggregator in host mode
TCP_IP = 52  # IPv4 20 + TCP 20 + timestamps 12 bytes per segment
ETHERNET = WIRE_OVERHEAD - IP_UDP
RING_STEP_LATENCY = 20e-6  # alpha: a ring step's TCP send and receive through the kernel and Gloo (assumed)
MIN_POOL = 64  # slots the tuner's in-network model assumes at least when told none (Network.pool)

# family: encode and decode M elements/s of the codec named in the comment (bench host-codecs, 2026-11-27 09:30 UTC)
HOST_CODEC_RATES = {
    "uniform": (187.3, 247.1),  # uniform4 (uniform8: 434.3, 413.4)
    "adaptive": (96.3, 238.8),
    "adaptive-huffman": (26.0, 52.9),
    "lloyd": (3.4, 148.0),  # lloyd3
    "bitmask": (781.4, 479.5),  # bitmask (16)
    "qsgd": (15.4, 86.9),  # qsgd4 (qsgd127: 15.7, 87.4)
    "terngrad": (63.1, 171.3),
    "signsgd": (416.7, 84.6),
    "topk": (300.3, 833.4),  # topk0.01
    "randomk": (557.4, 648.4),  # randomk0.01
    "powersgd": (1920.9, 1157.8),  # powersgd4's factor package alone, not its matrix products
}
# The tuner's host-codec candidates by class, each costed by its family's row.
TUNED_FAMILIES: dict[type, str] = {Uniform: "uniform", Adaptive: "adaptive", AdaptiveHuffman: "adaptive-huffman",
                                   Lloyd: "lloyd", Bitmask: "bitmask", QSGD: "qsgd", TernGrad: "terngrad",
                                   TopK: "topk", RandomK: "randomk"}


def host_codec_seconds(family: str) -> tuple[float, float]:
    """Seconds per element to encode and to decode with the host codec ``family``."""
    encode, decode = HOST_CODEC_RATES[family]
    return 1e-6 / encode, 1e-6 / decode


def segment_overhead(mtu: int) -> float:
    """Wire bytes per payload byte of a full TCP segment under ``mtu``."""
    mss = mtu - TCP_IP
    return (mss + TCP_IP + ETHERNET) / mss


def ring_seconds(world: int, rate: float, elements: int, rtt: float, mtu: int, *, element_size: int = 4,
                 alpha: float = RING_STEP_LATENCY) -> float:
    """Gloo's ring allreduce (reduce-scatter, then allgather) of ``elements`` on ``world`` ranks: a step's
    latency ``alpha`` and half a round trip per step, and each rank's ring bytes in TCP segments under ``mtu``."""
    if world == 1:
        return 0.0
    s = element_size * elements * segment_overhead(mtu)
    return 2 * (world - 1) * (alpha + rtt / 2) + 2 * (world - 1) / world * s * 8 / rate


def in_network_seconds(rate: float, rtt: float, elements: int, packet_elements: int, pool: int,
                       element_size: int = 1) -> float:
    """The in-network allreduce's network (the module's docstring): the packets at the link's rate, or at the
    pool's window per round trip if slower, the slots' empty first packets, and the last round trip."""
    chunks = math.ceil(elements / packet_elements)
    wire_packet = packet_elements * element_size + HDR + WIRE_OVERHEAD
    window = min(pool, chunks)
    bootstrap = HDR + WIRE_OVERHEAD  # an empty packet per slot first
    serial = wire_packet * 8 / rate
    round_trip = rtt + 2 * serial  # a round trip includes sending the packet and receiving its result
    rate_held = min(rate, window * wire_packet * 8 / round_trip)
    return chunks * wire_packet * 8 / rate_held + window * bootstrap * 8 / rate + rtt + 2 * serial


def covering_pool(rate: float, rtt: float, packet_elements: int, element_size: int = 1) -> int:
    """The smallest pool that covers the bandwidth-delay product (SwitchML's rule), a packet's serialisation each
    way in the round trip."""
    wire_packet = packet_elements * element_size + HDR + WIRE_OVERHEAD
    round_trip = rtt + 2 * wire_packet * 8 / rate
    return math.ceil(rate * round_trip / 8 / wire_packet)


def tuner_ring(world: int, rate: float, elements: int, network: Network) -> float:
    """``ring_seconds`` on the tuner's network (``Costs.ring``)."""
    return ring_seconds(world, rate, elements, network.rtt, network.mtu)


def tuner_in_network(world: int, rate: float, elements: int, packet_elements: int, element_size: int,
                     network: Network) -> float:
    """``in_network_seconds`` on the tuner's network (``Costs.in_network``): its pool, or one covering the
    bandwidth-delay product (at least MIN_POOL slots) where it names none."""
    pool = network.pool
    if pool is None:
        pool = max(MIN_POOL, covering_pool(rate, network.rtt, packet_elements, element_size))
    return in_network_seconds(rate, network.rtt, elements, packet_elements, pool, element_size)


def tuner_costs(datagram_io: float = IO_PER_DATAGRAM_GSO) -> Costs:
    """The tuner's Costs from this table and these network models (``Costs``), the DDP hook's and the
    simulator's; a datagram costs GSO/GRO's ``datagram_io`` (burstio uses them where it can) unless told
    otherwise."""
    return Costs(switch_cpu=dict(SWITCH_CPU),
                 host_cpu={codec: host_codec_seconds(family) for codec, family in TUNED_FAMILIES.items()},
                 result_decode=RESULT_FLOAT32, datagram_io=datagram_io, datagram_overhead=WIRE_OVERHEAD,
                 ip_udp=IP_UDP, ring=tuner_ring, in_network=tuner_in_network, host_package=HOST_PACKAGE)
