"""The cnat8 codec: one C_nat code (protocol.cnat) per element, relative to the slot's floor f (the exponent of
its unit, from the agreed exponent: protocol.arith.cnat_floor). A worker encodes its chunk at that floor, so its
codes hold k = e - f in [0, s(n)]; the switch adds them as +-2**k units, whatever the floor, and re-encodes the
sum with C_nat (k = b + up <= 31), so the result decodes straight to float32 at the same floor.

The functions have the signatures every codec module shares (see protocol.codecs)."""

from __future__ import annotations

import numpy as np
from numba import njit

from intml.protocol.arith import (
    CNAT_RANGE,
    PRECODED,
    RESULT_K_MAX,
    add_fixed_rows,
    cnat_floor,
    data_k_max,
    lower_codes,
    sum_to_codes_kernel,
)
from intml.protocol.cnat import (
    codes_in_range,
    codes_in_range_or_nonfinite,
    decode_kernel,
    encode_into,
    has_underflow,
    put_nonfinite_codes,
    take_nonfinite_codes,
)
from intml.protocol.codec import Codec

ID = Codec.CNAT8
NAME = "cnat8"
PAYLOAD_DTYPE = ID.payload_dtype
WIDTH = PAYLOAD_DTYPE.itemsize
EXP_RANGE = CNAT_RANGE
# The worker reads a chunk a window ahead: protocol.arith.precode_chunk finds its exponent proposal and encodes it
# at its own floor (encode_chunk then lowers the codes to the agreed floor, or re-encodes if that floor matters).
PRECODES = True


@njit(inline="always")
def encode_chunk(x, payload, key, offset, exp, vbits, low, local_exp, stochastic, heads):
    """Codes of float32 x (elements offset.. of the tensor, random words keyed by key) at the floor of agreed
    exponent exp, into payload. low and local_exp are precode_chunk's low word and exponent proposal for a
    payload that already holds x's codes at the proposal's floor; low without the PRECODED bit (0) asks for an
    encode. A precoded payload needs a new encode only if a value lies below the agreed floor (or the agreed
    exponent is below the proposal, which an honest switch never returns); else its k are lowered by the floors'
    difference. Not stochastic: encode_nearest's codes (a precoded payload must be too). heads: the encode's
    scratch (protocol.cnat.encode_into)."""
    floor = cnat_floor(exp, vbits)
    own = cnat_floor(local_exp, vbits)
    if encodes_again(low, floor, own):
        encode_into(x, payload, key, np.uint64(offset), floor, stochastic, heads)
    elif floor > own:
        lower_codes(payload, floor - own)


@njit(inline="always")
def encodes_again(low, floor, own):
    """Whether a chunk's codes at floor ``own`` (precode_chunk's, with its low word; low without the PRECODED bit:
    none) must be encoded again from the values at ``floor``, rather than lowered to it: the one case a worker
    holding only codes (worker.gpu's precoded allreduce) cannot serve itself."""
    return (low & np.uint32(PRECODED)) == np.uint32(0) or floor < own or has_underflow(low, floor)


@njit(inline="always")
def check_payload(payload, exp, vbits):
    """The switch's check of a contribution: every code is 0 or +-2**(f + k) with k <= T - f <= s(n) (only 0 when
    the chunk is all zero, exp = NO_EXP)."""
    return codes_in_range(payload, data_k_max(exp, vbits))


@njit(inline="always")
def check_nonfinite(payload, exp, vbits):
    """take_nonfinite's check alone: whether it would take the payload (nothing changes)."""
    return codes_in_range_or_nonfinite(payload, data_k_max(exp, vbits))


@njit(inline="always")
def take_nonfinite(payload, exp, vbits, flags):
    """The switch's check of a contribution that failed check_payload: if every code passes it or is a non-finite
    code, flags |= each lane's flags, the non-finite codes become 0 (added as nothing) and True; else False,
    nothing changed."""
    if not check_nonfinite(payload, exp, vbits):
        return False
    take_nonfinite_codes(payload, flags)
    return True


@njit(inline="always")
def put_nonfinite(payload, flags):
    """The result's lanes with flags become their non-finite codes; returns their count."""
    return put_nonfinite_codes(payload, flags)


@njit(inline="always")
def contribution_bound(exp, vbits):
    """A valid code adds +-2**k with k <= data_k_max (0 only, for an all-zero chunk)."""
    k = data_k_max(exp, vbits)
    return np.int64(0) if k < 0 else np.int64(1) << k


@njit(inline="always")
def add_payloads(data, rows, k, col, acc, exp, vbits, first):
    """acc = (first) or += the integer values +-2**k of the payloads data[rows[t], col:] for t < k."""
    add_fixed_rows(data, rows, k, col, acc, first)


@njit(inline="always")
def encode_result(acc, payload, key, offset, exp, vbits, stochastic):
    """The switch's stochastic (or nearest) C_nat re-encode of the sums acc into payload; returns the count of
    elements whose rounded sum exceeds float32 (they decode to +-Inf)."""
    return sum_to_codes_kernel(acc, payload, key, np.uint64(offset), cnat_floor(exp, vbits), stochastic)


@njit(inline="always")
def check_result(payload, exp, vbits):
    """The worker's check of a result: every code is 0, has k <= 31 (a re-encoded 31-bit sum) or is non-finite."""
    return codes_in_range(payload, RESULT_K_MAX) or codes_in_range_or_nonfinite(payload, RESULT_K_MAX)


@njit(inline="always")
def decode_result(payload, exp, vbits, out):
    """float32 out = the values of the result codes at the chunk's floor."""
    decode_kernel(payload, out.view(np.uint32), cnat_floor(exp, vbits))
