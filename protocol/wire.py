"""UDP wire format of intml (SwitchML-style in-network aggregation).

Every datagram starts with the data header below, packed (no padding), all
multi-byte fields big-endian (network order). ``HEADER_FIELDS`` is the single
source of truth: the numpy dtype ``HEADER`` (hot path, tools) and the scapy
layer ``testbed.capture.IntmlHeader`` (capture dissection) are both generated from it.
The scapy layers live apart because importing scapy opens a netlink socket to read
the routing table: the sans-I/O cores import this module, never that one.
tests/protocol/test_wire.py checks the tables here against the dtypes.

Data header (26 bytes):

| field     | offset | size | type | meaning |
|-----------|-------:|-----:|------|---------|
| magic     |      0 |    2 | u16  | 0x494E ("IN") |
| version   |      2 |    1 | u8   | protocol version, 1 |
| type      |      3 |    1 | u8   | MsgType |
| job       |      4 |    4 | u32  | job id |
| allreduce |      8 |    4 | u32  | allreduce sequence number within the job |
| chunk     |     12 |    4 | i32  | chunk sequence number within the allreduce; negative = exponent-bootstrap chunk |
| rank      |     16 |    2 | u16  | DATA: worker rank (low byte) and the chunk's owners (high byte); RESULT: the owners (high byte) |
| slot      |     18 |    2 | u16  | slot index within the job's pool |
| count     |     20 |    2 | u16  | number of payload elements (DATA / RESULT) |
| codec     |     22 |    1 | u8   | Codec of the payload elements |
| shadow    |     23 |    1 | u8   | shadow-set bit (bit 0); RESULT, PARTIAL: bit 1 = congestion experienced (``CONGESTED``); RESULT: bit 2 = re-sent (``STORED``) |
| exp       |     24 |    1 | i8   | agreed exponent of this chunk |
| next_exp  |     25 |    1 | i8   | DATA: sender's max exponent for its next chunk in this slot; RESULT: agreed (max) exponent of that chunk; -128 = none |

Payload by message type (the control plane's handshake and MACs: docs/protocol.md, "Control plane
authentication"; the keys: protocol.keys):

* DATA, RESULT: ``count`` elements of the codec's ``payload_dtype`` (protocol.codec:
  uint8 C_nat codes for CNAT8, big-endian int32 for INT32), then, for a job with the DATA/RESULT MAC, the
  ``TAG_SIZE``-byte SipHash-2-4 tag of the header and payload (protocol.siphash; docs/protocol.md,
  "DATA/RESULT MAC"). Left as scapy ``Raw`` in captures.
* JOIN, JOIN_ACK: the JOIN payload below, then the *slot bitmap*: ceil(pool_size / 8) bytes, bit s (byte s // 8,
  least significant bit first) for slot s. In a JOIN it is zero (padding, so that no JOIN_ACK is larger than its
  JOIN); in a JOIN_ACK bit s is the shadow set slot s of this core uses next (a rejoining rank's engine starts
  there). Dissected by scapy as ``IntmlJoin`` (the bitmap stays ``Raw``).
* CHALLENGE: the CHALLENGE payload below (dissected as ``IntmlChallenge``).
* LEAVE: a 16-byte MAC under the rank's session key.
* STATS_REQUEST: zero padding (the reply may be up to 3 times the request), then a 16-byte MAC.
* STATS_REPLY: UTF-8 JSON, then a 16-byte MAC. ERROR: UTF-8 text to the end of the datagram (``Raw``).
* PARTIAL (leaf to spine, docs/protocol.md "Leaf-spine"): ``count`` big-endian int32 partial sums whatever the
  codec, then the 8-byte contributors bitmap (u64, bit r for rank r); ``rank`` is the leaf's index at the spine
  (protocol.partial).
* PENDING (aggregator to one rank): the answer to a DATA retransmission whose round is still incomplete. Its
  header is the DATA's with type PENDING and count 0; then ``have``, a big-endian u64 with bit r set for each rank
  r the round has (the sender's bit among them: its datagram arrived, the round waits on the others); then, for a
  job with the DATA/RESULT MAC, the tag as on a RESULT (``PENDING_SIZE`` bytes before it). The rank stops resending
  the slot and backs off (docs/window.md, "A duplicate answered with the ranks it lacks").

``count`` is 0 in control messages (anything but DATA / RESULT).

Owners (DATA and RESULT; docs/protocol.md, "Reduce-scatter"): the high byte of ``rank`` says which ranks need the
chunk's sum. 0 (``ALL_OWNERS``) is every rank: an allreduce, whose datagrams are byte for byte those of a
protocol without owners. Code v > 0 names ranks lo .. lo + span with v - 1 = span * 64 + lo (span <= 3,
``MAX_OWNER_SPAN``): the ranks whose shards a reduce-scatter chunk overlaps. A round's result goes with its payload
to its owners and cut to its header (count 0: a *header-only completion*) to the other ranks. In control messages
``rank`` is the whole u16 (an operator's STATS_REQUEST uses 0xFFFF).

JOIN payload (101 bytes):

| field           | offset | size | type | meaning |
|-----------------|-------:|-----:|------|---------|
| world_size      |      0 |    2 | u16  | number of workers in the job |
| packet_elements |      2 |    2 | u16  | payload elements per DATA packet |
| pool_size       |      4 |    2 | u16  | number of slots in the job's pool |
| codec           |      6 |    1 | u8   | Codec used by the job |
| cores           |      7 |    1 | u8   | JOIN: 0; JOIN_ACK: data-plane cores (ports base .. base + cores - 1) |
| first_core      |      8 |    1 | u8   | the job's cores on the aggregators before this one in the workers' list |
| total_cores     |      9 |    1 | u8   | the job's cores on all its aggregators; 0: this aggregator's only |
| seed            |     10 |    8 | u64  | shared random seed |
| flags           |     18 |    1 | u8   | bit 0: the job's DATA / RESULT carry a MAC (JobParams.data_mac); bit 1: nearest rounding (JobParams.nearest) |
| group           |     19 |    4 | u32  | JOIN: 0; JOIN_ACK: IPv4 multicast group the job's results go to, 0 = unicast to each worker |
| group_port      |     23 |    2 | u16  | JOIN: 0; JOIN_ACK: UDP port of that group |
| allreduce       |     25 |    4 | u32  | JOIN: 0; JOIN_ACK: the allreduce number the rank uses next |
| nonce           |     29 |   16 | raw  | the worker's fresh client nonce Nc (echoed in the JOIN_ACK) |
| cookie          |     45 |   16 | raw  | first JOIN: 0; then the CHALLENGE's cookie (echoed in the JOIN_ACK) |
| job_nonce       |     61 |   16 | raw  | JOIN: 0; JOIN_ACK: the job nonce of this core (the data key's input) |
| mac             |     77 |   16 | raw  | JOIN: 0, or the proof under the token key; JOIN_ACK: under the session key |
| idle_timeout    |     93 |    4 | u32  | JOIN: 0; JOIN_ACK: the core's idle timeout in ms (0: none); a worker keeps alive at a third of it |
| codec_param     |     97 |    4 | u32  | a host codec's parameter (HostCodec.wire_param); 0 for a switch codec |

A job's slots may be spread over several aggregators (docs/protocol.md, "Several aggregators"): core c of an
aggregator then owns the slots s with s % total_cores == first_core + c.

CHALLENGE payload (33 bytes):

| field           | offset | size | type | meaning |
|-----------------|-------:|-----:|------|---------|
| nonce           |      0 |   16 | raw  | the JOIN's client nonce, echoed |
| cookie          |     16 |   16 | raw  | the core's stateless cookie for this sender, job, rank and nonce |
| cores           |     32 |    1 | u8   | data-plane cores of the core's aggregator (a worker lays the job out before proving its JOIN) |
"""

from __future__ import annotations

from collections.abc import Mapping
from enum import IntEnum

import numpy as np

from intml.protocol.codec import Codec

MAGIC = 0x494E  # "IN"
VERSION = 1
NO_EXP = -128  # next_exp value meaning "no next chunk"
SHADOW_SET = 0x01  # the shadow byte's shadow-set bit
# A RESULT's shadow byte, bit 1: the aggregator's receive queue was deep when it read the burst this result answered
# (docs/window.md). Set on the way out, after the result's MAC, which covers the byte with the bit clear: like IP's
# ECN field, a mark any hop may set; a worker checks the tag with the bit clear. A PARTIAL's: a queue on the leaf's
# way up to the spine was deep; the spine echoes it in the round's RESULT (aggregator.tiers).
CONGESTED = 0x02
# A RESULT's shadow byte, bit 2: a completed round's stored result sent again, in answer to a duplicate DATA of the
# rank it goes to (or passed on by a leaf from a spine that so answered); clear on a round's first sending. A rank
# that already took the round so knows its retransmission was spurious, as a DSACK tells TCP (worker.engine
# take_stale; docs/protocol.md, "Re-sends are marked"). Like CONGESTED, outside the MAC: flipping it changes a
# counter, never a sum.
STORED = 0x04
MARKS = CONGESTED | STORED  # the bits set after a RESULT's MAC, which covers the byte with them clear
# A queue marks from a quarter full on (its kernel socket's, a switch port's): room for a round trip's arrivals
MARK_FRACTION = 4
DEFAULT_PORT = 48879


class MsgType(IntEnum):
    """Value of the header's ``type`` field."""

    DATA = 1
    RESULT = 2
    JOIN = 3
    JOIN_ACK = 4
    LEAVE = 5
    STATS_REQUEST = 6
    STATS_REPLY = 7
    ERROR = 8
    CHALLENGE = 9
    PARTIAL = 10  # a leaf's int32 partial sum of its rack, to the spine (docs/protocol.md, "Leaf-spine")
    PENDING = 11  # a retransmission's round is incomplete: the ranks it has (the module docstring)


# (name, numpy type code, meaning); order is wire order.
HEADER_FIELDS: tuple[tuple[str, str, str], ...] = (
    ("magic", ">u2", "0x494E ('IN')"),
    ("version", "u1", "protocol version"),
    ("type", "u1", "MsgType"),
    ("job", ">u4", "job id"),
    ("allreduce", ">u4", "allreduce sequence number within the job"),
    ("chunk", ">i4", "chunk sequence number; negative = exponent bootstrap"),
    ("rank", ">u2", "DATA: rank (low byte) and owners (high byte); RESULT: owners (high byte)"),
    ("slot", ">u2", "slot index within the job's pool"),
    ("count", ">u2", "number of payload elements"),
    ("codec", "u1", "Codec"),
    ("shadow", "u1", "shadow-set bit (bit 0); RESULT, PARTIAL: bit 1 = congestion experienced"),
    ("exp", "i1", "agreed exponent of this chunk"),
    ("next_exp", "i1", "exponent of the next chunk in this slot, NO_EXP = none"),
)
HEADER = np.dtype([(name, code) for name, code, _ in HEADER_FIELDS])
HEADER_SIZE = HEADER.itemsize
# Plain ints so numba kernels can parse raw bytes with them as compile-time constants.
OFFSETS: dict[str, int] = {name: int(HEADER.fields[name][1]) for name in HEADER.names}


def marked_stored(result: bytes) -> bytes:
    """``result`` as a re-send carries it: with the STORED mark in its shadow byte, outside its tag."""
    again = bytearray(result)
    again[OFFSETS["shadow"]] |= STORED
    return bytes(again)

JOIN_FIELDS: tuple[tuple[str, str, str], ...] = (
    ("world_size", ">u2", "number of workers"),
    ("packet_elements", ">u2", "payload elements per DATA packet"),
    ("pool_size", ">u2", "slots in the job's pool"),
    ("codec", "u1", "Codec"),
    ("cores", "u1", "JOIN: 0; JOIN_ACK: data-plane cores (ports base .. base + cores - 1)"),
    ("first_core", "u1", "the job's cores on the aggregators before this one in the workers' list"),
    ("total_cores", "u1", "the job's cores on all its aggregators; 0: this aggregator's only"),
    ("seed", ">u8", "shared random seed"),
    ("flags", "u1", "bit 0: DATA / RESULT carry a MAC; bit 1: C_nat rounds to nearest"),
    ("group", ">u4", "JOIN: 0; JOIN_ACK: IPv4 multicast group of the job's results, 0 = unicast"),
    ("group_port", ">u2", "JOIN: 0; JOIN_ACK: UDP port of that group"),
    ("allreduce", ">u4", "JOIN: 0; JOIN_ACK: the allreduce number the rank uses next"),
    ("nonce", "V16", "the worker's client nonce"),
    ("cookie", "V16", "the CHALLENGE's cookie, or 0"),
    ("job_nonce", "V16", "JOIN: 0; JOIN_ACK: the core's job nonce"),
    ("mac", "V16", "JOIN: proof under the token key, or 0; JOIN_ACK: under the session key"),
    ("idle_timeout", ">u4", "JOIN: 0; JOIN_ACK: the core's idle timeout in ms (0: none): keep alive well within it"),
    ("codec_param", ">u4", "a host codec's parameter (protocol.codecs.host); 0 for a switch codec"),
)
JOIN = np.dtype([(name, code) for name, code, _ in JOIN_FIELDS])
JOIN_SIZE = JOIN.itemsize
JOIN_MAC = HEADER_SIZE + JOIN.fields["mac"][1]  # offset of the MAC in a JOIN / JOIN_ACK datagram
FLAG_DATA_MAC = 1
FLAG_NEAREST = 2  # the job's C_nat codes round to the nearer power of two, at the workers and the switch

CHALLENGE_FIELDS: tuple[tuple[str, str, str], ...] = (
    ("nonce", "V16", "the JOIN's client nonce, echoed"),
    ("cookie", "V16", "the core's stateless cookie"),
    ("cores", "u1", "data-plane cores of the core's aggregator"),
)
CHALLENGE = np.dtype([(name, code) for name, code, _ in CHALLENGE_FIELDS])
CHALLENGE_SIZE = CHALLENGE.itemsize

_ELEMENT_TYPES = (MsgType.DATA, MsgType.RESULT)  # types whose payload is `count` elements

# The owners of a chunk, in the high byte of a DATA or RESULT's rank field (the module docstring, "Owners"). A rank
# is below MAX_WORLD = 64, so the low byte holds it and the high byte was always 0: an allreduce's code.
OWNERS_SHIFT = 8
RANK_MASK = 0xFF
ALL_OWNERS = 0
MAX_OWNER_SPAN = 3  # a code names at most 4 consecutive ranks; a chunk over more shards is sent to all


HAVE_SIZE = 8  # a PENDING's bitmap of the ranks its round has, u64 (MAX_WORLD = 64 ranks)
PENDING_SIZE = HEADER_SIZE + HAVE_SIZE  # a PENDING without its tag

MAX_DATAGRAM = 65507  # the largest UDP payload over IPv4
TAG_SIZE = 8  # the SipHash-2-4 tag after the payload of a DATA or RESULT datagram of a job with data_mac


def max_packet_elements(codec: Codec | int, data_mac: bool = False) -> int:
    """The most elements one datagram can carry for a codec (count is also a u16), with room for the tag if the
    job has data_mac."""
    room = MAX_DATAGRAM - HEADER_SIZE - (TAG_SIZE if data_mac else 0)
    return min(0xFFFF, room // Codec(codec).bytes_per_element)


def element_datagram_size(codec: Codec | int, elements: int, data_mac: bool = False) -> int:
    """The length of a DATA or RESULT datagram of ``elements`` elements (a job's largest: its packet elements)."""
    return HEADER_SIZE + elements * Codec(codec).bytes_per_element + (TAG_SIZE if data_mac else 0)


def payload_dtype(codec: Codec | int) -> np.dtype:
    """Wire dtype of one payload element for ``codec``."""
    return Codec(codec).payload_dtype


def header_array(n: int) -> np.ndarray:
    """Zeroed array of ``n`` headers with magic and version set (for packet bursts)."""
    headers = np.zeros(n, HEADER)
    headers["magic"] = MAGIC
    headers["version"] = VERSION
    return headers


def pack(header: Mapping[str, int] | np.void, payload: np.ndarray | bytes = b"") -> bytes:
    """Serialise one packet.

    ``header`` is a HEADER record or a dict of field values (missing fields are
    those of ``header_array``). An array payload is cast to the header codec's
    wire dtype; bytes are appended verbatim. Nothing is validated, so tests can
    build malformed packets; ``unpack`` does the checking.
    """
    record = header_array(1)
    if isinstance(header, np.void):
        record[0] = header
    else:
        for name, value in header.items():
            record[name] = value
    if isinstance(payload, np.ndarray):
        payload = payload.astype(payload_dtype(record["codec"][0]), casting="same_kind").tobytes()
    return record.tobytes() + payload


def unpack(buf: bytes) -> tuple[np.void, np.ndarray]:
    """Parse one packet into (header record, payload array); raise ValueError if malformed.

    DATA / RESULT payloads come back as ``count`` elements of ``payload_dtype(codec)``;
    other message types as the remaining bytes (uint8). For tools and tests: the hot
    path parses with numba using ``OFFSETS``.
    """
    if len(buf) < HEADER_SIZE:
        raise ValueError(f"short buffer: {len(buf)} bytes, header needs {HEADER_SIZE}")
    header = np.frombuffer(buf, HEADER, count=1)[0]
    if header["magic"] != MAGIC:
        raise ValueError(f"bad magic 0x{int(header['magic']):04X}, expected 0x{MAGIC:04X}")
    if header["version"] != VERSION:
        raise ValueError(f"bad version {header['version']}, expected {VERSION}")
    if header["type"] not in set(MsgType):
        raise ValueError(f"unknown message type {header['type']}")
    if header["type"] not in _ELEMENT_TYPES:
        return header, np.frombuffer(buf, np.uint8, offset=HEADER_SIZE)
    if header["codec"] not in set(Codec):
        raise ValueError(f"unknown codec {header['codec']}")
    dtype = payload_dtype(header["codec"])
    count = int(header["count"])
    if len(buf) - HEADER_SIZE != count * dtype.itemsize:
        raise ValueError(
            f"payload is {len(buf) - HEADER_SIZE} bytes but count={count} "
            f"{Codec(header['codec']).name} elements need {count * dtype.itemsize}"
        )
    return header, np.frombuffer(buf, dtype, count=count, offset=HEADER_SIZE)


def slot_bitmap_size(pool_size: int) -> int:
    """Bytes of the slot bitmap after a JOIN / JOIN_ACK payload: one bit per slot of the job's pool."""
    return -(-pool_size // 8)


def pack_join(header_fields: Mapping[str, int], join_fields: Mapping[str, int | bytes],
              bitmap: bytes | None = None) -> bytes:
    """Serialise a JOIN (or, with ``type=JOIN_ACK``, a JOIN_ACK) packet: the JOIN payload (bytes for the
    16-byte fields), then the slot bitmap (default: zeros for ``pool_size`` slots)."""
    body = np.zeros(1, JOIN)
    for name, value in join_fields.items():
        body[name] = value
    if bitmap is None:
        bitmap = bytes(slot_bitmap_size(int(body["pool_size"][0])))
    return pack({"type": MsgType.JOIN, **header_fields}, body.tobytes() + bitmap)


def unpack_join(buf: bytes) -> tuple[np.void, np.void, bytes]:
    """Parse a JOIN / JOIN_ACK packet into (header record, JOIN record, slot bitmap)."""
    header, body = unpack(buf)
    if header["type"] not in (MsgType.JOIN, MsgType.JOIN_ACK):
        raise ValueError(f"not a JOIN / JOIN_ACK packet: type {header['type']}")
    if body.size < JOIN_SIZE:
        raise ValueError(f"JOIN payload is {body.size} bytes, expected at least {JOIN_SIZE}")
    join = body[:JOIN_SIZE].view(JOIN)[0]
    bitmap = body[JOIN_SIZE:].tobytes()
    if len(bitmap) != slot_bitmap_size(int(join["pool_size"])):
        raise ValueError(f"JOIN slot bitmap is {len(bitmap)} bytes, pool size {int(join['pool_size'])} needs "
                         f"{slot_bitmap_size(int(join['pool_size']))}")
    return header, join, bitmap


def pack_challenge(job: int, rank: int, nonce: bytes, cookie: bytes, cores: int = 1) -> bytes:
    body = np.zeros(1, CHALLENGE)
    body["nonce"], body["cookie"], body["cores"] = nonce, cookie, cores
    return pack({"type": MsgType.CHALLENGE, "job": job, "rank": rank}, body.tobytes())


def unpack_challenge(buf: bytes) -> tuple[np.void, np.void]:
    """Parse a CHALLENGE into (header record, CHALLENGE record)."""
    header, body = unpack(buf)
    if header["type"] != MsgType.CHALLENGE or body.size != CHALLENGE_SIZE:
        raise ValueError(f"not a CHALLENGE of {CHALLENGE_SIZE} bytes: type {header['type']}, {body.size} bytes")
    return header, body.view(CHALLENGE)[0]
