"""`intml-testbed bench burstio`: loopback packets/s of BurstSocket with UDP GSO/GRO, with sendmmsg/recvmmsg alone,
and of a plain sendto/recvfrom loop (the anchor), in one run, one process, two sockets per variant.

Every variant interleaves: send ``burst`` datagrams of one size to one destination, then receive until that batch
arrived (or a 0.2 s loss timeout), so the receive queue never overflows. The BurstSocket variants differ only in
``gso``/``gro`` (GSO alone: the receiving kernel cuts each packet back into datagrams; GRO alone: loopback does
not coalesce, so it shows the cost of 64 KiB reads and the copy into rows). The plain loop uses sockets with the
same buffer sizes.
"""

from __future__ import annotations

import select
import socket
import time

import numpy as np

from intml.burstio.mmsg import _SO_RCVBUFFORCE, _SO_SNDBUFFORCE, _WANT_BUF, BurstSocket, _set_buf, addr_key
from intml.testbed.timing import emit

LOSS_TIMEOUT = 0.2  # seconds without the rest of a batch before it counts as lost
SIZES = (1050, 8218)  # bytes per datagram: a cnat8 packet at MTU 1500, and the largest at MTU 9000
OFFLOADS = {  # variant: (gso, gro)
    "gso+gro": (True, True),
    "gso": (True, False),
    "gro": (False, True),
    "mmsg": (False, False),
}


def _udp_pair() -> tuple[socket.socket, socket.socket]:
    a = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    b = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    a.bind(("127.0.0.1", 0))
    b.bind(("127.0.0.1", 0))
    return a, b


def _burst(n_packets: int, size: int, burst: int, gso: bool, gro: bool) -> tuple[int, int, float]:
    """(received, lost, seconds) through BurstSocket."""
    a, b = _udp_pair()
    tx, rx = BurstSocket(a, burst, size, gso=gso, gro=gro), BurstSocket(b, burst, size, gso=gso, gro=gro)
    if (tx.gso, rx.gro) != (gso, gro):
        raise RuntimeError("this kernel lacks UDP GSO/GRO")
    tx.tx_data[:] = np.arange(size, dtype=np.uint8)
    tx.tx_len[:] = size
    tx.tx_addr[:] = addr_key(*b.getsockname())
    tx.send_burst(burst)  # warm-up: loads the compiled bookkeeping kernels outside the timed loop
    deadline = time.monotonic() + LOSS_TIMEOUT
    while time.monotonic() < deadline:
        if rx.recv_burst() == 0:
            select.select([rx], [], [], 0.01)
    got = lost = 0
    t0 = time.perf_counter()
    left = n_packets
    while left:
        k = tx.send_burst(min(burst, left))
        left -= k
        want, t_batch = got + k, time.monotonic()
        while got < want:
            r = rx.recv_burst()
            if r:
                got += int(np.count_nonzero(rx.rx_len[:r] == size))
            elif time.monotonic() - t_batch > LOSS_TIMEOUT:
                lost += want - got
                want = got
    seconds = time.perf_counter() - t0
    a.close(), b.close()
    return got, lost, seconds


def _plain(n_packets: int, size: int, burst: int) -> tuple[int, int, float]:
    """(received, lost, seconds) through sendto/recvfrom, one Python call per datagram."""
    a, b = _udp_pair()
    for s in (a, b):  # the buffers BurstSocket asks for, so only the calls differ
        _set_buf(s, _SO_RCVBUFFORCE, socket.SO_RCVBUF, _WANT_BUF)
        _set_buf(s, _SO_SNDBUFFORCE, socket.SO_SNDBUF, _WANT_BUF)
    b.settimeout(LOSS_TIMEOUT)
    payload, dest = bytes(size), b.getsockname()
    got = lost = 0
    t0 = time.perf_counter()
    left = n_packets
    while left:
        k = min(burst, left)
        for _ in range(k):
            a.sendto(payload, dest)
        left -= k
        for _ in range(k):
            try:
                data, _src = b.recvfrom(size)
            except TimeoutError:
                lost += 1
                continue
            got += len(data) == size
    seconds = time.perf_counter() - t0
    a.close(), b.close()
    return got, lost, seconds


def run(n_packets: int = 200_000, sizes: tuple[int, ...] = SIZES, burst: int = 256,
        as_json: bool = False) -> list[dict]:
    rows = []
    for size in sizes:
        variants = [(f"{name} (BurstSocket)", lambda n, s, b, o=offload: _burst(n, s, b, *o))
                    for name, offload in OFFLOADS.items()]
        at = len(rows)
        for variant, fn in [*variants, ("plain (sendto/recvfrom, anchor)", _plain)]:
            got, lost, seconds = fn(n_packets, size, burst)
            rows.append({"size": size, "variant": variant, "packets_per_s": got / seconds,
                         "gb_per_s": got * size / seconds / 1e9, "lost": lost})
        plain, mmsg = rows[-1]["packets_per_s"], rows[at + len(OFFLOADS) - 1]["packets_per_s"]
        for row in rows[at:]:
            row["ratio_to_plain"] = row["packets_per_s"] / plain
            row["ratio_to_mmsg"] = row["packets_per_s"] / mmsg
    emit(rows, as_json, "UDP datagrams on loopback, one process",
         [("size", "bytes", "d"), ("variant", "variant", ""), ("packets_per_s", "packets/s", ",.0f"),
          ("gb_per_s", "GB/s", ".2f"), ("lost", "lost", "d"), ("ratio_to_mmsg", "× mmsg", ".2f"),
          ("ratio_to_plain", "× plain", ".2f")],
         {"packets": n_packets, "sizes": list(sizes), "burst": burst})
    return rows
