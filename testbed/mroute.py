"""Static multicast routes in a network namespace, so that the testbed's switch namespace replicates one results
datagram to every worker port, as a switch's multicast replication does.

Linux forwards multicast only between virtual interfaces (vifs) registered on an open multicast-routing socket
(``MRT_INIT`` on a raw IGMP socket, linux/mroute.h), by (source, group) entries of its forwarding cache (MFC); the
vifs and entries live as long as that socket. So the routes are held by a small process in the namespace::

    python -m intml.testbed.mroute --route 198.18.0.1/p0 --oif p0 p1 p2 p3 --group 239.255.42.0 --count 64

It prints ``ready`` once the routes are in, and holds them until SIGTERM or SIGINT.

Locally sent multicast is forwarded too: the kernel loops a copy of each multicast datagram a socket sends back in
through its outgoing device, where it meets the entry whose input is that device (``--route SOURCE/DEVICE``), and
forwards it to every other output device (``--oif``). Forwarded copies need a TTL above 1 (the sender's ``IP_MULTICAST_TTL``); each hop
takes one off.
"""

from __future__ import annotations

import ipaddress
import signal
import socket
import struct
import sys

from intml.aggregator.cli import OneLineParser, OptionError, multicast_group, positive

MRT_INIT, MRT_ADD_VIF, MRT_ADD_MFC = 200, 202, 204  # linux/mroute.h
MAXVIFS = 32  # the kernel's limit on vifs per routing table
VIFF_USE_IFINDEX = 0x8  # the vif names its device by index, not by address
TTL_THRESHOLD = 1  # forward a datagram on a vif only if its TTL is above this
VIFCTL = struct.Struct("=HBBIiI")  # vifi, flags, threshold, rate_limit, ifindex, remote address
MFCCTL = struct.Struct("=4s4sH32s2xIIIi")  # origin, group, parent vif, ttls[MAXVIFS], pad, counters, expire


def vifctl(vif: int, ifindex: int) -> bytes:
    return VIFCTL.pack(vif, VIFF_USE_IFINDEX, TTL_THRESHOLD, 0, ifindex, 0)


def mfcctl(source: str, group: str, parent: int, outputs: list[int]) -> bytes:
    """The entry for (source, group) arriving on vif ``parent``, forwarded to the vifs ``outputs``."""
    ttls = bytearray(MAXVIFS)  # 0: not an output
    for vif in outputs:
        ttls[vif] = TTL_THRESHOLD
    return MFCCTL.pack(socket.inet_aton(source), socket.inet_aton(group), parent, bytes(ttls), 0, 0, 0, 0)


def install(routes: list[tuple[str, str]], oifs: list[str], groups: list[str]) -> socket.socket:
    """Open the namespace's multicast-routing socket, add a vif per device and, for each (source, input device)
    of ``routes`` and each group, an entry to every output device but the input; closing the socket removes
    them."""
    devices = list(dict.fromkeys([*(dev for _, dev in routes), *oifs]))
    if len(devices) > MAXVIFS:
        raise ValueError(f"at most {MAXVIFS} devices (the kernel's MAXVIFS), got {len(devices)}")
    sock = socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_IGMP)
    try:
        sock.setsockopt(socket.IPPROTO_IP, MRT_INIT, struct.pack("i", 1))
        for vif, dev in enumerate(devices):
            sock.setsockopt(socket.IPPROTO_IP, MRT_ADD_VIF, vifctl(vif, socket.if_nametoindex(dev)))
        for source, dev in routes:
            parent = devices.index(dev)
            outputs = [devices.index(o) for o in oifs if o != dev]
            for group in groups:
                sock.setsockopt(socket.IPPROTO_IP, MRT_ADD_MFC, mfcctl(source, group, parent, outputs))
    except BaseException:
        sock.close()
        raise
    return sock


def _route(text: str) -> tuple[str, str]:
    source, sep, dev = text.partition("/")
    try:
        if not sep or not dev:
            raise ValueError
        return str(ipaddress.IPv4Address(source)), dev
    except ValueError:
        raise OptionError(f"a route is SOURCE/DEVICE, an IPv4 address and a device, e.g. 198.18.0.1/p0, "
                          f"got {text!r}") from None


def main(argv: list[str] | None = None) -> int:
    p = OneLineParser(prog="python -m intml.testbed.mroute", description=__doc__.split("\n\n")[0])
    p.add_argument("--route", type=_route, nargs="+", required=True,
                   help="SOURCE/DEVICE: a sender's address and the device its datagrams arrive (or loop back) on")
    p.add_argument("--oif", nargs="+", required=True, help="the devices to replicate them to")
    p.add_argument("--group", required=True, type=multicast_group, help="the first group")
    p.add_argument("--count", type=positive(), default=1,
                   help="consecutive groups from --group (default 1)")
    args = p.parse_args(argv)
    p.check("--group", multicast_group, args.group, args.count, "--count")
    devices = {dev for _, dev in args.route} | set(args.oif)
    if len(devices) > MAXVIFS:
        p.option_error("--oif", f"{len(devices)} devices in --route and --oif, the kernel routes between at most "
                                f"{MAXVIFS} (MAXVIFS)")
    groups = [str(ipaddress.IPv4Address(args.group) + i) for i in range(args.count)]
    try:
        if missing := sorted(devices - {name for _, name in socket.if_nameindex()}):
            raise ValueError(f"no device {', '.join(missing)} in this network namespace (`ip link` lists them)")
        sock = install(args.route, args.oif, groups)
    except PermissionError:
        print("mroute: multicast routing needs root (CAP_NET_ADMIN and CAP_NET_RAW): run it as root",
              file=sys.stderr, flush=True)
        return 1
    except (OSError, ValueError) as e:
        print(f"mroute: cannot install multicast routes: {e}", file=sys.stderr, flush=True)
        return 1
    print("ready", flush=True)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    try:
        signal.pause()
    except KeyboardInterrupt:
        pass
    finally:
        sock.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
