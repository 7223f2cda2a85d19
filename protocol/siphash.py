"""SipHash-2-4 (Aumasson and Bernstein, 2012), the keyed MAC of DATA and RESULT datagrams: Numba functions for the
kernels, and a plain-Python reference they are held to bit for bit (tests/protocol/test_data_mac.py, which also checks the
reference against the paper's test vectors).

A 128-bit key is two 64-bit words, k0 and k1, the little-endian halves of its 16 bytes (``key_words``); the tag is
the 64-bit output written little-endian, as the reference implementation emits it. SipHash is a PRF designed for
short inputs, fast in software with no tables and no carries beyond 64-bit additions: a per-packet MAC a CPU
data plane can afford (docs/protocol.md, "DATA/RESULT MAC", has its measured cost).
"""

from __future__ import annotations

import numpy as np
from numba import njit

from intml.protocol.wire import TAG_SIZE

MASK = (1 << 64) - 1
# "somepseudorandomlygeneratedbytes", the initial state of the paper
INIT = (0x736F6D6570736575, 0x646F72616E646F6D, 0x6C7967656E657261, 0x7465646279746573)


def key_words(key: bytes) -> tuple[int, int]:
    """(k0, k1) of a 16-byte key."""
    if len(key) != 16:
        raise ValueError(f"a SipHash key has 16 bytes, got {len(key)}")
    return int.from_bytes(key[:8], "little"), int.from_bytes(key[8:], "little")


# ---- the plain-Python reference ---------------------------------------------------------------------------------


def _rotl_ref(x: int, b: int) -> int:
    return ((x << b) | (x >> (64 - b))) & MASK


def _sipround_ref(v: list[int]) -> None:
    v[0] = (v[0] + v[1]) & MASK
    v[1] = _rotl_ref(v[1], 13) ^ v[0]
    v[0] = _rotl_ref(v[0], 32)
    v[2] = (v[2] + v[3]) & MASK
    v[3] = _rotl_ref(v[3], 16) ^ v[2]
    v[0] = (v[0] + v[3]) & MASK
    v[3] = _rotl_ref(v[3], 21) ^ v[0]
    v[2] = (v[2] + v[1]) & MASK
    v[1] = _rotl_ref(v[1], 17) ^ v[2]
    v[2] = _rotl_ref(v[2], 32)


def siphash24_ref(k0: int, k1: int, data: bytes) -> int:
    """SipHash-2-4 of `data` under (k0, k1), as the paper specifies it."""
    v = [INIT[0] ^ k0, INIT[1] ^ k1, INIT[2] ^ k0, INIT[3] ^ k1]
    tail = len(data) % 8
    last = int.from_bytes(data[len(data) - tail:], "little") | (len(data) & 0xFF) << 56
    blocks = [int.from_bytes(data[o:o + 8], "little") for o in range(0, len(data) - tail, 8)] + [last]
    for m in blocks:
        v[3] ^= m
        _sipround_ref(v)
        _sipround_ref(v)
        v[0] ^= m
    v[2] ^= 0xFF
    for _ in range(4):
        _sipround_ref(v)
    return v[0] ^ v[1] ^ v[2] ^ v[3]


def tag_ref(k0: int, k1: int, data: bytes) -> bytes:
    """The 8 bytes appended to `data` (a datagram's header and payload)."""
    return siphash24_ref(k0, k1, data).to_bytes(TAG_SIZE, "little")


# ---- Numba, for the kernels -------------------------------------------------------------------------------------


@njit(inline="always")
def _rotl(x, b):
    return (x << np.uint64(b)) | (x >> np.uint64(64 - b))


@njit(inline="always")
def _sipround(v0, v1, v2, v3):
    v0 += v1
    v1 = _rotl(v1, 13) ^ v0
    v0 = _rotl(v0, 32)
    v2 += v3
    v3 = _rotl(v3, 16) ^ v2
    v0 += v3
    v3 = _rotl(v3, 21) ^ v0
    v2 += v1
    v1 = _rotl(v1, 17) ^ v2
    v2 = _rotl(v2, 32)
    return v0, v1, v2, v3


@njit(inline="always")
def _word(p, o, k):
    """The little-endian word of the k <= 8 bytes p[o:o + k]."""
    m = np.uint64(0)
    for i in range(k):
        m |= np.uint64(p[o + i]) << np.uint64(8 * i)
    return m


@njit(cache=True, nogil=True, boundscheck=False)
def siphash24(p, n, k0, k1):
    """SipHash-2-4 of the first n bytes of the uint8 array p under the uint64 words (k0, k1)."""
    k0, k1 = np.uint64(k0), np.uint64(k1)
    v0 = k0 ^ np.uint64(INIT[0])
    v1 = k1 ^ np.uint64(INIT[1])
    v2 = k0 ^ np.uint64(INIT[2])
    v3 = k1 ^ np.uint64(INIT[3])
    full = n - n % 8
    for o in range(0, full, 8):
        m = _word(p, o, 8)
        v3 ^= m
        v0, v1, v2, v3 = _sipround(v0, v1, v2, v3)
        v0, v1, v2, v3 = _sipround(v0, v1, v2, v3)
        v0 ^= m
    m = _word(p, full, n - full) | (np.uint64(n & 0xFF) << np.uint64(56))
    v3 ^= m
    v0, v1, v2, v3 = _sipround(v0, v1, v2, v3)
    v0, v1, v2, v3 = _sipround(v0, v1, v2, v3)
    v0 ^= m
    v2 ^= np.uint64(0xFF)
    for _ in range(4):
        v0, v1, v2, v3 = _sipround(v0, v1, v2, v3)
    return v0 ^ v1 ^ v2 ^ v3


@njit(inline="always")
def put_tag(p, n, k0, k1):
    """Append the tag of p[:n] at p[n:n + TAG_SIZE]; returns the datagram's length with it."""
    tag = siphash24(p, n, k0, k1)
    for i in range(TAG_SIZE):
        p[n + i] = np.uint8((tag >> np.uint64(8 * i)) & np.uint64(0xFF))
    return n + TAG_SIZE


@njit(inline="always")
def tag_ok(p, length, k0, k1):
    """Whether the datagram p[:length] ends in the tag of what precedes it (False if it is too short to)."""
    n = length - TAG_SIZE
    if n < 0:
        return False
    return _word(p, n, TAG_SIZE) == siphash24(p, n, k0, k1)
