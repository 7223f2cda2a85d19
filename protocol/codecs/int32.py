"""The int32 codec, SwitchML's baseline: a worker sends q = rint(x * 2**(s - E)) as a big-endian int32 (s = s(n),
E the agreed exponent, protocol.arith), the switch adds the integers and sends the sums back as they are, and
the worker scales them by 2**(E - s).

The functions have the signatures every codec module shares (see protocol.codecs)."""

from __future__ import annotations

import numpy as np
from numba import njit

from intml.protocol.arith import INT32_NONFINITE, INT32_RANGE, dequantize, int32_scale_exponent, quantize_lane
from intml.protocol.cnat import NAN_FLAGS
from intml.protocol.codec import Codec
from intml.protocol.lanes import load_be32, store_be32

ID = Codec.INT32
NAME = "int32"
PAYLOAD_DTYPE = ID.payload_dtype
WIDTH = PAYLOAD_DTYPE.itemsize
EXP_RANGE = INT32_RANGE
# The encoding depends on the agreed exponent throughout, so nothing can be encoded before it is known: the
# worker finds every chunk's exponent up front (protocol.arith.chunk_exponents_kernel) and encodes when it sends.
PRECODES = False


@njit(inline="always")
def encode_chunk(x, payload, key, offset, exp, vbits, low, local_exp, stochastic, heads):
    """payload = rint(x * 2**(s - exp)) clamped to +-2**s, big-endian, and INT32_NONFINITE + flags for a NaN or
    an infinity (key, offset, low, local_exp, stochastic and heads are unused: int32 rounds to nearest always)."""
    scale = 2.0 ** int32_scale_exponent(exp, vbits)
    limit = np.int64(1) << vbits
    bits = x.view(np.uint32)
    for i in range(x.size):
        store_be32(payload, WIDTH * i, quantize_lane(x[i], bits[i], scale, limit))


@njit(inline="always")
def check_payload(payload, exp, vbits):
    """Every value lies in [-2**s, 2**s] (s = vbits <= 30), so n of them cannot overflow; a min/max reduction
    vectorises."""
    limit = np.int64(1) << vbits
    low = high = np.int32(0)
    for i in range(payload.size // WIDTH):
        v = load_be32(payload, WIDTH * i)
        low = min(low, v)
        high = max(high, v)
    return low >= -limit and high <= limit


@njit(inline="always")
def words_ok(payload, limit):
    """Every word lies in [-limit, limit] or is reserved (INT32_NONFINITE + flags)."""
    for i in range(payload.size // WIDTH):
        v = load_be32(payload, WIDTH * i)
        if (v < -limit or v > limit) and not (INT32_NONFINITE < v <= INT32_NONFINITE + NAN_FLAGS):
            return False
    return True


@njit(inline="always")
def check_nonfinite(payload, exp, vbits):
    """take_nonfinite's check alone: whether it would take the payload (nothing changes)."""
    return words_ok(payload, np.int64(1) << vbits)


@njit(inline="always")
def take_words(payload, limit, flags):
    """take_nonfinite with the bound +-limit: a leaf's partial sums (protocol.partial) carry flags the same way."""
    if not words_ok(payload, limit):
        return False
    for i in range(payload.size // WIDTH):
        v = load_be32(payload, WIDTH * i)
        if v < -limit:
            flags[i] |= np.uint8(np.int64(v) - INT32_NONFINITE)
            store_be32(payload, WIDTH * i, np.int32(0))
    return True


@njit(inline="always")
def take_nonfinite(payload, exp, vbits, flags):
    """The switch's check of a contribution that failed check_payload: if every word lies in [-2**s, 2**s] or is
    reserved (INT32_NONFINITE + flags), flags |= each lane's flags, the reserved words become 0 (added as
    nothing) and True; else False, nothing changed."""
    return take_words(payload, np.int64(1) << vbits, flags)


@njit(inline="always")
def put_nonfinite(payload, flags):
    """The result's lanes with flags become their reserved words (no sum of n values reaches them); returns their
    count."""
    count = 0
    for i in range(flags.size):
        if flags[i]:
            store_be32(payload, WIDTH * i, np.int32(INT32_NONFINITE + np.int64(flags[i])))
            count += 1
    return count


@njit(inline="always")
def contribution_bound(exp, vbits):
    """check_payload's bound: 2**s."""
    return np.int64(1) << vbits


@njit(inline="always")
def add_payloads(data, rows, k, col, acc, exp, vbits, first):
    """acc = (first) or += the int32 payloads data[rows[t], col:] for t < k, wrapping as the switch's registers."""
    for t in range(k):
        p = data[rows[t]]
        once = first and t == 0
        for i in range(acc.size):
            v = load_be32(p, col + WIDTH * i)
            acc[i] = v if once else np.int32(acc[i] + v)


@njit(inline="always")
def encode_result(acc, payload, key, offset, exp, vbits, stochastic):
    """payload = the sums, big-endian; nothing saturates (returns 0)."""
    for i in range(acc.size):
        store_be32(payload, WIDTH * i, acc[i])
    return 0


@njit(inline="always")
def check_result(payload, exp, vbits):
    """Every sum of n values in [-2**s, 2**s] is a valid int32, and the others are reserved words: nothing to
    check."""
    return True


@njit(inline="always")
def decode_result(payload, exp, vbits, out):
    """float32 out = sums * 2**(exp - s), and +-Inf or NaN for a reserved word."""
    unit = 2.0 ** -int32_scale_exponent(exp, vbits)
    for i in range(out.size):
        out[i] = dequantize(load_be32(payload, WIDTH * i), unit)
