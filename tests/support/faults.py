"""A seeded fault-injecting BurstSocket for tests: drops, duplicates and reorders the data-plane datagrams a
Worker sends and receives, so tests can show that results do not depend on loss. Control datagrams (``send_one``:
JOIN, LEAVE, statistics requests) go out untouched, as they did with the earlier transport shim.

``faulty_sockets(...)`` makes ``intml.worker.api`` build its sockets (the unicast one, then any multicast group's)
as FaultySockets, each seeded from its own counter. It handles datagrams as Python objects one by one: a test
tool, never on the hot path.
"""

from __future__ import annotations

import contextlib
import itertools
import random
from collections import deque
from collections.abc import Iterator

from intml.burstio.mmsg import BurstSocket
from intml.protocol.burst import Burst, Datagram


class FaultySocket(BurstSocket):
    """A BurstSocket whose ``recv_burst`` and ``send`` (the data plane) pass through seeded faults."""

    def __init__(self, sock, burst: int = 256, max_packet: int = 9000, *, gro: bool | None = None,
                 drop: float = 0.0, duplicate: float = 0.0, reorder: float = 0.0, seed: int = 0) -> None:
        for name, p in (("drop", drop), ("duplicate", duplicate), ("reorder", reorder)):
            if not 0.0 <= p < 1.0:
                raise ValueError(f"{name} probability must be in [0, 1), got {p}")
        super().__init__(sock, burst=burst, max_packet=max_packet, gro=gro)
        self.drop, self.duplicate, self.reorder = drop, duplicate, reorder
        self.random = random.Random(seed)
        self._inbox: deque[Datagram] = deque()
        self._held_out: list[Datagram] = []
        self._held_in: list[Datagram] = []
        self.counts = {"dropped": 0, "duplicated": 0, "reordered": 0}

    def _mangle(self, datagrams: list[Datagram], held: list[Datagram]) -> list[Datagram]:
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

    def send(self, burst: Burst) -> int:
        for data, addr in self._mangle(burst.datagrams(), self._held_out):
            self.send_one(data, addr)
        return burst.count

    def recv_burst(self, max_count: int | None = None) -> int:
        n = super().recv_burst()
        if n or self._held_in:
            self._inbox.extend(self._mangle(self.rx.datagrams(), self._held_in))
        batch = [self._inbox.popleft() for _ in range(min(len(self._inbox), self.rx.rows))]
        return self.rx.fill(batch)


@contextlib.contextmanager
def faulty_sockets(*, drop: float, duplicate: float, reorder: float, seed: int) -> Iterator[None]:
    """Within the block, Workers built in this process use FaultySockets seeded seed, seed + 1, ..."""
    import intml.worker.api as api

    seeds = itertools.count(seed)

    def make(sock, burst: int = 256, max_packet: int = 9000, gro: bool | None = None) -> FaultySocket:
        return FaultySocket(sock, burst, max_packet, gro=gro, drop=drop, duplicate=duplicate, reorder=reorder,
                            seed=next(seeds))

    real, api.BurstSocket = api.BurstSocket, make
    try:
        yield
    finally:
        api.BurstSocket = real
