"""The parameters of a job and of a worker, defined once: the JOIN fields every rank must agree on
(``JobParams``), a worker's timers (``WorkerTimers``), and the aggregator's defaults. ``Worker``, the PyTorch
configuration and the command lines all take their defaults from here.

Why each default is what it is:

* ``packet_elements = 1024``: 1024 C_nat codes plus the header fit a 1500-byte MTU.
* ``pool_size = 64``: slots, i.e. packets in flight per worker; 64 KiB of codes in flight covers the
  bandwidth-delay product of a 10 Gbit/s link with a 50 us round trip.
* ``min_rto = 0.05`` s: the floor of the adaptive retransmission timer. Ranks that share cores see scheduling
  delays of tens of milliseconds; a lower floor fires spurious retransmissions that add load exactly when the
  aggregator is busiest. Real losses are mostly repaired earlier, by fast retransmit.
* ``timeout = 30`` s without progress before ``AllreduceTimeout``.
* ``AGGREGATOR_IDLE_TIMEOUT = 300`` s: a job is torn down after this long without traffic. It must outlast a
  training pause (an evaluation pass, a checkpoint); a dead job's slots are held that long at worst.
* ``AGGREGATOR_MAX_POOL = 256`` slots per job: one JOIN may not reserve the whole table (a job needs only
  its bandwidth-delay product in flight: 256 packets of 1024 codes cover 10 Gbit/s with a 200 us round trip),
  and half of the default table stays for other jobs.
* ``AGGREGATOR_SLOTS = 512`` rows per core: the table costs 16 bytes x rows x max packet elements (64 MiB at
  8192 elements), and 512 rows hold eight jobs of the default pool.
* ``AGGREGATOR_JOB_HISTORY = 64`` finished jobs kept per core with their final counters: as many as a core
  holds live (``AGGREGATOR_MAX_JOBS``), so that a whole table's turnover can be looked back on; about 0.5 KB
  each, and all of them fit the reply to an operator's 16 KB STATS_REQUEST.
* ``ControlLimits``: JOIN, LEAVE and STATS_REQUEST datagrams reach the Python control plane only within token
  buckets kept by the burst kernel, one per source address (hashed into ``CONTROL_SOURCE_BUCKETS``) and one per
  core. A source is one socket: its control traffic is a JOIN handshake (2 datagrams a core), JOIN resends every
  0.2 s while unanswered, a LEAVE, a STATS_REQUEST on a stall. ``source_burst = 32`` covers all of that at once
  with room for an operator's repeated statistics requests; ``source_rate = 16`` per second refills it three
  times faster than a worker ever resends. The core's bucket bounds what a flood from many (spoofed) sources
  costs: ``global_rate = 1000`` per second at tens of microseconds each (measured: tests/aggregator/test_flood.py) is a few
  percent of a core, and ``global_burst = 256`` lets a whole job of MAX_WORLD ranks complete both rounds of its
  handshake at once. ``per_burst = 64``: at most one JOIN per rank of a MAX_WORLD job reaches Python from one
  received burst, so the results behind them wait for at most that much control work.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from intml.protocol.codec import Codec
from intml.protocol.codecs import BY_NAME, host
from intml.protocol.wire import FLAG_DATA_MAC, FLAG_NEAREST, JOIN, max_packet_elements

MAX_WORLD = 64  # ranks per job: the switch keeps one 64-bit bitmap per shadow set
MAX_CORES = int(np.iinfo(JOIN["total_cores"]).max)  # a job's cores on all its aggregators: one byte in the JOIN
CODEC_NAMES: dict[str, Codec] = {name: codec.ID for name, codec in BY_NAME.items()}

AGGREGATOR_SLOTS = 512
AGGREGATOR_MAX_ELEMENTS = 8192  # largest packet a job may use: a 9000-byte jumbo frame of C_nat codes
BURST = 256  # datagrams per recvmmsg/sendmmsg call, for aggregators and workers
AGGREGATOR_IDLE_TIMEOUT = 300.0
AGGREGATOR_MAX_JOBS = 64
AGGREGATOR_MAX_POOL = 256
AGGREGATOR_JOB_HISTORY = 64
CONTROL_SOURCE_BUCKETS = 1024  # a power of two: the hash's top bits index it


def codec_name(codec: Codec) -> str:
    """The name users and command lines give a switch codec (its key in CODEC_NAMES)."""
    return next(name for name, value in CODEC_NAMES.items() if value == codec)


HOST_CODECS = 16  # codec ids from here on are host codecs' (protocol.codecs.host), summed by the aggregator's host mode
# A host codec's package of P elements takes at most HOST_PACKAGE_BYTES * P + HOST_PACKAGE_SLACK bytes: a value and
# an index per element (a sparse codec sending all), and a header or a codebook.
HOST_PACKAGE_BYTES = 8
HOST_PACKAGE_SLACK = 1024
# an aggregator receives 4 bytes per element of its --max-packet-elements and a tag (an INT32 payload's datagram,
# aggregator.dataplane); so does a datagram of this many
HOST_DATAGRAM_ELEMENTS = max_packet_elements(Codec.INT32, data_mac=True)


def host_package_limit(packet_elements: int) -> int:
    """The most bytes a host codec's package of up to ``packet_elements`` elements may take (worker.host refuses
    to send a longer one)."""
    return HOST_PACKAGE_BYTES * packet_elements + HOST_PACKAGE_SLACK


def host_max_packet(max_elements: int) -> int:
    """The most packet elements of a host-codec job whose every package an aggregator taking packets of up to
    ``max_elements`` INT32 elements receives whole (host_package_limit)."""
    return max(0, (4 * max_elements - HOST_PACKAGE_SLACK) // HOST_PACKAGE_BYTES)


def host_aggregator_elements(packet_elements: int) -> int:
    """The --max-packet-elements an aggregator needs for a host-codec job of ``packet_elements``."""
    return -(-host_package_limit(packet_elements) // 4)


ROUNDINGS = ("stochastic", "nearest")  # C_nat's rounding: unbiased, or deterministic to the nearer power of two


@dataclasses.dataclass(frozen=True)
class JobParams:
    """What a JOIN carries and every rank of a job must agree on."""

    world_size: int
    packet_elements: int = 1024
    pool_size: int = 64
    codec: Codec | int = Codec.CNAT8  # a switch codec, or a host codec's wire id (>= HOST_CODECS)
    seed: int = 0
    data_mac: bool = False  # DATA / RESULT carry a keyed MAC (the JOIN's flags, bit 0)
    nearest: bool = False  # C_nat rounds to nearest at the workers and the switch, biased (flags, bit 1)
    codec_param: int = 0  # a host codec's parameter (HostCodec.wire_param); 0 for a switch codec

    def __post_init__(self) -> None:
        problem = self.problem()
        if problem:
            raise ValueError(problem)

    def problem(self, max_elements: int | None = None) -> str | None:
        """One line on what is wrong with these parameters (for an aggregator that takes packets of at most
        ``max_elements`` elements), or None."""
        if not 1 <= self.world_size <= MAX_WORLD:
            return f"world size must be in [1, {MAX_WORLD}], got {self.world_size}"
        if self.codec >= HOST_CODECS:
            try:
                codec = host.from_wire(self.codec, self.codec_param)
            except ValueError as exc:  # MalformedPackage: no such codec, or a parameter it does not take
                return f"host codec {self.codec} with parameter {self.codec_param}: {exc}"
            limit, where = host_max_packet(HOST_DATAGRAM_ELEMENTS), f"for {codec.name}"
            if max_elements is not None and host_max_packet(max_elements) < limit:
                limit, where = host_max_packet(max_elements), (
                    f"for {codec.name} on this aggregator (its --max-packet-elements {max_elements}: a host package "
                    f"may take {HOST_PACKAGE_BYTES} bytes per element and {HOST_PACKAGE_SLACK} more)")
        elif self.codec not in tuple(Codec) or self.codec_param:
            return f"unknown codec {self.codec} with parameter {self.codec_param}"
        else:
            limit, where = max_packet_elements(self.codec), f"for {Codec(self.codec).name.lower()}"
            if max_elements is not None and max_elements < limit:
                limit, where = max_elements, "on this aggregator (its --max-packet-elements)"
        if not 1 <= self.packet_elements <= limit:
            return f"packet elements must be in [1, {limit}] {where}, got {self.packet_elements}"
        if not 1 <= self.pool_size <= 0xFFFF:
            return f"pool size must be in [1, 65535], got {self.pool_size}"
        if not 0 <= self.seed < 1 << 64:
            return f"seed must be in [0, 2**64), got {self.seed}"
        return None

    @classmethod
    def of(cls, *, world_size: int, codec: str = "cnat8", **fields: int | bool) -> JobParams:
        """From a codec name (``cnat8``, ``int32``, or a host codec's: ``uniform8``...), as users and command lines
        give it."""
        if codec in CODEC_NAMES:
            return cls(world_size=world_size, codec=CODEC_NAMES[codec], **fields)
        try:
            found = host.parse(codec)
        except ValueError as exc:
            raise ValueError(f"codec must be one of {sorted(CODEC_NAMES)} or a host codec's name: {exc}") from None
        return cls(world_size=world_size, codec=found.wire_id, codec_param=found.wire_param(), **fields)

    @property
    def host_codec(self) -> host.HostCodec | None:
        """The job's host codec (the aggregator's host mode sums it), or None for a switch codec."""
        return host.from_wire(self.codec, self.codec_param) if self.codec >= HOST_CODECS else None

    @property
    def flags(self) -> int:
        """The JOIN's flags byte."""
        return (FLAG_DATA_MAC if self.data_mac else 0) | (FLAG_NEAREST if self.nearest else 0)


@dataclasses.dataclass(frozen=True)
class WorkerTimers:
    """A worker's deadlines and its retransmission timer (RFC 6298 style, seconds)."""

    timeout: float = 30.0  # no progress for this long: AllreduceTimeout
    connect_timeout: float = 5.0  # no JOIN_ACK for this long: the aggregator is unreachable
    rto: float = 0.05  # initial retransmission timeout
    min_rto: float = 0.05
    max_rto: float = 1.0

    def __post_init__(self) -> None:
        if not 0 < self.min_rto <= self.rto <= self.max_rto:
            raise ValueError(f"need 0 < min_rto <= rto <= max_rto, got {self.min_rto}, {self.rto}, {self.max_rto}")
        if not (self.timeout > 0 and self.connect_timeout > 0):
            raise ValueError("timeout and connect_timeout must be positive")


@dataclasses.dataclass(frozen=True)
class ControlLimits:
    """The admission of control datagrams (JOIN, LEAVE, STATS_REQUEST) per aggregator core: rates in datagrams
    per second, bursts in datagrams; the reasons for the defaults are in the module docstring."""

    source_rate: float = 16.0
    source_burst: int = 32
    global_rate: float = 1000.0
    global_burst: int = 256
    per_burst: int = 64

    def __post_init__(self) -> None:
        if not (self.source_rate > 0 and self.global_rate > 0):
            raise ValueError(f"control rates must be positive, got {self.source_rate}, {self.global_rate}")
        if min(self.source_burst, self.global_burst, self.per_burst) < 1:
            raise ValueError("control bursts must be at least 1")
