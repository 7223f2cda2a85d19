"""The v1model program on BMv2: ``simple_switch`` runs the compiled program in a network namespace this test makes,
on a veth port; the controller's entries for a joined job go in through ``simple_switch_CLI``
(p4.entries.cli_commands); packet streams are sent one frame at a time, and every datagram the switch sends back
(its UDP payload and destination) is compared, byte for byte, with what the pipeline model sends for the same
frame. Streams of several passes (recirculation), completions (multicast), re-sends, duplicates, stale packets and
an invalid code, both codecs, non-finite lanes; each copy carries the switch's and its rank's Ethernet addresses.
On the shipped program (v1model's random()) C_nat streams give every rank the same codes, so each sum is exact and
its encoding needs no random bits, or join with nearest rounding; sums that need random bits run on the test build
(``-DINTML_TEST_RANDOM``), whose frames carry the words the model is given. A burst into a slowed port builds its
egress queue, and the copies behind it leave with the congestion mark, as the model marks them at that depth.
Skipped, saying why, without root, ``ip``, the tools or the ``thrift`` package."""

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

from intml.aggregator.core import AggregatorCore
from intml.p4 import bmv2
from intml.p4.bmv2 import SWITCH_MAC, mac_of, unframe
from intml.p4.controller import controller_entries
from intml.p4.entries import cli_commands
from intml.p4.extern import CarriedRandom
from intml.p4.generate import TEST_RANDOM, TEST_RANDOM_ETHERTYPE
from intml.p4.layout import LANES_PER_PASS, MARK_DEPTH
from intml.protocol.reference import INT32_NONFINITE
from intml.protocol import wire
from intml.protocol.codec import Codec
from intml.protocol.wire import NO_EXP, MsgType

PORT = 1  # the one switch port: every rank behind it (the multicast nodes are on it too)
THRIFT = 9090
SETTLE_S = 0.5  # once a frame's expected output is in, how long to wait for an extra one (support/bmv2_port.py)
WAIT_S = 30.0  # how long to wait for a frame's expected output (BMv2 under load)


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

    def exchange(self, frames: list[bytes], expected: list[int], tmp: Path, burst: bool = False
                 ) -> list[list[bytes]]:
        """Each frame sent in turn; the frames the switch sent back after each (``expected``: how many the model
        sends for each). ``burst``: the frames in a burst (support/bmv2_port.py), every frame back under the
        first."""
        (tmp / "in.txt").write_text("\n".join(f"{f.hex()} {n}" for f, n in zip(frames, expected)))
        result = self.run_in([sys.executable, str(Path(__file__).parents[1] / "support" / "bmv2_port.py"), "h1",
                              str(tmp / "in.txt"), str(tmp / "out.json"), str(SETTLE_S), str(WAIT_S),
                              *(["burst"] if burst else [])], timeout=600)
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


@pytest.fixture
def switch(request: pytest.FixtureRequest, tmp_path: Path):
    """A fresh simple_switch (empty tables and groups, every register 0: every set EMPTY) running the program
    compiled with the ``-D`` defines of the fixture's parameter (default: none, the shipped program), once per
    source (support.p4build)."""
    program = compiled(*getattr(request, "param", ()))
    sw = Switch(f"intml-bmv2-{os.getpid()}", program, tmp_path / "simple_switch.log")
    try:
        yield sw
    finally:
        sw.close()


def frame(datagram: bytes, source: int, words: np.ndarray | None = None) -> bytes:
    """p4.bmv2's frame; ``words``: the test build's random words, in their header between the Ethernet and the IPv4
    header."""
    carried = b"" if words is None else (TEST_RANDOM_ETHERTYPE.to_bytes(2, "big") + words.astype(">u4").tobytes())
    return bmv2.frame(datagram, source, carried)


def packet(rank: int, allreduce: int, payload: np.ndarray, codec: Codec) -> bytes:
    return wire.pack({"type": int(MsgType.DATA), "job": 7, "allreduce": allreduce, "rank": rank,
                      "count": payload.size, "codec": int(codec), "shadow": allreduce % 2, "exp": 0,
                      "next_exp": NO_EXP}, payload)


NONFINITE = {3: (1, 0), 17: (0, 2), 70: (3, 0), 71: (1, 2), 149: (2, 2)}  # lane -> each rank's flags (0: finite)


def stream(codec: Codec, elements: int, same_codes: bool = True, nonfinite: bool = False) -> list[tuple[bytes, int]]:
    """Two ranks: a round (completion, multicast), a re-send, the next round on the same set, a duplicate, a stale
    packet, its completion; then an invalid code. ``same_codes``: C_nat ranks send equal codes, so that every sum is
    0 or ±2^k, encoded exactly (else their codes differ and the sums need rounding); ``nonfinite``: the NONFINITE
    lanes carry flags (a finite lane beside one is a single code: exact too)."""
    rng = np.random.default_rng(elements)
    if codec == Codec.INT32:
        values = [rng.integers(-1000, 1000, elements).astype(">i4") for _ in range(3)]
        ranks = [lambda r, v=v: v if r == 0 else -v // 2 for v in values]
    else:
        values = [np.where(rng.random((2, elements)) < 0.2, 0, 0x40 | rng.integers(0, 5, (2, elements))
                           | (rng.random((2, elements)) < 0.5) * 0x80).astype(np.uint8) for _ in range(3)]
        ranks = [lambda r, v=v: v[0 if same_codes else r] for v in values]

    def payload(k: int, rank: int) -> np.ndarray:
        out = ranks[k](rank).copy()
        for lane, flags in NONFINITE.items():
            if nonfinite and lane < elements and flags[rank]:
                out[lane] = flags[rank] if codec == Codec.CNAT8 else INT32_NONFINITE + flags[rank]
        return out

    bad = payload(2, 0)
    bad[-1] = 0x7F if codec == Codec.CNAT8 else 0x7FFFFFFF
    items = [(0, 0, payload(0, 0)), (1, 0, payload(0, 1)), (0, 0, payload(0, 0)), (1, 2, payload(1, 1)),
             (1, 2, payload(1, 1)), (0, 0, payload(0, 0)), (0, 2, payload(1, 0)), (0, 4, bad), (1, 4, payload(2, 1))]
    return [(packet(rank, allreduce, payload, codec), worker_addr(rank)) for rank, allreduce, payload in items]


def load(switch: Switch, core: AggregatorCore) -> None:
    """The controller's entries for ``core``'s jobs into the switch."""
    result = switch.cli(cli_commands(controller_entries(core), port=PORT))
    assert "Error" not in result.stdout, result.stdout[-3000:]


def counts(expected: list[list[tuple[bytes, int]]]) -> list[int]:
    """How many frames the switch should send back for each input: one per copy the model sends."""
    return [len(e) for e in expected]


def assert_sends(got: list[list[bytes]], expected: list[list[tuple[bytes, int]]]) -> None:
    """Each input frame's output equals the model's, byte for byte; each copy from the switch to its rank's
    Ethernet address, as a NIC accepts it."""
    assert sum(len(e) for e in expected) >= 5
    for i, (want, have) in enumerate(zip(expected, got)):
        assert sorted(unframe(f) for f in have) == sorted(want), f"frame {i}"
        for f in have:
            assert f[:6] == mac_of(unframe(f)[1]) and f[6:12] == SWITCH_MAC, f"frame {i}"


@pytest.mark.parametrize("codec, elements, nonfinite", [(Codec.CNAT8, 40, False), (Codec.CNAT8, 150, True),
                                                        (Codec.INT32, 150, True)])
def test_bmv2_sends_what_the_model_sends(switch: Switch, tmp_path: Path, codec: Codec, elements: int,
                                         nonfinite: bool) -> None:
    core, _, model = joined(2, elements, codec)
    load(switch, core)
    items = stream(codec, elements, nonfinite=nonfinite)
    expected = [model.receive(datagram, source, 0.0) for datagram, source in items]
    assert_sends(switch.exchange([frame(datagram, source) for datagram, source in items], counts(expected),
                                 tmp_path), expected)
    assert (model.counters(0)["nonfinite_elements"] > 0) == nonfinite


def test_bmv2_rounds_a_nearest_job_as_the_model(switch: Switch, tmp_path: Path) -> None:
    """A job joined with nearest rounding, ranks with different codes: every sum is rounded, and the shipped
    program rounds it as the model (and the kernel) do, deterministically."""
    core, _, model = joined(2, 150, Codec.CNAT8, flags=wire.FLAG_NEAREST)
    load(switch, core)
    items = stream(Codec.CNAT8, 150, same_codes=False, nonfinite=True)
    expected = [model.receive(datagram, source, 0.0) for datagram, source in items]
    assert_sends(switch.exchange([frame(datagram, source) for datagram, source in items], counts(expected),
                                 tmp_path), expected)


@pytest.mark.parametrize("switch", [(TEST_RANDOM,)], indirect=True)
def test_bmv2_test_build_rounds_with_the_carried_words(switch: Switch, tmp_path: Path) -> None:
    """The test build takes its random words from the frame: ranks with different codes (sums that need random
    bits), each frame with its own words, which the model is given too; other words would round otherwise."""
    random = CarriedRandom()
    core, _, model = joined(2, 150, Codec.CNAT8, random)
    load(switch, core)
    items = stream(Codec.CNAT8, 150, same_codes=False, nonfinite=True)
    rng = np.random.default_rng(3)
    words = [rng.integers(0, 1 << 32, LANES_PER_PASS, dtype=np.uint32) for _ in items]
    expected = []
    for (datagram, source), carried in zip(items, words):
        random.carried = carried
        expected.append(model.receive(datagram, source, 0.0))
    other = joined(2, 150, Codec.CNAT8, CarriedRandom())[2]  # every word 0: rounds down
    assert [other.receive(datagram, source, 0.0) for datagram, source in items] != expected
    assert_sends(switch.exchange([frame(datagram, source, carried) for (datagram, source), carried
                                  in zip(items, words)], counts(expected), tmp_path), expected)


BURST = 40  # re-sends in a burst: under the egress queue's 64 packets, and past MARK_DEPTH
SLOW_PPS = 20  # the port's rate while the burst queues: 2 s to drain it, 10 times slower than the burst comes in


def test_bmv2_marks_the_results_a_deep_egress_queue_holds(switch: Switch, tmp_path: Path) -> None:
    """With the queue empty (one frame at a time) results leave unmarked, as the model sends them at depth 0; a
    burst of re-sends into a port slowed to SLOW_PPS builds its egress queue, and each copy that found MARK_DEPTH
    or more ahead of it leaves marked: byte for byte the model's copy at that depth. The first MARK_DEPTH copies
    cannot have found that many ahead of them; the later ones did. Once the queue has drained, unmarked again."""
    core, _, model = joined(2, 40, Codec.CNAT8)
    load(switch, core)
    items = stream(Codec.CNAT8, 40)[:2]  # a round: rank 0, then rank 1's completion
    resend = items[0]

    def sends(depth: int) -> list[tuple[bytes, int]]:
        return model.receive(*resend, 0.0, depth)

    expected = [model.receive(datagram, source, 0.0) for datagram, source in items]
    unmarked, marked = sends(0), sends(MARK_DEPTH)
    assert len(unmarked) == 1 and unmarked != marked
    got = switch.exchange([frame(d, s) for d, s in items], counts(expected), tmp_path)
    assert [sorted(unframe(f) for f in have) for have in got] == [sorted(e) for e in expected] and expected[1]
    assert "Error" not in switch.cli([f"set_queue_rate {SLOW_PPS} {PORT}"]).stdout
    got = switch.exchange([frame(*resend)] * BURST, [1] * BURST, tmp_path, burst=True)[0]
    assert switch.cli([f"set_queue_rate 1000000 {PORT}"]).returncode == 0
    copies = [unframe(f) for f in got]
    assert len(copies) == BURST and all(c in (unmarked[0], marked[0]) for c in copies)
    assert copies[:MARK_DEPTH] == unmarked * MARK_DEPTH and marked[0] in copies[MARK_DEPTH:]
    print(f"\n{copies.count(marked[0])} of {BURST} re-sends marked behind a {SLOW_PPS} packet/s port")
    after = switch.exchange([frame(*resend)], [1], tmp_path)
    assert [unframe(f) for f in after[0]] == unmarked
