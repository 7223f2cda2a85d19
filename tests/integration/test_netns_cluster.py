"""A real cluster in network namespaces: shaped veth links, nftables random loss, the aggregator in the switch
namespace and one worker process per worker namespace. Needs root, iproute2 and nftables (the Makefile installs
them when it can); skipped with the reason otherwise."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys

import pytest

from intml.protocol import reference
from intml.testbed import mroute, netns
from intml.testbed.bench_allreduce import aggregator, run_ranks_intml
from intml.testbed.bench_cluster import aggregators_in, results_mode
from support.cluster import REPO_ROOT
from intml.testbed.procs import rank_env
from intml.testbed.rank import rank_input

pytestmark = [pytest.mark.process, pytest.mark.netns]

problem = netns.missing_requirements()
needs_cluster = pytest.mark.skipif(problem is not None, reason=f"namespace cluster unavailable: {problem}")

N, ELEMENTS, P, POOL, SEED = 3, 20_000, 1024, 16, 1


def reference_hash(codec: str, allreduce_seq: int) -> str:
    inputs = [rank_input(r, ELEMENTS, SEED) for r in range(N)]
    y = reference.allreduce(inputs, codec=codec, seed=SEED, allreduce_seq=allreduce_seq, packet_elements=P)
    return hashlib.sha256(y.tobytes()).hexdigest()[:16]


@needs_cluster
@pytest.mark.parametrize("codec", ["cnat8", "int32"])
def test_lossy_cluster_is_bit_identical_and_cleaned_up(codec):
    topo = netns.Topology(N, netns.parse_rate("200mbit"), loss=0.02)
    with topo:
        assert set(netns.list_namespaces(topo.prefix)) == {topo.switch, *(topo.worker(i) for i in range(N))}
        with aggregator(1, P, host="0.0.0.0", prefix=topo.exec_prefix(topo.switch)) as port:
            result = run_ranks_intml([f"{topo.port_ip(r)}:{port}" for r in range(N)], ELEMENTS, codec, P, POOL,
                                     warmup=0, rounds=3, prefixes=[topo.exec_prefix(topo.worker(r)) for r in range(N)],
                                     timeout=120)
        dropped = topo.dropped_packets()
    assert netns.list_namespaces(topo.prefix) == []
    assert dropped > 0, "the loss rules dropped nothing: the run did not test loss"
    assert result["identical_across_ranks"]
    # each round is a one-element barrier allreduce (sequence 2i) and then the tensor (sequence 2i + 1)
    assert result["hashes"] == [reference_hash(codec, 2 * i + 1) for i in range(3)]


@needs_cluster
def test_two_aggregator_namespaces_give_the_results_of_one():
    """The job spread over two aggregators in their own namespaces (1 and 2 cores) gives the reference's results
    bit for bit, as one aggregator in the switch namespace does, under loss too; bench cluster checks the same."""
    topo = netns.Topology(N, netns.parse_rate("200mbit"), loss=0.02, aggregators=2)
    prefixes = [topo.exec_prefix(topo.worker(r)) for r in range(N)]
    with topo:
        assert set(netns.list_namespaces(topo.prefix)) == set(topo.namespaces) and len(topo.namespaces) == N + 3
        with aggregator(1, P, host="0.0.0.0", prefix=topo.exec_prefix(topo.aggregator(0))) as p0, \
                aggregator(2, P, host="0.0.0.0", prefix=topo.exec_prefix(topo.aggregator(1))) as p1:
            both = f"{topo.aggregator_ip(0)}:{p0},{topo.aggregator_ip(1)}:{p1}"
            spread = run_ranks_intml([both] * N, ELEMENTS, "cnat8", P, POOL, warmup=0, rounds=2, prefixes=prefixes,
                                     timeout=120)
        with aggregator(3, P, host="0.0.0.0", prefix=topo.exec_prefix(topo.switch)) as port:
            one = run_ranks_intml([f"{topo.port_ip(r)}:{port}" for r in range(N)], ELEMENTS, "cnat8", P, POOL,
                                  warmup=0, rounds=2, prefixes=prefixes, timeout=120)
        dropped = topo.dropped_packets()
    assert netns.list_namespaces(topo.prefix) == []
    assert dropped > 0 and spread["identical_across_ranks"] and one["identical_across_ranks"]
    assert spread["hashes"] == one["hashes"] == [reference_hash("cnat8", 2 * i + 1) for i in range(2)]


def forwarded_by_switch(topo: netns.Topology) -> int:
    """Multicast datagrams the switch namespace's routes have replicated (`ip -s mroute`: per entry "N packets")."""
    out = subprocess.run(["ip", "netns", "exec", topo.switch, "ip", "-s", "mroute", "show"], capture_output=True,
                         text=True, check=True).stdout
    return sum(int(line.split()[0]) for line in out.splitlines() if " packets," in line)


@needs_cluster
@pytest.mark.parametrize("aggregators", [1, 2])
def test_multicast_results_are_replicated_by_the_switch_namespace(aggregators):
    """bench cluster's default: each aggregator multicasts a result once and the switch namespace's routes copy it
    to every worker port (testbed.mroute). Under loss on every link, bit-identical to the reference; the routes
    did the replicating; nothing is left behind."""
    topo = netns.Topology(N, netns.parse_rate("200mbit"), loss=0.02, aggregators=aggregators if aggregators > 1 else 0)
    with topo:
        with aggregators_in(topo, aggregators, 1, P, multicast=True) as addresses:
            result = run_ranks_intml(addresses, ELEMENTS, "cnat8", P, POOL, warmup=0, rounds=2,
                                     prefixes=[topo.exec_prefix(topo.worker(r)) for r in range(N)], timeout=120)
            forwarded = forwarded_by_switch(topo)
        dropped = topo.dropped_packets()
    assert netns.list_namespaces(topo.prefix) == []
    assert dropped > 0 and result["identical_across_ranks"]
    assert result["hashes"] == [reference_hash("cnat8", 2 * i + 1) for i in range(2)]
    assert forwarded >= 2 * -(-ELEMENTS // P), "the switch namespace replicated fewer datagrams than the results"


def test_mroute_structs_match_the_kernels():
    """linux/mroute.h: struct vifctl is 16 bytes; struct mfcctl 60 (42 bytes of addresses, parent and ttls, padded
    to 4, then four 4-byte counters). The kernel refuses any other length with EINVAL."""
    assert mroute.VIFCTL.size == 16 and mroute.MFCCTL.size == 60
    entry = mroute.MFCCTL.unpack(mroute.mfcctl("198.18.0.1", "239.255.42.3", 2, [0, 3]))
    assert entry[:3] == (bytes([198, 18, 0, 1]), bytes([239, 255, 42, 3]), 2)
    assert entry[3] == bytes([1, 0, 0, 1]) + bytes(28)


@needs_cluster
def test_multicast_routes_fail_in_one_line():
    with netns.Topology(2, netns.parse_rate("100mbit")) as topo:
        with pytest.raises(netns.ClusterError) as failed:
            with topo.multicast_routes([("198.18.0.1", "nosuchdev")], netns.RESULTS_GROUP, 1):
                pass
    assert "cannot install multicast routes" in str(failed.value) and "\n" not in str(failed.value)


def test_results_fall_back_to_unicast_beyond_the_kernels_multicast_devices():
    assert results_mode("multicast", 8, 1) == "multicast"
    assert results_mode("multicast", 30, 2) == "multicast" and results_mode("multicast", 31, 2) == "unicast"
    assert results_mode("multicast", 32, 1) == "multicast" and results_mode("multicast", 33, 1) == "unicast"
    assert results_mode("unicast", 4, 1) == "unicast"


def test_bench_cluster_default_cores():
    """Workers share the testbed's host: the aggregators get half of the CPUs the workers leave, at least 1."""
    from intml.testbed.bench_cluster import default_cores

    assert [default_cores(4, 1, cpus) for cpus in (2, 8, 16)] == [1, 2, 6]
    assert [default_cores(8, 2, cpus) for cpus in (2, 16, 32)] == [1, 2, 6]


@needs_cluster
def test_topology_is_removed_when_the_body_fails():
    topo = netns.Topology(2, netns.parse_rate("100mbit"))
    with pytest.raises(RuntimeError, match="boom"):
        with topo:
            assert len(netns.list_namespaces(topo.prefix)) == 3
            raise RuntimeError("boom")
    assert netns.list_namespaces(topo.prefix) == []


@needs_cluster
def test_shaping_limits_the_link_rate():
    """A 2-worker int32 allreduce of 1M elements moves 4 MB each way: at 50 Mbit that takes >= 0.64 s, whereas
    an unshaped veth takes a few tens of ms. Checks that tbf is really in the path (a lower bound, not a timing
    target: the bound is physics, and the CPU can only make it slower)."""
    elements, rate = 1_000_000, netns.parse_rate("50mbit")
    with netns.Topology(2, rate) as topo:
        with aggregator(1, 361, host="0.0.0.0", prefix=topo.exec_prefix(topo.switch)) as port:
            result = run_ranks_intml([f"{topo.port_ip(r)}:{port}" for r in range(2)], elements, "int32", 361, 64,
                                     warmup=0, rounds=1, prefixes=[topo.exec_prefix(topo.worker(r)) for r in range(2)],
                                     timeout=120)
    assert result["median_s"] >= 4 * elements * 8 / rate


@needs_cluster
def test_cleanup_removes_leftovers_of_a_crashed_run():
    topo = netns.Topology(1, netns.parse_rate("100mbit"))
    topo.up()  # and never down(), as after a crash
    removed = netns.remove_namespaces(topo.prefix)
    assert sorted(removed) == sorted([topo.switch, topo.worker(0)])
    assert netns.list_namespaces(topo.prefix) == []


def test_missing_tools_give_one_line():
    """Without the tools on PATH the CLI says what is missing in one line and exits non-zero."""
    env = {**rank_env(), "PATH": "/nonexistent"}
    done = subprocess.run([sys.executable, "-m", "intml.testbed", "cluster", "cleanup"], capture_output=True, text=True,
                          env=env, cwd=REPO_ROOT)
    assert done.returncode != 0
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    expected = "root" if os.geteuid() != 0 else "`ip` is not installed: apt-get install iproute2"
    assert expected in lines[0]


def test_parse_rate():
    assert netns.parse_rate("100mbit") == 100_000_000
    assert netns.parse_rate("1gbit") == 1_000_000_000
    assert netns.parse_rate("2.5Gbit") == 2_500_000_000
    with pytest.raises(ValueError, match="100mbit"):
        netns.parse_rate("fast")


def test_topology_rejects_bad_arguments():
    with pytest.raises(ValueError, match="loss"):
        netns.Topology(2, 10**8, loss=1.5)
    with pytest.raises(ValueError, match="mtu"):
        netns.Topology(2, 10**8, mtu=4000)
    with pytest.raises(ValueError, match="workers"):
        netns.Topology(0, 10**8)
    with pytest.raises(ValueError, match="aggregators"):
        netns.Topology(2, 10**8, aggregators=-1)
