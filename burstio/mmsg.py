"""Burst UDP receive/send with Linux ``recvmmsg(2)`` / ``sendmmsg(2)`` over preallocated numpy pools, with UDP
segmentation offload (GSO, ``UDP_SEGMENT``) on send and UDP receive coalescing (GRO, ``UDP_GRO``) on receive.

A :class:`BurstSocket` owns fixed packet buffers (``rx_data``/``tx_data``, one row per packet) and the
C control structures (``struct mmsghdr``, ``struct iovec``, ``struct sockaddr_in``, ``struct cmsghdr``) that point
into them. The control structures are numpy structured arrays filled and read by Numba kernels, one call per
burst: no Python object per packet. Per-packet work is meant to run later in numba kernels over
``rx_data``/``rx_len``/``rx_addr``.

GSO (send): the datagrams of a burst are grouped by destination (a stable sort: each destination still gets its
datagrams in order; the order across destinations carries no meaning in UDP), and a run of datagrams to one
destination with one length (the last may be shorter) goes out as one sendmmsg entry: one iovec per datagram
(the kernel copies the iovec array into one buffer and cuts it at the ``UDP_SEGMENT`` size, so the datagrams need
not be contiguous: zero copy from the core's memory, as before), at most ``GSO_MAX_SEGMENTS`` datagrams and
``GSO_MAX_BYTES`` bytes per entry. The aggregator's results to one worker and a worker's DATA to one core are
such runs. The kernel then builds, routes and (on loopback) delivers one packet per run; a NIC or the driver
layer segments it. A run the kernel refuses for its GSO (a segment longer than the path MTU allows: EMSGSIZE or
EINVAL; no checksum offload on the route: EIO) is sent again one datagram per entry; if that works, GSO is turned
off for the socket (``gso_fallbacks`` counts it), else the destination itself is refused.

GRO (receive): with ``UDP_GRO`` on, one read may hold several datagrams of one size from one source (the last
may be shorter), with the size in a ``UDP_GRO`` control message. Each recvmmsg entry then reads into a 64 KiB
buffer (``GRO_BUF``) and a kernel cuts the reads into ``rx`` rows, one datagram per row, as the plain path
gives them: the rest of the stack sees datagrams. Datagrams read but not yet handed out (more than the rows
asked for) wait in those buffers for the next ``recv_burst``, which hands them out before reading again; as the
socket is no longer readable for them, a caller that stops before ``recv_burst`` returns 0 checks ``pending``.
On loopback the kernel hands a GSO packet to a GRO socket whole (and cuts it for a socket without GRO).

Fallback: GSO and GRO are on where the kernel has them (Linux >= 4.18 and 5.0); a kernel that refuses the
socket options (ENOPROTOOPT, EINVAL) gets plain sendmmsg/recvmmsg. ``INTML_GSO=0`` in the environment (or
``BurstSocket(..., gso=False, gro=False)``) forces the plain path, so both are testable on one machine.

Measured (``intml-testbed bench burstio --packets 100000``, loopback, this 2-core machine shared with other
jobs; packets/s, and the ratio to sendmmsg/recvmmsg without offload in the same run):

=========  ===========  ===========  ===========  ===========  ======================
bytes      GSO+GRO      GSO alone    GRO alone    mmsg         plain sendto/recvfrom
=========  ===========  ===========  ===========  ===========  ======================
1050       5.17 M 5.97  1.64 M 1.89  0.73 M 0.84  0.87 M 1     0.40 M 0.46
2048       0.86 M 2.41  0.56 M 1.57  0.29 M 0.83  0.36 M 1     0.24 M 0.67
4130       0.42 M 1.56  0.34 M 1.25  0.24 M 0.89  0.27 M 1     0.21 M 0.79
8218       0.38 M 1.08  0.43 M 1.22  0.28 M 0.78  0.35 M 1     0.29 M 0.82
=========  ===========  ===========  ===========  ===========  ======================

So GSO is on by default everywhere: it pays at every size, and costs nothing where runs are single datagrams
(loopback's 64 KiB datagrams). GRO pays only where the senders' runs are coalesced and the datagrams small: each
datagram is copied once more (from the 64 KiB read into its row, ~0.08 ns/byte), which outweighs the saved
per-datagram kernel work somewhere between 4130 and 8218 bytes (GSO alone beats GSO+GRO at 8218), and a read that
is not coalesced only pays the copy (GRO alone: 0.78-0.89). It is therefore on by default only for sockets whose
``max_packet`` is at most ``GRO_MAX_PACKET`` (an aggregator of MTU-1500 packets, 1024 elements: 4130-byte results
at most), and off for the loopback benchmark's 64 KiB datagrams. A worker's unicast socket takes any datagram (a
statistics reply can be long) and has GRO where its job's datagrams are that short (worker.api.rank_socket).
End to end (``intml-testbed bench allreduce --workers 4 --elements 25000000``, loopback, alternating trials,
medians): with 1024-element packets (1050-byte datagrams) intml takes 0.78 s with GSO/GRO (INTML_GSO=1) and
1.18 s without; with 8192-element packets 0.226 s and 0.243 s; with the default 64 KiB datagrams, where no run
fits one GSO entry, the two differ only by this machine's noise.

The kernels allocate nothing and compile without Numba's runtime (``_nrt=False``): the runtime's atomic reference
counts on each row view they take cost more than their copies (docs/benchmarks.md, "Where an aggregator core's
time goes"), so no slice assignment here (it may allocate a temporary).

Addresses are plain integers, ``key = (ipv4_host_order_u32 << 16) | port`` (see :func:`addr_key`),
so they fit in a uint64 array and in numba code.

Limitations: Linux only (x86_64/aarch64 LP64 little-endian struct layouts, checked at import against ctypes);
IPv4 only (``AF_INET`` sockets; the sockaddr pool is ``sockaddr_in``); not thread-safe (one BurstSocket per
thread).

``intml-testbed bench burstio`` measures it against sendmmsg/recvmmsg without offload and a plain
sendto/recvfrom loop.
"""

from __future__ import annotations

import ctypes
import errno
import os
import select
import socket
import time

import numpy as np
from numba import njit

from intml.protocol.address import addr_key_of, addr_of
from intml.protocol.burst import Burst

__all__ = ["BurstSocket", "addr_key", "addr_of"]


# --- C ABI --------------------------------------------------------------------------------------

MSG_DONTWAIT = 0x40
MSG_TRUNC = 0x20
SOL_UDP = 17
UDP_SEGMENT = 103  # linux/udp.h: a send's GSO segment size (cmsg or socket option)
UDP_GRO = 104  # linux/udp.h: coalesce on receive; a read's segment size comes in a cmsg
GSO_MAX_SEGMENTS = 64  # the kernel's UDP_MAX_SEGMENTS (64 before Linux 6.15 raised it to 128)
GSO_MAX_BYTES = 65507  # one GSO entry is one IPv4 datagram before segmentation: 65535 - 20 (IP) - 8 (UDP)
GRO_BUF = 65536  # a coalesced read holds at most one IPv4 datagram's worth
GROUPS = 64  # destinations a burst is grouped by for GSO (more share one group: fewer, shorter runs)
GRO_MAX_PACKET = 4224  # GRO by default only where datagrams are at most this long (measured: see the docstring)
_SO_SNDBUFFORCE = getattr(socket, "SO_SNDBUFFORCE", 32)
_SO_RCVBUFFORCE = getattr(socket, "SO_RCVBUFFORCE", 33)
_WANT_BUF = 64 << 20  # requested socket buffer size; the kernel may grant less (net.core.rmem_max)
_NO_OPTION = (errno.ENOPROTOOPT, errno.EINVAL, errno.EOPNOTSUPP)  # a kernel without the UDP option
_GSO_REFUSED = (errno.EMSGSIZE, errno.EINVAL, errno.EIO)  # a GSO entry refused (segment over the MTU, no csum)


class _IOVec(ctypes.Structure):
    _fields_ = [("iov_base", ctypes.c_void_p), ("iov_len", ctypes.c_size_t)]


class _MsgHdr(ctypes.Structure):
    _fields_ = [
        ("msg_name", ctypes.c_void_p),
        ("msg_namelen", ctypes.c_uint32),
        ("msg_iov", ctypes.c_void_p),
        ("msg_iovlen", ctypes.c_size_t),
        ("msg_control", ctypes.c_void_p),
        ("msg_controllen", ctypes.c_size_t),
        ("msg_flags", ctypes.c_int),
    ]


class _MMsgHdr(ctypes.Structure):
    _fields_ = [("msg_hdr", _MsgHdr), ("msg_len", ctypes.c_uint)]


class _SockAddrIn(ctypes.Structure):
    _fields_ = [
        ("sin_family", ctypes.c_uint16),
        ("sin_port", ctypes.c_uint16),
        ("sin_addr", ctypes.c_uint32),
        ("sin_zero", ctypes.c_uint8 * 8),
    ]


class _CMsgHdr(ctypes.Structure):
    _fields_ = [("cmsg_len", ctypes.c_size_t), ("cmsg_level", ctypes.c_int), ("cmsg_type", ctypes.c_int)]


def _np_struct(fields: list[tuple[str, str, int]], ctype: type[ctypes.Structure]) -> np.dtype:
    """numpy dtype mirroring a C struct; offsets/size taken from ctypes, so the compiler's padding is used."""
    names, formats, offsets = zip(*fields)
    return np.dtype(
        {"names": list(names), "formats": list(formats), "offsets": list(offsets), "itemsize": ctypes.sizeof(ctype)}
    )


_IOVEC = _np_struct([("base", "u8", _IOVec.iov_base.offset), ("len", "u8", _IOVec.iov_len.offset)], _IOVec)
_MMSGHDR = _np_struct(
    [
        ("name", "u8", _MsgHdr.msg_name.offset),
        ("namelen", "u4", _MsgHdr.msg_namelen.offset),
        ("iov", "u8", _MsgHdr.msg_iov.offset),
        ("iovlen", "u8", _MsgHdr.msg_iovlen.offset),
        ("control", "u8", _MsgHdr.msg_control.offset),
        ("controllen", "u8", _MsgHdr.msg_controllen.offset),
        ("flags", "i4", _MsgHdr.msg_flags.offset),
        ("len", "u4", _MMsgHdr.msg_len.offset),
    ],
    _MMsgHdr,
)
# Port and address are big-endian fields, so assigning host-order integers byte-swaps them (vectorised).
_SOCKADDR_IN = _np_struct(
    [
        ("family", "=u2", _SockAddrIn.sin_family.offset),
        ("port", ">u2", _SockAddrIn.sin_port.offset),
        ("addr", ">u4", _SockAddrIn.sin_addr.offset),
    ],
    _SockAddrIn,
)
_CMSG_HDR = ctypes.sizeof(_CMsgHdr)
_TX_CTL = _CMSG_HDR + 8  # CMSG_SPACE(sizeof(uint16_t)): one UDP_SEGMENT message
_RX_CTL = 4 * _TX_CTL  # room for the UDP_GRO message (CMSG_SPACE(sizeof(int)) = 24) and any other
assert ctypes.sizeof(ctypes.c_void_p) == 8 and _MMSGHDR.itemsize == 64 and _SOCKADDR_IN.itemsize == 16
assert _CMSG_HDR == 16 and _CMsgHdr.cmsg_level.offset == 8 and _CMsgHdr.cmsg_type.offset == 12

# Where the fields sit, in words of the numpy views the kernels below read and write (u32 and u64 for mmsghdr,
# u64 for iovec, bytes for sockaddr_in, u32 or u16 for cmsghdr): one Numba call per burst fills or reads them.
_MSG_NAMELEN, _MSG_FLAGS, _MSG_LEN = (off // 4 for off in (_MsgHdr.msg_namelen.offset, _MsgHdr.msg_flags.offset,
                                                           _MMsgHdr.msg_len.offset))
_MSG_IOV, _MSG_IOVLEN, _MSG_CONTROL, _MSG_CONTROLLEN = (
    off // 8 for off in (_MsgHdr.msg_iov.offset, _MsgHdr.msg_iovlen.offset, _MsgHdr.msg_control.offset,
                         _MsgHdr.msg_controllen.offset))
_IOV_BASE, _IOV_LEN = _IOVec.iov_base.offset // 8, _IOVec.iov_len.offset // 8
_IOV_SIZE = _IOVEC.itemsize
_NAME_PORT, _NAME_ADDR = _SockAddrIn.sin_port.offset, _SockAddrIn.sin_addr.offset
_NAME_SIZE = _SOCKADDR_IN.itemsize
_CTL_GSO = _CMSG_HDR // 2  # the UDP_SEGMENT size (u16) in a tx control message, in u16 words


@njit(cache=True, nogil=True, boundscheck=False, _nrt=False)
def _source(name, i):
    """The address key in sockaddr_in ``i``."""
    ip = np.uint64(0)
    for k in range(4):
        ip = (ip << np.uint64(8)) | np.uint64(name[i, _NAME_ADDR + k])
    port = (np.uint64(name[i, _NAME_PORT]) << np.uint64(8)) | np.uint64(name[i, _NAME_PORT + 1])
    return (ip << np.uint64(16)) | port


@njit(cache=True, nogil=True, boundscheck=False, _nrt=False)
def _after_recv(r, msg, iov, name, rx_len, rx_addr, max_packet):
    """Lengths (-1 if truncated) and source keys of r datagrams received into rx rows; re-arm namelen and iov_len."""
    for i in range(r):
        rx_len[i] = -1 if msg[i, _MSG_FLAGS] & MSG_TRUNC else np.int32(msg[i, _MSG_LEN])
        rx_addr[i] = _source(name, i)
        msg[i, _MSG_NAMELEN] = _NAME_SIZE
        iov[i, _IOV_LEN] = max_packet


@njit(cache=True, nogil=True, boundscheck=False, _nrt=False)
def _gro_size(ctl, e, controllen):
    """The segment size in entry e's UDP_GRO control message (``ctl`` in u32 words), 0 if it has none."""
    p = 0  # in bytes; control messages are 8-byte aligned
    while p + _CMSG_HDR <= controllen:
        w = p // 4
        size = np.uint64(ctl[e, w]) | (np.uint64(ctl[e, w + 1]) << np.uint64(32))
        if size < _CMSG_HDR or p + size > controllen:
            break
        if ctl[e, w + 2] == SOL_UDP and ctl[e, w + 3] == UDP_GRO and size >= _CMSG_HDR + 4:
            return np.int64(ctl[e, w + 4])
        p += (int(size) + 7) & ~7
    return 0


@njit(cache=True, nogil=True, boundscheck=False, _nrt=False)
def _split_gro(r, e, off, row, rows, msg, msg64, name, ctl, buf, rx_data, rx_len, rx_addr, max_packet):
    """Hand out the datagrams of GRO reads e..r-1 (from byte ``off`` of read e) as rx rows ``row..rows-1``: a
    coalesced read is cut at its UDP_GRO segment size; a datagram longer than ``max_packet`` gets length -1, as
    the plain path reports it. Returns ``(row, e, off)`` where it stopped (``e == r``: every read handed out).
    A read handed out whole is re-armed (namelen, controllen) for the next recvmmsg."""
    while e < r and row < rows:
        total = np.int64(msg[e, _MSG_LEN])
        truncated = msg[e, _MSG_FLAGS] & MSG_TRUNC != 0
        seg = _gro_size(ctl, e, msg64[e, _MSG_CONTROLLEN])
        if seg <= 0 or seg > total or truncated:
            seg = total
        src = _source(name, e)
        read = buf[e]
        while row < rows:
            size = min(seg, total - off)
            rx_addr[row] = src
            if truncated or size > max_packet:
                rx_len[row] = -1
            else:
                dst, seg_bytes = rx_data[row], read[off:off + size]
                for k in range(size):  # this loop LLVM vectorises: 4x faster than a slice assignment or read[off + k]
                    dst[k] = seg_bytes[k]
                rx_len[row] = size
            row += 1
            off += size
            if off >= total:
                break
        if off >= total:
            msg[e, _MSG_NAMELEN] = _NAME_SIZE
            msg64[e, _MSG_CONTROLLEN] = _RX_CTL
            e += 1
            off = 0
    return row, e, off


@njit(cache=True, nogil=True, boundscheck=False, _nrt=False)
def _plan_send(count, pos, m, gso, order, tx_ptr, tx_len, tx_addr, msg64, iov, name, ctl, first, iov_at, ctl_at):
    """sendmmsg entries m.. for the datagrams at positions ``pos..count-1`` of ``order``; returns the entries' end.

    Without ``gso``, one entry per datagram. With it, a run of datagrams to one address with one length (the last
    may be shorter; none empty) shares an entry: an iovec each, and a UDP_SEGMENT control message with the length,
    at most GSO_MAX_SEGMENTS datagrams and GSO_MAX_BYTES bytes. ``first[m]``: the position of entry m's first
    datagram, and ``first[end] = count``."""
    for k in range(pos, count):
        i = order[k]
        iov[k, _IOV_BASE] = tx_ptr[i]
        iov[k, _IOV_LEN] = tx_len[i]
    k = pos
    while k < count:
        i = order[k]
        size, key = tx_len[i], tx_addr[i]
        n, total = 1, size
        if gso and size > 0:
            while k + n < count and n < GSO_MAX_SEGMENTS:
                j = order[k + n]
                if tx_addr[j] != key or tx_len[j] == 0 or tx_len[j] > size or total + tx_len[j] > GSO_MAX_BYTES:
                    break
                total += tx_len[j]
                n += 1
                if tx_len[j] < size:  # a shorter datagram ends a run
                    break
        first[m] = k
        msg64[m, _MSG_IOV] = iov_at + k * _IOV_SIZE
        msg64[m, _MSG_IOVLEN] = n
        if n > 1:
            msg64[m, _MSG_CONTROL] = ctl_at + m * _TX_CTL
            msg64[m, _MSG_CONTROLLEN] = _TX_CTL
            ctl[m, _CTL_GSO] = size
        else:
            msg64[m, _MSG_CONTROL] = 0
            msg64[m, _MSG_CONTROLLEN] = 0
        for b in range(4):
            name[m, _NAME_ADDR + b] = np.uint8((key >> np.uint64(40 - 8 * b)) & np.uint64(0xFF))
        name[m, _NAME_PORT] = np.uint8((key >> np.uint64(8)) & np.uint64(0xFF))
        name[m, _NAME_PORT + 1] = np.uint8(key & np.uint64(0xFF))
        m += 1
        k += n
    first[m] = count
    return m


@njit(cache=True, nogil=True, boundscheck=False, _nrt=False)
def _group(count, tx_addr, order, group_key, group_at, group_of):
    """``order``: the datagrams < count grouped by destination, each destination's in their order (a counting sort;
    past ``GROUPS - 1`` distinct destinations, the others share the last group, still in their order)."""
    distinct = 0
    group_at[:] = 0
    for i in range(count):
        key = tx_addr[i]
        g = 0
        while g < distinct and group_key[g] != key:
            g += 1
        if g == distinct and distinct < GROUPS - 1:
            group_key[g] = key
            distinct += 1
        group_of[i] = g
        group_at[g + 1] += 1
    for g in range(GROUPS):  # group_at[g]: where group g starts
        group_at[g + 1] += group_at[g]
    for i in range(count):
        g = group_of[i]
        order[group_at[g]] = i
        group_at[g] += 1


@njit(cache=True, nogil=True, boundscheck=False, _nrt=False)
def _before_send(count, gso, order, groups, tx_ptr, tx_len, tx_addr, max_packet, msg64, iov, name, ctl, first,
                 iov_at, ctl_at):
    """Plan the sendmmsg entries of datagrams < count (grouped by destination, stably, when ``gso``); returns how
    many, or -1 (nothing written) if a length is outside [0, max_packet]."""
    for i in range(count):
        if tx_len[i] < 0 or tx_len[i] > max_packet:
            return -1
    if gso:
        _group(count, tx_addr, order, *groups)
    else:
        for i in range(count):
            order[i] = i
    return _plan_send(count, 0, 0, gso, order, tx_ptr, tx_len, tx_addr, msg64, iov, name, ctl, first, iov_at,
                      ctl_at)


_libc = ctypes.CDLL(None, use_errno=True)
_recvmmsg = _libc.recvmmsg
_recvmmsg.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_uint, ctypes.c_int, ctypes.c_void_p]
_recvmmsg.restype = ctypes.c_int
_sendmmsg = _libc.sendmmsg
_sendmmsg.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_uint, ctypes.c_int]
_sendmmsg.restype = ctypes.c_int

_RETRY_SEND = (errno.EAGAIN, errno.EWOULDBLOCK, errno.ENOBUFS, errno.EINTR)


# --- address keys -------------------------------------------------------------------------------


def addr_key(host: str, port: int) -> int:
    """IPv4 ``(host, port)`` -> ``(ipv4_host_order_u32 << 16) | port``; ``host`` may be a name (resolved here)."""
    return addr_key_of(socket.gethostbyname(host), port)


# --- burst socket -------------------------------------------------------------------------------


def _set_buf(sock: socket.socket, force: int, plain: int, want: int) -> int:
    # *BUFFORCE ignores net.core.[rw]mem_max but needs CAP_NET_ADMIN; otherwise the kernel caps
    # the plain option silently. The value read back is what was granted (Linux doubles it).
    for opt in (force, plain):
        try:
            sock.setsockopt(socket.SOL_SOCKET, opt, want)
            break
        except OSError:
            continue
    return sock.getsockopt(socket.SOL_SOCKET, plain)


def _setsockopt(sock: socket.socket, level: int, option: int, value: int) -> None:
    sock.setsockopt(level, option, value)  # a module function, so tests can play a kernel without the option


def _udp_option(sock: socket.socket, option: int, value: int) -> bool:
    """Set a SOL_UDP option; False where the kernel lacks it."""
    try:
        _setsockopt(sock, SOL_UDP, option, value)
    except OSError as exc:
        if exc.errno in _NO_OPTION:
            return False
        raise
    return True


def offload_default(max_packet: int) -> tuple[bool, bool]:
    """Whether (GSO, GRO) are wanted by default: ``INTML_GSO=0`` forces both off, ``INTML_GSO=1`` both on;
    otherwise GSO is on, and GRO where it paid: for datagrams of at most ``GRO_MAX_PACKET`` bytes."""
    forced = os.environ.get("INTML_GSO", "")
    if forced in ("0", "1"):
        return forced == "1", forced == "1"
    return True, max_packet <= GRO_MAX_PACKET


class BurstSocket:
    """A bound IPv4 UDP socket plus preallocated rx/tx packet pools used by recvmmsg/sendmmsg.

    Receive: ``n = recv_burst()``; packet ``i < n`` is ``rx_data[i, :rx_len[i]]`` from ``rx_addr[i]``;
    ``rx_len[i] == -1`` marks a datagram longer than ``max_packet`` (truncated; drop it).
    Send: fill ``tx_data[i, :tx_len[i]]`` and ``tx_addr[i]`` for ``i < count``, then ``send_burst(count)``.
    Entry i is sent from address ``tx_ptr[i]``, which starts as row i of ``tx_data``; to send from buffers of
    your own without copying (the aggregator's stored results, a worker's stored datagrams), point ``tx_ptr[i]``
    at them and keep those bytes unchanged until ``send_burst`` returns.
    The arrays are reused by every call: consume received packets before the next ``recv_burst``.
    ``gso``/``gro``: use UDP_SEGMENT / UDP_GRO where the kernel has them (default: ``offload_default``); the
    attributes of the same names say whether they are in use.
    """

    def __init__(self, sock: socket.socket, burst: int = 256, max_packet: int = 9000, *, gso: bool | None = None,
                 gro: bool | None = None) -> None:
        if sock.family != socket.AF_INET or sock.type != socket.SOCK_DGRAM:
            raise ValueError("BurstSocket needs an IPv4 (AF_INET) UDP (SOCK_DGRAM) socket")
        if burst < 1 or max_packet < 1:
            raise ValueError("burst and max_packet must be positive")
        self.sock = sock
        self.burst = burst
        self.max_packet = max_packet
        self.send_timeout = 1.0  # total seconds send_burst may wait for writability before giving up
        sock.setblocking(False)
        self.rcvbuf = _set_buf(sock, _SO_RCVBUFFORCE, socket.SO_RCVBUF, _WANT_BUF)
        self.sndbuf = _set_buf(sock, _SO_SNDBUFFORCE, socket.SO_SNDBUF, _WANT_BUF)
        want_gso, want_gro = offload_default(max_packet)
        self.gso = (want_gso if gso is None else gso) and _udp_option(sock, UDP_SEGMENT, 0)  # 0: per entry only
        self.gro = (want_gro if gro is None else gro) and _udp_option(sock, UDP_GRO, 1)
        self.gso_fallbacks = 0  # times a GSO entry was refused where the same datagrams one by one were not

        self.rx = Burst.rows_of(burst, max_packet)  # what recv_burst received, as the cores take it
        self.rx_data, self.rx_len, self.rx_addr = self.rx.data, self.rx.length, self.rx.addr
        self.tx_data = np.zeros((burst, max_packet), np.uint8)
        self.tx_len = np.zeros(burst, np.int32)
        self.tx_addr = np.zeros(burst, np.uint64)
        # C structures; the numpy arrays own the memory and live as long as self (keeps pointers valid).
        # With GRO, reads land in 64 KiB buffers (untouched pages cost no memory) and are cut into rx rows.
        self._gro_buf = np.zeros((burst, GRO_BUF), np.uint8) if self.gro else None
        self._rx_msg, self._rx_iov, self._rx_name = self._structs(self.rx_data if self._gro_buf is None
                                                                  else self._gro_buf)
        self._tx_msg, self._tx_iov, self._tx_name = self._structs(self.tx_data)
        self._rx_ctl = np.zeros((burst, _RX_CTL // 4), np.uint32)
        if self.gro:
            self._rx_msg["control"] = self._rx_ctl.ctypes.data + np.arange(burst, dtype=np.uint64) * _RX_CTL
            self._rx_msg["controllen"] = _RX_CTL
        self._tx_ctl = np.zeros((burst, _TX_CTL // 2), np.uint16)  # one UDP_SEGMENT message per entry
        ctl_words = self._tx_ctl.view(np.uint32)
        ctl_words[:, 0] = _CMSG_HDR + 2  # cmsg_len = CMSG_LEN(sizeof(uint16_t)), exactly, or the kernel refuses
        ctl_words[:, _CMsgHdr.cmsg_level.offset // 4] = SOL_UDP
        ctl_words[:, _CMsgHdr.cmsg_type.offset // 4] = UDP_SEGMENT
        self.tx_ptr = self._tx_iov["base"].copy()  # row i of tx_data
        self._tx_name["family"] = socket.AF_INET
        self._tx_msg["namelen"] = _SOCKADDR_IN.itemsize
        self._order = np.zeros(burst, np.int64)  # datagram of each position, grouped by destination under GSO
        self._first = np.zeros(burst + 1, np.int64)  # position of each entry's first datagram
        self._groups = (np.zeros(GROUPS, np.uint64), np.zeros(GROUPS + 1, np.int64), np.zeros(burst, np.int64))
        self._rx_ptr = self._rx_msg.ctypes.data
        self._tx_ptr = self._tx_msg.ctypes.data
        # plain-integer views of the C structures for the kernels above
        self._rx_words = tuple(self._words(a) for a in (self._rx_msg, self._rx_iov, self._rx_name))
        self._gro_words = (self._words(self._rx_msg), self._words(self._rx_msg, np.uint64),
                           self._words(self._rx_name), self._rx_ctl)
        self._tx_words = (self._words(self._tx_msg, np.uint64), self._words(self._tx_iov), self._words(self._tx_name),
                          self._tx_ctl, self._first, self._tx_iov.ctypes.data, self._tx_ctl.ctypes.data)
        self._held = 0  # GRO reads in _gro_buf not yet handed out whole: reads _held_read.. from byte _held_off
        self._held_read = self._held_off = 0
        self._recvmmsg = _recvmmsg  # instance attributes so tests can inject faults
        self._sendmmsg = _sendmmsg
        self.tx_sent = 0  # packets sent by the last send_burst (also valid when it raised)
        self.send_failed = 0  # datagrams send() skipped because the kernel refused their destination

    def _words(self, structs: np.ndarray, word: type | None = None) -> np.ndarray:
        """An array of C structures as rows of u32 (mmsghdr), u64 (iovec) or bytes (sockaddr_in), or of ``word``."""
        word = word or {_MMSGHDR: np.uint32, _IOVEC: np.uint64, _SOCKADDR_IN: np.uint8}[structs.dtype]
        return structs.view(word).reshape(self.burst, -1)

    def _structs(self, data: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        n = self.burst
        msg = np.zeros(n, _MMSGHDR)
        iov = np.zeros(n, _IOVEC)
        name = np.zeros(n, _SOCKADDR_IN)
        rows = np.arange(n, dtype=np.uint64)
        iov["base"] = data.ctypes.data + rows * np.uint64(data.strides[0])
        iov["len"] = data.shape[1]
        msg["name"] = name.ctypes.data + rows * np.uint64(_SOCKADDR_IN.itemsize)
        msg["namelen"] = _SOCKADDR_IN.itemsize
        msg["iov"] = iov.ctypes.data + rows * np.uint64(_IOVEC.itemsize)
        msg["iovlen"] = 1
        return msg, iov, name

    def fileno(self) -> int:
        return self.sock.fileno()

    @property
    def pending(self) -> bool:
        """Datagrams already read from the socket (GRO) wait for the next ``recv_burst``: the socket will not
        report them readable."""
        return self._held > 0

    def recv_burst(self, max_count: int | None = None) -> int:
        """Receive up to ``max_count`` (default ``burst``) datagrams, in one non-blocking recvmmsg at most.

        Returns how many arrived (0 if none is waiting) and fills ``rx_len``/``rx_addr``/``rx_data``
        for them; truncated datagrams get ``rx_len = -1``. Other errors raise OSError.
        """
        n = self.burst if max_count is None else max(0, min(int(max_count), self.burst))
        self.rx.count = 0
        if n == 0:
            return 0
        if self._gro_buf is None:
            r = self._recv(n)
            if r:
                _after_recv(r, *self._rx_words, self.rx_len, self.rx_addr, self.max_packet)
            self.rx.count = r
            return r
        row = self._hand_out(0, n) if self._held else 0
        if row < n and not self._held:
            self._held, self._held_read, self._held_off = self._recv(n - row), 0, 0
            row = self._hand_out(row, n)
        self.rx.count = row
        return row

    def _recv(self, n: int) -> int:
        """One recvmmsg of up to n entries; 0 if nothing is waiting."""
        # msg_namelen and msg_controllen (value-result) and iov_len must hold their full sizes before each call.
        # They were set in __init__ and the kernel only writes entries it filled, so those are restored after
        # the call: an empty poll (the common case when spinning) then costs just the syscall.
        while True:
            r = self._recvmmsg(self.sock.fileno(), self._rx_ptr, n, MSG_DONTWAIT, None)
            if r >= 0:
                return r
            err = ctypes.get_errno()
            if err in (errno.EAGAIN, errno.EWOULDBLOCK):
                return 0
            if err != errno.EINTR:
                raise OSError(err, os.strerror(err))

    def _hand_out(self, row: int, rows: int) -> int:
        """Cut the held GRO reads into rx rows ``row..rows-1``; returns the rows filled."""
        row, read, off = _split_gro(self._held, self._held_read, self._held_off, row, rows, *self._gro_words,
                                    self._gro_buf, self.rx_data, self.rx_len, self.rx_addr, self.max_packet)
        self._held_read, self._held_off = read, off
        if read == self._held:
            self._held = 0
        return row

    def send_burst(self, count: int) -> int:
        """Send ``tx_len[i]`` bytes at ``tx_ptr[i]`` (by default ``tx_data[i]``) to ``tx_addr[i]`` for ``i < count``;
        returns the number sent.

        Partial sends continue where they stopped; on EAGAIN/ENOBUFS it waits for writability (poll)
        for at most ``send_timeout`` seconds in total, then returns what was sent. Other errors raise
        OSError (``tx_sent`` still tells how many went out).
        """
        return self._transmit(count, self.tx_ptr, self.tx_len, self.tx_addr, skip_refused=False)

    def _transmit(self, count: int, ptr: np.ndarray, length: np.ndarray, addr: np.ndarray, skip_refused: bool) -> int:
        """send_burst's body over the descriptors ``ptr``, ``length`` and ``addr`` (the tx arrays, or a core's
        burst's, planned from where they lie); ``skip_refused``: an entry whose destination the kernel refuses is
        skipped and its datagrams counted in ``send_failed`` instead of raising."""
        count = int(count)
        if not 0 <= count <= self.burst:
            raise ValueError(f"count must be in [0, {self.burst}], got {count}")
        self.tx_sent = 0
        if count == 0:
            return 0
        words = self._tx_words
        entries = _before_send(count, self.gso, self._order, self._groups, ptr, length, addr, self.max_packet, *words)
        if entries < 0:
            raise ValueError(f"tx_len must be in [0, {self.max_packet}]")

        first = self._first
        sent = m = 0
        probe = -1  # an entry cut out of a refused GSO run: if it goes out, GSO was at fault
        deadline = None
        poller = None
        stride = _MMSGHDR.itemsize
        while m < entries:
            r = self._sendmmsg(self.sock.fileno(), self._tx_ptr + m * stride, entries - m, MSG_DONTWAIT)
            if r > 0:
                if m == probe:
                    self.gso = False
                    self.gso_fallbacks += 1
                probe = -1
                sent += int(first[m + r] - first[m])
                m += r
                self.tx_sent = sent
                continue
            err = ctypes.get_errno() if r < 0 else errno.EAGAIN
            if err == errno.EINTR:
                continue
            if err not in _RETRY_SEND:
                datagrams = int(first[m + 1] - first[m])
                if datagrams > 1 and err in _GSO_REFUSED:  # the rest one datagram per entry; entry m probes
                    entries = _plan_send(count, int(first[m]), m, False, self._order, ptr, length, addr, *words)
                    probe = m
                    continue
                if not skip_refused:
                    raise OSError(err, os.strerror(err))
                self.send_failed += datagrams
                probe = -1
                m += 1
                continue
            now = time.monotonic()
            if deadline is None:
                deadline = now + self.send_timeout
            left = deadline - now
            if left <= 0:
                break
            if err == errno.ENOBUFS:
                # device/qdisc queue full: POLLOUT would report writable at once, so back off instead
                time.sleep(min(left, 0.001))
            else:
                if poller is None:
                    poller = select.poll()
                    poller.register(self.sock.fileno(), select.POLLOUT)
                poller.poll(max(1, int(left * 1000)))
        return sent

    def send(self, burst: Burst) -> int:
        """Send the first ``burst.count`` datagrams of a core's output burst from where they lie (zero copy), in
        sendmmsg calls of at most ``self.burst``; returns how many went out (fewer only if the socket stayed
        full past ``send_timeout``). A datagram the kernel refuses (an error other than a full socket, e.g.
        EINVAL for port 0 or EACCES for a broadcast address) is skipped and counted in ``send_failed``: one bad
        destination must not cost the others their datagrams."""
        sent = 0
        for done in range(0, burst.count, self.burst):
            n = min(self.burst, burst.count - done)
            refused = self.send_failed
            went = self._transmit(n, burst.ptr[done:], burst.length[done:], burst.addr[done:], skip_refused=True)
            sent += went
            if went + self.send_failed - refused < n:  # the socket stayed full
                break
        return sent

    def send_one(self, data: bytes, addr_key: int) -> None:
        """Send one datagram with a plain sendto (control messages); waits up to ``send_timeout`` if full."""
        addr = addr_of(addr_key)
        deadline = time.monotonic() + self.send_timeout
        while True:
            try:
                self.sock.sendto(data, addr)
                return
            except (BlockingIOError, InterruptedError):
                pass
            except OSError as e:
                if e.errno != errno.ENOBUFS:
                    raise
            left = deadline - time.monotonic()
            if left <= 0:
                raise BlockingIOError(errno.EAGAIN, "send_one: socket not writable within send_timeout")
            select.select([], [self.sock], [], min(left, 0.001))
