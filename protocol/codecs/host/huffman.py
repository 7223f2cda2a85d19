"""Canonical Huffman coding (seed 001's last stage, seed 000's dynamic codebooks): a codebook built from a
histogram, sent as its symbols' code lengths, and the codes themselves.

A codebook on the wire: the first symbol coded (uint16) and the span to the last (uint32), then one 5-bit field
per symbol of that span, 0 for a symbol that does not occur and its code length + 1 for one that does, packed most
significant bit first. The receiver rebuilds the codes from the lengths alone (canonical order: by length, then
symbol), so a codebook can only be wrong in ways it checks: a span past the alphabet or not ending on symbols that
occur, or lengths that do not make a complete prefix code (Kraft's sum exactly 1). One symbol alone takes 0 bits
per element; no symbols, no elements.
"""

from __future__ import annotations

import heapq
import struct

import numpy as np
from numba import njit

from intml.protocol.codecs.host.base import MalformedPackage
from intml.protocol.codecs.host.packing import Reader, check_padding, pack_codes, unpack_codes, write_fields

FIELD = 5  # bits of a codebook entry
MAX_LENGTH = 30  # the longest code a 5-bit field can give
# A code longer than 30 bits needs a total weight of at least Fibonacci(33) = 3524578: no longer input is coded.
MAX_SYMBOLS = 3524577


def code_lengths(histogram: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Huffman's code lengths of the symbols that occur: (symbols, lengths) in canonical order. The two lightest
    subtrees merge first, ties to the one holding the smaller symbol, so every encoder builds the same code."""
    present = np.flatnonzero(histogram)
    if int(histogram.sum()) > MAX_SYMBOLS:
        raise ValueError(f"Huffman coding takes at most {MAX_SYMBOLS} symbols at once")
    shift = max(1, (histogram.size - 1).bit_length())  # a symbol's bits in a heap key
    lengths = _depths(histogram[present].astype(np.int64), present.astype(np.int64), shift)
    order = np.lexsort((present, lengths))
    return present[order].astype(np.int64), lengths[order]


@njit(cache=True)
def _depths(weights, symbols, shift):
    """Each leaf's depth in Huffman's tree. Nodes 0..k-1 are the leaves; each merge makes the next node, the
    parent of the two it takes; a parent comes after its children, so depths are filled from the root down. A
    subtree is on the heap as one integer, its weight above its smallest symbol (``shift`` bits), which names it:
    the subtrees on the heap hold disjoint symbols."""
    k = weights.size
    if k == 0:
        return np.zeros(0, np.int64)
    parent = np.full(2 * k - 1, -1, np.int64)
    node_of = np.zeros(symbols[k - 1] + 1, np.int64)  # a subtree's node, by its smallest symbol
    mask = (1 << shift) - 1
    heap = [(weights[i] << shift) | symbols[i] for i in range(k)]
    for i in range(k):
        node_of[symbols[i]] = i
    heapq.heapify(heap)
    for node in range(k, 2 * k - 1):
        first = heapq.heappop(heap)
        second = heapq.heappop(heap)
        parent[node_of[first & mask]] = node
        parent[node_of[second & mask]] = node
        smallest = min(first & mask, second & mask)
        node_of[smallest] = node
        heapq.heappush(heap, (((first >> shift) + (second >> shift)) << shift) | smallest)
    depth = np.zeros(2 * k - 1, np.int64)
    for node in range(2 * k - 3, -1, -1):
        depth[node] = depth[parent[node]] + 1
    return depth[:k]


@njit(cache=True)
def canonical_codes(lengths):
    """The canonical code of each entry of a codebook in canonical order (its int64 lengths)."""
    codes = np.zeros(lengths.size, np.int64)
    code = 0
    previous = lengths[0] if lengths.size else 0
    for i in range(lengths.size):
        code <<= lengths[i] - previous
        codes[i] = code
        previous = lengths[i]
        code += 1
    return codes


def write_codebook(symbols: np.ndarray, lengths: np.ndarray) -> bytes:
    """A codebook's bytes."""
    if symbols.size == 0:
        return struct.pack(">HI", 0, 0)
    first = int(symbols.min())
    table = np.zeros(int(symbols.max()) - first + 1, np.uint32)
    table[symbols - first] = lengths + 1
    return struct.pack(">HI", first, table.size) + pack_codes(table, FIELD)


def read_codebook(reader: Reader, alphabet: int) -> tuple[np.ndarray, np.ndarray]:
    """(symbols, lengths) in canonical order of a codebook over symbols 0..alphabet-1; MalformedPackage unless it
    is one code_lengths could have made."""
    first, span = reader.take("HI")
    if first + span > alphabet:
        raise MalformedPackage(f"a codebook of symbols {first}..{first + span - 1} over an alphabet of {alphabet}")
    table = unpack_codes(reader.take(f"{(span * FIELD + 7) // 8}s")[0], span, FIELD, reader.codec).astype(np.int64)
    if span and (table[0] == 0 or table[-1] == 0) or not span and first:
        raise MalformedPackage("a codebook's range starts or ends with an absent symbol")
    present = np.flatnonzero(table)
    lengths = table[present] - 1
    if present.size == 1 and lengths[0] != 0 or present.size > 1 and lengths.min() < 1:
        raise MalformedPackage("a codebook's code lengths are out of range")
    if present.size > 1 and int(np.sum(np.int64(1) << (MAX_LENGTH - lengths))) != 1 << MAX_LENGTH:
        raise MalformedPackage("a codebook's lengths do not make a complete prefix code")
    order = np.lexsort((present, lengths))
    return present[order] + first, lengths[order]


def encode(values: np.ndarray, symbols: np.ndarray, lengths: np.ndarray) -> bytes:
    """The codes of ``values`` (each one of ``symbols``), most significant bit first, zero-padded to a byte."""
    if values.size == 0 or lengths.size == 0 or lengths.max() == 0:
        return b""
    table_code = np.zeros(int(symbols.max()) + 1, np.int64)
    table_length = np.zeros(int(symbols.max()) + 1, np.int64)
    table_code[symbols], table_length[symbols] = canonical_codes(lengths), lengths
    widths = table_length[values]
    out = np.zeros((int(widths.sum()) + 7) // 8, np.uint8)
    write_fields(table_code[values], widths, out)
    return out.tobytes()


def decode(data: bytes, symbols: np.ndarray, lengths: np.ndarray, count: int, codec: str) -> np.ndarray:
    """The ``count`` symbols ``data`` codes with the complete prefix code ``symbols``, ``lengths`` (in canonical
    order, as read_codebook and code_lengths give them); MalformedPackage if it runs out, has bytes or bits left
    over."""
    out = np.zeros(count, np.int64)
    if lengths.size == 0 and count:
        raise MalformedPackage(f"a {codec} package with no codebook stands for no elements, not {count}")
    if lengths.size and lengths.max() == 0:
        out[:] = symbols[0]
        used = 0
    else:
        counts = np.bincount(lengths, minlength=MAX_LENGTH + 2)
        table_bits = min(int(lengths.max(initial=0)), TABLE_BITS)
        used = _decode(np.frombuffer(data, np.uint8), counts, symbols, lengths, table_bits, out)
    if used < 0 or (used + 7) // 8 != len(data):
        raise MalformedPackage(f"a {codec} package's codes do not make {count} elements")
    check_padding(data, used, codec)
    return out


TABLE_BITS = 11  # the longest code the decoder's table finds in one look-up; longer ones continue bit by bit


@njit(cache=True)
def _decode(data, counts, symbols, lengths, table_bits, out):
    """Canonical decoding through a table of every ``table_bits``-bit pattern's first code (its entry index and
    length), a code longer than that bit by bit: at each length, the codes first_code.. first_code + counts - 1
    are whole. The bits used, or -1 if the data runs out."""
    first_code = np.zeros(counts.size, np.int64)
    first_index = np.zeros(counts.size, np.int64)
    code = 0
    index = 0
    for length in range(1, counts.size):
        first_code[length] = code
        first_index[length] = index
        code = (code + counts[length]) << 1
        index += counts[length]
    entry = np.zeros(1 << table_bits, np.int64)
    entry_length = np.zeros(1 << table_bits, np.int64)  # 0: the pattern's code is longer than table_bits
    for k in range(lengths.size):
        length = lengths[k]
        if length <= table_bits:
            start = (first_code[length] + k - first_index[length]) << (table_bits - length)
            entry[start:start + (1 << (table_bits - length))] = k
            entry_length[start:start + (1 << (table_bits - length))] = length
    available = data.size * 8
    pos = 0
    for i in range(out.size):
        at = pos >> 3  # the table_bits (<= 11) bits from pos lie in three bytes, zeros past the end
        window = 0
        for b in range(at, at + 3):
            window = (window << 8) | (data[b] if b < data.size else 0)
        pattern = (window >> (24 - (pos & 7) - table_bits)) & ((1 << table_bits) - 1)
        length = entry_length[pattern]
        if length:
            if pos + length > available:
                return -1
            out[i] = symbols[entry[pattern]]
            pos += length
            continue
        code = 0
        length = 0
        while True:
            if pos >= available or length >= counts.size - 1:
                return -1
            code = (code << 1) | ((data[pos >> 3] >> (7 - (pos & 7))) & 1)
            pos += 1
            length += 1
            if code - first_code[length] < counts[length]:
                out[i] = symbols[first_index[length] + code - first_code[length]]
                break
    return pos
