"""Datagram addresses as plain integers, ``key = ipv4 << 16 | port`` (IPv4 in host order), so that they fit a
uint64 array and Numba code. Pure arithmetic: resolving a host name is the drivers' business (burstio)."""

from __future__ import annotations


def addr_key_of(ip: str, port: int) -> int:
    """Dotted-quad ``ip`` and ``port`` -> address key."""
    parts = ip.split(".")
    if len(parts) != 4 or not all(p.isdigit() and int(p) <= 255 for p in parts):
        raise ValueError(f"not an IPv4 address: {ip!r}")
    if not 0 <= port <= 0xFFFF:
        raise ValueError(f"port out of range: {port}")
    ipv4 = 0
    for p in parts:
        ipv4 = ipv4 << 8 | int(p)
    return ipv4 << 16 | port


def addr_of(key: int) -> tuple[str, int]:
    """Address key -> ``("a.b.c.d", port)``."""
    key = int(key)
    if not 0 <= key < 1 << 48:
        raise ValueError(f"address key out of range: {key:#x}")
    ipv4 = key >> 16
    return ".".join(str(ipv4 >> s & 0xFF) for s in (24, 16, 8, 0)), key & 0xFFFF


def format_addr(key: int) -> str:
    """Address key -> ``"a.b.c.d:port"``."""
    return "%s:%d" % addr_of(key)
