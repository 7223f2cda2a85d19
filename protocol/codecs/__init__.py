"""The payload codecs: one module per codec, each with the same interface, and the one place that branches on a
codec id.

A codec module has
    ID             the wire's ``Codec`` value (the header's and the JOIN's ``codec`` field)
    NAME           what users and command lines call it
    PAYLOAD_DTYPE  the numpy dtype of one payload element on the wire (big-endian; protocol.codec defines it per id);
                   WIDTH = its size in bytes
    EXP_RANGE      (lo, hi): the range the per-chunk exponents E are clipped to (protocol.arith: float32's, both)
    PRECODES       whether the worker encodes a chunk a window ahead, finding its exponent proposal in the same
                   read (protocol.arith.precode_chunk), or finds all exponents up front and encodes on sending
and Numba functions with these signatures (payload: the uint8 bytes of a datagram's elements; exp: the chunk's
agreed exponent; vbits: s(n) of the job):
    encode_chunk(x, payload, key, offset, exp, vbits, low, local_exp, stochastic, heads)   a worker's float32
                   chunk x (tensor elements offset.., random words keyed by key; not stochastic: rounded to nearest)
                   into payload; low and local_exp: precode_chunk's word and exponent proposal for a precoded
                   payload, or 0 and any exponent to encode; heads: a uint32 scratch of at least
                   protocol.cnat.heads_size(x.size, stochastic) words, so that the encode allocates nothing
    check_payload(payload, exp, vbits) -> bool               the switch's check of a contribution (finite)
    check_nonfinite(payload, exp, vbits) -> bool             take_nonfinite's check alone, nothing changed
    take_nonfinite(payload, exp, vbits, flags) -> bool       the check of one that failed check_payload: valid
                   with non-finite lanes, whose flags it ORs into the uint8 flags and then zeroes in the payload
    put_nonfinite(payload, flags) -> lanes                   the result's lanes with flags made non-finite
    contribution_bound(exp, vbits) -> int                    the largest |integer value| one contribution adds
                   (a spine's check of a leaf's partial sums: protocol.partial)
    add_payloads(data, rows, k, col, acc, exp, vbits, first) acc = (first) or += the payloads data[rows[t], col:]
                   for t < k, acc being the slot's int32 accumulators (acc.size elements)
    encode_result(acc, payload, key, offset, exp, vbits, stochastic) -> elements beyond float32   the switch's
                   result payload (not stochastic: rounded to nearest)
    check_result(payload, exp, vbits) -> bool                the worker's check of a result
    decode_result(payload, exp, vbits, out)                  float32 out = the result's values

The codec functions and the dispatchers below (which take the codec id first) are all ``inline="always"``: they
compile into the kernel that calls them, under its flags (boundscheck=False), so a kernel built on them gets the
code its own per-codec loops had, and a codec id known to the kernel costs one compare per call. Adding a codec: its module, a
``Codec`` value and its payload dtype in protocol.codec, an entry in CODECS and a branch in each dispatcher.
"""

from __future__ import annotations

from types import ModuleType

from numba import njit

from intml.protocol.codecs import cnat8, int32

CODECS: tuple[ModuleType, ...] = (cnat8, int32)
BY_ID: dict[int, ModuleType] = {codec.ID: codec for codec in CODECS}
BY_NAME: dict[str, ModuleType] = {codec.NAME: codec for codec in CODECS}


@njit(inline="always")
def width(codec):
    return cnat8.WIDTH if codec == cnat8.ID else int32.WIDTH


@njit(inline="always")
def exp_range(codec):
    return cnat8.EXP_RANGE if codec == cnat8.ID else int32.EXP_RANGE


@njit(inline="always")
def precodes(codec):
    return cnat8.PRECODES if codec == cnat8.ID else int32.PRECODES


@njit(inline="always")
def encode_chunk(codec, x, payload, key, offset, exp, vbits, low, local_exp, stochastic, heads):
    if codec == cnat8.ID:
        cnat8.encode_chunk(x, payload, key, offset, exp, vbits, low, local_exp, stochastic, heads)
    else:
        int32.encode_chunk(x, payload, key, offset, exp, vbits, low, local_exp, stochastic, heads)


@njit(inline="always")
def check_payload(codec, payload, exp, vbits):
    if codec == cnat8.ID:
        return cnat8.check_payload(payload, exp, vbits)
    return int32.check_payload(payload, exp, vbits)


@njit(inline="always")
def check_nonfinite(codec, payload, exp, vbits):
    if codec == cnat8.ID:
        return cnat8.check_nonfinite(payload, exp, vbits)
    return int32.check_nonfinite(payload, exp, vbits)


@njit(inline="always")
def take_nonfinite(codec, payload, exp, vbits, flags):
    if codec == cnat8.ID:
        return cnat8.take_nonfinite(payload, exp, vbits, flags)
    return int32.take_nonfinite(payload, exp, vbits, flags)


@njit(inline="always")
def put_nonfinite(codec, payload, flags):
    if codec == cnat8.ID:
        return cnat8.put_nonfinite(payload, flags)
    return int32.put_nonfinite(payload, flags)


@njit(inline="always")
def contribution_bound(codec, exp, vbits):
    if codec == cnat8.ID:
        return cnat8.contribution_bound(exp, vbits)
    return int32.contribution_bound(exp, vbits)


@njit(inline="always")
def add_payloads(codec, data, rows, k, col, acc, exp, vbits, first):
    if codec == cnat8.ID:
        cnat8.add_payloads(data, rows, k, col, acc, exp, vbits, first)
    else:
        int32.add_payloads(data, rows, k, col, acc, exp, vbits, first)


@njit(inline="always")
def encode_result(codec, acc, payload, key, offset, exp, vbits, stochastic):
    if codec == cnat8.ID:
        return cnat8.encode_result(acc, payload, key, offset, exp, vbits, stochastic)
    return int32.encode_result(acc, payload, key, offset, exp, vbits, stochastic)


@njit(inline="always")
def check_result(codec, payload, exp, vbits):
    if codec == cnat8.ID:
        return cnat8.check_result(payload, exp, vbits)
    return int32.check_result(payload, exp, vbits)


@njit(inline="always")
def decode_result(codec, payload, exp, vbits, out):
    if codec == cnat8.ID:
        cnat8.decode_result(payload, exp, vbits, out)
    else:
        int32.decode_result(payload, exp, vbits, out)
