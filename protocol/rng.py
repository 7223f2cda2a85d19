"""Counter-based random bits: a pure function of (seed, stream, element index).

Every stochastic rounding in intml draws its bits here, never from a stateful generator, so that the same
inputs and keys give the same codes whatever the chunking, the call order, the thread count, or the order in
which packets arrive. That is what makes an allreduce bit-identical with and without loss.

Spec (the numpy oracle in ``protocol.reference`` restates it independently):

* ``key = splitmix64(splitmix64(seed) ^ stream)``, all arithmetic mod 2**64.
* The element index ``i`` (uint64) is split into ``hi = i >> 32`` and ``lo = i & 0xFFFFFFFF``.
  ``block_key = splitmix64(key + hi) >> 32`` is fixed for 2**32 consecutive elements.
* ``bits32(i) = lowbias32(lo ^ block_key)``.

lowbias32 is Chris Wellons' 32-bit integer hash (a bijection with very low avalanche bias). One 32-bit hash per
element is what lets the encoder run at memory speed: it vectorises to 8 lanes of AVX2, where a 64-bit hash
cannot (AVX2 has no 64-bit vector multiply). Two streams see the same hash inputs only as a permutation of each
other's indices (``lo ^ kA == lo' ^ kB``), never at the same element, so different ranks' roundings of the same
element are independent. A long encode forms each word's first multiply from a table instead (block_heads):
the same words, one multiply per element fewer.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit

from intml.protocol.lanes import Lanes, mul32

MASK64 = (1 << 64) - 1
_U32 = np.uint32
_U64 = np.uint64


def splitmix64_int(x: int) -> int:
    """splitmix64 finaliser on a Python int (mod 2**64)."""
    x = (x + 0x9E3779B97F4A7C15) & MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & MASK64
    return x ^ (x >> 31)


_HEAD_MULTIPLIER = 0x7FEB352D
_TAIL_MULTIPLIER = 0x846CA68B


@njit(inline="always")
def lowbias32_tail(y):
    """lowbias32 after its first multiply (lowbias32_head's result)."""
    y = _U32(y ^ (y >> 15))
    y = mul32(y, _U32(_TAIL_MULTIPLIER))
    return _U32(y ^ (y >> 16))


def lowbias32_tail_lanes(lanes: Lanes, y: ir.Value) -> ir.Value:
    """lowbias32_tail of each lane of y, in LLVM IR (protocol.lanes.Lanes)."""
    b = lanes.builder
    y = b.xor(y, b.lshr(y, lanes.const(15)))
    y = b.mul(y, lanes.const(_TAIL_MULTIPLIER))
    return b.xor(y, b.lshr(y, lanes.const(16)))


@njit(inline="always")
def lowbias32_head(x):
    return mul32(_U32(x ^ (x >> 16)), _U32(_HEAD_MULTIPLIER))


@njit(inline="always")
def lowbias32(x):
    return lowbias32_tail(lowbias32_head(x))


@njit(inline="always")
def _splitmix64(x):
    x = _U64(x + _U64(0x9E3779B97F4A7C15))
    x = _U64((x ^ (x >> _U64(30))) * _U64(0xBF58476D1CE4E5B9))
    x = _U64((x ^ (x >> _U64(27))) * _U64(0x94D049BB133111EB))
    return _U64(x ^ (x >> _U64(31)))


@njit(inline="always")
def derive_key(seed, stream):
    """The 64-bit key of one random stream, inside kernels (the switch derives one per allreduce)."""
    return _splitmix64(_U64(_splitmix64(_U64(seed)) ^ _U64(stream)))


def stream_key(seed: int, stream: int) -> int:
    """The 64-bit key of one random stream: every kernel takes this, not the seed."""
    if not 0 <= seed <= MASK64 or not 0 <= stream <= MASK64:
        raise ValueError(f"seed and stream must be integers in [0, 2**64), got seed={seed}, stream={stream}")
    return int(_stream_key(_U64(seed), _U64(stream)))


@njit(cache=True)
def _stream_key(seed, stream):
    return derive_key(seed, stream)


@njit(inline="always")
def block_key(key, hi):
    """The 32-bit key for elements [hi * 2**32, (hi + 1) * 2**32)."""
    return _U32(_splitmix64(_U64(_U64(key) + _U64(hi))) >> _U64(32))


BLOCK = 4096  # kernels walk their input in blocks aligned to this, so no block straddles a 2**32 boundary
_LOW = BLOCK - 1  # block_heads needs BLOCK a power of two no larger than 2**16
_HIGH = 0xFFFFFFFF ^ _LOW


@njit(cache=True, nogil=True, boundscheck=False)
def _fill_heads(heads, first, mask):
    for j in range(heads.size):
        heads[j] = mul32(_U32(_U32(first + j) ^ mask), _U32(_HEAD_MULTIPLIER))


@njit(inline="always")
def block_heads(heads, k, lo0, span, filled):
    """The first multiply of bits32 for ``span`` elements from lo0 (k = their block key) without a multiply per
    element: lowbias32_head(lo ^ k) == heads[lo % BLOCK] + offset, for lo in [lo0, lo0 + span).

    Why it holds: with lo = base | j (base a multiple of BLOCK, j < BLOCK), x = lo ^ k has x >> 16 = c fixed over
    the block, so x ^ (x >> 16) = lo ^ m, m = k ^ c, which is (base ^ m with the low bits cleared) + (j ^ (m & _LOW))
    on disjoint bits, and the multiply distributes over that sum. heads (BLOCK uint32) keeps mul(j ^ mask) for
    the mask in ``filled`` (-1: none), which stays the same for the 2**16 / BLOCK blocks that share c, so a long
    walk fills it once per 2**16 elements. Returns (offset, filled)."""
    s0 = int(lo0 & _U32(_LOW))
    base = _U32(lo0 - _U32(s0))
    m = _U32(k ^ _U32(_U32(base ^ k) >> _U32(16)))
    mask = np.int64(m & _U32(_LOW))
    if mask != filled:
        _fill_heads(heads[s0:s0 + span], s0, _U32(mask))
        filled = mask if span == BLOCK else np.int64(-1)  # a partial fill serves no other block
    return mul32(_U32(_U32(base ^ m) & _U32(_HIGH)), _U32(_HEAD_MULTIPLIER)), filled


@njit(cache=True, nogil=True, boundscheck=False)
def fill_bits32(out, key, offset):
    """out[j] = bits32(offset + j) for the stream ``key``."""
    n = out.size
    start = 0
    while start < n:
        idx = _U64(offset + start)
        lo0 = _U32(idx & _U64(0xFFFFFFFF))
        span = min(n - start, (1 << 32) - int(lo0))
        k = block_key(key, idx >> _U64(32))
        for j in range(span):
            out[start + j] = lowbias32(_U32(_U32(lo0 + _U32(j)) ^ k))
        start += span


def random_bits(seed: int, stream: int, offset: int, n: int) -> np.ndarray:
    """The n 32-bit random words of a stream starting at element ``offset`` (for tests and tools)."""
    out = np.empty(n, np.uint32)
    fill_bits32(out, _U64(stream_key(seed, stream)), _U64(offset))
    return out
