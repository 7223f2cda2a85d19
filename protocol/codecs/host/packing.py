"""What the host codecs' packages are made of: big-endian headers read with a bound check, N-bit codes packed
most significant bit first, a tensor's keyed random words, and the float32 ratios in codec names."""

from __future__ import annotations

import struct
from collections.abc import Callable

import numpy as np
from numba import njit

from intml.protocol.codecs.host.base import HostCodec, MalformedPackage
from intml.protocol.rng import fill_bits32


class Reader:
    """Reads a package's fields in order; a field past the end is a MalformedPackage, not a struct.error."""

    def __init__(self, package: bytes, codec: str) -> None:
        self.package = bytes(package)
        self.codec = codec
        self.at = 0

    def take(self, fmt: str) -> tuple:
        """The next fields in struct format ``fmt`` (big-endian)."""
        size = struct.calcsize(">" + fmt)
        if self.at + size > len(self.package):
            raise MalformedPackage(f"a {self.codec} package of {len(self.package)} bytes ends inside its header")
        fields = struct.unpack_from(">" + fmt, self.package, self.at)
        self.at += size
        return fields

    def rest(self) -> bytes:
        """The bytes after the fields taken."""
        return self.package[self.at:]


WHOLE_BYTES = {8: np.dtype(np.uint8), 16: np.dtype(">u2"), 32: np.dtype(">u4")}  # widths numpy packs as they are


def pack_codes(codes: np.ndarray, width: int) -> bytes:
    """``codes`` (each < 2**width) as ``width``-bit fields, most significant bit first, zero-padded to a byte."""
    if width in WHOLE_BYTES:
        return np.asarray(codes).astype(WHOLE_BYTES[width]).tobytes()
    out = np.zeros((codes.size * width + 7) // 8, np.uint8)
    write_fields(np.asarray(codes, np.int64), np.full(1, width, np.int64), out)
    return out.tobytes()


@njit(cache=True)
def write_fields(codes, widths, out):
    """Writes each code in its width (``widths``: one per code, or one for all; at most 32 bits) to ``out``, most
    significant bit first, through a bit accumulator; the last byte's free bits stay zero."""
    acc = 0
    held = 0
    at = 0
    fixed = widths.size == 1
    for i in range(codes.size):
        width = widths[0] if fixed else widths[i]
        acc = (acc << width) | codes[i]
        held += width
        while held >= 8:
            held -= 8
            out[at] = (acc >> held) & 0xFF
            at += 1
        acc &= (1 << held) - 1
    if held:
        out[at] = (acc << (8 - held)) & 0xFF


def unpack_codes(data: bytes, count: int, width: int, codec: str) -> np.ndarray:
    """The ``count`` codes ``pack_codes`` packed; MalformedPackage for a wrong length or non-zero padding."""
    if len(data) != (count * width + 7) // 8:
        raise MalformedPackage(f"{count} {width}-bit {codec} codes take {(count * width + 7) // 8} bytes, "
                               f"got {len(data)}")
    check_padding(data, count * width, codec)
    if width in WHOLE_BYTES:
        return np.frombuffer(data, WHOLE_BYTES[width]).astype(np.uint32)
    out = np.empty(count, np.uint32)
    _read_fields(np.frombuffer(data, np.uint8), width, out)
    return out


@njit(cache=True)
def _read_fields(data, width, out):
    """Fills ``out`` with the ``width``-bit fields of ``data``, most significant bit first."""
    acc = 0
    held = 0
    at = 0
    mask = (1 << width) - 1
    for i in range(out.size):
        while held < width:
            acc = (acc << 8) | data[at]
            at += 1
            held += 8
        held -= width
        out[i] = (acc >> held) & mask
        acc &= (1 << held) - 1


def check_padding(data: bytes, used: int, codec: str) -> None:
    """MalformedPackage unless the bits of ``data`` after its first ``used`` (in its last byte) are zero."""
    if used % 8 and data[used // 8] & ((1 << (8 - used % 8)) - 1):
        raise MalformedPackage(f"a {codec} package's padding bits are not zero")


FLOAT32_MAX = float(np.finfo(np.float32).max)


def saturated(values: np.ndarray) -> np.ndarray:
    """float64 values as float32, those past its range at its largest finite value: an unbiased codec's scaled-up
    value near float32's limit can exceed it, and a decoder returns finite values."""
    return np.clip(values, -FLOAT32_MAX, FLOAT32_MAX).astype(np.float32)


def random_words(key: int, offset: int, count: int) -> np.ndarray:
    """The 32-bit random words of elements ``offset``.. of the stream ``key`` (protocol.rng, as C_nat draws)."""
    out = np.empty(count, np.uint32)
    fill_bits32(out, np.uint64(key), np.uint64(offset))
    return out


def uniforms(key: int, offset: int, count: int) -> np.ndarray:
    """Keyed uniform draws in [0, 1): each element's random word / 2**32, in float64 (exact)."""
    return random_words(key, offset, count) * 2.0 ** -32


def float32_ratio(text: str, codec: str) -> float:
    """A ratio in (0, 1] from a codec name, rounded to float32 so that the JOIN's parameter carries it exactly."""
    try:
        ratio = float(np.float32(text))
    except ValueError:
        raise ValueError(f"{codec} takes a ratio in (0, 1], as in {codec}0.01; got {text!r}") from None
    if not 0 < ratio <= 1:
        raise ValueError(f"{codec} takes a ratio in (0, 1], got {text!r}")
    return ratio


def ratio_name(family: str, ratio: float) -> str:
    """A ratio codec's name: its family and the float32 ratio's shortest decimal (topk0.01, randomk1)."""
    return family + np.format_float_positional(np.float32(ratio), trim="-")


def ratio_bits(ratio: float) -> int:
    """The float32 bits of a ratio: a JOIN's codec parameter."""
    return int(np.float32(ratio).view(np.uint32))


def ratio_of_bits(bits: int, codec: str) -> float:
    """The ratio a JOIN's parameter carries; MalformedPackage if it is not one in (0, 1]."""
    ratio = float(np.uint32(bits & 0xFFFFFFFF).view(np.float32))
    if not 0 < ratio <= 1:
        raise MalformedPackage(f"a {codec} parameter must be a ratio in (0, 1], got {ratio}")
    return ratio


class IntegerCodec(HostCodec):
    """A codec with one integer parameter in low..high, written after its family's name (uniform8) and sent as
    the JOIN's parameter."""

    family: str
    low: int
    high: int

    def __init__(self, param: int) -> None:
        self.param = param
        self.name = f"{self.family}{param}"

    def wire_param(self) -> int:
        return self.param

    @classmethod
    def entry(cls) -> dict:
        """The family's FAMILIES entry."""
        return {cls.family: (cls.wire_id, lambda text: cls(integer_suffix(text, cls.family, cls.low, cls.high)),
                             lambda param: cls(wire_integer(param, cls.family, cls.low, cls.high)))}


def integer_suffix(text: str, codec: str, low: int, high: int) -> int:
    """The integer after a family's name (uniform8's 8), in [low, high]."""
    if not text.isdigit() or not low <= int(text) <= high:
        raise ValueError(f"{codec} takes an integer in {low}..{high}, as in {codec}{low}; got {text!r}")
    return int(text)


def wire_integer(param: int, codec: str, low: int, high: int) -> int:
    """An integer JOIN parameter in [low, high]; MalformedPackage otherwise."""
    if not low <= param <= high:
        raise MalformedPackage(f"a {codec} parameter must be in {low}..{high}, got {param}")
    return param


def parameterless(make: Callable[[], HostCodec], codec: str) -> tuple[Callable[[str], HostCodec],
                                                                     Callable[[int], HostCodec]]:
    """A FAMILIES entry's two constructors for a codec without parameters: nothing after the name, param 0."""
    def from_text(text: str) -> HostCodec:
        if text:
            raise ValueError(f"{codec} takes no parameter, got {text!r}")
        return make()

    def from_param(param: int) -> HostCodec:
        if param:
            raise MalformedPackage(f"{codec} takes no parameter, got {param}")
        return make()

    return from_text, from_param
