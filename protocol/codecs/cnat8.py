"""The cnat8 codec: one C_nat code (protocol.cnat) per element. A worker encodes its chunk with the floor of the
agreed exponent; the switch adds codes as +-2**(e - floor) in units of 2**floor and re-encodes the sum with C_nat
(protocol.arith), so the result decodes straight to float32.

The functions have the signatures every codec module shares (see protocol.codecs)."""

from __future__ import annotations

import numpy as np
from numba import njit

from intml.protocol.arith import CNAT_RANGE, add_fixed_rows, cnat_floor, sum_to_codes_kernel
from intml.protocol.cnat import E_MAX, E_MIN, codes_in_range, decode_kernel, encode_kernel, has_underflow
from intml.protocol.wire import NO_EXP, Codec

ID = Codec.CNAT8
NAME = "cnat8"
PAYLOAD_DTYPE = np.dtype(np.uint8)
WIDTH = PAYLOAD_DTYPE.itemsize
EXP_RANGE = CNAT_RANGE
# The worker reads a chunk once, a window ahead: protocol.arith.precode_chunk encodes it at the lowest floor and
# finds its exponent proposal in the same pass (encode_chunk then re-encodes only if the agreed floor matters).
PRECODES = True


@njit(inline="always")
def encode_chunk(x, payload, key, offset, exp, vbits, low):
    """Codes of float32 x (elements offset.. of the tensor, random words keyed by key) at the floor of agreed
    exponent exp, into payload. low is precode_chunk's smallest-magnitude word for a payload that already holds
    x's codes at the lowest floor (then only a value below the agreed floor needs a new encode), or 0 to encode."""
    floor = cnat_floor(exp, vbits)
    if has_underflow(low, floor):
        encode_kernel(x, payload, key, np.uint64(offset), floor, True)


@njit(inline="always")
def check_payload(payload, exp, vbits):
    """The switch's check of a contribution: every code is 0 or +-2**e with floor <= e <= exp (only 0 when the
    chunk is all zero, exp = NO_EXP)."""
    floor = cnat_floor(exp, vbits)
    return codes_in_range(payload, floor, floor - 1 if exp == NO_EXP else exp)


@njit(inline="always")
def add_payloads(data, rows, k, col, acc, exp, vbits, first):
    """acc = (first) or += the integer values of the payloads data[rows[t], col:] for t < k."""
    add_fixed_rows(data, rows, k, col, acc, cnat_floor(exp, vbits), first)


@njit(inline="always")
def encode_result(acc, payload, key, offset, exp, vbits):
    """The switch's stochastic C_nat re-encode of the sums acc into payload; returns the saturated count."""
    return sum_to_codes_kernel(acc, payload, key, np.uint64(offset), cnat_floor(exp, vbits))


@njit(inline="always")
def check_result(payload, exp, vbits):
    """The worker's check of a result: every code valid (a sum may exceed the chunk's exponent, up to E_MAX)."""
    return codes_in_range(payload, E_MIN, E_MAX)


@njit(inline="always")
def decode_result(payload, exp, vbits, out):
    """float32 out = the values of the result codes."""
    decode_kernel(payload, out.view(np.uint32))
