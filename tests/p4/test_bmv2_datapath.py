"""``intml-aggregator --engine bmv2``: real Workers allreduce through the compiled program on a real BMv2
``simple_switch`` (p4.bmv2.Bmv2DataPath, testbed.bmv2.Bmv2Switch), and get what the kernel engine gives them.
int32 sums are bit-identical, in one pass (64 elements a packet) and in four (256, recirculated), with loss,
duplication and reordering too. C_nat sums are re-encoded with v1model's random() where the kernel uses its keyed
random bits: every rank gets the same result, each element the kernel's or the other power of two around the same
exact sum, and the kernel's bit for bit where every rank sends the same tensor (each sum is then a power of two:
no random bit is drawn: each rank sends powers of two, encoded exactly). Skipped, saying why, without root, ``ip``, the tools or the ``thrift`` package."""

from __future__ import annotations

import numpy as np
import pytest
from support.allreduce import new_job
from support.cluster import HOST, aggregator, run_cli, run_ok
from support.p4build import compiled

from intml.testbed.bmv2 import missing

pytestmark = [pytest.mark.netns, pytest.mark.process,
              pytest.mark.skipif(missing() is not None, reason=str(missing()))]

N = 2
SIZE = 1000  # elements per allreduce: 16 packets of 64, 4 of 256 (the last one partial)


def tensor(seed: int, rank: int, k: int, same: bool) -> np.ndarray:
    """Rank ``rank``'s tensor of allreduce #k; with ``same``, every rank's is the same signed powers of two and
    zeros (each encoded exactly, so every rank sends the same codes)."""
    rng = np.random.default_rng([seed, 0 if same else rank, k])
    if same:
        return (rng.choice([-1, 0, 1], SIZE) * 2.0 ** rng.integers(-6, 7, SIZE)).astype(np.float32)
    return (rng.standard_normal(SIZE) * 2.0 ** int(rng.integers(-6, 7))).astype(np.float32)


def allreduces(port: int, job: int, rank: int, codec: str, seed: int, packet: int, same: bool,
               faults: float) -> list[bytes]:
    """Join, two allreduces (so slot sets are reused), leave: each result's bytes."""
    import contextlib

    from support.faults import faulty_sockets

    from intml.worker import Worker

    sockets = faulty_sockets(drop=faults, duplicate=faults, reorder=faults, seed=100 * job + rank) \
        if faults else contextlib.nullcontext()
    with sockets, Worker(f"{HOST}:{port}", job=job, rank=rank, world_size=N, token="t", codec=codec,
                         packet_elements=packet, pool_size=4, seed=seed, timeout=30) as w:
        return [w.allreduce(tensor(seed, rank, k, same)).tobytes() for k in range(2)]


def run(port: int, codec: str, seed: int, packet: int, same: bool = False, faults: float = 0.0) -> list[list[bytes]]:
    job = new_job()
    return run_ok(allreduces, [(port, job, r, codec, seed, packet, same, faults) for r in range(N)], timeout=120)


@pytest.fixture(scope="module")
def engines():
    """A kernel aggregator and a BMv2 one (its switch started once for the module)."""
    with aggregator() as kernel, aggregator("--engine", "bmv2", "--bmv2-program", str(compiled())) as bmv2:
        yield kernel.port, bmv2.port


@pytest.mark.parametrize("packet, faults", [(64, 0.0), (256, 0.0), (256, 0.1)])
def test_int32_allreduce_through_bmv2_is_bit_identical_to_the_kernel(engines, packet: int, faults: float) -> None:
    kernel, bmv2 = engines
    want = run(kernel, "int32", 5, packet)
    got = run(bmv2, "int32", 5, packet, faults=faults)
    assert got == want


@pytest.mark.parametrize("packet", [64, 256])
def test_cnat8_allreduce_through_bmv2_stays_within_the_cnat_bound(engines, packet: int) -> None:
    kernel, bmv2 = engines
    want, got = run(kernel, "cnat8", 6, packet), run(bmv2, "cnat8", 6, packet)
    assert got[1] == got[0]  # one multicast result for every rank
    for k in range(2):
        b, w = (np.frombuffer(x[k], np.float32).astype(np.float64) for x in (got[0], want[0]))
        ratio = b[w != 0] / w[w != 0]
        assert np.isin(ratio, (0.5, 1.0, 2.0)).all(), np.unique(ratio)  # the same sum's other power of two
        tiny = np.abs(w).max() * 2.0 ** -40  # below the floor: the sum rounds to 0 or the floor's 2**f
        assert (np.abs(b[w == 0]) < tiny).all()
        assert (b == w).mean() > 0.3  # an element is the kernel's with the probability its rounding keeps


@pytest.mark.parametrize("packet", [64, 256])
def test_cnat8_equal_inputs_through_bmv2_are_bit_identical_to_the_kernel(engines, packet: int) -> None:
    kernel, bmv2 = engines
    assert run(bmv2, "cnat8", 7, packet, same=True) == run(kernel, "cnat8", 7, packet, same=True)


@pytest.mark.parametrize("args, says", [((), "needs --bmv2-program"),
                                        (("--bmv2-program", "/nonexistent.json"), "no BMv2 program at"),
                                        (("--bmv2-program", "intml.json", "--cores", "2"), "--cores 1")])
def test_bmv2_engine_says_what_is_wrong_in_one_line(args: tuple[str, ...], says: str) -> None:
    result = run_cli("--engine", "bmv2", *args)
    assert result.returncode != 0 and says in result.stderr, result.stderr
    assert len(result.stderr.strip().splitlines()) == 1 and "Traceback" not in result.stderr, result.stderr
