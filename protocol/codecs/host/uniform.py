"""``uniform<N>``, seed 001's fixed quantizer: each package's range [w_min, w_max] split into 2**N equal bins, a
value sent as its bin's index and received as the bin's centre.

Package: w_min, w_max (float32), N (uint8), the N-bit codes packed most significant bit first.
The paper's Quantize counts bins down from w_max while its decoder counts up from w_min; here both count up from
w_min, and w_max falls in the last bin (the paper's floor would give it a bin 2**N of its own).
"""

from __future__ import annotations

import numpy as np
from numba import njit

from intml.protocol.codecs.host.base import MalformedPackage
from intml.protocol.codecs.host.packing import IntegerCodec, Reader, pack_codes, unpack_codes

HEADER = ">ffB"
MAX_BITS = 16


def quantize(x: np.ndarray, lo: float, hi: float, bits: int) -> np.ndarray:
    """The bin indices of ``x`` among 2**bits equal bins of [lo, hi], in float64."""
    out = np.zeros(x.size, np.uint32)
    if hi != lo:
        _quantize(np.asarray(x, np.float32), lo, hi - lo, float(2 ** bits), out)
    return out


@njit(cache=True)
def _quantize(x, lo, span, levels, out):
    """floor((x - lo) / span * levels), the last bin holding hi."""
    for i in range(x.size):
        out[i] = min(np.floor((np.float64(x[i]) - lo) / span * levels), levels - 1)


def centres(codes: np.ndarray, lo: float, hi: float, bits: int) -> np.ndarray:
    """The bin centres the codes stand for, in float32."""
    out = np.empty(codes.size, np.float32)
    _centres(np.asarray(codes, np.int64), lo, hi, float(2 ** bits), out)
    return out


@njit(cache=True)
def _centres(codes, lo, hi, levels, out):
    """lo + (hi - lo) * ((code + 0.5) / levels) in float64, rounded to float32."""
    for i in range(codes.size):
        out[i] = lo + (hi - lo) * ((codes[i] + 0.5) / levels)


def range_of(x: np.ndarray) -> tuple[float, float]:
    """A package's [w_min, w_max] (0, 0 for an empty one); + 0.0 makes a -0.0 a 0.0, since which of two zeros is the
    minimum would be up to the implementation."""
    return (float(x.min()) + 0.0, float(x.max()) + 0.0) if x.size else (0.0, 0.0)


def read_range(reader: Reader) -> tuple[float, float, int]:
    """w_min, w_max and N from a package's header: finite, ordered, N in 1..16."""
    lo, hi, bits = reader.take(HEADER[1:])
    if not (np.isfinite(lo) and np.isfinite(hi) and lo <= hi):
        raise MalformedPackage(f"a {reader.codec} package's range [{lo}, {hi}] is not one an encoder sends")
    if not 1 <= bits <= MAX_BITS:
        raise MalformedPackage(f"a {reader.codec} package's N = {bits} is out of 1..{MAX_BITS}")
    return lo, hi, bits


def encode_fixed(x: np.ndarray, bits: int) -> bytes:
    """A package of ``x`` quantized to ``bits`` bits."""
    lo, hi = range_of(x)
    return np.array((lo, hi), ">f4").tobytes() + bytes([bits]) + pack_codes(quantize(x, lo, hi, bits), bits)


def decode_fixed(package: bytes, count: int, codec: str, expected_bits: int | None) -> np.ndarray:
    """The values of a fixed-N package; ``expected_bits`` None accepts any N in 1..16."""
    reader = Reader(package, codec)
    lo, hi, bits = read_range(reader)
    if expected_bits is not None and bits != expected_bits:
        raise MalformedPackage(f"a {codec} package says N = {bits}")
    return centres(unpack_codes(reader.rest(), count, bits, codec), lo, hi, bits)


class Uniform(IntegerCodec):
    wire_id = 16
    unbiased = False
    switch_reason = ("uniform<N> scales by each package's own [w_min, w_max]: "
                     "a switch cannot add codes on different grids")
    family, low, high = "uniform", 2, MAX_BITS

    def __init__(self, bits: int) -> None:
        super().__init__(bits)
        self.bits = bits

    def encode(self, x: np.ndarray, key: int, offset: int) -> bytes:
        return encode_fixed(x, self.bits)

    def decode(self, package: bytes, count: int) -> np.ndarray:
        return decode_fixed(package, count, self.name, self.bits)


FAMILIES = Uniform.entry()
