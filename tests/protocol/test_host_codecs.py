"""Tests of protocol.codecs.host: every host codec's packages and decoded values equal its slow reference's bit for
bit; the ones that claim it are unbiased; names and JOIN parameters round-trip; any bytes decode to ``count``
float32 values or raise MalformedPackage; error feedback makes top-k and random-k converge; PowerSGD's two rounds
recover a low-rank sum and agree across ranks."""

import heapq
import struct

import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from intml.protocol.codecs.host import FAMILIES, MalformedPackage, Memory, from_wire, huffman, parse
from intml.protocol.codecs.host import reference
from intml.protocol.codecs.host.packing import Reader, pack_codes, unpack_codes
from intml.protocol.codecs.host.powersgd import LowRank
from intml.protocol.codecs.host.reference import REFERENCES

SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
NAMES = ["uniform2", "uniform8", "uniform16", "adaptive", "adaptive-c6", "adaptive-huffman", "adaptive-huffman-c2-m3",
         "lloyd1", "lloyd4", "bitmask", "bitmask9", "bitmask32", "qsgd1", "qsgd15", "terngrad", "signsgd", "topk0.01",
         "topk0.5", "randomk0.1", "randomk1", "powersgd4"]
FLOATS = st.floats(width=32, allow_nan=False, allow_infinity=False)
VECTORS = st.lists(FLOATS, max_size=70).map(lambda v: np.array(v, np.float32))
KEYS = st.integers(0, 2 ** 64 - 1)
OFFSETS = st.integers(0, 2 ** 33)  # past 2**32, where protocol.rng's block key changes


def family_of(name: str) -> str:
    return max((family for family in FAMILIES if name.startswith(family)), key=len)


def gaussian(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(n).astype(np.float32)


def allreduce(codec, parts: list[np.ndarray], key: int = 7) -> np.ndarray:
    """What host mode computes: each rank's package decoded, combined in rank order, the result's package decoded."""
    n = parts[0].size
    total = codec.combine([codec.decode(codec.encode(part, key + rank, 0), n) for rank, part in enumerate(parts)])
    return codec.decode_result(codec.encode_result(total), n)


def test_every_family_is_tested_and_has_its_reference():
    assert {family_of(name) for name in NAMES} == set(FAMILIES) == set(REFERENCES)


@pytest.mark.parametrize("name", NAMES)
@SETTINGS
@given(x=VECTORS, key=KEYS, offset=OFFSETS)
@example(x=np.zeros(0, np.float32), key=0, offset=0)
@example(x=np.ones(1, np.float32), key=0, offset=0)
@example(x=np.full(9, -2.5, np.float32), key=1, offset=2 ** 32 - 3)
def test_matches_reference_bit_for_bit(name, x, key, offset):
    codec = parse(name)
    encode, decode = REFERENCES[family_of(name)]
    package = codec.encode(x, key, offset)
    assert package == encode(codec, x, key, offset)
    values = codec.decode(package, x.size)
    assert values.dtype == np.float32 and values.shape == x.shape
    assert values.tobytes() == decode(codec, package, x.size).tobytes()


@pytest.mark.parametrize("name", NAMES)
def test_name_and_wire_parameter_round_trip(name):
    codec = parse(name)
    assert codec.name == name
    again = from_wire(codec.wire_id, codec.wire_param())
    assert (type(again), again.name, again.wire_param()) == (type(codec), name, codec.wire_param())
    assert codec.switch_reason and "\n" not in codec.switch_reason


def test_wire_ids_are_distinct_and_above_the_switch_codecs():
    ids = [wire_id for wire_id, _, _ in FAMILIES.values()]
    assert len(set(ids)) == len(ids) and min(ids) >= 16


@pytest.mark.parametrize("name", ["uniform1", "uniform17", "uniformx", "lloyd0", "lloyd9", "qsgd0", "topk0", "topk1.5",
                                  "randomk", "powersgd0", "bitmask8", "adaptive-c17", "adaptive-m0", "adaptive-f0",
                                  "adaptive-q1", "terngrad2", "signsgd1", "gzip"])
def test_bad_names_are_refused(name):
    with pytest.raises(ValueError):
        parse(name)


@pytest.mark.parametrize(("wire_id", "param"), [(16, 1), (16, 17), (19, 9), (21, 0), (22, 1), (23, 5), (24, 0),
                                                (24, 0x3FC00000), (25, 0x7FC00000), (26, 0), (17, 0), (20, 33),
                                                (99, 0), (0, 0)])
def test_bad_join_parameters_are_malformed(wire_id, param):
    with pytest.raises(MalformedPackage):
        from_wire(wire_id, param)


def test_adaptive_picks_n_from_the_entropy():
    constant, spread = np.full(4000, 3.0, np.float32), np.linspace(-1, 1, 4000, dtype=np.float32)
    assert parse("adaptive").encode(constant, 1, 0)[8] == 5  # H = 0: N = c
    assert parse("adaptive-c6").encode(constant, 1, 0)[8] == 6
    assert parse("adaptive").encode(spread, 1, 0)[8] == 9  # a flat sample over 16 bins: H close to M = 4
    assert parse("adaptive-huffman-m2").encode(spread, 1, 0)[8] == 7


@pytest.mark.parametrize("name", ["qsgd2", "qsgd8", "terngrad", "randomk0.25"])
def test_unbiased_within_six_standard_errors(name):
    """The mean of 2000 keyed encodings is within 6 standard errors (the samples' own) of each value, plus 1e-6
    of it for the float32 results and the 2**-32 granularity of the draws."""
    codec, x, trials = parse(name), gaussian(48, 1), 2000
    samples = np.array([codec.decode(codec.encode(x, key, 100), x.size) for key in range(trials)], np.float64)
    error = np.abs(samples.mean(axis=0) - x)
    bound = 6 * samples.std(axis=0) / np.sqrt(trials) + 1e-6 * np.abs(x)
    assert codec.unbiased and np.all(error <= bound)


@SETTINGS
@given(cut=st.integers(0, 300), key=KEYS, offset=OFFSETS)
def test_random_draws_follow_the_element_not_the_package(cut, key, offset):
    """Keyed as C_nat is: which elements random-k keeps depends on their index in the tensor, not on where the
    packages are cut."""
    codec, x = parse("randomk0.3"), gaussian(300, 8)
    whole = codec.decode(codec.encode(x, key, offset), 300)
    parts = [codec.decode(codec.encode(x[:cut], key, offset), cut),
             codec.decode(codec.encode(x[cut:], key, offset + cut), 300 - cut)]
    assert whole.tobytes() == np.concatenate(parts).tobytes()
    assert whole.tobytes() != codec.decode(codec.encode(x, key ^ 1, offset), 300).tobytes()


def test_only_qsgd_terngrad_and_randomk_claim_unbiasedness():
    assert {family_of(name) for name in NAMES if parse(name).unbiased} == {"qsgd", "terngrad", "randomk"}


def test_error_feedback_converges():
    """Over 300 rounds of a gradient with a fixed mean, what top-k sent sums to within 5% of what came in; without
    the memory, its losses pile up."""
    codec, rng, mean = parse("topk0.05"), np.random.default_rng(5), gaussian(200, 2)
    memory = Memory(mean.size)
    inputs, sent, sent_without = np.zeros(mean.size), np.zeros(mean.size), np.zeros(mean.size)
    for step in range(300):
        gradient = (mean + rng.standard_normal(mean.size)).astype(np.float32)
        compensated = memory.compensate(gradient)
        decoded = codec.decode(codec.encode(compensated, step, 0), mean.size)
        memory.update(compensated, decoded)
        inputs, sent = inputs + gradient, sent + decoded
        sent_without += codec.decode(codec.encode(gradient, step, 0), mean.size)
    assert np.linalg.norm(sent - inputs) < 0.05 * np.linalg.norm(inputs)
    assert np.linalg.norm(sent_without - inputs) > 0.5 * np.linalg.norm(inputs)


def test_randomk_without_memory_errs_by_its_sampling_noise_only():
    """Random-k's sends over 300 rounds miss the inputs' sum by no more than 1.5 times the norm its variance
    predicts (sum of x**2 (1 / ratio - 1)): noise, no drift, with no memory at all."""
    codec, rng, mean = parse("randomk0.05"), np.random.default_rng(5), gaussian(200, 2)
    inputs, sent, variance = np.zeros(mean.size), np.zeros(mean.size), 0.0
    for step in range(300):
        gradient = (mean + rng.standard_normal(mean.size)).astype(np.float32)
        inputs, sent = inputs + gradient, sent + codec.decode(codec.encode(gradient, step, 0), mean.size)
        variance += float(np.sum(gradient.astype(np.float64) ** 2)) * (1 / codec.ratio - 1)
    assert np.linalg.norm(sent - inputs) < 1.5 * np.sqrt(variance)


def test_signsgd_majority_vote():
    codec = parse("signsgd")
    parts = [np.array(v, np.float32) for v in ([1, -1, 2, -3, 0], [1, -1, -2, 3, -1], [-1, -1, -2, 3, -1])]
    assert allreduce(codec, parts).tolist() == [1, -1, -1, 1, -1]
    assert allreduce(codec, parts[:2]).tolist() == [1, -1, 1, 1, 1]  # ties go to +1
    assert len(codec.encode_result(np.zeros(9))) == 2


def test_sparse_contributions_sum_exactly():
    parts = [gaussian(50, seed) for seed in range(3)]
    codec = parse("topk0.1")
    decoded = [codec.decode(codec.encode(part, 0, 0), 50) for part in parts]
    assert allreduce(codec, parts).tolist() == (decoded[0].astype(np.float64) + decoded[1] + decoded[2]).astype(
        np.float32).tolist()
    assert all(np.count_nonzero(d) == 5 for d in decoded)


@pytest.mark.parametrize("histogram", [[], [7], [0, 0, 3], [5, 5], [1, 1, 2, 3, 5, 8, 13, 21, 34, 55],
                                       [9, 0, 0, 1, 4, 0, 2], list(range(1, 300))])
def test_huffman_round_trip(histogram):
    histogram = np.array(histogram, np.int64)
    values = np.repeat(np.arange(histogram.size), histogram)
    np.random.default_rng(0).shuffle(values)
    symbols, lengths = huffman.code_lengths(histogram)
    data = huffman.encode(values, symbols, lengths)
    if symbols.size <= 1:
        assert data == b""  # one symbol alone takes no bits
    else:
        assert np.sum(2.0 ** -lengths) == 1  # a complete prefix code
        entropy = -np.sum(histogram[histogram > 0] * np.log2(histogram[histogram > 0] / values.size))
        assert entropy <= 8 * len(data) < entropy + values.size + 8  # within a bit per symbol of the entropy
    book = Reader(huffman.write_codebook(symbols, lengths), "test")
    read_symbols, read_lengths = huffman.read_codebook(book, max(histogram.size, 1))
    assert (read_symbols.tolist(), read_lengths.tolist()) == (symbols.tolist(), lengths.tolist())
    assert huffman.decode(data, read_symbols, read_lengths, values.size, "test").tolist() == values.tolist()


@SETTINGS
@given(width=st.integers(1, 32), data=st.data())
def test_bit_packing_matches_reference(width, data):
    """The packing kernels against the reference's strings of bits, at every width a codec uses (1..32 bits)."""
    codes = data.draw(st.lists(st.integers(0, 2 ** width - 1), max_size=80))
    package = pack_codes(np.array(codes, np.uint32), width)
    assert package == reference.to_bytes("".join(reference.field(c, width) for c in codes))
    assert unpack_codes(package, len(codes), width, "test").tolist() == reference.fields(package, len(codes), width)


def tree_depths(histogram: list[int]) -> dict[int, int]:
    """Huffman's rule as the codec states it, with Python's heapq on (weight, smallest symbol, leaves) tuples: the
    two lightest subtrees merge, ties to the one holding the smaller symbol. symbol -> depth."""
    heap = [(w, s, [s]) for s, w in enumerate(histogram) if w]
    depth = {s: 0 for _, s, _ in heap}
    heapq.heapify(heap)
    while len(heap) > 1:
        (w1, s1, a), (w2, s2, b) = heapq.heappop(heap), heapq.heappop(heap)
        for leaf in a + b:
            depth[leaf] += 1
        heapq.heappush(heap, (w1 + w2, min(s1, s2), a + b))
    return depth


@SETTINGS
@given(histogram=st.lists(st.integers(0, 20), max_size=600))
@example(histogram=[3] * 40)  # ties everywhere
def test_huffman_tree_is_the_stated_rule(histogram):
    """The compiled tree builder picks the tree the rule picks, ties included (every encoder builds one code)."""
    symbols, lengths = huffman.code_lengths(np.array(histogram, np.int64))
    assert dict(zip(symbols.tolist(), lengths.tolist())) == tree_depths(histogram)


@SETTINGS
@given(weights=st.lists(st.integers(1, 50_000), min_size=2, max_size=40), seed=st.integers(0, 2 ** 32 - 1))
@example(weights=[round(1.618034 ** k / 2.236068) for k in range(1, 31)], seed=0)  # Fibonacci: codes of 1..29 bits
def test_huffman_table_decoder_matches_reference(weights, seed):
    """The table-driven decoder against the reference's prefix matching, on codebooks whose longest codes are
    longer than the table (they continue bit by bit) and with the data cut short (it runs out)."""
    histogram = np.array(weights, np.int64)
    values = np.random.default_rng(seed).choice(histogram.size, 60, p=histogram / histogram.sum())
    values[:histogram.size // 2] = np.argsort(histogram)[:histogram.size // 2]  # the longest codes, too
    symbols, lengths = huffman.code_lengths(histogram)
    book = reference.canonical(symbols.tolist(), lengths.tolist())
    data = huffman.encode(values, symbols, lengths)
    assert data == reference.to_bytes("".join(book[v] for v in values.tolist()))
    assert huffman.decode(data, symbols, lengths, values.size, "test").tolist() == values.tolist()
    with pytest.raises(MalformedPackage):
        huffman.decode(data[:-1], symbols, lengths, values.size, "test")


@SETTINGS
@given(rows=st.integers(1, 8), data=st.data())
def test_combine_sums_in_rank_order(rows, data):
    """The combine kernel is Python's float64 sum, rank by rank, element by element (a list of rows or a 2-D
    array alike)."""
    decoded = [np.array(data.draw(st.lists(FLOATS, min_size=5, max_size=5)), np.float32) for _ in range(rows)]
    want = [sum((float(d[i]) for d in decoded[1:]), float(decoded[0][i])) for i in range(5)]
    codec = parse("uniform8")
    assert codec.combine(decoded).tolist() == want == codec.combine(np.stack(decoded)).tolist()


def huffman_package(first: int, fields: list[int], n_bits: int = 4, codes: bytes = b"") -> bytes:
    """An adaptive-huffman package over [0, 1] with N = n_bits and a codebook of the given 5-bit fields."""
    bits = "".join(format(f, "05b") for f in fields)
    bits += "0" * (-len(bits) % 8)
    table = bytes(int(bits[i:i + 8], 2) for i in range(0, len(bits), 8))
    return struct.pack(">ffBHI", 0, 1, n_bits, first, len(fields)) + table + codes


def test_a_hand_made_huffman_package_decodes():
    # symbols 2 (length 1: code 0), 3 and 4 (length 2: codes 10, 11); elements 2, 4, 3, 2 are 0 11 10 0
    values = parse("adaptive-huffman").decode(huffman_package(2, [2, 3, 3], codes=bytes([0b01110000])), 4)
    assert values.tolist() == [(q + 0.5) / 16 for q in (2, 4, 3, 2)]


MALFORMED = {
    "uniform8": [b"", b"\0" * 8, struct.pack(">ffB", 0, 1, 7) + b"\0\0", struct.pack(">ffB", 0, 1, 8) + b"\0",
                 struct.pack(">ffB", 1, 0, 8) + b"\0\0", struct.pack(">ffB", np.nan, 1, 8) + b"\0\0",
                 struct.pack(">ffB", 0, 1, 8) + b"\0\0\0"],
    "adaptive": [struct.pack(">ffB", 0, 1, 0) + b"", struct.pack(">ffB", 0, 1, 17) + b"\0" * 5,
                 struct.pack(">ffB", 0, np.inf, 8) + b"\0\0"],
    "adaptive-huffman": [
        huffman_package(0, [2] * 17),  # oversized: 17 symbols over an alphabet of 16
        huffman_package(15, [1, 2]),  # past the alphabet
        huffman_package(0, [2, 2, 2], codes=b"\0"),  # inconsistent: three codes of length 1
        huffman_package(0, [2, 3]),  # incomplete: lengths 1 and 2
        huffman_package(0, [2, 0]),  # the range ends on an absent symbol
        huffman_package(0, [2]),  # a lone symbol with a length of 1
        huffman_package(0, [2, 2], codes=b"\x41"),  # 2 elements: 01, then padding bits that are not zero
        huffman_package(0, [2, 2], codes=b""),  # runs out
        huffman_package(0, [2, 2], codes=b"\0\0"),  # a byte left over
        huffman_package(0, []),  # no codebook for two elements
        huffman_package(3, []),  # an empty codebook starting at a symbol
        huffman_package(0, [2, 2], n_bits=17),  # N out of range
        huffman_package(0, [2, 2], n_bits=1)[:-1]],  # truncated codebook
    "lloyd1": [b"\2" + b"\0" * 16 + b"\0", b"\1" + struct.pack(">ff", 0, np.nan) + b"\0", b"\1\0\0"],
    "bitmask": [b"\x7f\x80\0\0", b"\0\0\0", b"\0\0\0\0\0"],
    "qsgd2": [struct.pack(">d", 1) + bytes([0b011_00000]), struct.pack(">d", -1) + b"\0", b"\0\0",
              struct.pack(">d", np.inf) + b"\0"],
    "terngrad": [struct.pack(">f", 1) + bytes([0b11_000000]), struct.pack(">f", np.nan) + b"\0", b"\0\0\0\0"],
    "signsgd": [b"\1", b"", b"\0\0"],
    "topk0.5": [struct.pack(">If", 2, 1.0), struct.pack(">IfIf", 1, 1.0, 0, 1.0), struct.pack(">IfIf", 0, 1.0, 1, 1.0),
                struct.pack(">If", 0, np.inf), struct.pack(">If", 0, 1.0)[:7]],
    "randomk0.5": [struct.pack(">If", 2, 1.0), struct.pack(">IfIf", 1, 1.0, 1, 1.0), b"\0" * 9],
    "powersgd2": [struct.pack(">ff", 1, np.nan), b"\0" * 7],
}


@pytest.mark.parametrize(("name", "package"), [(n, p) for n, ps in MALFORMED.items() for p in ps])
def test_malformed_packages_raise(name, package):
    with pytest.raises(MalformedPackage):
        parse(name).decode(package, 2)


def test_signsgd_result_is_validated():
    with pytest.raises(MalformedPackage):
        parse("signsgd").decode_result(b"\x01", 2)


@pytest.mark.parametrize("name", NAMES)
@SETTINGS
@given(data=st.data(), count=st.integers(0, 40))
def test_any_bytes_decode_or_raise_malformed(name, data, count):
    """Garbage, and valid packages truncated, extended or with one byte changed: ``count`` float32 values (finite)
    or MalformedPackage, never another exception."""
    codec = parse(name)
    valid = codec.encode(gaussian(count, data.draw(st.integers(0, 9))), 3, 0)
    package = data.draw(st.one_of(
        st.binary(max_size=300),
        st.integers(0, len(valid)).map(lambda cut: valid[:cut]),
        st.binary(min_size=1, max_size=4).map(lambda tail: valid + tail),
        st.tuples(st.integers(0, max(len(valid) - 1, 0)), st.integers(0, 255)).map(
            lambda change: valid[:change[0]] + bytes([change[1]]) + valid[change[0] + 1:])))
    try:
        values = codec.decode(package, count)
    except MalformedPackage:
        return
    assert values.dtype == np.float32 and values.shape == (count,) and np.all(np.isfinite(values))


def test_powersgd_recovers_a_low_rank_sum_and_agrees_across_ranks():
    codec, rng = parse("powersgd2"), np.random.default_rng(4)
    u, v = rng.standard_normal((30, 2)), rng.standard_normal((20, 2))
    gradients = [(u @ np.diag(rng.uniform(0.5, 2, 2)) @ v.T).astype(np.float32) for _ in range(3)]
    states = [LowRank((30, 20), 2, key=11) for _ in gradients]
    p = allreduce(codec, [s.first(g) for s, g in zip(states, gradients)])
    q = allreduce(codec, [s.second(p) for s in states])
    updates = [s.finish(q) for s in states]
    assert all(update.tobytes() == updates[0].tobytes() for update in updates)
    total = np.sum(gradients, axis=0, dtype=np.float64).reshape(-1)
    assert np.linalg.norm(updates[0] - total) < 1e-5 * np.linalg.norm(total)


def test_powersgd_error_feedback_converges():
    """A full-rank gradient sent at rank 1: over 200 steps the updates sum to within 5% of the gradients'."""
    codec, gradient = parse("powersgd1"), gaussian(12 * 8, 6).reshape(12, 8)
    state, sent = LowRank((12, 8), 1, key=3), np.zeros(gradient.size)
    for _ in range(200):
        p = allreduce(codec, [state.first(gradient)])
        sent += state.finish(allreduce(codec, [state.second(p)]))
    assert np.linalg.norm(sent - 200 * gradient.reshape(-1)) < 0.05 * 200 * np.linalg.norm(gradient)
