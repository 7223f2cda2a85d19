"""Dissecting captures: scapy layers for intml, generated from the field lists of ``protocol.wire``.

    from scapy.utils import rdpcap
    from intml.testbed import capture
    capture.bind_port(48879)          # plus port + i for each further aggregator core
    for packet in rdpcap("run.pcap"):
        packet.show()

Importing scapy reads the routing table through a netlink socket, so this module stays out of the sans-I/O
cores' imports (tests/protocol/test_sans_io.py checks it).
"""

from __future__ import annotations

import numpy as np
from scapy.fields import (
    ByteEnumField,
    ByteField,
    Field,
    IntField,
    LongField,
    ShortField,
    SignedByteField,
    SignedIntField,
    XShortField,
    XStrFixedLenField,
)
from scapy.layers.inet import UDP
from scapy.packet import Packet, bind_bottom_up, bind_layers

from intml.protocol.codec import Codec
from intml.protocol.wire import (
    CHALLENGE_FIELDS,
    DEFAULT_PORT,
    HEADER_FIELDS,
    JOIN_FIELDS,
    MAGIC,
    VERSION,
    MsgType,
)

_SCAPY_FIELDS = {  # numpy dtype.str -> scapy field (scapy's IntField / LongField are unsigned)
    "|u1": ByteField,
    "|i1": SignedByteField,
    ">u2": ShortField,
    ">u4": IntField,
    ">i4": SignedIntField,
    ">u8": LongField,
}
_SCAPY_ENUMS = {"type": MsgType, "codec": Codec}  # u8 fields shown by name
_SCAPY_DEFAULTS = {"magic": MAGIC, "version": VERSION}  # the rest default to 0, as in header_array


def _scapy_fields(fields: tuple[tuple[str, str, str], ...]) -> list[Field]:
    out: list[Field] = []
    for name, code, _ in fields:
        default = _SCAPY_DEFAULTS.get(name, 0)
        if name in _SCAPY_ENUMS:
            out.append(ByteEnumField(name, default, {m.value: m.name for m in _SCAPY_ENUMS[name]}))
        elif name == "magic":
            out.append(XShortField(name, default))
        elif np.dtype(code).kind == "V":  # nonces, cookies, MACs: raw bytes, shown in hex
            out.append(XStrFixedLenField(name, bytes(np.dtype(code).itemsize), np.dtype(code).itemsize))
        else:
            out.append(_SCAPY_FIELDS[np.dtype(code).str](name, default))
    return out


class IntmlHeader(Packet):
    """intml data header. DATA / RESULT / LEAVE / STATS_REQUEST / STATS_REPLY / ERROR payloads stay ``Raw``."""

    name = "IntML"
    fields_desc = _scapy_fields(HEADER_FIELDS)

    def mysummary(self) -> str:
        return self.sprintf("IntML %type% job=%job% ar=%allreduce% chunk=%chunk% rank=%rank% slot=%slot%")


class IntmlJoin(Packet):
    """JOIN / JOIN_ACK payload; the slot bitmap after it stays ``Raw``."""

    name = "IntML JOIN"
    fields_desc = _scapy_fields(JOIN_FIELDS)


class IntmlChallenge(Packet):
    """CHALLENGE payload."""

    name = "IntML CHALLENGE"
    fields_desc = _scapy_fields(CHALLENGE_FIELDS)


def bind_port(port: int) -> None:
    """Dissect UDP traffic to or from ``port`` as intml (aggregators may use one port per core)."""
    for direction in ({"dport": port}, {"sport": port}):
        if (direction, IntmlHeader) not in UDP.payload_guess:
            bind_bottom_up(UDP, IntmlHeader, **direction)


# bind_layers also sets the field when building (UDP()/IntmlHeader() gets dport); a second
# bind_layers would override that, so the other directions are bound for dissection only.
bind_layers(UDP, IntmlHeader, dport=DEFAULT_PORT)
bind_port(DEFAULT_PORT)
bind_layers(IntmlHeader, IntmlJoin, type=MsgType.JOIN)
bind_bottom_up(IntmlHeader, IntmlJoin, type=MsgType.JOIN_ACK)
bind_layers(IntmlHeader, IntmlChallenge, type=MsgType.CHALLENGE)
