"""A real BMv2 ``simple_switch`` running the compiled intml program, for p4.bmv2.Bmv2DataPath.

``Bmv2Switch`` makes a network namespace (``intml-bmv2-<pid>-<hex>``: ``intml-testbed cleanup`` removes one a
killed run left) with one veth pair, starts ``simple_switch`` on one end (switch port ``PORT``) and holds, from
this process, a raw socket on the other end and a Thrift connection to the switch's runtime API (both opened
inside the namespace: a socket keeps the namespace it was made in). Everything it made is removed on ``close``,
on a failed start too. ``missing`` says in one line what a host lacks to run it, and how to get it.
"""

from __future__ import annotations

import contextlib
import ctypes
import io
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

PORT = 1  # the switch's one port: every rank behind it, the multicast nodes too
THRIFT_PORT = 9090  # in the switch's own namespace, so never in use
TOOLS = Path(__file__).resolve().parents[2] / "shared" / "p4tools"  # beside the checkout, as make test has it
CLONE_NEWNET = 0x40000000
PR_SET_PDEATHSIG = 1
PACKET_OUTGOING = 4  # AF_PACKET's pkttype of a frame this socket sent itself
ETH_P_ALL = 0x0003
_ADDED = re.compile(r"Entry has been added with handle (\d+)")
_NODE = re.compile(r"node was created with handle (\d+)")


class Bmv2Error(RuntimeError):
    """The switch could not be started or refused a runtime command (one line)."""


def tool(name: str) -> Path | None:
    """BMv2's or p4c's ``name`` from ../shared/p4tools/bin, else from PATH."""
    local = TOOLS / "bin" / name
    if local.exists():
        return local
    found = shutil.which(name)
    return Path(found) if found else None


def _runtime_path() -> Path | None:
    """Where simple_switch_CLI's Python modules (runtime_CLI, sswitch_CLI, bm_runtime) are."""
    cli = tool("simple_switch_CLI")
    if cli is None:
        return None
    for folder in (cli.resolve().parent.parent / "lib" / "python", cli.resolve().parent):
        if (folder / "sswitch_CLI.py").exists():
            return folder
    return None


def missing() -> str | None:
    """One line on what this host lacks to run BMv2 and how to get it, or None."""
    if os.geteuid() != 0:
        return "BMv2 needs root to make its network namespace: run as root (sudo)"
    if shutil.which("ip") is None:
        return "BMv2 needs iproute2's ip: apt-get install iproute2"
    if tool("simple_switch") is None:
        return f"simple_switch is neither in {TOOLS}/bin nor on PATH: install BMv2 (p4lang/behavioral-model)"
    if _runtime_path() is None:
        return f"simple_switch_CLI's Python modules (sswitch_CLI.py) are neither in {TOOLS}/lib/python nor on PATH"
    try:
        import thrift  # noqa: F401  (BMv2's runtime API)
    except ImportError:
        return "BMv2's runtime API needs the thrift Python package: pip install thrift"
    return None


def _die_with_parent() -> None:
    """The switch ends with the process that started it, even one killed outright."""
    ctypes.CDLL(None).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def _ip(*args: str) -> None:
    result = subprocess.run(["ip", *args], capture_output=True, text=True)
    if result.returncode:
        raise Bmv2Error(f"ip {' '.join(args)}: {result.stderr.strip()}")


@contextlib.contextmanager
def inside(namespace: str) -> Iterator[None]:
    """This thread in network namespace ``namespace`` for the block (what it opens stays there)."""
    libc = ctypes.CDLL(None, use_errno=True)
    with open("/proc/self/ns/net") as home, open(f"/run/netns/{namespace}") as target:
        if libc.setns(target.fileno(), CLONE_NEWNET):
            raise Bmv2Error(f"setns into {namespace}: {os.strerror(ctypes.get_errno())}")
        try:
            yield
        finally:
            libc.setns(home.fileno(), CLONE_NEWNET)


class Bmv2Switch:
    """``simple_switch`` running ``program`` (p4c-bm2-ss's JSON) in a namespace of its own, its port ``PORT`` on
    a veth pair whose other end this process sends and receives frames on. ``log``: simple_switch's output (else
    a file named after the namespace in the temporary folder). ``startup_s``: how long it may take to load the program and open its runtime API."""

    def __init__(self, program: Path, *, log: Path | None = None, startup_s: float = 180.0) -> None:
        problem = missing()
        if problem:
            raise Bmv2Error(problem)
        if not Path(program).is_file():
            raise Bmv2Error(f"no BMv2 program at {program}: compile p4/intml.p4 with p4c-bm2-ss -o intml.json")
        self.program = Path(program)
        self.namespace = f"intml-bmv2-{os.getpid()}-{secrets.token_hex(2)}"
        self.process: subprocess.Popen | None = None
        self.sock: socket.socket | None = None
        self.api = None
        _ip("netns", "add", self.namespace)
        try:
            self._start(log, startup_s)
        except BaseException:
            self.close()
            raise

    def _start(self, log: Path | None, startup_s: float) -> None:
        ns = self.namespace
        _ip("-n", ns, "link", "add", "s1", "type", "veth", "peer", "name", "h1")
        for link in ("lo", "s1", "h1"):
            _ip("-n", ns, "link", "set", link, "up")
        for link in ("s1", "h1"):  # no IPv6 chatter on the port
            subprocess.run(["ip", "netns", "exec", ns, "sysctl", "-qw", f"net.ipv6.conf.{link}.disable_ipv6=1"],
                           capture_output=True)
        self.log = log or Path(tempfile.gettempdir()) / f"{ns}.log"
        output = open(self.log, "w")
        self.process = subprocess.Popen(
            ["ip", "netns", "exec", ns, str(tool("simple_switch")), "-i", f"{PORT}@s1", "--thrift-port",
             str(THRIFT_PORT), "--notifications-addr", f"ipc://{self.log.with_suffix('.ipc')}",  # default: one a host
             str(self.program)], stdout=output, stderr=subprocess.STDOUT, preexec_fn=_die_with_parent)
        with inside(ns):
            self.sock = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(ETH_P_ALL))
            self.sock.bind(("h1", 0))
            self.sock.setblocking(False)
            self.api = self._connect(time.monotonic() + startup_s)

    def _connect(self, deadline: float):
        """The runtime API (simple_switch_CLI's command set, in this process) once the switch answers."""
        sys.path.insert(0, str(_runtime_path()))
        import bmpy_utils
        import runtime_CLI
        import sswitch_CLI

        while True:
            if self.process.poll() is not None:
                said = self.log.read_text().strip().splitlines()[-1:] or ["no output"]
                raise Bmv2Error(f"simple_switch exited with status {self.process.returncode} loading {self.program}: "
                                f"{said[0]}")
            try:
                with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
                    services = runtime_CLI.RuntimeAPI.get_thrift_services(runtime_CLI.PreType.SimplePreLAG)
                    services += sswitch_CLI.SimpleSwitchAPI.get_thrift_services()
                    standard, mc, sswitch = bmpy_utils.thrift_connect("localhost", THRIFT_PORT, services, io.StringIO())
                break
            except BaseException as exc:  # the CLI's connect exits the interpreter when nobody listens yet
                if time.monotonic() > deadline:
                    raise Bmv2Error(f"simple_switch's runtime API did not answer on port {THRIFT_PORT}: {exc}")
                time.sleep(0.5)
        runtime_CLI.load_json_config(standard, str(self.program))  # the file: the switch's copy exceeds Thrift's limit
        return sswitch_CLI.SimpleSwitchAPI(runtime_CLI.PreType.SimplePreLAG, standard, mc, sswitch)

    # ---- the runtime API --------------------------------------------------------------------------------------
    def command(self, line: str) -> str:
        """Run one simple_switch_CLI command; its output, or Bmv2Error if the switch refused it."""
        with contextlib.redirect_stdout(io.StringIO()) as out:
            self.api.onecmd(line)
        text = out.getvalue()
        if "Error" in text or "Invalid" in text:
            raise Bmv2Error(f"simple_switch refused {line!r}: {text.strip().splitlines()[-1]}")
        return text

    def table_add(self, line: str) -> int:
        """A ``table_add`` command; the entry's handle."""
        return int(_ADDED.search(self.command(line)).group(1))

    def node_create(self, line: str) -> int:
        """An ``mc_node_create`` command; the node's handle."""
        return int(_NODE.search(self.command(line)).group(1))

    def register_read(self, name: str) -> list[int]:
        return self.api.client.bm_register_read_all(0, name)

    def register_write_range(self, name: str, cells: range, value: int) -> None:
        self.api.client.bm_register_write_range(0, name, cells.start, cells.stop, value)

    def counter_packets(self, name: str, cells: range) -> list[int]:
        return [self.api.client.bm_counter_read(0, name, i).packets for i in cells]

    # ---- the port ---------------------------------------------------------------------------------------------
    def send(self, frame: bytes) -> None:
        self.sock.send(frame)

    def receive(self, wait_s: float) -> list[bytes]:
        """The IPv4 frames the switch sent, until none came for ``wait_s`` seconds."""
        frames = []
        last = time.monotonic()
        while True:
            try:
                data, addr = self.sock.recvfrom(65535)
            except BlockingIOError:
                if time.monotonic() - last >= wait_s:
                    return frames
                time.sleep(min(wait_s / 10, 0.0005))
                continue
            if addr[2] != PACKET_OUTGOING and data[12:14] == b"\x08\x00":
                frames.append(data)
                last = time.monotonic()

    def close(self) -> None:
        """Stop the switch and remove its namespace (idempotent)."""
        if self.sock is not None:
            self.sock.close()
            self.sock = None
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        subprocess.run(["ip", "netns", "del", self.namespace], capture_output=True)

    def __enter__(self) -> Bmv2Switch:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
