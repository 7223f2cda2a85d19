"""``intml-aggregator --engine bmv2``: an aggregator core whose data path (aggregator.datapath) is the compiled
P4 program running on a real BMv2 ``simple_switch`` (testbed.bmv2.Bmv2Switch). As a switch's controller does,
``Bmv2DataPath`` writes the per-job entries (p4.controller, p4.entries.cli_commands) through the switch's
runtime API when a job is placed, a rank takes its seat or the job ends, and clears the job's slot registers on
placement. Each received DATA datagram goes into the switch as the Ethernet/IPv4/UDP frame the program parses;
what the switch sends back (results, multicast copies) is the output burst. JOIN, LEAVE and STATS_REQUEST never
reach the switch: the core's control admission (aggregator.slots.admit_control) lists them, as the program's
control meter would send them to its CPU port. The switch's counters are added into the core's, so STATS works.
The switch runs at its own pace: a result the switch sends after ``quiet_s`` without output goes out with the
next burst's.
"""

from __future__ import annotations

import socket
from typing import Any, Protocol

import numpy as np

from intml.aggregator.core import AggregatorCore
from intml.aggregator.counters import CoreCounters
from intml.aggregator.datapath import Placed, RoundState, Slots, allocate, check_results_group, group_of, wire_job
from intml.aggregator.kernel import read_only
from intml.aggregator.slots import Limiter, admit_control, new_limiter
from intml.p4.controller import switch_job
from intml.p4.engine import engine_problem, switch_refusal
from intml.p4.entries import SwitchJob, cli_commands, job_entries
from intml.p4.layout import MAX_WORLD, lane_index
from intml.protocol import wire
from intml.protocol.address import addr_key_of, addr_of
from intml.protocol.burst import Burst
from intml.protocol.job import (
    AGGREGATOR_MAX_ELEMENTS,
    AGGREGATOR_MAX_JOBS,
    AGGREGATOR_SLOTS,
    ControlLimits,
    JobParams,
)
from intml.protocol.stats import N_STATS, PACKETS_IN, STAT_NAMES
from intml.protocol.wire import HEADER, HEADER_SIZE, MAGIC, MsgType

SWITCH_IP = "10.77.0.1"  # the switch's address as its frames carry it (the program never routes on it)
SWITCH_MAC = b"\x02\0\0\0\0\x01"
PORT = 1  # the switch port every rank is behind (testbed.bmv2.PORT)
CONTROL = (MsgType.JOIN, MsgType.LEAVE, MsgType.STATS_REQUEST)
QUIET_S = 0.05  # a burst's output is complete once the switch sent nothing for this long
COUNTERS_EVERY_S = 1.0  # how often the switch's counters are read into the core's
SLOT_STATE = {"round_key": -1, "worker_bitmap": 0, "worker_count": 0}  # a new job's rows: no round (-1: all ones)
DROP_TRUNCATED = STAT_NAMES.index("drop_truncated")


class Switch(Protocol):
    """What the data path needs of a running switch (testbed.bmv2.Bmv2Switch)."""

    def command(self, line: str) -> str: ...

    def table_add(self, line: str) -> int: ...

    def node_create(self, line: str) -> int: ...

    def register_read(self, name: str) -> list[int]: ...

    def register_write_range(self, name: str, cells: range, value: int) -> None: ...

    def counter_packets(self, name: str, cells: range) -> list[int]: ...

    def send(self, frame: bytes) -> None: ...

    def receive(self, wait_s: float) -> list[bytes]: ...


def mac_of(key: int) -> bytes:
    """A worker's Ethernet address: one per address key."""
    return b"\x02\x01" + (key & 0xFFFFFFFF).to_bytes(4, "big")


def frame(datagram: bytes, source: int, carried: bytes = b"") -> bytes:
    """Ethernet (from the worker's address to the switch's), IPv4 (checksum computed) and UDP (no checksum) around
    a datagram from address key ``source``; ``carried``: a header between the Ethernet and the IPv4 header (the
    test build's random words, with their ethertype)."""
    ip, port = addr_of(source)
    udp = port.to_bytes(2, "big") + wire.DEFAULT_PORT.to_bytes(2, "big") + (8 + len(datagram)).to_bytes(2, "big")
    udp += b"\0\0"
    header = bytearray(b"\x45\x00" + (28 + len(datagram)).to_bytes(2, "big") + b"\0\0\0\0\x40\x11\0\0"
                       + socket.inet_aton(ip) + socket.inet_aton(SWITCH_IP))
    total = sum(int.from_bytes(header[i:i + 2], "big") for i in range(0, 20, 2))
    while total >> 16:
        total = (total & 0xFFFF) + (total >> 16)
    header[10:12] = (~total & 0xFFFF).to_bytes(2, "big")
    return SWITCH_MAC + mac_of(source) + carried + b"\x08\x00" + bytes(header) + udp + datagram


def unframe(data: bytes) -> tuple[bytes, int]:
    """(UDP payload, destination address key) of a frame the switch sent."""
    ihl = (data[14] & 0xF) * 4
    udp = 14 + ihl
    length = int.from_bytes(data[udp + 4:udp + 6], "big")
    key = addr_key_of(socket.inet_ntoa(data[30:34]), int.from_bytes(data[udp + 2:udp + 4], "big"))
    return data[udp + 8:udp + length], key


class Bmv2DataPath:
    """``switch`` (running the compiled program, its tables and registers as it started: empty) as a data path.
    Options as aggregator.kernel.KernelDataPath's; ``quiet_s``: see the module docstring."""

    marks = True  # the program marks a result that leaves a deep egress queue (p4/egress.p4); each copy is new

    def __init__(self, switch: Switch, *, rows: int = AGGREGATOR_SLOTS,
                 max_elements: int = AGGREGATOR_MAX_ELEMENTS, max_jobs: int = AGGREGATOR_MAX_JOBS,
                 results_group: tuple[int, int] | None = None, control_limits: ControlLimits = ControlLimits(),
                 counters: CoreCounters | None = None, name: str = "this aggregator core",
                 quiet_s: float = QUIET_S) -> None:
        problem = engine_problem(rows, max_jobs, "bmv2")
        if problem:
            raise ValueError(problem)
        check_results_group(results_group, max_jobs)
        self.switch = switch
        self.results_group = results_group
        self.max_elements = max_elements
        self.name = name
        self.quiet_s = quiet_s
        self.counters = CoreCounters(max_jobs, rows) if counters is None else counters
        self.limiter = Limiter(*new_limiter(control_limits))
        self._control = np.empty(control_limits.per_burst, np.int64)
        self.jobs: dict[int, SwitchJob] = {}  # what the controller wrote, by job key (aggregator.datapath.job_key)
        self.placed: dict[int, Placed] = {}
        self._written: dict[int, list[str]] = {}  # per job id: the commands that delete its entries, in order
        self._last_seen = np.zeros((max_jobs, MAX_WORLD))
        self._switch_counts = np.zeros((max_jobs + 1, N_STATS), np.int64)  # the switch's, as last read (core last)
        self._counted_at = -np.inf

    # ---- the controller ---------------------------------------------------------------------------------------
    def _write(self, job: int) -> None:
        """Write the job's entries, recording how to delete each (handles as the switch numbered them)."""
        undo: list[str] = []
        self._written[job] = undo
        node = 0
        for line in cli_commands(job_entries(self.jobs[job]), port=PORT):
            verb, *args = line.split()
            if verb == "table_add":
                undo.append(f"table_delete {args[0]} {self.switch.table_add(line)}")
            elif verb == "mc_node_create":
                node = self.switch.node_create(line)
                undo.append(f"mc_node_destroy {node}")
            elif verb == "mc_node_associate":  # cli_commands numbers nodes as a fresh switch would
                self.switch.command(f"mc_node_associate {args[0]} {node}")
                undo.insert(len(undo) - 1, f"mc_node_dissociate {args[0]} {node}")
            else:
                self.switch.command(line)
                if verb == "mc_mgrp_create":
                    undo.append(f"mc_mgrp_destroy {args[0]}")

    def _erase(self, job: int) -> None:
        # groups last: a group is destroyed once its nodes are gone
        for line in sorted(self._written.pop(job), key=lambda line: line.startswith("mc_mgrp_destroy")):
            self.switch.command(line)

    # ---- aggregator.datapath.DataPath ---------------------------------------------------------------------
    def refuse(self, job: int, params: JobParams, slots: Slots, rank: int) -> str | None:
        return switch_refusal(self.placed, job, params, "BMv2 (--engine bmv2)")

    def place(self, job: int, params: JobParams, slots: Slots, data_key: bytes, now: float) -> Placed | str:
        found = allocate(self.counters, job, len(slots.of(params.pool_size)), self.name)
        if isinstance(found, str):
            return found
        j, rows = found
        self._sync_counters(now, force=True)  # the entry's counts so far belong to its previous job
        cells = range(lane_index(2 * rows.start, 0), lane_index(2 * rows.stop, 0))  # both sets, every pass
        for register, empty in SLOT_STATE.items():
            self.switch.register_write_range(register, cells, empty)
        self.switch.register_write_range("member_seen", range(j * MAX_WORLD, (j + 1) * MAX_WORLD), 0)
        self._last_seen[j] = now
        placed = self.placed[job] = Placed(j, rows, group_of(self.results_group, j))
        self.jobs[job] = switch_job(wire_job(job), j, params, slots, rows, placed.group, {})
        self._write(job)
        return placed

    def seat(self, job: int, rank: int, addr: int, now: float) -> None:
        self.jobs[job].members[rank] = addr
        self._last_seen[self.placed[job].index, rank] = now
        self._erase(job)
        self._write(job)

    def remove(self, job: int) -> None:
        rows = self.placed.pop(job).rows
        self._erase(job)
        del self.jobs[job]
        self.counters.row_used[rows.start:rows.stop] = False

    def process(self, rx: Burst, now: float) -> tuple[Burst, np.ndarray]:
        """As aggregator.kernel.KernelDataPath.process; the output burst has rows of its own."""
        if rx.data is None:
            raise ValueError("receive needs a burst with rows of its own (Burst.rows_of)")
        host = np.zeros(N_STATS, np.int64)  # what the switch never sees, counted here
        n_ctl = 0
        for i in range(rx.count):
            length, addr = int(rx.length[i]), int(rx.addr[i])
            if length < 0:
                host[PACKETS_IN] += 1
                host[DROP_TRUNCATED] += 1
                continue
            datagram = bytes(rx.data[i, :length])
            header = np.frombuffer(datagram, HEADER, count=1)[0] if length >= HEADER_SIZE else None
            if header is not None and header["magic"] == MAGIC and header["type"] in CONTROL:
                host[PACKETS_IN] += 1
                n_ctl = admit_control(self.limiter, self._control, n_ctl, i, addr, now, host)
                continue
            if header is not None and header["type"] == MsgType.DATA:
                self._saw(int(header["job"]), int(header["rank"]) & 0xFF, addr, now)
            self.switch.send(frame(datagram, addr))
        self.counters.core_stats += host
        sent = [unframe(f) for f in self.switch.receive(self.quiet_s)]
        self._sync_counters(now)
        out = Burst.rows_of(len(sent), max([1] + [len(d) for d, _ in sent]))
        out.fill(sent)
        return out, self._control[:n_ctl].copy()

    def _saw(self, job_id: int, rank: int, addr: int, now: float) -> None:
        """A DATA packet (wire job id ``job_id``: one tenant holds an id on a switch) of a seated rank from its
        address keeps the job alive."""
        for job in self.jobs.values():
            if job.job_id == job_id and rank < MAX_WORLD and job.members.get(rank) == addr:
                self._last_seen[job.index, rank] = now

    def _sync_counters(self, now: float, force: bool = False) -> None:
        """Add what the switch counted since the last read into the core's counters (every COUNTERS_EVERY_S)."""
        if not force and now - self._counted_at < COUNTERS_EVERY_S:
            return
        self._counted_at = now
        for j in [p.index for p in self.placed.values()] + [-1]:
            if j < 0:
                counts = np.array(self.switch.counter_packets("core_counter", range(N_STATS)), np.int64)
                target = self.counters.core_stats
            else:
                cells = range(j * N_STATS, (j + 1) * N_STATS)
                counts = np.add(self.switch.counter_packets("job_counter", cells),
                                self.switch.counter_packets("egress_job_counter", cells), dtype=np.int64)
                target = self.counters.stats[j]
            target += counts - self._switch_counts[j]
            self._switch_counts[j] = counts

    def round_state(self, job: int) -> RoundState:
        rows = self.placed[job].rows
        cells = slice(lane_index(2 * rows.start, 0), lane_index(2 * rows.stop, 0), lane_index(1, 0))

        def read(name: str, dtype) -> np.ndarray:  # pass 0's cells: where a round opens first
            return np.array(self.switch.register_read(name)[cells], np.uint64).astype(dtype).reshape(-1, 2)

        return RoundState(read_only(read("round_key", np.int64)), read_only(read("worker_bitmap", np.uint64)),
                          read_only(read("worker_count", np.int64)))

    def last_seen(self, job: int) -> np.ndarray:
        return read_only(self._last_seen[self.placed[job].index])


def bmv2_core(*, switch: Switch, rows: int = AGGREGATOR_SLOTS, max_elements: int = AGGREGATOR_MAX_ELEMENTS,
              max_jobs: int = AGGREGATOR_MAX_JOBS, results_group: tuple[int, int] | None = None,
              control_limits: ControlLimits = ControlLimits(), counters: CoreCounters | None = None,
              **options: Any) -> AggregatorCore:
    """An AggregatorCore with a Bmv2DataPath on ``switch`` (its ``datapath``). ``options``: AggregatorCore's."""
    return AggregatorCore(Bmv2DataPath(switch, rows=rows, max_elements=max_elements, max_jobs=max_jobs,
                                       results_group=results_group, control_limits=control_limits,
                                       counters=counters, name=f"aggregator core {options.get('core', 0)}"),
                          **options)
