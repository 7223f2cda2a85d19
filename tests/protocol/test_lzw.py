"""protocol.lzw: round trips, a hand-computed stream, the code widths' growth and cap, and malformed streams."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from intml.protocol import lzw


def test_hand_computed_example() -> None:
    # ABABABA: A (65), B (66), then AB (256, added after A) and ABA (258: the code being defined as it is read,
    # the decoder's special case), four 9-bit codes MSB first and 4 zero bits of padding:
    # 001000001 001000010 100000000 100000010 0000 = 20 90 a0 10 20
    assert lzw.encode(b"ABABABA") == bytes.fromhex("2090a01020")
    assert lzw.decode(bytes.fromhex("2090a01020")) == b"ABABABA"


def test_empty_and_single_byte() -> None:
    assert lzw.encode(b"") == b""
    assert lzw.decode(b"") == b""
    assert lzw.encode(b"\xff") == bytes([0b01111111, 0b10000000])  # 011111111 and 7 bits of padding
    assert lzw.decode(lzw.encode(b"\xff")) == b"\xff"


def test_widths_grow_from_9_bits_and_stop_at_the_cap() -> None:
    assert [lzw.width(k) for k in (0, 256, 257, 768, 769)] == [9, 9, 10, 10, 11]
    assert lzw.width(10 ** 6) == 16 and lzw.width(10 ** 6, max_width=12) == 12


@settings(max_examples=60, deadline=None)
@given(st.binary(max_size=3000), st.sampled_from([9, 10, 12, 16]))
def test_round_trip(data: bytes, max_width: int) -> None:
    assert lzw.decode(lzw.encode(data, max_width), max_width) == data


def test_round_trip_past_a_full_dictionary() -> None:
    # 40 KB of few-symbol runs fill a 9-bit dictionary (256 new entries) many times over; widths then stay at 9
    data = np.random.default_rng(1).integers(0, 4, 40_000, dtype=np.uint8).tobytes()
    packed = lzw.encode(data, max_width=9)
    assert lzw.decode(packed, max_width=9) == data
    assert len(packed) < len(data) / 2  # two bits of information per byte: compressible even with 256 entries


def test_raw_float32_barely_compress() -> None:
    """Seed 001's finding: LZW of raw float weights saves little (mantissa bits look random)."""
    weights = np.random.default_rng(2).normal(0, 0.1, 20_000).astype(np.float32).tobytes()
    assert len(lzw.encode(weights)) / len(weights) > 0.9  # saves under a tenth (in fact it grows them)


@pytest.mark.parametrize("packed, why", [(bytes([0b10000001, 0]), "past the dictionary"),
                                         (bytes.fromhex("2090a01021"), "not a zero padding"),
                                         (b"\x00", "8 bits left over")])
def test_malformed_streams_are_refused(packed: bytes, why: str) -> None:
    with pytest.raises(ValueError, match=why):
        lzw.decode(packed)


def test_max_width_out_of_range() -> None:
    with pytest.raises(ValueError, match="max_width"):
        lzw.encode(b"x", max_width=8)
