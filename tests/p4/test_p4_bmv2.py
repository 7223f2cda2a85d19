"""The v1model program on BMv2: ``simple_switch`` runs the compiled program in a network namespace this test makes,
on a veth port; the controller's entries for a joined job go in through ``simple_switch_CLI``
(p4.entries.cli_commands); packet streams are sent one frame at a time, and every datagram the switch sends back
(its UDP payload and destination) is compared, byte for byte, with what the pipeline model sends for the same
frame. Streams of several passes (recirculation), completions (multicast), re-sends, duplicates, stale packets and
an invalid code, both codecs; each copy carries the switch's and its rank's Ethernet addresses. C_nat streams give every rank the same codes, so each sum is a power of two and its
encoding needs no random bits (the shipped program keeps v1model's random()). Skipped, saying why, without root,
``ip``, the tools or the ``thrift`` package."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from support.harness import worker_addr
from support.p4build import compiled, tool
from test_p4_model import joined

from intml.p4.bmv2 import SWITCH_MAC, frame, mac_of, unframe
from intml.p4.controller import controller_entries
from intml.p4.entries import cli_commands
from intml.protocol import wire
from intml.protocol.codec import Codec
from intml.protocol.wire import NO_EXP, MsgType

PORT = 1  # the one switch port: every rank behind it (the multicast nodes are on it too)
THRIFT = 9090
QUIET_S = 3.0  # a frame's output is complete after this long without another (BMv2 under load)


def missing() -> str | None:
    if os.geteuid() != 0:
        return "needs root for a network namespace"
    if shutil.which("ip") is None:
        return "needs iproute2's ip"
    for name in ("p4c-bm2-ss", "simple_switch", "simple_switch_CLI"):
        if tool(name) is None:
            return f"{name} is neither in ../shared/p4tools/bin nor on PATH"
    try:
        import thrift  # noqa: F401  (simple_switch_CLI's)
    except ImportError:
        return "simple_switch_CLI needs the thrift Python package"
    return None


pytestmark = [pytest.mark.netns, pytest.mark.process,
              pytest.mark.skipif(missing() is not None, reason=str(missing()))]


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True)


class Switch:
    def __init__(self, namespace: str, json_path: Path, log: Path) -> None:
        self.namespace, self.json_path = namespace, json_path
        _ip("netns", "add", namespace)
        try:
            _ip("-n", namespace, "link", "add", "s1", "type", "veth", "peer", "name", "h1")
            for link in ("lo", "s1", "h1"):
                _ip("-n", namespace, "link", "set", link, "up")
            for link in ("s1", "h1"):  # no IPv6 chatter on the port
                self.run_in(["sysctl", "-qw", f"net.ipv6.conf.{link}.disable_ipv6=1"])
            self.process = subprocess.Popen(
                ["ip", "netns", "exec", namespace, str(tool("simple_switch")), "-i", f"{PORT}@s1",
                 "--thrift-port", str(THRIFT), str(json_path)], stdout=log.open("w"), stderr=subprocess.STDOUT)
            deadline = time.monotonic() + 120
            while self.cli(["show_ports"]).returncode != 0 or "s1" not in self.cli(["show_ports"]).stdout:
                assert self.process.poll() is None and time.monotonic() < deadline, log.read_text()[-2000:]
                time.sleep(1)
        except BaseException:
            self.close()
            raise

    def run_in(self, command: list[str], **kw) -> subprocess.CompletedProcess:
        return subprocess.run(["ip", "netns", "exec", self.namespace, *command], capture_output=True, text=True,
                              **kw)

    def cli(self, commands: list[str]) -> subprocess.CompletedProcess:
        # --json: the CLI would fetch the program over Thrift, and the 17 MB JSON exceeds its client's limit
        return self.run_in([sys.executable, str(tool("simple_switch_CLI")), "--thrift-port", str(THRIFT),
                            "--json", str(self.json_path)],
                           input="\n".join(commands) + "\n", timeout=300)

    def exchange(self, frames: list[bytes], tmp: Path) -> list[list[bytes]]:
        """Each frame sent in turn; the frames the switch sent back after each."""
        (tmp / "in.txt").write_text("\n".join(f.hex() for f in frames))
        result = self.run_in([sys.executable, str(Path(__file__).parents[1] / "support" / "bmv2_port.py"), "h1",
                              str(tmp / "in.txt"), str(tmp / "out.json"), str(QUIET_S)], timeout=600)
        assert result.returncode == 0, result.stderr
        out: list[list[bytes]] = [[] for _ in frames]
        for i, frame in json.loads((tmp / "out.json").read_text()):
            out[i].append(bytes.fromhex(frame))
        return out

    def close(self) -> None:
        process = getattr(self, "process", None)
        if process is not None and process.poll() is None:
            process.terminate()
            process.wait(30)
        subprocess.run(["ip", "netns", "del", self.namespace], capture_output=True)


@pytest.fixture(scope="module")
def program() -> Path:
    """The program compiled for BMv2 (once per source: support.p4build)."""
    return compiled()


@pytest.fixture
def switch(program: Path, tmp_path: Path):
    """A fresh simple_switch (empty tables and groups, every register 0: every set EMPTY)."""
    sw = Switch(f"intml-bmv2-{os.getpid()}", program, tmp_path / "simple_switch.log")
    try:
        yield sw
    finally:
        sw.close()


def packet(rank: int, allreduce: int, payload: np.ndarray, codec: Codec) -> bytes:
    return wire.pack({"type": int(MsgType.DATA), "job": 7, "allreduce": allreduce, "rank": rank,
                      "count": payload.size, "codec": int(codec), "shadow": allreduce % 2, "exp": 0,
                      "next_exp": NO_EXP}, payload)


def stream(codec: Codec, elements: int) -> list[tuple[bytes, int]]:
    """Two ranks: a round (completion, multicast), a re-send, the next round on the same set, a duplicate, a stale
    packet, its completion; then an invalid code."""
    rng = np.random.default_rng(elements)
    if codec == Codec.INT32:
        values = [rng.integers(-1000, 1000, elements).astype(">i4") for _ in range(3)]
        same = [lambda r, v=v: v if r == 0 else -v // 2 for v in values]
    else:
        values = [np.where(rng.random(elements) < 0.2, 0, 0x40 | rng.integers(0, 5, elements)
                           | (rng.random(elements) < 0.5) * 0x80).astype(np.uint8) for _ in range(3)]
        same = [lambda r, v=v: v for v in values]  # equal codes: every sum is 0 or ±2^k, encoded exactly
    bad = values[2].copy()
    bad[-1] = 0x7F if codec == Codec.CNAT8 else 0x7FFFFFFF
    items = [(0, 0, same[0](0)), (1, 0, same[0](1)), (0, 0, same[0](0)), (1, 2, same[1](1)), (1, 2, same[1](1)),
             (0, 0, same[0](0)), (0, 2, same[1](0)), (0, 4, bad), (1, 4, same[2](1))]
    return [(packet(rank, allreduce, payload, codec), worker_addr(rank)) for rank, allreduce, payload in items]


@pytest.mark.parametrize("codec, elements", [(Codec.CNAT8, 40), (Codec.CNAT8, 150), (Codec.INT32, 150)])
def test_bmv2_sends_what_the_model_sends(switch: Switch, tmp_path: Path, codec: Codec, elements: int) -> None:
    core, _, model = joined(2, elements, codec)
    commands = cli_commands(controller_entries(core), port=PORT)
    result = switch.cli(commands)
    assert "Error" not in result.stdout, result.stdout[-3000:]
    items = stream(codec, elements)
    expected = [model.receive(datagram, source, 0.0) for datagram, source in items]
    got = switch.exchange([frame(datagram, source) for datagram, source in items], tmp_path)
    assert sum(len(e) for e in expected) >= 5
    for i, (want, have) in enumerate(zip(expected, got)):
        assert sorted(unframe(f) for f in have) == sorted(want), f"frame {i}"
        for f in have:  # each copy from the switch to its rank's Ethernet address, as a NIC accepts it
            assert f[:6] == mac_of(unframe(f)[1]) and f[6:12] == SWITCH_MAC, f"frame {i}"
