"""`intml-testbed bench burstio`: loopback packets/s of BurstSocket (recvmmsg/sendmmsg) beside a plain
sendto/recvfrom loop, one process, two sockets.

Both variants interleave: send ``burst`` datagrams, then receive until that batch arrived (or a 0.2 s loss
timeout), so the receive queue never overflows. The anchor is the plain loop on sockets with the same buffer
sizes.
"""

from __future__ import annotations

import select
import socket
import time

import numpy as np

from intml.burstio.mmsg import _SO_RCVBUFFORCE, _SO_SNDBUFFORCE, _WANT_BUF, BurstSocket, _set_buf, addr_key
from intml.testbed.timing import emit

LOSS_TIMEOUT = 0.2  # seconds without the rest of a batch before it counts as lost


def _udp_pair() -> tuple[socket.socket, socket.socket]:
    a = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    b = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    a.bind(("127.0.0.1", 0))
    b.bind(("127.0.0.1", 0))
    return a, b


def _burst(n_packets: int, size: int, burst: int) -> tuple[int, int, float]:
    """(received, lost, seconds) through BurstSocket."""
    a, b = _udp_pair()
    tx, rx = BurstSocket(a, burst, size), BurstSocket(b, burst, size)
    tx.tx_data[:] = np.arange(size, dtype=np.uint8)
    tx.tx_len[:] = size
    tx.tx_addr[:] = addr_key(*b.getsockname())
    tx.send_burst(1)  # warm-up: loads the compiled bookkeeping kernels outside the timed loop
    while rx.recv_burst() == 0:
        select.select([rx], [], [], LOSS_TIMEOUT)
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


def run(n_packets: int = 200_000, size: int = 8192, burst: int = 256, as_json: bool = False) -> list[dict]:
    rows = []
    for variant, fn in (("burst (recvmmsg/sendmmsg)", _burst), ("plain (sendto/recvfrom, anchor)", _plain)):
        got, lost, seconds = fn(n_packets, size, burst)
        rows.append({"variant": variant, "packets_per_s": got / seconds, "gb_per_s": got * size / seconds / 1e9,
                     "lost": lost})
    for row in rows:
        row["ratio_to_plain"] = row["packets_per_s"] / rows[-1]["packets_per_s"]
    emit(rows, as_json, "UDP datagrams on loopback, one process",
         [("variant", "variant", ""), ("packets_per_s", "packets/s", ",.0f"), ("gb_per_s", "GB/s", ".2f"),
          ("lost", "lost", "d"), ("ratio_to_plain", "× plain", ".2f")],
         {"packets": n_packets, "size": size, "burst": burst})
    return rows
