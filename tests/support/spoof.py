"""Send UDP datagrams with a chosen source address and port on loopback, through a raw IPv4 socket (IP_HDRINCL):
an off-path attacker's forged packets, for tests. Needs root or CAP_NET_RAW (``raw_socket`` raises
PermissionError otherwise, so tests can skip).

The kernel fills in the IPv4 header's checksum and length; the UDP checksum is 0 (none, which IPv4 allows).
"""

from __future__ import annotations

import socket
import struct

from intml.protocol.address import addr_of


def raw_socket() -> socket.socket:
    """A raw IPv4 socket that sends whole IP packets (IPPROTO_RAW implies IP_HDRINCL)."""
    return socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_RAW)


def udp_packet(payload: bytes, src: int, dst: int) -> bytes:
    """An IPv4/UDP packet carrying `payload` from address key `src` to address key `dst`."""
    (src_ip, src_port), (dst_ip, dst_port) = addr_of(src), addr_of(dst)
    ip = struct.pack("!BBHHHBBH4s4s", 0x45, 0, 20 + 8 + len(payload), 0, 0, 64, socket.IPPROTO_UDP, 0,
                     socket.inet_aton(src_ip), socket.inet_aton(dst_ip))
    return ip + struct.pack("!HHHH", src_port, dst_port, 8 + len(payload), 0) + payload


def send_spoofed(raw: socket.socket, payload: bytes, src: int, dst: int) -> None:
    """Send `payload` to address key `dst` as if it came from address key `src`."""
    raw.sendto(udp_packet(payload, src, dst), (addr_of(dst)[0], 0))
