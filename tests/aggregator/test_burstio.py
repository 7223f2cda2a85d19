"""Tests of burstio.mmsg: burst send/receive over real UDP sockets on 127.0.0.1, truncation, address keys."""

import collections
import ctypes
import errno
import os
import select
import socket
import time

import numpy as np
import pytest
from numba.core.registry import CPUDispatcher

from intml.burstio import mmsg
from intml.burstio.mmsg import BurstSocket, addr_key, addr_of
from intml.protocol.burst import Burst

pytestmark = pytest.mark.process

LOCAL = "127.0.0.1"
DEADLINE = 5.0  # seconds to wait for datagrams that must arrive


@pytest.fixture(autouse=True, params=["1", "0"], ids=["gso-gro", "plain"])
def offload(request, monkeypatch) -> str:
    """Every test runs with GSO and GRO on (INTML_GSO=1) and with the plain path (INTML_GSO=0), unless it says."""
    monkeypatch.setenv("INTML_GSO", request.param)
    return request.param


@pytest.fixture
def udp():
    """Factory of bound loopback UDP sockets, closed at teardown."""
    made = []

    def make() -> socket.socket:
        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        s.bind((LOCAL, 0))
        made.append(s)
        return s

    yield make
    for s in made:
        s.close()


def key_of(s: socket.socket) -> int:
    return addr_key(*s.getsockname())


def recv_all(bs: BurstSocket, n: int, max_count: int | None = None) -> list[tuple[int, bytes | None, int]]:
    """Receive ``n`` datagrams as (len, bytes or None if truncated, source key), bounded by DEADLINE."""
    out = []
    end = time.monotonic() + DEADLINE
    while len(out) < n:
        r = bs.recv_burst(max_count)
        for i in range(r):
            ln = int(bs.rx_len[i])
            out.append((ln, bs.rx_data[i, :ln].tobytes() if ln >= 0 else None, int(bs.rx_addr[i])))
        if r == 0:
            left = end - time.monotonic()
            assert left > 0, f"only {len(out)} of {n} datagrams arrived"
            select.select([bs], [], [], min(left, 0.05))
    return out


def fill_tx(bs: BurstSocket, payloads: list[bytes], dest: int) -> None:
    for i, p in enumerate(payloads):
        bs.tx_data[i, : len(p)] = np.frombuffer(p, np.uint8)
        bs.tx_len[i] = len(p)
        bs.tx_addr[i] = dest


def random_payloads(n: int, max_len: int, seed: int) -> list[bytes]:
    rng = np.random.default_rng(seed)
    lens = rng.integers(0, max_len + 1, n)
    lens[:3] = [0, 1, max_len]  # edge lengths, including an empty datagram
    return [rng.integers(0, 256, int(k), dtype=np.uint8).tobytes() for k in lens]


def test_send_from_own_buffers_through_tx_ptr(udp):
    """Entries pointed at other memory (one buffer sent to two entries, another at an offset) send those bytes
    and leave tx_data alone; entries left at their rows still send tx_data."""
    a, b = udp(), udp()
    tx, rx = BurstSocket(a, burst=8), BurstSocket(b)
    own = np.frombuffer(b"stored result datagram", np.uint8).copy()
    other = np.arange(100, dtype=np.uint8)
    fill_tx(tx, [b"row zero", b"row one", b"row two"], key_of(b))
    tx.tx_ptr[0] = tx.tx_ptr[1] = own.ctypes.data
    tx.tx_len[0] = tx.tx_len[1] = own.size
    tx.tx_ptr[2] = other.ctypes.data + 10
    tx.tx_len[2] = 5
    fill_tx_row3 = b"row three"
    tx.tx_data[3, :len(fill_tx_row3)] = np.frombuffer(fill_tx_row3, np.uint8)
    tx.tx_len[3], tx.tx_addr[3] = len(fill_tx_row3), key_of(b)
    assert tx.send_burst(4) == 4
    got = sorted(data for _, data, _ in recv_all(rx, 4))
    assert got == sorted([own.tobytes()] * 2 + [bytes(range(10, 15)), fill_tx_row3])
    assert bytes(tx.tx_data[0, :8]) == b"row zero"


def test_burst_to_burst_roundtrip(udp):
    a, b = udp(), udp()
    tx, rx = BurstSocket(a), BurstSocket(b)
    payloads = random_payloads(200, tx.max_packet, seed=1)
    fill_tx(tx, payloads, key_of(b))
    assert tx.send_burst(200) == 200
    got = recv_all(rx, 200)
    src = key_of(a)
    assert collections.Counter(got) == collections.Counter((len(p), p, src) for p in payloads)
    assert rx.recv_burst() == 0  # nothing extra


def test_multiple_bursts_and_max_count(udp):
    a, b = udp(), udp()
    tx, rx = BurstSocket(a, burst=16, max_packet=64), BurstSocket(b, burst=16, max_packet=64)
    payloads = [bytes([i]) * (i % 64) for i in range(40)]
    for start in range(0, 40, 16):
        chunk = payloads[start : start + 16]
        fill_tx(tx, chunk, key_of(b))
        assert tx.send_burst(len(chunk)) == len(chunk)
    first = recv_all(rx, 3, max_count=3)
    assert len(first) == 3
    rest = recv_all(rx, 37)
    assert collections.Counter(p for _, p, _ in first + rest) == collections.Counter(payloads)


def test_recv_empty_returns_zero(udp):
    rx = BurstSocket(udp())
    assert rx.recv_burst() == 0
    assert rx.recv_burst(0) == 0
    assert rx.recv_burst(1) == 0


def test_truncated_datagram_reported(udp):
    a, b = udp(), udp()
    rx = BurstSocket(b, burst=8, max_packet=1000)
    dest = b.getsockname()
    sent = [b"x" * 1500, b"y" * 100, b"z" * 1000, b"w" * 1001, b"v" * 7]
    for p in sent:
        a.sendto(p, dest)
    got = recv_all(rx, len(sent))
    assert [ln for ln, _, _ in got] == [-1, 100, 1000, -1, 7]  # loopback keeps order
    assert [p for _, p, _ in got] == [None, sent[1], sent[2], None, sent[4]]
    assert {k for _, _, k in got} == {key_of(a)}
    # still usable afterwards
    a.sendto(b"after", dest)
    assert recv_all(rx, 1) == [(5, b"after", key_of(a))]


def test_truncation_in_middle_of_burst_send(udp):
    a, b = udp(), udp()
    tx, rx = BurstSocket(a, burst=4, max_packet=3000), BurstSocket(b, burst=4, max_packet=2000)
    payloads = [b"a" * 10, b"b" * 2500, b"c" * 2000, b"d" * 3]
    fill_tx(tx, payloads, key_of(b))
    assert tx.send_burst(4) == 4
    got = recv_all(rx, 4)
    assert [ln for ln, _, _ in got] == [10, -1, 2000, 3]
    assert [p for _, p, _ in got] == [payloads[0], None, payloads[2], payloads[3]]


@pytest.mark.parametrize(
    "host,port",
    [("127.0.0.1", 5000), ("0.0.0.0", 0), ("255.255.255.255", 65535), ("10.1.2.3", 1), ("192.168.0.254", 4791)],
)
def test_addr_key_roundtrip(host, port):
    k = addr_key(host, port)
    assert 0 <= k < 1 << 48
    assert addr_of(k) == (host, port)
    assert addr_of(np.uint64(k)) == (host, port)


def test_addr_key_value():
    assert addr_key("127.0.0.1", 5000) == (0x7F000001 << 16) | 5000
    assert addr_key("10.0.0.2", 0x1234) == 0x0A000002_1234
    assert addr_of(0x0A000002_1234) == ("10.0.0.2", 0x1234)


def test_addr_key_rejects_bad_input():
    with pytest.raises(ValueError):
        addr_key("127.0.0.1", 65536)
    with pytest.raises(ValueError):
        addr_key("127.0.0.1", -1)
    with pytest.raises(ValueError):
        addr_of(1 << 48)


def test_send_burst_to_plain_socket(udp):
    a, b = udp(), udp()
    tx = BurstSocket(a, burst=32, max_packet=4000)
    b.settimeout(DEADLINE)
    payloads = random_payloads(32, 4000, seed=2)
    fill_tx(tx, payloads, key_of(b))
    assert tx.send_burst(32) == 32
    got = [b.recvfrom(65535) for _ in payloads]
    assert collections.Counter(d for d, _ in got) == collections.Counter(payloads)
    assert {src for _, src in got} == {a.getsockname()}


def test_recv_burst_from_plain_sendto(udp):
    a, b = udp(), udp()
    rx = BurstSocket(b, burst=8, max_packet=2000)
    payloads = random_payloads(20, 2000, seed=3)
    for p in payloads:
        a.sendto(p, b.getsockname())
    got = recv_all(rx, 20)
    assert collections.Counter(got) == collections.Counter((len(p), p, key_of(a)) for p in payloads)


def test_send_one(udp):
    a, b = udp(), udp()
    tx, rx = BurstSocket(a), BurstSocket(b)
    tx.send_one(b"join", key_of(b))
    assert recv_all(rx, 1) == [(4, b"join", key_of(a))]


def test_two_destinations_in_one_burst(udp):
    a, b, c = udp(), udp(), udp()
    tx = BurstSocket(a, burst=6, max_packet=100)
    rb, rc = BurstSocket(b, burst=6, max_packet=100), BurstSocket(c, burst=6, max_packet=100)
    payloads = [bytes([i]) * (i + 1) for i in range(6)]
    fill_tx(tx, payloads, 0)
    tx.tx_addr[:] = [key_of(b), key_of(c)] * 3
    assert tx.send_burst(6) == 6
    assert [p for _, p, _ in recv_all(rb, 3)] == payloads[0::2]
    assert [p for _, p, _ in recv_all(rc, 3)] == payloads[1::2]


def test_send_burst_validates(udp):
    tx = BurstSocket(udp(), burst=4, max_packet=100)
    assert tx.send_burst(0) == 0
    with pytest.raises(ValueError):
        tx.send_burst(5)
    tx.tx_len[:] = 101
    tx.tx_addr[:] = addr_key(LOCAL, 9)
    with pytest.raises(ValueError):
        tx.send_burst(1)


def test_socket_setup(udp):
    s = udp()
    bs = BurstSocket(s)
    assert s.getblocking() is False
    assert bs.fileno() == s.fileno()
    assert bs.rcvbuf >= 1 << 16 and bs.sndbuf >= 1 << 16
    assert bs.rcvbuf == s.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF)
    assert bs.rx_data.shape == bs.tx_data.shape == (256, 9000) and bs.rx_data.dtype == np.uint8
    assert bs.rx_len.dtype == bs.tx_len.dtype == np.int32
    assert bs.rx_addr.dtype == bs.tx_addr.dtype == np.uint64


def test_rejects_non_ipv4_udp():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as t, pytest.raises(ValueError):
        BurstSocket(t)
    with socket.socket(socket.AF_INET6, socket.SOCK_DGRAM) as u6, pytest.raises(ValueError):
        BurstSocket(u6)


def test_recv_error_raises():
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.bind((LOCAL, 0))
    bs = BurstSocket(s)
    s.close()  # fileno() is now -1 -> EBADF
    with pytest.raises(OSError) as e:
        bs.recv_burst()
    assert e.value.errno == errno.EBADF


def flaky_sendmmsg(bs: BurstSocket, most: int) -> list[int]:
    """Fault injection: every other sendmmsg of ``bs`` fails with EAGAIN, the others send at most ``most`` entries;
    returns the entries asked of each call, as they come."""
    real = bs._sendmmsg
    calls: list[int] = []

    def flaky(fd, ptr, vlen, flags):
        calls.append(vlen)
        if len(calls) % 2 == 0:
            ctypes.set_errno(errno.EAGAIN)
            return -1
        return real(fd, ptr, min(vlen, most), flags)

    bs._sendmmsg = flaky
    return calls


def test_partial_send_and_eagain_are_continued(udp):
    """Fault injection: the kernel sends fewer than asked, then reports EAGAIN; all must still go out."""
    a, b = udp(), udp()
    tx, rx = BurstSocket(a, burst=10, max_packet=50), BurstSocket(b, burst=10, max_packet=50)
    calls = flaky_sendmmsg(tx, most=3)
    payloads = [bytes([65 + i]) * (i + 1) for i in range(10)]
    fill_tx(tx, payloads, key_of(b))
    assert tx.send_burst(10) == 10
    assert calls[0] == 10 and calls[2] == 7  # resumed after the 3 that went out
    assert [p for _, p, _ in recv_all(rx, 10)] == payloads


def test_send_gives_up_after_timeout(udp):
    """Persistent EAGAIN: send_burst returns the count sent so far instead of looping forever."""
    a = udp()
    tx = BurstSocket(a, burst=4, max_packet=10)
    tx.send_timeout = 0.05
    tx._sendmmsg = lambda *args: (ctypes.set_errno(errno.EAGAIN), -1)[1]
    fill_tx(tx, [b"x"] * 4, addr_key(LOCAL, 9))
    assert tx.send_burst(4) == 0
    assert tx.tx_sent == 0


def test_send_hard_error_raises(udp):
    a = udp()
    tx = BurstSocket(a, burst=2, max_packet=10)
    tx._sendmmsg = lambda *args: (ctypes.set_errno(errno.EPERM), -1)[1]
    fill_tx(tx, [b"x"] * 2, addr_key(LOCAL, 9))
    with pytest.raises(OSError) as e:
        tx.send_burst(2)
    assert e.value.errno == errno.EPERM


def test_send_takes_a_core_burst_and_rx_is_one(udp) -> None:
    """BurstSocket.send sends a Burst's datagrams from the memory they lie in, in several sendmmsg calls when the
    burst is longer than the socket's; recv_burst leaves what it got in ``rx`` as a Burst with its count."""
    a, b = udp(), udp()
    sender, receiver = BurstSocket(a, burst=4, max_packet=64), BurstSocket(b, burst=16, max_packet=64)
    to = key_of(b)
    store = np.arange(10 * 32, dtype=np.uint8).reshape(10, 32)  # a core's stored datagrams
    out = Burst(store, 10)
    for i in range(10):
        out.ptr[i] = store.ctypes.data + (9 - i) * 32  # last row first: sent from where they lie, no copy
        out.length[i] = 1 + i
        out.addr[i] = to
    out.count = 10
    assert sender.send(out) == 10
    assert int(sender.tx_ptr[0]) == sender.tx_data.ctypes.data  # rows point at tx_data again afterwards
    got: list[tuple[bytes, int]] = []
    end = time.monotonic() + DEADLINE
    while len(got) < 10 and time.monotonic() < end:
        if receiver.recv_burst():
            got += receiver.rx.datagrams()
    assert [d for d, _ in got] == [store[9 - i, : 1 + i].tobytes() for i in range(10)]
    assert {src for _, src in got} == {key_of(a)}
    assert receiver.recv_burst() == 0 and receiver.rx.count == 0


def test_send_skips_and_counts_refused_destinations(udp) -> None:
    """A destination the kernel refuses (port 0: EINVAL) costs only its own datagram: the others of the burst,
    before and after it and across sendmmsg calls, still go out, and the refusals are counted."""
    a, b = udp(), udp()
    sender, receiver = BurstSocket(a, burst=4, max_packet=64), BurstSocket(b, burst=16, max_packet=64)
    refused = addr_key("127.0.0.1", 0)
    store = np.arange(10 * 32, dtype=np.uint8).reshape(10, 32)
    out = Burst(store, 10)
    bad = {0, 3, 4, 9}  # first, last of a sendmmsg call, first of the next, last of the burst
    for i in range(10):
        out.ptr[i] = store.ctypes.data + i * 32
        out.length[i] = 1 + i
        out.addr[i] = refused if i in bad else key_of(b)
    out.count = 10
    assert sender.send(out) == 10 - len(bad)
    assert sender.send_failed == len(bad)
    got: list[tuple[bytes, int]] = []
    end = time.monotonic() + DEADLINE
    while len(got) < 10 - len(bad) and time.monotonic() < end:
        if receiver.recv_burst():
            got += receiver.rx.datagrams()
    assert [d for d, _ in got] == [store[i, : 1 + i].tobytes() for i in range(10) if i not in bad]


# ---- GSO (UDP_SEGMENT) and GRO (UDP_GRO) --------------------------------------------------------------------
def offload_pair(udp, burst: int, max_packet: int, on: bool) -> tuple[BurstSocket, BurstSocket]:
    a, b = udp(), udp()
    return (BurstSocket(a, burst, max_packet, gso=on, gro=on), BurstSocket(b, burst, max_packet, gso=on, gro=on))


def counting(bs: BurstSocket) -> list[tuple[int, int]]:
    """Record (entries asked, entries the kernel took) of each sendmmsg and recvmmsg call of ``bs``."""
    calls: list[tuple[int, int]] = []
    send, recv = bs._sendmmsg, bs._recvmmsg

    def counted_send(fd, ptr, vlen, flags):
        r = send(fd, ptr, vlen, flags)
        calls.append((vlen, r))
        return r

    def counted_recv(fd, ptr, vlen, flags, timeout):
        r = recv(fd, ptr, vlen, flags, timeout)
        calls.append((vlen, r))
        return r

    bs._sendmmsg, bs._recvmmsg = counted_send, counted_recv
    return calls


def burst_of(rows: list[tuple[bytes, int]]) -> Burst:
    """A core's output burst: the datagrams lie back to back in one store, in order."""
    store = np.frombuffer(b"".join(p for p, _ in rows) or b"\0", np.uint8).copy()
    out = Burst(store, max(1, len(rows)))
    at = store.ctypes.data
    for i, (p, dest) in enumerate(rows):
        out.ptr[i], out.length[i], out.addr[i] = at, len(p), dest
        at += len(p)
    out.count = len(rows)
    return out


def receive_each(sockets: dict[int, BurstSocket], want: int, max_count: int | None = None) -> dict[int, list]:
    """Datagrams received by each socket, in arrival order, as (bytes or None if truncated, source key)."""
    got: dict[int, list] = {k: [] for k in sockets}
    end = time.monotonic() + DEADLINE
    while sum(map(len, got.values())) < want:
        assert time.monotonic() < end, f"only {sum(map(len, got.values()))} of {want} datagrams arrived"
        idle = True
        for k, bs in sockets.items():
            while (r := bs.recv_burst(max_count)) > 0:
                idle = False
                got[k] += [(bs.rx_data[i, :bs.rx_len[i]].tobytes() if bs.rx_len[i] >= 0 else None,
                            int(bs.rx_addr[i])) for i in range(r)]
        if idle:
            select.select(list(sockets.values()), [], [], 0.05)
    return got


def test_offload_defaults_and_the_environment(udp, monkeypatch) -> None:
    """This kernel has both (the tests below exercise them). By default GSO is on, and GRO for datagrams of at
    most GRO_MAX_PACKET bytes (where it paid); INTML_GSO=0 forces both off, INTML_GSO=1 both on."""
    from intml.burstio.mmsg import GRO_MAX_PACKET

    monkeypatch.delenv("INTML_GSO", raising=False)
    small, large = BurstSocket(udp(), max_packet=GRO_MAX_PACKET), BurstSocket(udp(), max_packet=GRO_MAX_PACKET + 1)
    assert small.gso and small.gro and small.sock.getsockopt(17, 104) == 1  # SOL_UDP, UDP_GRO
    assert large.gso and not large.gro and large.sock.getsockopt(17, 104) == 0
    monkeypatch.setenv("INTML_GSO", "0")
    plain = BurstSocket(udp(), max_packet=100)
    assert not plain.gso and not plain.gro and plain.sock.getsockopt(17, 104) == 0
    monkeypatch.setenv("INTML_GSO", "1")
    assert BurstSocket(udp(), max_packet=65507).gro
    assert not BurstSocket(udp(), max_packet=100, gso=False, gro=False).gro  # the arguments decide over both


def test_kernel_without_offload_falls_back(udp, monkeypatch) -> None:
    """setsockopt refused (ENOPROTOOPT, EINVAL: an older kernel): the socket runs the plain path, and works."""
    from intml.burstio import mmsg

    monkeypatch.setenv("INTML_GSO", "1")
    for err in (errno.ENOPROTOOPT, errno.EINVAL):
        def refuse(sock, level, option, value, err=err):
            raise OSError(err, os.strerror(err))

        monkeypatch.setattr(mmsg, "_setsockopt", refuse)
        tx, rx = BurstSocket(udp(), burst=8, max_packet=100), BurstSocket(udp(), burst=8, max_packet=100)
        assert not (tx.gso or tx.gro or rx.gso or rx.gro)
        payloads = [bytes([i]) * 40 for i in range(8)]
        fill_tx(tx, payloads, key_of(rx.sock))
        assert tx.send_burst(8) == 8
        assert [p for _, p, _ in recv_all(rx, 8)] == payloads

    def other(sock, level, option, value):
        raise OSError(errno.EBADF, "not a kernel without the option")

    monkeypatch.setattr(mmsg, "_setsockopt", other)
    with pytest.raises(OSError):
        BurstSocket(udp())


def offload_traffic(dests: list[int], seed: int, max_packet: int) -> list[tuple[bytes, int]]:
    """Runs of equal sizes (longer than a GSO entry takes), short last segments, singles, empty datagrams, sizes at
    max_packet, interleaved destinations."""
    rng = np.random.default_rng(seed)
    rows: list[tuple[bytes, int]] = []
    for run, size in enumerate([1050, 8218, 1, 0, max_packet, 700, 3000, 1050]):
        k = int(rng.integers(1, 90))
        last = int(rng.integers(1, size + 1)) if size and run % 2 else size
        sizes = [size] * (k - 1) + [last]
        rows += [(rng.integers(0, 256, s, dtype=np.uint8).tobytes(), dests[int(rng.integers(len(dests)))]
                  if run % 3 == 0 else dests[run % len(dests)]) for s in sizes]
    return rows


@pytest.mark.parametrize("max_count", [None, 7])
def test_offload_and_plain_deliver_the_same_datagrams(udp, max_count) -> None:
    """The same core bursts through GSO/GRO sockets and through plain ones: every receiver gets the same datagrams
    from the same source, in the same order (per destination), bit for bit; GSO took fewer sendmmsg entries and
    GRO fewer reads. ``max_count`` 7 leaves coalesced reads half handed out between recv_burst calls."""
    received = {}
    entries = {}
    for on in (True, False):
        tx = BurstSocket(udp(), burst=256, max_packet=9000, gso=on, gro=on)
        rxs = {i: BurstSocket(udp(), burst=64, max_packet=9000, gso=on, gro=on) for i in range(3)}
        keys = [key_of(r.sock) for r in rxs.values()]
        rows = offload_traffic(keys, seed=5, max_packet=9000)
        sent_calls, recv_calls = counting(tx), [counting(r) for r in rxs.values()]
        assert tx.send(burst_of(rows)) == len(rows)
        got = receive_each(rxs, len(rows), max_count)
        assert not any(r.pending for r in rxs.values()) and all(r.recv_burst() == 0 for r in rxs.values())
        want = {i: [(p, key_of(tx.sock)) for p, d in rows if d == keys[i]] for i in rxs}
        assert got == want
        received[on] = [[p for p, _ in got[i]] for i in rxs]
        entries[on] = (sum(r for _, r in sent_calls), sum(max(r, 0) for c in recv_calls for _, r in c))
    assert received[True] == received[False]
    n = sum(map(len, received[True]))
    assert entries[False] == (n, n)
    assert entries[True][0] < n // 4 and entries[True][1] < n // 4


def test_gro_from_many_sources_and_plain_senders(udp) -> None:
    """Many sources at once, some with GSO and some without, into one GRO socket: each source's datagrams arrive
    whole, in order, with that source's address."""
    rx = BurstSocket(udp(), burst=32, max_packet=2000, gro=True)
    senders = [BurstSocket(udp(), burst=64, max_packet=2000, gso=i % 2 == 0, gro=False) for i in range(6)]
    sent = {}
    for i, s in enumerate(senders):
        rows = [(bytes([i, k]) * (300 + i), key_of(rx.sock)) for k in range(50)] + [(b"end" * i, key_of(rx.sock))]
        assert s.send(burst_of(rows)) == len(rows)
        sent[key_of(s.sock)] = [p for p, _ in rows]
    got = receive_each({0: rx}, sum(map(len, sent.values())))[0]
    assert {src: [p for p, s in got if s == src] for src in sent} == sent
    assert {src for _, src in got} == set(sent)


def test_gro_marks_long_datagrams_truncated(udp) -> None:
    """A coalesced run of datagrams longer than max_packet: each is a row of length -1, as the plain path gives."""
    tx = BurstSocket(udp(), burst=16, max_packet=3000, gso=True)
    rx = BurstSocket(udp(), burst=16, max_packet=1000, gro=True)
    rows = [(b"L" * 2000, key_of(rx.sock))] * 5 + [(b"s" * 900, key_of(rx.sock))] * 3 + [(b"t" * 30, key_of(rx.sock))]
    assert tx.send(burst_of(rows)) == len(rows)
    got = receive_each({0: rx}, len(rows))[0]
    assert [p for p, _ in got] == [None] * 5 + [b"s" * 900] * 3 + [b"t" * 30]


def test_gso_refused_falls_back_to_one_datagram_per_entry(udp) -> None:
    """Fault injection: the kernel refuses GSO entries (EMSGSIZE: a segment over the path MTU). The run goes out
    again one datagram per entry, GSO is then off for the socket, and nothing is lost or duplicated."""
    tx, rx = offload_pair(udp, 64, 2000, on=True)
    real = tx._sendmmsg
    refused = []

    def no_gso(fd, ptr, vlen, flags):
        controllen = ctypes.c_size_t.from_address(ptr + 40).value  # msg_controllen of the first entry
        if controllen:
            refused.append(vlen)
            ctypes.set_errno(errno.EMSGSIZE)
            return -1
        return real(fd, ptr, vlen, flags)

    tx._sendmmsg = no_gso
    rows = [(bytes([k]) * 1000, key_of(rx.sock)) for k in range(40)]
    assert tx.send(burst_of(rows)) == 40
    assert refused == [1] and not tx.gso and tx.gso_fallbacks == 1 and tx.send_failed == 0
    assert [p for p, _ in receive_each({0: rx}, 40)[0]] == [p for p, _ in rows]


def test_gso_run_to_a_refused_destination_is_skipped(udp) -> None:
    """A GSO run to port 0 (EINVAL, as GSO refusals also are): its datagrams are skipped and counted, GSO stays on,
    and the runs to a good destination around it arrive."""
    tx, rx = offload_pair(udp, 64, 2000, on=True)
    bad = addr_key(LOCAL, 0)
    rows = ([(b"a" * 500, key_of(rx.sock))] * 10 + [(b"b" * 500, bad)] * 10 + [(b"c" * 500, key_of(rx.sock))] * 10)
    assert tx.send(burst_of(rows)) == 20
    assert tx.send_failed == 10 and tx.gso and tx.gso_fallbacks == 0
    assert [p for p, _ in receive_each({0: rx}, 20)[0]] == [b"a" * 500] * 10 + [b"c" * 500] * 10
    with pytest.raises(OSError) as e:  # send_burst raises instead
        fill_tx(tx, [b"x" * 10] * 4, bad)
        tx.send_burst(4)
    assert e.value.errno == errno.EINVAL and tx.tx_sent == 0


def test_gso_partial_sends_and_eagain_are_continued(udp) -> None:
    """Fault injection on GSO entries: the kernel takes one entry at a time, with EAGAIN between; all arrive once."""
    tx, rx = offload_pair(udp, 256, 9000, on=True)
    calls = flaky_sendmmsg(tx, most=1)
    rows = offload_traffic([key_of(rx.sock)], seed=7, max_packet=9000)[:256]
    assert tx.send(burst_of(rows)) == len(rows)
    assert [p for p, _ in receive_each({0: rx}, len(rows))[0]] == [p for p, _ in rows]
    assert len(calls) < len(rows)  # entries carried runs


def test_gro_recv_errors_and_eintr(udp) -> None:
    """Fault injection on the GRO receive: EINTR is retried, other errors raise, and what was read is kept."""
    tx, rx = offload_pair(udp, 64, 2000, on=True)
    real = rx._recvmmsg
    script = [errno.EINTR]

    def flaky(fd, ptr, vlen, flags, timeout):
        if script:
            ctypes.set_errno(script.pop())
            return -1
        return real(fd, ptr, vlen, flags, timeout)

    rx._recvmmsg = flaky
    rows = [(bytes([k]) * 700, key_of(rx.sock)) for k in range(100)]
    assert tx.send(burst_of(rows)) == 100
    assert [p for p, _ in receive_each({0: rx}, 100, max_count=9)[0]] == [p for p, _ in rows]
    script.append(errno.ENOMEM)
    with pytest.raises(OSError):
        rx.recv_burst()


@pytest.mark.parametrize("distinct", [1, 4, 63, 64, 200])
def test_grouping_by_destination_is_a_stable_sort(distinct: int) -> None:
    """The send kernel's grouping against numpy's stable sort: up to GROUPS - 1 destinations it is that sort;
    past them the later destinations share one group in which every datagram keeps its place."""
    from intml.burstio.mmsg import GROUPS, _group

    rng = np.random.default_rng(distinct)
    for count in (0, 1, 255, 256):
        addr = rng.integers(0, distinct, 256).astype(np.uint64) * np.uint64(7919) + np.uint64(1 << 40)
        order = np.full(256, -1, np.int64)
        _group(count, addr, order, np.zeros(GROUPS, np.uint64), np.zeros(GROUPS + 1, np.int64), np.zeros(256, np.int64))
        assert sorted(order[:count]) == list(range(count))
        first_seen = {k: i for i, k in reversed(list(enumerate(addr[:count].tolist())))}
        rank = {k: r for r, k in enumerate(sorted(first_seen, key=first_seen.get))}
        group = [min(rank[k], GROUPS - 1) for k in addr[:count].tolist()]
        assert order[:count].tolist() == sorted(range(count), key=lambda i: group[i])


def test_the_kernels_run_without_numbas_runtime() -> None:
    """Every burst kernel allocates nothing, so none needs Numba's runtime and its atomic reference counts."""
    kernels = [f for f in vars(mmsg).values() if isinstance(f, CPUDispatcher)]
    assert len(kernels) >= 7 and all(f.targetoptions["_nrt"] is False for f in kernels)
