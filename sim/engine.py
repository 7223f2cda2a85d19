"""The discrete-event loop: a heap of events keyed by (time, sequence), so events at the same virtual instant run
in the order they were scheduled and a run is deterministic. Datagrams arriving at the same instant are
delivered together: ``deliver`` collects them per instant, and each node gets its share as one burst."""

from __future__ import annotations

import heapq
from collections.abc import Callable, Sequence
from typing import Protocol

Datagram = tuple[bytes, int, int]  # (payload, source address key, destination address key)


class Node(Protocol):
    """Anything a datagram can arrive at: a host or a switch."""

    def arrive(self, datagrams: Sequence[Datagram], now: float) -> None:
        """``datagrams`` (a list, or a tuple other nodes share: read it, keep it, never change it)."""


class Simulator:
    """A virtual clock and the event heap. ``packet_events`` counts datagrams delivered to nodes."""

    def __init__(self) -> None:
        self.now = 0.0
        self._heap: list[tuple[float, int, Callable, tuple]] = []
        self._seq = 0
        self._arrivals: dict[float, dict[Node, list[Datagram]]] = {}
        self.events = 0
        self.packet_events = 0

    def at(self, time: float, fn: Callable, *args) -> None:
        """Run fn(*args) at virtual time ``time`` (not before now)."""
        if time < self.now:
            raise ValueError(f"cannot schedule at {time} before now ({self.now})")
        heapq.heappush(self._heap, (time, self._seq, fn, args))
        self._seq += 1

    def deliver(self, time: float, node: Node, datagram: Datagram) -> None:
        """``datagram`` reaches ``node`` at ``time``; everything reaching one node at one instant arrives as one
        burst, in the order delivered."""
        self.deliver_train([time], node, [datagram])

    def deliver_train(self, times: list[float], node: Node, datagrams: list[Datagram]) -> None:
        """``deliver(times[i], node, datagrams[i])`` for each i, in one call (a link's burst)."""
        arrivals = self._arrivals
        for time, datagram in zip(times, datagrams):
            bucket = arrivals.get(time)
            if bucket is None:
                bucket = arrivals[time] = {node: [datagram]}
                self.at(time, self._arrive, time)
                continue
            entry = bucket.get(node)
            if entry is None:
                bucket[node] = [datagram]
            elif type(entry) is tuple:  # deliver_all's shared burst
                bucket[node] = [*entry, datagram]
            else:
                entry.append(datagram)

    def deliver_all(self, time: float, nodes: list[Node], datagram: Datagram) -> None:
        """``datagram`` reaches every node of ``nodes`` at ``time`` (a multicast fan-out): the same as ``deliver``
        to each in turn, in one call. At an instant nothing else reaches yet (the usual case), every node's burst is
        one shared tuple, which a later delivery to that node at the same instant replaces by a list."""
        bucket = self._arrivals.get(time)
        if bucket is None:
            bucket = dict.fromkeys(nodes, (datagram,))
            if len(bucket) == len(nodes):
                self._arrivals[time] = bucket
                self.at(time, self._arrive, time)
                return
            bucket = self._arrivals[time] = {}  # a node listed twice gets the datagram twice
            self.at(time, self._arrive, time)
        get = bucket.get
        for node in nodes:
            entry = get(node)
            if entry is None:
                bucket[node] = [datagram]
            elif type(entry) is tuple:
                bucket[node] = [*entry, datagram]
            else:
                entry.append(datagram)

    def _arrive(self, time: float) -> None:
        count = 0
        for node, datagrams in self._arrivals.pop(time).items():
            count += len(datagrams)
            node.arrive(datagrams, time)
        self.packet_events += count

    def run(self, until: float = float("inf"), stop: Callable[[], bool] | None = None) -> None:
        """Run events in order until the heap is empty, the next event is after ``until``, or ``stop()``."""
        heap = self._heap
        while heap:
            if stop is not None and stop():
                return
            time, _, fn, args = heap[0]
            if time > until:
                return
            heapq.heappop(heap)
            self.now = time
            self.events += 1
            fn(*args)
