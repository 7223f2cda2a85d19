"""A cluster on one machine: Linux network namespaces joined by shaped veth links, with real packet loss.

Topology (``Topology.up``):

* one namespace per worker, ``<prefix>-w<i>``, and one for the switch, ``<prefix>-sw``;
* worker i is joined to the switch by its own veth pair: ``eth0`` (198.18.i.2/24) in the worker, port ``p<i>``
  (198.18.i.1/24) in the switch. 198.18.0.0/15 is the range RFC 2544 reserves for benchmarks;
* the switch namespace forwards IP between its ports, so Gloo's worker-to-worker traffic crosses exactly the
  same shaped ports as intml's worker-to-aggregator traffic;
* with ``aggregators`` > 0, that many aggregator namespaces, ``<prefix>-a<k>``, each joined to the switch by an
  unshaped veth: ``eth0`` (198.19.k.2/24) in the aggregator, port ``a<k>`` (198.19.k.1/24) in the switch. They
  stand for aggregation servers on fat links beside the switch (as BytePS's servers, or a multi-rack SwitchML's
  switches): the workers' links stay the bottleneck, as with the aggregator in the switch namespace (the
  default, ``aggregators`` = 0);
* results multicast (``multicast_routes``): the switch namespace replicates what an aggregator sends to the
  results groups out of every worker port, through static multicast routes that testbed.mroute holds, as a
  switch's replication engine does;
* every port is shaped in both directions with ``tc tbf`` on the egress of both veth ends (``--rate``);
* loss is nftables ``numgen random`` drops on the receiving side of each link direction: in the switch
  namespace's prerouting for packets from the workers, and in each worker namespace's input for packets
  from the switch (a multicast result is lost on each copy's link, not on its way into the switch). Each link
  direction loses the given fraction of packets, whoever sent them. (A drop on the
  sender's output hook would fail the send with EPERM instead of losing the packet.)
  Under loss intml runs without UDP GSO there (``exec_prefix``), so that loss acts per datagram.
  (netem does not exist in this kernel. Duplication is not emulated on the links: nftables' dup statement
  clones a packet out through a device rather than back to the receiver; the fault-injection shim of
  tests/support/faults.py tests duplication instead.)

Names carry a unique prefix (``intml-<hex>``), so concurrent runs never collide. ``down`` is idempotent and
runs on exit, on Ctrl-C and on SIGTERM; ``cleanup`` removes anything a crashed run left behind.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field

from intml.aggregator.cli import bit_rate as parse_rate  # the testbed's rate syntax: tc's

PREFIX = "intml-"
SUBNET = "198.18.{i}.{host}"
AGGREGATOR_SUBNET = "198.19.{k}.{host}"
RESULTS_GROUP = "239.255.42.0"  # the first multicast group of the testbed's results (administratively scoped)
MTUS = (1500, 9000)  # link MTUs: Ethernet's and jumbo frames
MAX_LINKS = 200  # worker (and aggregator) links of one topology: each a /24 of SUBNET (AGGREGATOR_SUBNET), of 256


class ClusterError(RuntimeError):
    """The host cannot build the cluster (not root, a tool missing, or a command failed)."""


def missing_requirements() -> str | None:
    """One line saying what the host lacks to build a cluster, or None."""
    if os.geteuid() != 0:
        return "network namespaces need root: run as root (or with sudo)"
    for tool, package in (("ip", "iproute2"), ("tc", "iproute2"), ("nft", "nftables")):
        if shutil.which(tool) is None:
            return f"`{tool}` is not installed: apt-get install {package}"
    return None


def _run(*cmd: str) -> None:
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise ClusterError(f"`{' '.join(cmd)}` failed: {done.stderr.strip()}")


def _burst_bytes(rate_bit: int, mtu: int) -> int:
    """tbf bucket: 2 ms of traffic at the rate, and never less than a few full frames."""
    return max(4 * (mtu + 14), rate_bit // 8 // 500)


@dataclass
class Topology:
    workers: int
    rate_bit: int
    mtu: int = 1500
    loss: float = 0.0
    aggregators: int = 0  # aggregator namespaces; 0: the aggregator runs in the switch namespace
    prefix: str = field(default_factory=lambda: PREFIX + secrets.token_hex(3))
    _up: bool = False

    def __post_init__(self) -> None:
        if not 1 <= self.workers <= MAX_LINKS:
            raise ValueError(f"workers must be in [1, {MAX_LINKS}], got {self.workers}")
        if not 0.0 <= self.loss < 1.0:
            raise ValueError(f"loss must be in [0, 1), got {self.loss}")
        if self.mtu not in MTUS:
            raise ValueError(f"mtu must be one of {MTUS}, got {self.mtu}")
        if not 0 <= self.aggregators <= MAX_LINKS:
            raise ValueError(f"aggregators must be in [0, {MAX_LINKS}], got {self.aggregators}")

    @property
    def switch(self) -> str:
        return f"{self.prefix}-sw"

    def worker(self, i: int) -> str:
        return f"{self.prefix}-w{i}"

    def aggregator(self, k: int) -> str:
        return f"{self.prefix}-a{k}"

    @property
    def namespaces(self) -> list[str]:
        return [self.switch, *map(self.worker, range(self.workers)), *map(self.aggregator, range(self.aggregators))]

    @staticmethod
    def aggregator_ip(k: int) -> str:
        return AGGREGATOR_SUBNET.format(k=k, host=2)

    @staticmethod
    def worker_ip(i: int) -> str:
        return SUBNET.format(i=i, host=2)

    @staticmethod
    def port_ip(i: int) -> str:
        return SUBNET.format(i=i, host=1)

    def exec_prefix(self, namespace: str) -> list[str]:
        """The command prefix that runs a program in ``namespace``. With loss, intml's UDP GSO is off there
        (INTML_GSO=0): a veth carries a GSO batch as one buffer, so the loss rules would drop whole batches of up
        to 64 datagrams, which no NIC does (it segments on the wire); GSO under per-datagram loss is tested with
        the fault shim (tests/integration/test_offload_e2e.py)."""
        return ["ip", "netns", "exec", namespace, *(["env", "INTML_GSO=0"] if self.loss > 0 else [])]

    def up(self) -> Topology:
        problem = missing_requirements()
        if problem:
            raise ClusterError(problem)
        self._up = True  # from here on, down() has something to remove even if a step fails
        try:
            self._build()
        except BaseException:
            self.down()
            raise
        return self

    def _build(self) -> None:
        sw = self.switch
        _run("ip", "netns", "add", sw)
        _run("ip", "-n", sw, "link", "set", "lo", "up")
        _run("ip", "netns", "exec", sw, "sysctl", "-qw", "net.ipv4.ip_forward=1")
        burst = _burst_bytes(self.rate_bit, self.mtu)
        tbf = ["tbf", "rate", f"{self.rate_bit}bit", "burst", str(burst), "latency", "100ms"]
        tag = self.prefix.removeprefix(PREFIX)
        for i in range(self.workers):
            ns = self.worker(i)
            # veth names: at most 15 characters
            self._attach(ns, f"ix{tag}w{i}", f"ix{tag}s{i}", f"p{i}", self.worker_ip(i), self.port_ip(i))
            _run("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", "eth0", "root", *tbf)
            _run("ip", "netns", "exec", sw, "tc", "qdisc", "add", "dev", f"p{i}", "root", *tbf)
            if self.loss > 0:
                self._add_loss(ns, "input", "eth0")
        for k in range(self.aggregators):
            ns = self.aggregator(k)
            self._attach(ns, f"ix{tag}a{k}", f"ix{tag}b{k}", f"a{k}", self.aggregator_ip(k),
                         AGGREGATOR_SUBNET.format(k=k, host=1))
        if self.loss > 0:  # unicast only: an aggregator's own multicast loops back in through p0 to be replicated,
            self._add_loss(sw, "prerouting", "p*", "meta pkttype unicast ")  # and loses on each copy's link

    def _attach(self, ns: str, a: str, b: str, port: str, ip: str, port_ip: str) -> None:
        """A new namespace ``ns`` joined to the switch by a veth (names a, b): eth0 at ``ip`` there, ``port`` at
        ``port_ip`` in the switch, the default route through it."""
        sw = self.switch
        _run("ip", "netns", "add", ns)
        _run("ip", "-n", ns, "link", "set", "lo", "up")
        _run("ip", "link", "add", a, "mtu", str(self.mtu), "type", "veth", "peer", "name", b, "mtu", str(self.mtu))
        _run("ip", "link", "set", a, "netns", ns)
        _run("ip", "link", "set", b, "netns", sw)
        _run("ip", "-n", ns, "link", "set", a, "name", "eth0")
        _run("ip", "-n", sw, "link", "set", b, "name", port)
        _run("ip", "-n", ns, "addr", "add", f"{ip}/24", "dev", "eth0")
        _run("ip", "-n", sw, "addr", "add", f"{port_ip}/24", "dev", port)
        _run("ip", "-n", ns, "link", "set", "eth0", "up")
        _run("ip", "-n", sw, "link", "set", port, "up")
        _run("ip", "-n", ns, "route", "add", "default", "via", port_ip)

    @contextlib.contextmanager
    def multicast_routes(self, senders: list[tuple[str, str]], group: str, count: int) -> Iterator[None]:
        """While the block runs, the switch namespace replicates what each (address, switch port) of ``senders``
        sends to the groups [group, group + count) out of every worker port (testbed.mroute holds the routes).
        The senders' datagrams need a TTL of at least 2."""
        ports = [f"p{i}" for i in range(self.workers)]
        cmd = [*self.exec_prefix(self.switch), sys.executable, "-m", "intml.testbed.mroute",
               "--route", *(f"{ip}/{dev}" for ip, dev in senders), "--oif", *ports, "--group", group,
               "--count", str(count)]
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            if proc.stdout.readline().strip() != "ready":
                raise ClusterError(proc.communicate(timeout=10)[1].strip() or "mroute exited without a reason")
            yield
        finally:
            proc.terminate()
            proc.wait(timeout=10)

    def _add_loss(self, ns: str, hook: str, interfaces: str, match: str = "") -> None:
        threshold = round(self.loss * 1_000_000)
        rules = (f"table inet intml {{ chain loss {{ type filter hook {hook} priority 0; policy accept;\n"
                 f"  iifname \"{interfaces}\" {match}numgen random mod 1000000 < {threshold} counter drop\n  }}\n}}\n")
        done = subprocess.run(["ip", "netns", "exec", ns, "nft", "-f", "-"], input=rules, capture_output=True,
                              text=True)
        if done.returncode != 0:
            raise ClusterError(f"nft rules in {ns} failed: {done.stderr.strip()}")

    def dropped_packets(self) -> int:
        """Packets the loss rules dropped so far, in both directions of every link."""
        total = 0
        for ns in [self.switch, *(self.worker(i) for i in range(self.workers))]:  # the aggregators' links: no loss
            out = subprocess.run(["ip", "netns", "exec", ns, "nft", "list", "table", "inet", "intml"],
                                 capture_output=True, text=True).stdout
            total += sum(int(line.split("packets")[1].split()[0]) for line in out.splitlines() if "packets" in line)
        return total

    def down(self) -> None:
        """Remove every namespace of this topology (their veths go with them). Safe to call twice."""
        if not self._up:
            return
        remove_namespaces(self.prefix + "-")
        self._up = False

    def __enter__(self) -> Topology:
        self.up()
        self._previous_term = signal.signal(signal.SIGTERM, _raise_interrupt)
        return self

    def __exit__(self, *exc) -> None:
        self.down()
        signal.signal(signal.SIGTERM, self._previous_term)


def _raise_interrupt(*_) -> None:
    raise KeyboardInterrupt  # SIGTERM unwinds like Ctrl-C, so the with-block tears the topology down


def list_namespaces(prefix: str = PREFIX) -> list[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return [line.split()[0] for line in out.splitlines() if line.startswith(prefix)]


def remove_namespaces(prefix: str = PREFIX) -> list[str]:
    """Delete every namespace whose name starts with prefix (the `cleanup` subcommand); returns their names."""
    names = list_namespaces(prefix)
    for name in names:
        for pid in subprocess.run(["ip", "netns", "pids", name], capture_output=True, text=True).stdout.split():
            try:
                os.kill(int(pid), signal.SIGKILL)  # a namespace with live processes would linger
            except ProcessLookupError:
                pass
        subprocess.run(["ip", "netns", "del", name], capture_output=True)
    return names


def hold(workers: int, rate: str, mtu: int, loss: float) -> None:
    """`intml-testbed cluster up`: build a topology, say how to use it, and keep it until Ctrl-C."""
    import time

    with Topology(workers, parse_rate(rate), mtu=mtu, loss=loss) as topo:
        print(f"switch namespace {topo.switch}: ports " + ", ".join(topo.port_ip(i) for i in range(workers)))
        for i in range(workers):
            print(f"worker {i}: ip netns exec {topo.worker(i)} ...  (address {topo.worker_ip(i)}, "
                  f"aggregator at {topo.port_ip(i)})")
        print("Ctrl-C tears it down", flush=True)
        try:
            while True:
                time.sleep(3600)
        except KeyboardInterrupt:
            pass
