"""A seeded fault-injection shim around a BurstSocket: drops, duplicates and reorders datagrams in both
directions (what the worker sends and what it receives), so tests can show that results do not depend on loss.

It handles datagrams as Python objects one by one: a test tool, never on the hot path.
"""

from __future__ import annotations

import ctypes
import random
from collections import deque

from intml.burstio.mmsg import BurstSocket


class FaultyTransport:
    """Wraps a BurstSocket with the same attributes and methods the Worker uses."""

    def __init__(self, inner: BurstSocket, *, drop: float = 0.0, duplicate: float = 0.0, reorder: float = 0.0,
                 seed: int = 0) -> None:
        for name, p in (("drop", drop), ("duplicate", duplicate), ("reorder", reorder)):
            if not 0.0 <= p < 1.0:
                raise ValueError(f"{name} probability must be in [0, 1), got {p}")
        self.inner = inner
        self.drop, self.duplicate, self.reorder = drop, duplicate, reorder
        self.random = random.Random(seed)
        self.sock = inner.sock
        self.rx_data, self.rx_len, self.rx_addr = inner.rx_data, inner.rx_len, inner.rx_addr
        self.tx_data, self.tx_len, self.tx_addr, self.tx_ptr = inner.tx_data, inner.tx_len, inner.tx_addr, inner.tx_ptr
        self._inbox: deque[tuple[bytes, int]] = deque()
        self._held_out: list[tuple[bytes, int]] = []
        self._held_in: list[tuple[bytes, int]] = []
        self.counts = {"dropped": 0, "duplicated": 0, "reordered": 0}

    def fileno(self) -> int:
        return self.inner.fileno()

    def _mangle(self, datagrams: list[tuple[bytes, int]], held: list[tuple[bytes, int]]) -> list[tuple[bytes, int]]:
        """Apply the faults; a reordered datagram is held back and released after the next batch."""
        out = []
        released, held[:] = list(held), []
        for d in datagrams:
            r = self.random.random()
            if r < self.drop:
                self.counts["dropped"] += 1
                continue
            if r < self.drop + self.reorder:
                self.counts["reordered"] += 1
                held.append(d)
                continue
            out.append(d)
            if self.random.random() < self.duplicate:
                self.counts["duplicated"] += 1
                out.append(d)
        return out + released

    def send_burst(self, count: int) -> int:
        batch = [(ctypes.string_at(int(self.tx_ptr[i]), int(self.tx_len[i])), int(self.tx_addr[i]))
                 for i in range(count)]
        for data, addr in self._mangle(batch, self._held_out):
            self.inner.send_one(data, addr)
        return count

    def send_one(self, data: bytes, addr_key: int) -> None:
        self.inner.send_one(data, addr_key)

    def recv_burst(self, max_count: int | None = None) -> int:
        n = self.inner.recv_burst()
        batch = [(bytes(self.rx_data[i, : self.rx_len[i]]), int(self.rx_addr[i])) for i in range(n)]
        if n or self._held_in:
            self._inbox.extend(self._mangle(batch, self._held_in))
        count = 0
        while self._inbox and count < self.rx_len.size:
            data, addr = self._inbox.popleft()
            self.rx_data[count, : len(data)] = memoryview(data)
            self.rx_len[count] = len(data)
            self.rx_addr[count] = addr
            count += 1
        return count
