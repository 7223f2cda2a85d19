"""Tests of protocol.wire: doc/dtype agreement, numpy <-> scapy agreement, pcap dissection, errors."""

import struct

import numpy as np
import pytest
from hypothesis import example, given
from hypothesis import strategies as st
from scapy.layers.inet import IP, UDP
from scapy.layers.l2 import Ether
from scapy.packet import Raw, split_bottom_up
from scapy.utils import rdpcap, wrpcap

from intml.protocol import wire
from intml.protocol.codec import Codec
from intml.protocol.wire import (
    DEFAULT_PORT,
    CHALLENGE,
    HEADER,
    HEADER_SIZE,
    JOIN,
    MAGIC,
    NO_EXP,
    OFFSETS,
    VERSION,
    MsgType,
    header_array,
    pack,
    pack_join,
    payload_dtype,
    unpack,
    unpack_join,
)
from intml.testbed.capture import IntmlChallenge, IntmlHeader, IntmlJoin, bind_port

NAMES = HEADER.names
BOUNDS = {name: np.iinfo(HEADER.fields[name][0]) for name in NAMES}
MINS = {name: int(b.min) for name, b in BOUNDS.items()}
MAXS = {name: int(b.max) for name, b in BOUNDS.items()}


def doc_tables(doc: str) -> list[list[dict[str, str]]]:
    """Markdown tables of ``doc`` as lists of {column: cell} rows (separator rows dropped)."""
    tables, rows = [], []
    for line in [*doc.splitlines(), ""]:
        line = line.strip()
        if line.startswith("|"):
            rows.append([cell.strip() for cell in line.strip("|").split("|")])
        elif rows:
            columns, *body = rows
            tables.append([dict(zip(columns, r)) for r in body if set("".join(r)) - set("-: ")])
            rows = []
    return tables


def dtype_spec(dtype: np.dtype) -> list[tuple[str, int, int, str]]:
    return [
        (name, off, sub.itemsize, "raw" if sub.kind == "V" else f"{sub.kind}{8 * sub.itemsize}")
        for name, (sub, off) in ((n, dtype.fields[n][:2]) for n in dtype.names)
    ]


def test_doc_tables_match_dtypes():
    tables = doc_tables(wire.__doc__)
    assert len(tables) == 3
    for table, dtype in zip(tables, (HEADER, JOIN, CHALLENGE)):
        documented = [(r["field"], int(r["offset"]), int(r["size"]), r["type"]) for r in table]
        assert documented == dtype_spec(dtype)
    assert HEADER_SIZE == 26 and wire.JOIN_SIZE == 101 and wire.CHALLENGE_SIZE == 33


def test_offsets_are_plain_ints_of_a_packed_header():
    assert OFFSETS == {name: HEADER.fields[name][1] for name in NAMES}
    assert all(type(v) is int for v in OFFSETS.values())
    assert HEADER.itemsize == sum(HEADER.fields[n][0].itemsize for n in NAMES)  # no padding


def test_scapy_fields_follow_field_lists():
    for layer, dtype in ((IntmlHeader, HEADER), (IntmlJoin, JOIN), (IntmlChallenge, CHALLENGE)):
        assert [f.name for f in layer.fields_desc] == list(dtype.names)
        assert [f.sz for f in layer.fields_desc] == [dtype.fields[n][0].itemsize for n in dtype.names]
    assert len(IntmlHeader()) == HEADER_SIZE


def test_codec_helpers():
    assert [Codec(c).bytes_per_element for c in (0, 1)] == [1, 4]
    assert payload_dtype(Codec.CNAT8) == np.uint8 and payload_dtype(1) == np.dtype(">i4")


def test_big_endian_known_bytes():
    header = dict(type=MsgType.DATA, job=0x01020304, allreduce=0x05060708, chunk=-2, rank=0x0A0B,
                  slot=0x0C0D, count=2, codec=Codec.INT32, shadow=1, exp=-3, next_exp=NO_EXP)
    expected = bytes.fromhex(
        "494E 01 01 01020304 05060708 FFFFFFFE 0A0B 0C0D 0002 01 01 FD 80" " 00000001 FFFFFFFF"
    )
    assert pack(header, np.array([1, -1], np.int32)) == expected
    assert bytes(IntmlHeader(**header) / Raw(expected[HEADER_SIZE:])) == expected


def int_fields(**fixed):
    """Strategy of header dicts over each field's full range, with some fields fixed."""
    return st.fixed_dictionaries(
        {name: fixed.get(name, st.integers(MINS[name], MAXS[name])) for name in NAMES}
    )


NOT_JOIN = st.integers(0, 255).filter(lambda t: t not in (MsgType.JOIN, MsgType.JOIN_ACK, MsgType.CHALLENGE))


@given(header=int_fields(type=NOT_JOIN), payload=st.binary(max_size=64))
@example(header={**MINS, "type": MsgType.DATA}, payload=b"")
@example(header={**MAXS, "type": MsgType.RESULT}, payload=b"\xff" * 8)
def test_numpy_pack_dissects_in_scapy(header, payload):
    pkt = IntmlHeader(pack(header, payload))
    assert {name: pkt.getfieldval(name) for name in NAMES} == header
    assert bytes(pkt.payload) == payload


@st.composite
def data_packets(draw):
    """(header dict, element values) for a valid DATA / RESULT packet, any codec."""
    codec = draw(st.sampled_from(Codec))
    info = np.iinfo(payload_dtype(codec))
    values = draw(st.lists(st.integers(int(info.min), int(info.max)), max_size=40))
    header = draw(int_fields(magic=st.just(MAGIC), version=st.just(VERSION),
                             type=st.sampled_from([MsgType.DATA, MsgType.RESULT]),
                             codec=st.just(codec), count=st.just(len(values))))
    return header, values


@given(data_packets())
def test_scapy_build_unpacks_in_numpy(packet):
    header, values = packet
    fmt = "B" if header["codec"] == Codec.CNAT8 else "i"
    raw = bytes(IntmlHeader(**header) / Raw(struct.pack(f">{len(values)}{fmt}", *values)))
    record, payload = unpack(raw)
    assert {name: int(record[name]) for name in NAMES} == header
    assert payload.dtype == payload_dtype(header["codec"])
    assert payload.tolist() == values
    assert pack(record, payload) == raw  # np.void headers pack back to the same bytes


def pcap_roundtrip(tmp_path, pkt):
    path = tmp_path / "capture.pcap"
    wrpcap(str(path), [pkt])
    (read,) = rdpcap(str(path))
    return read


def sample_data():
    header = dict(type=MsgType.RESULT, job=9, allreduce=2**32 - 1, chunk=-1, slot=77, count=3,
                  codec=Codec.INT32, shadow=1, exp=-5, next_exp=NO_EXP)
    return header, pack(header, np.array([7, -7, 2**31 - 1], np.int32))


@pytest.mark.parametrize("sport, dport", [(40000, DEFAULT_PORT), (DEFAULT_PORT, 40000)])
def test_pcap_roundtrip(tmp_path, sport, dport):
    header, raw = sample_data()
    pkt = Ether() / IP(src="10.0.0.1", dst="10.0.0.2") / UDP(sport=sport, dport=dport) / Raw(raw)
    read = pcap_roundtrip(tmp_path, pkt)
    assert read.haslayer(IntmlHeader)
    assert {name: read[IntmlHeader].getfieldval(name) for name in header} == header
    assert read[Raw].load == raw[HEADER_SIZE:]
    assert "RESULT" in read.summary()


@pytest.fixture
def other_port():
    port = 48890
    yield port
    split_bottom_up(UDP, IntmlHeader, dport=port)  # undo bind_port: scapy bindings are global
    split_bottom_up(UDP, IntmlHeader, sport=port)


def test_bind_port(tmp_path, other_port):
    header, raw = sample_data()
    pkt = Ether() / IP() / UDP(sport=40000, dport=other_port) / Raw(raw)
    assert not pcap_roundtrip(tmp_path, pkt).haslayer(IntmlHeader)
    bind_port(other_port)
    bind_port(other_port)  # idempotent
    assert UDP.payload_guess.count(({"dport": other_port}, IntmlHeader)) == 1
    read = pcap_roundtrip(tmp_path, pkt)
    assert read.haslayer(IntmlHeader)
    assert {name: read[IntmlHeader].getfieldval(name) for name in header} == header
    assert read[Raw].load == raw[HEADER_SIZE:]


JOIN_VALUES = dict(world_size=8, packet_elements=256, pool_size=2**16 - 1, codec=Codec.INT32,
                   cores=0, first_core=3, total_cores=255, seed=2**64 - 1, flags=1, group=0xEFFF0001,
                   group_port=48879, allreduce=2**32 - 1,
                   nonce=bytes(range(16)), cookie=b"c" * 16, job_nonce=b"j" * 16, mac=bytes(range(100, 116)),
                   idle_timeout=2**32 - 1, codec_param=2**32 - 2)


def _field(record: np.void, name: str) -> int | bytes:
    return bytes(record[name]) if record.dtype.fields[name][0].kind == "V" else int(record[name])


@pytest.mark.parametrize("kind", [MsgType.JOIN, MsgType.JOIN_ACK])
def test_join_roundtrip_and_dissection(kind):
    bitmap = bytes([0xA5]) * wire.slot_bitmap_size(JOIN_VALUES["pool_size"])
    raw = pack_join({"type": kind, "job": 42, "rank": 3}, JOIN_VALUES, bitmap)
    assert len(raw) == HEADER_SIZE + wire.JOIN_SIZE + 8192
    header, body, got_bitmap = unpack_join(raw)
    assert (header["type"], header["job"], header["rank"]) == (kind, 42, 3)
    assert {name: _field(body, name) for name in JOIN.names} == JOIN_VALUES and got_bitmap == bitmap
    pkt = IntmlHeader(raw)
    assert pkt.haslayer(IntmlJoin)
    assert {name: pkt[IntmlJoin].getfieldval(name) for name in JOIN.names} == JOIN_VALUES
    assert pkt[Raw].load == bitmap


def test_scapy_join_build_sets_type():
    raw = bytes(IntmlHeader(job=1) / IntmlJoin(**JOIN_VALUES) / Raw(bytes(8192)))
    header, body, _ = unpack_join(raw)
    assert header["type"] == MsgType.JOIN
    assert bytes(body["mac"]) == JOIN_VALUES["mac"]


def test_challenge_roundtrip_and_dissection():
    raw = wire.pack_challenge(7, 2, b"n" * 16, b"k" * 16, cores=5)
    assert len(raw) == HEADER_SIZE + wire.CHALLENGE_SIZE
    header, body = wire.unpack_challenge(raw)
    assert (header["type"], header["job"], header["rank"]) == (MsgType.CHALLENGE, 7, 2)
    assert (bytes(body["nonce"]), bytes(body["cookie"]), int(body["cores"])) == (b"n" * 16, b"k" * 16, 5)
    pkt = IntmlHeader(raw)
    assert pkt[IntmlChallenge].cookie == b"k" * 16 and pkt[IntmlChallenge].cores == 5
    assert bytes(IntmlHeader(job=7, rank=2) / IntmlChallenge(nonce=b"n" * 16, cookie=b"k" * 16, cores=5)) == raw
    with pytest.raises(ValueError, match="not a CHALLENGE"):
        wire.unpack_challenge(raw[:-1])


def test_unpack_join_rejects_other_packets():
    with pytest.raises(ValueError, match="not a JOIN"):
        unpack_join(pack({"type": MsgType.LEAVE}))
    with pytest.raises(ValueError, match=f"JOIN payload is {wire.JOIN_SIZE - 1} bytes"):
        unpack_join(pack_join({}, {})[:-1])
    with pytest.raises(ValueError, match="JOIN slot bitmap is 1 bytes, pool size 9 needs 2"):
        unpack_join(pack_join({}, {"pool_size": 9})[:-1])


def test_control_payloads_are_raw_bytes():
    header, payload = unpack(pack({"type": MsgType.ERROR}, b'{"error": "x"}'))
    assert header["type"] == MsgType.ERROR and payload.tobytes() == b'{"error": "x"}'
    assert unpack(pack({"type": MsgType.LEAVE}))[1].size == 0


GOOD = pack({"type": MsgType.DATA, "count": 4, "codec": Codec.INT32}, np.arange(4, dtype=np.int32))


def patched(offset: int, value: bytes) -> bytes:
    return GOOD[:offset] + value + GOOD[offset + len(value):]


@pytest.mark.parametrize("buf, message", [
    (GOOD[:HEADER_SIZE - 1], "short buffer: 25 bytes"),
    (b"", "short buffer: 0 bytes"),
    (patched(OFFSETS["magic"], b"NI"), "bad magic 0x4E49"),
    (patched(OFFSETS["version"], b"\x02"), "bad version 2"),
    (patched(OFFSETS["type"], b"\x0c"), "unknown message type 12"),
    (patched(OFFSETS["codec"], b"\x02"), "unknown codec 2"),
    (GOOD[:-1], "payload is 15 bytes but count=4 INT32 elements need 16"),
    (GOOD + b"\x00", "payload is 17 bytes but count=4"),
    (patched(OFFSETS["codec"], b"\x00"), "payload is 16 bytes but count=4 CNAT8 elements need 4"),
])
def test_unpack_errors(buf, message):
    assert unpack(GOOD)[1].tolist() == [0, 1, 2, 3]  # the unpatched packet is fine
    with pytest.raises(ValueError, match=message):
        unpack(buf)


def test_header_array():
    headers = header_array(3)
    assert headers.dtype == HEADER and headers.shape == (3,)
    assert (headers["magic"] == MAGIC).all() and (headers["version"] == VERSION).all()
    assert all(not headers[name].any() for name in NAMES if name not in ("magic", "version"))
    headers["type"] = MsgType.LEAVE
    headers["job"] = 0x0A0B0C0D
    raw = headers.tobytes()
    assert raw[:8] == b"IN\x01\x05\x0a\x0b\x0c\x0d"
    assert raw[HEADER_SIZE:2 * HEADER_SIZE] == raw[:HEADER_SIZE]  # packed back to back
    assert unpack(raw[:HEADER_SIZE])[0]["job"] == 0x0A0B0C0D
