"""LZW (Welch 1984), the lossless coder seed 001 tried on raw float weights and found ineffective.

The classic algorithm with variable-width codes, as Unix compress has it: the dictionary starts with the 256
single bytes, each code emitted adds the longest match plus the next byte, and codes grow from 9 bits to
``max_width`` bits as the dictionary grows. A full dictionary stays as it is (no clear code). Code k (counted from
0) is written in width(k) = max(9, bit length of the largest code that can exist before it, 255 + k) bits, capped
at ``max_width``, so the decoder knows every width from the count alone. Codes are packed most significant bit
first and the last byte is padded with zero bits; fewer than 9 bits left means the end, so no end code is sent.

It is a measurement, not a wire codec: the averaging table compares what it makes of the raw float32 weights with
gzip's and with the quantizers'.
"""

from __future__ import annotations

FIRST_WIDTH = 9
MAX_WIDTH = 16  # compress's default


def width(k: int, max_width: int = MAX_WIDTH) -> int:
    """The bits of code k (0-based) in a stream whose dictionary holds at most 2**max_width entries."""
    return min(max_width, max(FIRST_WIDTH, (255 + k).bit_length()))


def _check(max_width: int) -> None:
    if not FIRST_WIDTH <= max_width <= 24:
        raise ValueError(f"max_width must be in [{FIRST_WIDTH}, 24], got {max_width}")


def encode(data: bytes, max_width: int = MAX_WIDTH) -> bytes:
    _check(max_width)
    table = {bytes([b]): b for b in range(256)}
    limit = 1 << max_width
    acc = bits = k = 0
    out = bytearray()

    def emit(code: int) -> None:
        nonlocal acc, bits, k
        w = width(k, max_width)
        acc, bits, k = (acc << w) | code, bits + w, k + 1
        while bits >= 8:
            bits -= 8
            out.append((acc >> bits) & 0xFF)
        acc &= (1 << bits) - 1

    match = b""
    for b in data:
        longer = match + bytes([b])
        if longer in table:
            match = longer
            continue
        emit(table[match])
        if len(table) < limit:
            table[longer] = len(table)
        match = bytes([b])
    if match:
        emit(table[match])
    if bits:
        out.append((acc << (8 - bits)) & 0xFF)
    return bytes(out)


def decode(packed: bytes, max_width: int = MAX_WIDTH) -> bytes:
    """The bytes ``encode(data, max_width)`` stands for; ValueError for a code that no encoder could have sent, or
    anything but a zero padding of under a byte after the last code."""
    _check(max_width)
    table = [bytes([b]) for b in range(256)]
    limit = 1 << max_width
    out = bytearray()
    acc = bits = k = 0
    previous = b""
    for byte in packed:
        acc, bits = (acc << 8) | byte, bits + 8
        if bits < width(k, max_width):
            continue
        w = width(k, max_width)
        bits -= w
        code, acc, k = acc >> bits, acc & ((1 << bits) - 1), k + 1
        if code < len(table):
            entry = table[code]
        elif code == len(table) and previous:  # the code being defined now: the previous match plus its first byte
            entry = previous + previous[:1]
        else:
            raise ValueError(f"LZW code {code} at code {k - 1} is past the dictionary's {len(table)} entries")
        if previous and len(table) < limit:
            table.append(previous + entry[:1])
        out += entry
        previous = entry
    if bits >= 8 or acc:  # what is left must be the last byte's padding, all zero
        raise ValueError(f"LZW stream: {bits} bits left over after code {k - 1}, not a zero padding")
    return bytes(out)
