"""Tests of protocol.rng: splitmix64 / lowbias32 against independent Python-int arithmetic and published
vectors, the kernel against the numpy oracle (protocol.reference.bits32), stream separation, uniformity and
independence."""

import math

import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from intml.protocol import reference
from numba import njit

from intml.protocol.rng import (
    BLOCK,
    block_heads,
    block_key,
    fill_bits32,
    lowbias32,
    lowbias32_tail,
    random_bits,
    splitmix64_int,
    stream_key,
)

M32 = (1 << 32) - 1
M64 = (1 << 64) - 1
SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])

U64 = st.integers(0, M64)
U32 = st.integers(0, M32)


# --- independent restatements with Python ints ----------------------------------------------------------------


def py_splitmix64(state: int) -> int:
    """First output of Vigna's splitmix64 generator whose state is ``state`` (state += golden gamma, then mix)."""
    z = (state + 0x9E3779B97F4A7C15) % 2**64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) % 2**64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) % 2**64
    return z ^ (z >> 31)


def py_lowbias32(x: int) -> int:
    """Chris Wellons' lowbias32: x ^= x >> 16; x *= 0x7feb352d; x ^= x >> 15; x *= 0x846ca68b; x ^= x >> 16."""
    x ^= x >> 16
    x = (x * 0x7FEB352D) % 2**32
    x ^= x >> 15
    x = (x * 0x846CA68B) % 2**32
    x ^= x >> 16
    return x


def py_bits32(seed: int, stream: int, index: int) -> int:
    key = py_splitmix64(py_splitmix64(seed) ^ stream)
    block = py_splitmix64((key + (index >> 32)) % 2**64) >> 32
    return py_lowbias32((index & M32) ^ block)


def worker_stream(allreduce: int, rank: int) -> int:
    """Stream numbers laid out like protocol.arith's (allreduce << 24 | stage << 16 | rank): realistic keys."""
    return (allreduce << 24) | (1 << 16) | rank


def switch_stream(allreduce: int) -> int:
    return (allreduce << 24) | (2 << 16)


OFFSETS = st.one_of(
    st.sampled_from([0, 1, 4095, 4096, 2**32 - 3, 2**32 - 1, 2**32, 2**33 - 7, 2**63 - 2, 2**63, 2**64 - 4000]),
    st.integers(2**32 - 3000, 2**32 + 10),  # straddles the first 2**32 block boundary
    st.integers(0, 2**64 - 4000),
)


# --- splitmix64 ------------------------------------------------------------------------------------------------


def test_splitmix64_published_vector():
    # Vigna's splitmix64.c seeded with 0: the first outputs are these (published test vector).
    assert splitmix64_int(0) == 0xE220A8397B1DCDAF
    assert py_splitmix64(0) == 0xE220A8397B1DCDAF
    # The k-th output of the generator is the finaliser of state k * gamma.
    published = [0xE220A8397B1DCDAF, 0x6E789E6AA1B965F4, 0x06C45D188009454F, 0xF88BB8A8724C81EC, 0x1B39896A51A8749B]
    assert [splitmix64_int(k * 0x9E3779B97F4A7C15 % 2**64) for k in range(5)] == published


def test_splitmix64_hand_computed_step_by_step():
    # splitmix64(1), each step written out: z = 1 + gamma; then the two xorshift-multiply rounds and a final xorshift.
    z = 0x9E3779B97F4A7C16
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M64
    z ^= z >> 31
    assert splitmix64_int(1) == z
    # wrap-around of the first addition
    assert splitmix64_int(M64) == py_splitmix64(M64)


@SETTINGS
@given(U64)
@example(0)
@example(M64)
@example(2**64 - 0x9E3779B97F4A7C15)  # state + gamma == 0 mod 2**64
def test_splitmix64_matches_python_ints(x):
    assert splitmix64_int(x) == py_splitmix64(x)


@SETTINGS
@given(U64, U64)
@example(0, 0)
@example(M64, M64)
def test_stream_key_matches_definition(seed, stream):
    assert stream_key(seed, stream) == py_splitmix64(py_splitmix64(seed) ^ stream)


@pytest.mark.parametrize("seed, stream", [(-1, 0), (0, -1), (2**64, 0), (0, 2**64)])
def test_stream_key_rejects_out_of_range(seed, stream):
    with pytest.raises(ValueError, match="2\\*\\*64"):
        stream_key(seed, stream)


# --- lowbias32 -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("x", [0, 1, 2, 0x7FFFFFFF, 0x80000000, 0xDEADBEEF, M32])
def test_lowbias32_known_values(x):
    assert int(lowbias32(np.uint32(x))) == py_lowbias32(x)


def test_lowbias32_zero_is_fixed_point():
    # 0 ^ 0 = 0 and 0 * c = 0 at every step
    assert int(lowbias32(np.uint32(0))) == 0


@SETTINGS
@given(U32)
def test_lowbias32_matches_python_ints(x):
    assert int(lowbias32(np.uint32(x))) == py_lowbias32(x)


def test_lowbias32_through_kernel_on_a_range():
    """The kernel's words over 2**16 consecutive indices straddling 2**32 equal the Python-int definition
    lowbias32(lo ^ (splitmix64(key + hi) >> 32)), element by element."""
    seed, stream, offset, n = 12345, 678, 2**32 - 2**15, 2**16  # straddles the 2**32 boundary
    got = random_bits(seed, stream, offset, n)
    want = np.array([py_bits32(seed, stream, offset + j) for j in range(n)], dtype=np.uint32)
    np.testing.assert_array_equal(got, want)



@njit
def _words_through_heads(key, offset, n):
    """bits32 of n elements from offset as an encoder forms them: lowbias32_tail of block_heads' head, one
    aligned block at a time, the heads table kept across blocks."""
    out = np.empty(n, np.uint32)
    heads = np.empty(BLOCK, np.uint32)
    filled = np.int64(-1)
    start = 0
    while start < n:
        idx = np.uint64(offset + start)
        s0 = int(idx % np.uint64(BLOCK))
        end = min(n, start + BLOCK - s0)
        k = block_key(key, idx >> np.uint64(32))
        head_offset, filled = block_heads(heads, k, np.uint32(idx & np.uint64(0xFFFFFFFF)), end - start, filled)
        for j in range(end - start):
            out[start + j] = lowbias32_tail(np.uint32(heads[s0 + j] + head_offset))
        start = end
    return out


@pytest.mark.parametrize("offset, n", [(0, 5), (4095, 2), (2**16 - 5000, 3 * 2**16), (2**32 - 70000, 140_000)])
def test_block_heads_give_the_same_words(offset, n):
    """The encoders' split of lowbias32 (a table of heads per 2**16 elements, one add per element) gives bits32
    word for word: across partial blocks, whole blocks sharing a table, its refills and the 2**32 boundary."""
    key = stream_key(314, 159)
    np.testing.assert_array_equal(_words_through_heads(np.uint64(key), np.uint64(offset), n),
                                  random_bits(314, 159, offset, n))

# --- the kernel against the numpy oracle -----------------------------------------------------------------------


@SETTINGS
@given(seed=U64, stream=U64, offset=OFFSETS, n=st.integers(0, 3000))
@example(seed=0, stream=0, offset=2**32 - 3, n=7)
@example(seed=M64, stream=M64, offset=2**64 - 4000, n=3000)
def test_random_bits_matches_reference(seed, stream, offset, n):
    got = random_bits(seed, stream, offset, n)
    assert got.dtype == np.uint32 and got.shape == (n,)
    want = reference.bits32(stream_key(seed, stream), np.arange(n, dtype=np.uint64) + np.uint64(offset))
    np.testing.assert_array_equal(got, want)


@SETTINGS
@given(seed=U64, stream=U64, offset=OFFSETS, n=st.integers(1, 40))
def test_random_bits_matches_python_ints(seed, stream, offset, n):
    got = random_bits(seed, stream, offset, n)
    assert [int(w) for w in got] == [py_bits32(seed, stream, offset + j) for j in range(n)]


@SETTINGS
@given(seed=U64, stream=U64, offset=OFFSETS, n=st.integers(0, 3000), data=st.data())
def test_random_bits_is_a_pure_function_of_the_index(seed, stream, offset, n, data):
    whole = random_bits(seed, stream, offset, n)
    cut = data.draw(st.integers(0, n))
    parts = np.concatenate([random_bits(seed, stream, offset + cut, n - cut), random_bits(seed, stream, offset, cut)])
    np.testing.assert_array_equal(np.concatenate([whole[cut:], whole[:cut]]), parts)
    out = np.zeros(n, np.uint32)
    fill_bits32(out, np.uint64(stream_key(seed, stream)), np.uint64(offset))
    np.testing.assert_array_equal(out, whole)


# --- separation of streams -------------------------------------------------------------------------------------


def test_different_streams_and_seeds_never_agree_at_the_same_index():
    """Two keys whose block keys differ feed lowbias32 (a bijection) different inputs at every index, so their
    words differ at EVERY index: not just "rarely". (Block keys collide with probability 2**-32 per pair.)"""
    n = 4096
    keys = [(seed, worker_stream(a, rank)) for seed in (0, 1, 2**64 - 1) for a in (0, 1, 5) for rank in range(8)]
    keys += [(seed, switch_stream(a)) for seed in (0, 1) for a in (0, 1, 5)]
    keys += [(0, 1), (1, 0), (0, 2**64 - 1), (2**63, 0)]
    for offset in (0, 2**32 - n // 2):
        words = np.stack([random_bits(seed, stream, offset, n) for seed, stream in keys])
        for i in range(len(keys)):
            same = (words[i + 1 :] == words[i]).sum(axis=1)
            assert not same.any(), f"{keys[i]} agrees with another stream at {same.max()} of {n} indices"


def test_seed_and_stream_are_not_interchangeable():
    assert stream_key(1, 0) != stream_key(0, 1)
    assert not np.array_equal(random_bits(1, 0, 0, 64), random_bits(0, 1, 0, 64))


def test_blocks_above_2_32_get_fresh_words():
    # the same low 32 bits in the next 2**32 block use a different block key
    a = random_bits(7, 9, 5, 1024)
    b = random_bits(7, 9, 2**32 + 5, 1024)
    c = random_bits(7, 9, 2**33 + 5, 1024)
    assert not (a == b).any() and not (b == c).any() and not (a == c).any()


# --- statistics ------------------------------------------------------------------------------------------------

N_STAT = 1 << 20


@pytest.mark.parametrize(
    "seed, stream, offset",
    [(0, 0, 0), (2024, worker_stream(3, 1), 2**32 - N_STAT // 2), (2**64 - 1, switch_stream(9), 2**40)],
)
def test_top_byte_uniform_chi_square(seed, stream, offset):
    """Chi-square of the top 8 bits over 2**20 words: 255 degrees of freedom, mean 255, sd sqrt(510) ~ 22.6.
    Accept within 6 sd either side ([120, 391]); the lower bound catches too-regular output (e.g. a counter, whose
    statistic would be ~0). Under the null hypothesis the two-sided failure probability is below 1e-6."""
    words = random_bits(seed, stream, offset, N_STAT)
    counts = np.bincount(words >> 24, minlength=256)
    expected = N_STAT / 256
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    sd = math.sqrt(2 * 255)
    assert abs(chi2 - 255) <= 6 * sd, chi2


def test_every_bit_is_balanced():
    """Each of the 32 bits is 1 with frequency 1/2 within 6 standard errors (0.5 / sqrt(N) each)."""
    words = random_bits(99, 3, 2**32 - 1000, N_STAT)
    ones = np.array([((words >> np.uint32(b)) & np.uint32(1)).sum() for b in range(32)]) / N_STAT
    assert np.all(np.abs(ones - 0.5) <= 6 * 0.5 / math.sqrt(N_STAT)), ones


def _corr(a: np.ndarray, b: np.ndarray) -> float:
    a = a.astype(np.float64) - a.mean()
    b = b.astype(np.float64) - b.mean()
    return float((a * b).sum() / math.sqrt((a * a).sum() * (b * b).sum()))


@pytest.mark.parametrize("offset", [0, 2**32 - N_STAT // 2])
def test_two_ranks_words_are_uncorrelated(offset):
    """Pearson correlation of two ranks' words at the same indices over N = 2**20 pairs. Under independence its
    standard deviation is 1/sqrt(N) ~ 0.001; accept |r| <= 5/sqrt(N) ~ 0.0049. Same for the top bytes (what the
    encoder's rounding actually depends on), for rank vs switch streams, and for lag-1 within one stream."""
    bound = 5 / math.sqrt(N_STAT)
    a = random_bits(11, worker_stream(1, 0), offset, N_STAT)
    b = random_bits(11, worker_stream(1, 1), offset, N_STAT)
    s = random_bits(11, switch_stream(1), offset, N_STAT)
    assert abs(_corr(a, b)) <= bound
    assert abs(_corr(a >> 24, b >> 24)) <= bound
    assert abs(_corr(a, s)) <= bound
    assert abs(_corr(a[1:], a[:-1])) <= bound
    # agreement of the top bit: 1/2 within 5 standard errors
    assert abs(((a >> 31) == (b >> 31)).mean() - 0.5) <= 5 * 0.5 / math.sqrt(N_STAT)
