"""Runs inside the BMv2 test's network namespace: sends each frame of a file on one veth end and records what the
switch sends back after each, as ``[[input index, frame hex], ...]`` (JSON). Not a test.

After each frame it waits for the number of frames the model expects back (up to ``wait_s``, BMv2 under load), then
for ``settle_s`` without another: an extra frame, even a late one that lands after the next input, still fails the
comparison, so the wait need not be long enough to attribute it correctly. With ``burst`` (a sixth argument), the
frames go out BURST_GAP_S apart instead, and everything the switch sends back is recorded under index 0: it waits for
the sum of the expected counts, then for ``settle_s`` without another."""

import json
import socket
import sys
import time

PACKET_OUTGOING = 4  # AF_PACKET's pkttype of a frame this socket itself sent
BURST_GAP_S = 0.005  # frames sent back to back do not all reach BMv2's pipeline (8 of 40 were lost on the build VM)


def main(interface: str, frames_file: str, out_file: str, settle_s: float, wait_s: float, burst: bool) -> None:
    lines = [line.split() for line in open(frames_file).read().splitlines() if line]
    frames, expected = [bytes.fromhex(f) for f, _ in lines], [int(n) for _, n in lines]
    sock = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(0x0003))
    sock.bind((interface, 0))
    sock.settimeout(0.05)
    received = []
    if burst:
        for frame in frames:
            sock.send(frame)
            time.sleep(BURST_GAP_S)
        frames, expected = [b""], [sum(expected)]
    for i, frame in enumerate(frames):
        if frame:
            sock.send(frame)
        last = time.monotonic()
        got = 0
        while time.monotonic() - last < (settle_s if got >= expected[i] else wait_s):
            try:
                data, addr = sock.recvfrom(65535)
            except socket.timeout:
                continue
            if addr[2] != PACKET_OUTGOING and data[12:14] == b"\x08\x00":
                received.append([i, data.hex()])
                got += 1
                last = time.monotonic()
    json.dump(received, open(out_file, "w"))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3], float(sys.argv[4]), float(sys.argv[5]), len(sys.argv) > 6)
