"""Runs inside the BMv2 test's network namespace: sends each frame of a file on one veth end and records what the
switch sends back within a quiet period after each, as ``[[input index, frame hex], ...]`` (JSON). Not a test."""

import json
import socket
import sys
import time

PACKET_OUTGOING = 4  # AF_PACKET's pkttype of a frame this socket itself sent


def main(interface: str, frames_file: str, out_file: str, quiet_s: float) -> None:
    frames = [bytes.fromhex(line) for line in open(frames_file).read().split()]
    sock = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(0x0003))
    sock.bind((interface, 0))
    sock.settimeout(0.05)
    received = []
    for i, frame in enumerate(frames):
        sock.send(frame)
        last = time.monotonic()
        while time.monotonic() - last < quiet_s:
            try:
                data, addr = sock.recvfrom(65535)
            except socket.timeout:
                continue
            if addr[2] != PACKET_OUTGOING and data[12:14] == b"\x08\x00":
                received.append([i, data.hex()])
                last = time.monotonic()
    json.dump(received, open(out_file, "w"))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3], float(sys.argv[4]))
