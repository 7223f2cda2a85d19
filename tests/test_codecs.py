"""Tests of protocol.codecs: every registered codec has the common interface; each dispatcher computes bit for bit
what the codec's own function does; and a whole allreduce built from the dispatchers alone (each rank's encode,
the switch's check, add and result encode, each worker's check and decode) equals protocol.reference's oracle bit
for bit, for several world sizes."""

import inspect
import struct

import numpy as np
import pytest
from harness import make_inputs
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from intml.protocol import codecs, reference, wire
from intml.protocol.arith import chunk_exponents, precode_chunk, switch_stream, value_bits, worker_stream
from intml.protocol.job import CODEC_NAMES
from intml.protocol.rng import stream_key
from intml.protocol.wire import NO_EXP, Codec

SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
FUNCTIONS = {  # name: parameters, the same in every codec
    "encode_chunk": ("x", "payload", "key", "offset", "exp", "vbits", "low"),
    "check_payload": ("payload", "exp", "vbits"),
    "add_payloads": ("data", "rows", "k", "col", "acc", "exp", "vbits", "first"),
    "encode_result": ("acc", "payload", "key", "offset", "exp", "vbits"),
    "check_result": ("payload", "exp", "vbits"),
    "decode_result": ("payload", "exp", "vbits", "out"),
}
CODEC_MODULES = pytest.mark.parametrize("codec", codecs.CODECS, ids=lambda c: c.NAME)
M64 = (1 << 64) - 1


def test_registry_covers_the_wire_codecs() -> None:
    assert sorted(codecs.BY_ID) == sorted(Codec)
    assert [codecs.BY_ID[c.ID] for c in codecs.CODECS] == list(codecs.CODECS)
    assert [codecs.BY_NAME[c.NAME] for c in codecs.CODECS] == list(codecs.CODECS)
    assert CODEC_NAMES == {"cnat8": Codec.CNAT8, "int32": Codec.INT32}


@CODEC_MODULES
def test_codec_interface(codec) -> None:
    assert isinstance(codec.ID, Codec) and codec.NAME == codec.ID.name.lower()
    assert codec.PAYLOAD_DTYPE.byteorder in ("|", ">")  # network order on the wire
    assert codec.WIDTH == codec.PAYLOAD_DTYPE.itemsize == codec.ID.bytes_per_element
    assert wire.payload_dtype(codec.ID) == codec.PAYLOAD_DTYPE
    lo, hi = codec.EXP_RANGE
    assert NO_EXP < lo <= hi <= 127  # exponents travel as int8, NO_EXP apart
    assert isinstance(codec.PRECODES, bool)
    for name, params in FUNCTIONS.items():
        assert tuple(inspect.signature(getattr(codec, name).py_func).parameters) == params, name
        assert tuple(inspect.signature(getattr(codecs, name).py_func).parameters) == ("codec", *params), name


@CODEC_MODULES
def test_constant_dispatchers(codec) -> None:
    assert codecs.width(codec.ID) == codec.WIDTH
    assert codecs.exp_range(codec.ID) == codec.EXP_RANGE
    assert codecs.precodes(codec.ID) == codec.PRECODES


def chunk_values(seed: int, n: int) -> np.ndarray:
    """Finite float32 of every magnitude the codecs treat apart: below and around the floors, saturating, zero."""
    rng = np.random.default_rng(seed)
    x = np.where(rng.random(n) < 0.5, -1.0, 1.0) * 2.0 ** rng.uniform(-140, 20, n) * (rng.random(n) < 0.9)
    return x.astype(np.float32)


def random_bytes(seed: int, n: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


@st.composite
def chunk_cases(draw):
    """(codec, rng seed, element count, agreed exponent, s(n)) with exponents of the codec's range or NO_EXP."""
    codec = draw(st.sampled_from(codecs.CODECS))
    lo, hi = codec.EXP_RANGE
    return (codec, draw(st.integers(0, 2**32 - 1)), draw(st.integers(0, 700)),
            draw(st.one_of(st.just(NO_EXP), st.integers(lo, hi))), value_bits(draw(st.integers(1, 64))))


@SETTINGS
@given(case=chunk_cases(), key=st.integers(0, M64), offset=st.integers(0, 2**40), precoded=st.booleans())
def test_encode_chunk_dispatch(case, key, offset, precoded) -> None:
    codec, seed, n, exp, vbits = case
    x = chunk_values(seed, n)
    low = np.uint32(0xFFFFFFFF if precoded else 0)  # "already encoded" (nothing below any floor) or "encode"
    got, want = (random_bytes(seed, n * codec.WIDTH) for _ in range(2))
    codecs.encode_chunk(int(codec.ID), x, got, np.uint64(key), offset, exp, vbits, low)
    codec.encode_chunk(x, want, np.uint64(key), offset, exp, vbits, low)
    assert got.tobytes() == want.tobytes()


@SETTINGS
@given(case=chunk_cases(), kind=st.sampled_from(["random", "in range", "encoded"]))
def test_check_dispatch(case, kind) -> None:
    codec, seed, n, exp, vbits = case
    payload = random_bytes(seed, n * codec.WIDTH)
    if kind != "random":  # the codec's own encode of values below 2**exp, or of any size
        x = chunk_values(seed, n)
        if kind == "in range":
            x = np.ldexp(x.astype(np.float64), exp - 20).astype(np.float32)
        codec.encode_chunk(x, payload, np.uint64(seed), 0, exp, vbits, np.uint32(0))
    assert codecs.check_payload(int(codec.ID), payload, exp, vbits) == codec.check_payload(payload, exp, vbits)
    assert codecs.check_result(int(codec.ID), payload, exp, vbits) == codec.check_result(payload, exp, vbits)


@SETTINGS
@given(case=chunk_cases(), k=st.integers(0, 9), col=st.integers(0, 30), first=st.booleans())
def test_add_payloads_dispatch(case, k, col, first) -> None:
    codec, seed, n, exp, vbits = case
    rng = np.random.default_rng(seed)
    data = random_bytes(seed, 12 * (col + n * codec.WIDTH)).reshape(12, -1)
    rows = rng.permutation(12)[:k].astype(np.int64)
    got, want = (np.random.default_rng(seed).integers(-2**31, 2**31, n, dtype=np.int32) for _ in range(2))
    codecs.add_payloads(int(codec.ID), data, rows, k, col, got, exp, vbits, first)
    codec.add_payloads(data, rows, k, col, want, exp, vbits, first)
    assert got.tobytes() == want.tobytes()


@SETTINGS
@given(case=chunk_cases(), key=st.integers(0, M64), offset=st.integers(0, 2**40))
def test_result_dispatch(case, key, offset) -> None:
    codec, seed, n, exp, vbits = case
    acc = np.random.default_rng(seed).integers(-2**31, 2**31, n, dtype=np.int32)
    got, want = (np.zeros(n * codec.WIDTH, np.uint8) for _ in range(2))
    saturated = codecs.encode_result(int(codec.ID), acc, got, np.uint64(key), offset, exp, vbits)
    assert saturated == codec.encode_result(acc, want, np.uint64(key), offset, exp, vbits)
    assert got.tobytes() == want.tobytes()
    payload = random_bytes(seed, n * codec.WIDTH)
    got_values, want_values = np.zeros(n, np.float32), np.ones(n, np.float32)
    codecs.decode_result(int(codec.ID), payload, exp, vbits, got_values)
    codec.decode_result(payload, exp, vbits, want_values)
    assert got_values.tobytes() == want_values.tobytes()


def test_int32_check_payload_bounds() -> None:
    """The switch's int32 contribution check: [-2**s, 2**s] is accepted, one past either end is not."""
    vbits = 28
    limit = 1 << vbits
    for values, ok in (([limit, -limit, 0], True), ([limit + 1], False), ([-limit - 1], False),
                       ([-(2**31)], False), ([2**31 - 1], False), ([], True)):
        payload = np.frombuffer(struct.pack(f">{len(values)}i", *values), np.uint8).copy()
        assert bool(codecs.int32.check_payload(payload, 0, vbits)) == ok, values


def dispatched_allreduce(codec, xs: list[np.ndarray], *, seed: int, allreduce_seq: int,
                         packet_elements: int) -> np.ndarray:
    """An allreduce from the dispatchers alone, chunk by chunk as the workers and the switch run it."""
    cid, n, size = int(codec.ID), len(xs), xs[0].size
    vbits = value_bits(n)
    exps = [chunk_exponents(x, packet_elements, codecs.exp_range(cid)) for x in xs]
    worker_keys = [np.uint64(stream_key(seed, worker_stream(allreduce_seq, r))) for r in range(n)]
    switch_key = np.uint64(stream_key(seed, switch_stream(allreduce_seq)))
    out = np.empty(size, np.float32)
    for c, lo in enumerate(range(0, size, packet_elements)):
        count = min(packet_elements, size - lo)
        exp = max(int(e[c]) for e in exps)
        data = np.zeros((n, codecs.width(cid) * count), np.uint8)
        for r, x in enumerate(xs):
            low = np.uint32(0)
            if codecs.precodes(cid):  # as the worker does: encoded at the lowest floor first
                _, _, _, low = precode_chunk(x[lo:lo + count], data[r], worker_keys[r], lo)
            codecs.encode_chunk(cid, x[lo:lo + count], data[r], worker_keys[r], lo, exp, vbits, low)
            assert codecs.check_payload(cid, data[r], exp, vbits)
        acc = np.empty(count, np.int32)
        codecs.add_payloads(cid, data, np.arange(n, dtype=np.int64), n, 0, acc, exp, vbits, True)
        result = np.empty(codecs.width(cid) * count, np.uint8)
        codecs.encode_result(cid, acc, result, switch_key, lo, exp, vbits)
        assert codecs.check_result(cid, result, exp, vbits)
        codecs.decode_result(cid, result, exp, vbits, out[lo:lo + count])
    return out


@pytest.mark.parametrize("n", [1, 2, 3, 7, 16, 64])
@pytest.mark.parametrize("kind", ["mixed", "normal", "zero_chunks", "huge", "tiny"])
@CODEC_MODULES
def test_round_trip_matches_reference(codec, kind, n) -> None:
    packet = 96
    xs = make_inputs(n, 5 * packet + 17, packet, kind, seed=n)
    got = dispatched_allreduce(codec, xs, seed=n * 7919, allreduce_seq=3, packet_elements=packet)
    want = reference.allreduce(xs, codec=codec.NAME, seed=n * 7919, allreduce_seq=3, packet_elements=packet)
    assert got.tobytes() == want.tobytes()
