"""Burst UDP receive/send with Linux ``recvmmsg(2)`` / ``sendmmsg(2)`` over preallocated numpy pools.

A :class:`BurstSocket` owns fixed packet buffers (``rx_data``/``tx_data``, one row per packet) and the
C control structures (``struct mmsghdr``, ``struct iovec``, ``struct sockaddr_in``) that point into
them. The control structures are numpy structured arrays, so after a ``recvmmsg`` call the lengths
and source addresses are copied out with vectorised numpy operations, and before a ``sendmmsg`` call
the lengths and destinations are filled in the same way: no Python object per packet. Per-packet
work is meant to run later in numba kernels over ``rx_data``/``rx_len``/``rx_addr``.

Addresses are plain integers, ``key = (ipv4_host_order_u32 << 16) | port`` (see :func:`addr_key`),
so they fit in a uint64 array and in numba code.

Limitations: Linux only (x86_64/aarch64 LP64 struct layouts, checked at import against ctypes);
IPv4 only (``AF_INET`` sockets; the sockaddr pool is ``sockaddr_in``); one iovec per datagram; no
ancillary data; not thread-safe (one BurstSocket per thread).

``intml-testbed bench burstio`` measures it against a plain sendto/recvfrom loop.
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
_SO_SNDBUFFORCE = getattr(socket, "SO_SNDBUFFORCE", 32)
_SO_RCVBUFFORCE = getattr(socket, "SO_RCVBUFFORCE", 33)
_WANT_BUF = 64 << 20  # requested socket buffer size; the kernel may grant less (net.core.rmem_max)


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
assert ctypes.sizeof(ctypes.c_void_p) == 8 and _MMSGHDR.itemsize == 64 and _SOCKADDR_IN.itemsize == 16

# Where the fields sit, in words of the numpy views the kernels below read and write (u32 for mmsghdr, u64 for
# iovec, bytes for sockaddr_in): one Numba call per burst fills or reads them, not a dozen numpy calls.
_MSG_NAMELEN, _MSG_FLAGS, _MSG_LEN = (off // 4 for off in (_MsgHdr.msg_namelen.offset, _MsgHdr.msg_flags.offset,
                                                           _MMsgHdr.msg_len.offset))
_IOV_BASE, _IOV_LEN = _IOVec.iov_base.offset // 8, _IOVec.iov_len.offset // 8
_NAME_PORT, _NAME_ADDR = _SockAddrIn.sin_port.offset, _SockAddrIn.sin_addr.offset
_NAME_SIZE = _SOCKADDR_IN.itemsize


@njit(cache=True, nogil=True, boundscheck=False)
def _after_recv(r, msg, iov, name, rx_len, rx_addr, max_packet):
    """Lengths (-1 if truncated) and source keys of r received datagrams; re-arm namelen and iov_len."""
    for i in range(r):
        rx_len[i] = -1 if msg[i, _MSG_FLAGS] & MSG_TRUNC else np.int32(msg[i, _MSG_LEN])
        ip = np.uint64(0)
        for k in range(4):
            ip = (ip << np.uint64(8)) | np.uint64(name[i, _NAME_ADDR + k])
        port = (np.uint64(name[i, _NAME_PORT]) << np.uint64(8)) | np.uint64(name[i, _NAME_PORT + 1])
        rx_addr[i] = (ip << np.uint64(16)) | port
        msg[i, _MSG_NAMELEN] = _NAME_SIZE
        iov[i, _IOV_LEN] = max_packet


@njit(cache=True, nogil=True, boundscheck=False)
def _before_send(count, tx_ptr, tx_len, tx_addr, iov, name, max_packet):
    """Point the iovecs and addresses of entries < count at the datagrams; False (nothing written) if a length is
    outside [0, max_packet]."""
    for i in range(count):
        if tx_len[i] < 0 or tx_len[i] > max_packet:
            return False
    for i in range(count):
        iov[i, _IOV_BASE] = tx_ptr[i]
        iov[i, _IOV_LEN] = tx_len[i]
        key = tx_addr[i]
        for k in range(4):
            name[i, _NAME_ADDR + k] = np.uint8((key >> np.uint64(40 - 8 * k)) & np.uint64(0xFF))
        name[i, _NAME_PORT] = np.uint8((key >> np.uint64(8)) & np.uint64(0xFF))
        name[i, _NAME_PORT + 1] = np.uint8(key & np.uint64(0xFF))
    return True


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


class BurstSocket:
    """A bound IPv4 UDP socket plus preallocated rx/tx packet pools used by recvmmsg/sendmmsg.

    Receive: ``n = recv_burst()``; packet ``i < n`` is ``rx_data[i, :rx_len[i]]`` from ``rx_addr[i]``;
    ``rx_len[i] == -1`` marks a datagram longer than ``max_packet`` (truncated; drop it).
    Send: fill ``tx_data[i, :tx_len[i]]`` and ``tx_addr[i]`` for ``i < count``, then ``send_burst(count)``.
    Entry i is sent from address ``tx_ptr[i]``, which starts as row i of ``tx_data``; to send from buffers of
    your own without copying (the aggregator's stored results, a worker's stored datagrams), point ``tx_ptr[i]``
    at them and keep those bytes unchanged until ``send_burst`` returns.
    The arrays are reused by every call: consume received packets before the next ``recv_burst``.
    """

    def __init__(self, sock: socket.socket, burst: int = 256, max_packet: int = 9000) -> None:
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

        self.rx = Burst.rows_of(burst, max_packet)  # what recv_burst received, as the cores take it
        self.rx_data, self.rx_len, self.rx_addr = self.rx.data, self.rx.length, self.rx.addr
        self.tx_data = np.zeros((burst, max_packet), np.uint8)
        self.tx_len = np.zeros(burst, np.int32)
        self.tx_addr = np.zeros(burst, np.uint64)
        # C structures; the numpy arrays own the memory and live as long as self (keeps pointers valid).
        self._rx_msg, self._rx_iov, self._rx_name = self._structs(self.rx_data)
        self._tx_msg, self._tx_iov, self._tx_name = self._structs(self.tx_data)
        self._tx_rows = self._tx_iov["base"].copy()  # row i of tx_data
        self.tx_ptr = self._tx_rows.copy()
        self._tx_name["family"] = socket.AF_INET
        self._tx_msg["namelen"] = _SOCKADDR_IN.itemsize
        self._rx_ptr = self._rx_msg.ctypes.data
        self._tx_ptr = self._tx_msg.ctypes.data
        # plain-integer views of the C structures for _after_recv / _before_send
        self._rx_words = tuple(self._words(a) for a in (self._rx_msg, self._rx_iov, self._rx_name))
        self._tx_words = tuple(self._words(a) for a in (self._tx_iov, self._tx_name))
        self._recvmmsg = _recvmmsg  # instance attributes so tests can inject faults
        self._sendmmsg = _sendmmsg
        self.tx_sent = 0  # packets sent by the last send_burst (also valid when it raised)
        self.send_failed = 0  # datagrams send() skipped because the kernel refused their destination

    def _words(self, structs: np.ndarray) -> np.ndarray:
        """An array of C structures as rows of u32 (mmsghdr), u64 (iovec) or bytes (sockaddr_in)."""
        word = {_MMSGHDR: np.uint32, _IOVEC: np.uint64, _SOCKADDR_IN: np.uint8}[structs.dtype]
        return structs.view(word).reshape(self.burst, -1)

    def _structs(self, data: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        n = self.burst
        msg = np.zeros(n, _MMSGHDR)
        iov = np.zeros(n, _IOVEC)
        name = np.zeros(n, _SOCKADDR_IN)
        rows = np.arange(n, dtype=np.uint64)
        iov["base"] = data.ctypes.data + rows * np.uint64(data.strides[0])
        iov["len"] = self.max_packet
        msg["name"] = name.ctypes.data + rows * np.uint64(_SOCKADDR_IN.itemsize)
        msg["namelen"] = _SOCKADDR_IN.itemsize
        msg["iov"] = iov.ctypes.data + rows * np.uint64(_IOVEC.itemsize)
        msg["iovlen"] = 1
        return msg, iov, name

    def fileno(self) -> int:
        return self.sock.fileno()

    def recv_burst(self, max_count: int | None = None) -> int:
        """One non-blocking recvmmsg: receive up to ``max_count`` (default ``burst``) datagrams.

        Returns how many arrived (0 if none is waiting) and fills ``rx_len``/``rx_addr``/``rx_data``
        for them; truncated datagrams get ``rx_len = -1``. Other errors raise OSError.
        """
        n = self.burst if max_count is None else max(0, min(int(max_count), self.burst))
        self.rx.count = 0
        if n == 0:
            return 0
        # msg_namelen (value-result) and iov_len must hold their full sizes before each call. They were
        # set in __init__ and the kernel only writes entries it filled, so those are restored after
        # the call: an empty poll (the common case when spinning) then costs just the syscall.
        while True:
            r = self._recvmmsg(self.sock.fileno(), self._rx_ptr, n, MSG_DONTWAIT, None)
            if r >= 0:
                break
            err = ctypes.get_errno()
            if err in (errno.EAGAIN, errno.EWOULDBLOCK):
                return 0
            if err != errno.EINTR:
                raise OSError(err, os.strerror(err))
        if r:
            _after_recv(r, *self._rx_words, self.rx_len, self.rx_addr, self.max_packet)
        self.rx.count = r
        return r

    def send_burst(self, count: int) -> int:
        """Send ``tx_len[i]`` bytes at ``tx_ptr[i]`` (by default ``tx_data[i]``) to ``tx_addr[i]`` for ``i < count``;
        returns the number sent.

        Partial sends continue where they stopped; on EAGAIN/ENOBUFS it waits for writability (poll)
        for at most ``send_timeout`` seconds in total, then returns what was sent. Other errors raise
        OSError (``tx_sent`` still tells how many went out).
        """
        count = int(count)
        if not 0 <= count <= self.burst:
            raise ValueError(f"count must be in [0, {self.burst}], got {count}")
        self.tx_sent = 0
        if count == 0:
            return 0
        if not _before_send(count, self.tx_ptr, self.tx_len, self.tx_addr, *self._tx_words, self.max_packet):
            raise ValueError(f"tx_len must be in [0, {self.max_packet}]")

        sent = 0
        deadline = None
        poller = None
        stride = _MMSGHDR.itemsize
        while sent < count:
            r = self._sendmmsg(self.sock.fileno(), self._tx_ptr + sent * stride, count - sent, MSG_DONTWAIT)
            if r > 0:
                sent += r
                self.tx_sent = sent
                continue
            err = ctypes.get_errno() if r < 0 else errno.EAGAIN
            if err not in _RETRY_SEND:
                raise OSError(err, os.strerror(err))
            if err == errno.EINTR:
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
        done = 0  # datagrams of the burst handled: sent or skipped
        while done < burst.count:
            n = min(self.burst, burst.count - done)
            self.tx_ptr[:n] = burst.ptr[done:done + n]
            self.tx_len[:n] = burst.length[done:done + n]
            self.tx_addr[:n] = burst.addr[done:done + n]
            full = False
            try:
                went = self.send_burst(n)
                full = went < n
            except OSError:
                went = self.tx_sent  # sendmmsg stopped at the refused datagram, which is skipped
                self.send_failed += 1
                done += 1
            finally:
                self.tx_ptr[:n] = self._tx_rows[:n]  # rows point at tx_data again for send_burst users
            sent += went
            done += went
            if full:
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
