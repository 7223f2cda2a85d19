"""`intml-testbed bench mac`: what the optional DATA/RESULT MAC costs, per packet and per allreduce, in one run.

Per packet, for 1024 C_nat codes and for 256 int32 values (both 1050-byte datagrams): the SipHash-2-4 tag alone
over the full-size DATA datagrams of a recorded allreduce (what checking one costs), and the aggregator's whole
burst kernel (process_burst, through AggregatorCore.receive) per DATA packet of the same recorded allreduce
(bootstrap packets included) without and with the MAC, which also tags each completed result; the kernel without
it is the anchor. Then the loopback allreduce (an aggregator and worker processes, as
`bench allreduce`) without and with the MAC, at the same packet size (the largest a tagged datagram allows), in
alternating trials. Figures are medians over repeats; the variants with and without the MAC alternate, so that
both see the same load on a shared machine.
"""

from __future__ import annotations

import json
import platform
import statistics
import time

import numpy as np
from numba import njit

from intml.aggregator.core import AggregatorCore
from intml.protocol import wire
from intml.protocol.burst import Burst
from intml.protocol.job import BURST, CODEC_NAMES, JobParams
from intml.protocol.siphash import key_words, siphash24
from intml.protocol.wire import TAG_SIZE
from intml.testbed.bench_allreduce import run_intml
from intml.testbed.timing import emit, median_seconds
from intml.worker.engine import StreamEngine
from intml.worker.session import WorkerSession

KEY = bytes(range(16))
WORLD = 4
POOL = 64
PACKETS = {"cnat8": 1024, "int32": 256}  # elements per packet: 1050-byte datagrams either way


def _addr(i: int) -> int:
    return 0x7F000001 << 16 | (5000 + i)


AGG = 0x7F000001 << 16 | 4000


def _core(codec: str, packet_elements: int, mac: bool) -> AggregatorCore:
    """A core with the job joined by WORLD ranks through the JOIN handshake; with ``mac``, the job's data key is
    set to KEY in its table (the engines of ``record`` share it: the kernel's cost does not depend on the key)."""
    core = AggregatorCore(rows=POOL, max_elements=packet_elements)
    params = JobParams(world_size=WORLD, packet_elements=packet_elements, pool_size=POOL,
                       codec=CODEC_NAMES[codec], seed=1, data_mac=mac)
    for r in range(WORLD):
        session = WorkerSession(job=1, rank=r, params=params, token="", aggregator=AGG)
        session.connect(0.0)
        while not session.joined:
            rx = Burst.rows_of(1, wire.MAX_DATAGRAM)
            rx.fill([(d, _addr(r)) for d, _ in session.datagrams_to_send(0.0)])
            core.receive(rx, 0.0)
            for reply, _ in core.take_replies():
                session.receive(reply, AGG, 0.0)
    if mac:
        core.datapath.jobs.mac_key[core.info[1].index] = key_words(KEY)
    return core


def record(codec: str, packet_elements: int, chunks: int, mac: bool) -> list[tuple[bytes, int]]:
    """Every DATA datagram (and its source) the WORLD ranks of one loss-free allreduce of `chunks` chunks send, in
    the order a core receives them, bursts of whatever the ranks sent since the last one."""
    keys = np.array([key_words(KEY)], np.uint64) if mac else None
    engines = [StreamEngine(job=1, rank=r, world_size=WORLD, codec=CODEC_NAMES[codec],
                            packet_elements=packet_elements, pool_size=POOL, seed=1, agg_addrs=[AGG],
                            data_mac_keys=keys) for r in range(WORLD)]
    core = _core(codec, packet_elements, mac)
    rng = np.random.default_rng(0)
    up = []
    for r, e in enumerate(engines):
        x = (rng.standard_normal(chunks * packet_elements) * 1e-3).astype(np.float32)
        up += [(d, _addr(r)) for d, _ in e.start(x, 0.0).datagrams()]
    stream = []
    while up:
        stream += up
        rx = Burst.rows_of(len(up), max(len(d) for d, _ in up))
        rx.fill(up)
        down = core.receive(rx, 0.0).datagrams()
        up = []
        for r, e in enumerate(engines):
            mine = [(d, AGG) for d, dst in down if dst == _addr(r)]
            if mine:
                rx = Burst.rows_of(len(mine), e.max_datagram)
                rx.fill(mine)
                up += [(d, _addr(r)) for d, _ in e.receive(rx, 0.0).datagrams()]
    assert all(e.done for e in engines)
    return stream


def _bursts(stream: list[tuple[bytes, int]]) -> list[Burst]:
    out = []
    for i in range(0, len(stream), BURST):
        part = stream[i:i + BURST]
        rx = Burst.rows_of(len(part), max(len(d) for d, _ in part))
        rx.fill(part)
        out.append(rx)
    return out


def kernel_seconds(codec: str, packet_elements: int, plain: list[tuple[bytes, int]],
                   tagged: list[tuple[bytes, int]], repeats: int) -> tuple[float, float]:
    """Median times of AggregatorCore.receive over the whole plain stream (a core without the MAC) and the whole
    tagged one (a core with it), in bursts of BURST, on a fresh core each run. The two alternate, so that both
    see the same load on a shared machine."""
    streams = {False: _bursts(plain), True: _bursts(tagged)}
    times: dict[bool, list[float]] = {False: [], True: []}
    for k in range(repeats + 1):  # the first pair warms up (and compiles)
        for mac, bursts in streams.items():
            core = _core(codec, packet_elements, mac)
            start = time.perf_counter()
            for rx in bursts:
                core.receive(rx, 0.0)
            if k:
                times[mac].append(time.perf_counter() - start)
    return statistics.median(times[False]), statistics.median(times[True])


@njit(cache=True, nogil=True)
def _tag_burst(data, length, n, k0, k1):
    acc = np.uint64(0)
    for i in range(n):
        acc ^= siphash24(data[i], length[i] - TAG_SIZE, k0, k1)
    return acc


def tag_seconds(full: list[tuple[bytes, int]], repeats: int) -> float:
    """Median time to compute the tag of every datagram of `full` (already tagged: over all but the tag)."""
    rx = Burst.rows_of(len(full), max(len(d) for d, _ in full))
    rx.fill(full)
    k0, k1 = (np.uint64(k) for k in key_words(KEY))
    return median_seconds(lambda: _tag_burst(rx.data, rx.length, rx.count, k0, k1), repeats, warmup=2)


def run(chunks: int, repeats: int, workers: int, elements: int, cores: int, rounds: int, trials: int,
        as_json: bool) -> dict:
    rows = []
    for codec, p in PACKETS.items():
        plain, tagged = record(codec, p, chunks, False), record(codec, p, chunks, True)
        n = len(plain)
        assert len(tagged) == n
        base, with_mac = (t / n for t in kernel_seconds(codec, p, plain, tagged, repeats))
        size = max(len(d) for d, _ in plain)
        full = [(d, a) for d, a in tagged if len(d) == size + TAG_SIZE]  # not the bootstrap packets
        tag = tag_seconds(full, repeats) / len(full)
        rows.append({"what": f"{codec}, {p} elements ({size}-byte datagrams)",
                     "kernel_ns": 1e9 * base, "kernel_mac_ns": 1e9 * with_mac, "tag_ns": 1e9 * tag,
                     "ratio": with_mac / base})
    per_packet = {"workers": WORLD, "pool": POOL, "chunks": chunks, "burst": BURST, "repeats": repeats,
                  "cpu": platform.processor() or platform.machine(), "rows": rows}
    if not as_json:
        _table(per_packet, "DATA/RESULT MAC per DATA packet (aggregator core, one thread; the kernel's figures are "
               "averaged over a whole allreduce, bootstrap packets included)",
               [("what", "stream", ""), ("kernel_ns", "kernel ns/pkt (anchor)", ".0f"),
                ("kernel_mac_ns", "kernel+MAC ns/pkt", ".0f"), ("tag_ns", "one tag ns", ".0f"),
                ("ratio", "× anchor", ".2f")])
    codec = "cnat8"
    p = wire.max_packet_elements(CODEC_NAMES[codec], data_mac=True)  # the same packets with and without the tag
    per_round: dict[bool, list[float]] = {False: [], True: []}
    retransmissions = {False: 0, True: 0}
    for _ in range(trials):  # alternating, so that both see the same load on a shared machine
        for on in (False, True):
            res = run_intml(workers, elements, codec, p, POOL, cores, 1, rounds, None, data_mac=on)
            if not res["identical_across_ranks"]:
                raise RuntimeError("intml ranks disagree on the result: the allreduce is not bit-identical")
            per_round[on] += res["per_round_s"]
            retransmissions[on] += res["retransmissions"]
    loop = [{"mac": "on" if on else "off", "median_s": statistics.median(per_round[on]),
             "ratio": statistics.median(per_round[on]) / statistics.median(per_round[False]),
             "retransmissions": retransmissions[on]} for on in (False, True)]
    allreduce = {"workers": workers, "elements": elements, "codec": codec, "packet_elements": p, "pool": POOL,
                 "cores": cores, "trials": trials, "rounds_per_trial": rounds, "results": "unicast", "rows": loop}
    if as_json:
        print(json.dumps({"benchmark": "mac", "per_packet": per_packet, "allreduce": allreduce}, indent=2))
    else:
        print()
        _table(allreduce, "loopback allreduce without and with the MAC",
               [("mac", "MAC", ""), ("median_s", "median s", ".4f"), ("ratio", "× off", ".2f"),
                ("retransmissions", "retransmissions", "d")])
    return {"per_packet": per_packet, "allreduce": allreduce}


def _table(report: dict, title: str, columns: list[tuple[str, str, str]]) -> None:
    emit(report["rows"], False, title, columns, {k: v for k, v in report.items() if k != "rows"})
