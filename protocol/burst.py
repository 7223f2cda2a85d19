"""``Burst``: the one type the sans-I/O cores take datagrams in and hand datagrams out with.

Row i of a burst is ``length[i]`` bytes starting at address ``ptr[i]``, received from (or to be sent to) the
address key ``addr[i]`` (``protocol.address``); ``count`` rows are valid. The bytes live in ``memory``, a numpy
array owned by whoever made the burst: a receive burst's own rows, or a core's stored results and datagram
buffers, which it leaves untouched until its next call. Drivers hand ``ptr``/``length``/``addr`` to
sendmmsg as they are (zero copy); a simulator or a test takes owned ``(bytes, address)`` pairs from
``datagrams()`` and puts them in with ``fill()``, with no pointer arithmetic of its own.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

Datagram = tuple[bytes, int]  # (payload, address key)


class Burst:
    """Datagram descriptors over one owned memory block; see the module docstring."""

    __slots__ = ("data", "length", "addr", "ptr", "memory", "count")

    def __init__(self, memory: np.ndarray, rows: int, data: np.ndarray | None = None) -> None:
        """A burst of up to ``rows`` datagrams whose bytes lie in ``memory`` (C-contiguous). ``data``: the
        2-D ``(rows, width)`` uint8 view of ``memory`` when the burst carries its own rows (receive bursts)."""
        if not memory.flags.c_contiguous:
            raise ValueError("a burst's memory must be C-contiguous")
        self.memory = memory
        self.data = data
        self.length = np.zeros(rows, np.int32)
        self.addr = np.zeros(rows, np.uint64)
        self.ptr = np.zeros(rows, np.uint64)
        if data is not None:  # each row points at its own buffer until a sender points it elsewhere
            self.ptr[:] = data.ctypes.data + np.arange(rows, dtype=np.uint64) * np.uint64(data.shape[1])
        self.count = 0

    @classmethod
    def rows_of(cls, rows: int, width: int) -> Burst:
        """A burst with ``rows`` buffers of ``width`` bytes of its own (for receiving, or building datagrams)."""
        data = np.zeros((max(1, rows), width), np.uint8)
        return cls(data, max(1, rows), data)

    @property
    def rows(self) -> int:
        return self.length.size

    def datagrams(self) -> list[Datagram]:
        """Owned copies of the first ``count`` datagrams, in order."""
        if self.count == 0:  # most timer calls send nothing: skip the views (a third of an idle call's time)
            return []
        flat = self.memory.reshape(-1).view(np.uint8)
        base = self.memory.ctypes.data
        out = []
        for i in range(self.count):
            start, size = int(self.ptr[i]) - base, int(self.length[i])
            if start < 0 or start + size > flat.size:
                raise ValueError(f"datagram {i} points outside its burst's memory")
            out.append((flat[start:start + size].tobytes(), int(self.addr[i])))
        return out

    def fill(self, datagrams: Iterable[Datagram]) -> int:
        """Copy datagrams into this burst's own rows (a receive burst); returns and sets ``count``."""
        if self.data is None:
            raise ValueError("fill needs a burst with rows of its own (Burst.rows_of)")
        n = 0
        for payload, addr in datagrams:
            if n == self.rows:
                raise ValueError(f"more than {self.rows} datagrams for this burst")
            size = min(len(payload), self.data.shape[1])
            self.data[n, :size] = np.frombuffer(payload, np.uint8, size)
            self.length[n] = size if size == len(payload) else -1  # truncated, as BurstSocket reports it
            self.addr[n] = addr
            n += 1
        self.count = n
        return n
