"""worker.gpu.driver: a device array's allreduce through a real aggregator (encode, pieces of codes to pinned host
memory, the engine, result codes back, decode on the device) equals ``Worker.allreduce`` of the same values on the
host, bit for bit: the result at every rank and the value this rank sent (error feedback), in a job mixing device
and CPU ranks, for cnat8 (a chunk forced to be encoded again included) and int32. A device reduce-scatter likewise
equals ``Worker.reduce_scatter`` (shards that do not start on a chunk).

Without a GPU the kernels run on numba's CUDA simulator (as in test_gpu_codec.py); ranks are forked processes. On a
device (INTML_TEST_CUDA_DEVICE=1) they are spawned: this process has initialised CUDA, and a forked child cannot
use it ("CUDA initialized before forking").
"""

from __future__ import annotations

import itertools
import os
import sys

import numpy as np
import pytest
from support.cluster import aggregator, run_ok
from numba.core import config

if "numba.cuda" not in sys.modules and os.environ.get("INTML_TEST_CUDA_DEVICE") != "1":
    config.ENABLE_CUDASIM = True

from numba import cuda  # noqa: E402

if not cuda.is_available():
    pytest.skip("numba.cuda was imported for a real device before this module, and there is none",
                allow_module_level=True)

from intml.protocol import half  # noqa: E402
from intml.worker.api import Worker  # noqa: E402
from intml.worker.gpu import driver  # noqa: E402
from intml.worker.gpu.driver import DeviceAllreducer  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.process, pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")]
PKT, POOL, N, SEED, TOKEN = 256, 4, 3, 77, "t"
START = "fork" if config.ENABLE_CUDASIM else "spawn"
OPS = ("sum", "mean")  # of the two allreduces: a mean over 3 ranks is a division no multiplication equals


def inputs(rank: int) -> list[np.ndarray]:
    """Two allreduces: mixed magnitudes over 2**-30..2**10 with zeros (odd size); then rank 0 near 1 with a tiny
    value in every chunk against ranks 2**20 larger: each of rank 0's chunks must be encoded again."""
    rng = np.random.default_rng([SEED, rank])
    size = 7 * PKT + 13
    mixed = (np.where(rng.random(size) < 0.5, -1.0, 1.0) * 2.0 ** rng.uniform(-30, 10, size)
             * (rng.random(size) < 0.9)).astype(np.float32)
    forced = rng.standard_normal(6 * PKT - 5).astype(np.float32) * (1.0 if rank == 0 else 2.0**20)
    if rank == 0:
        forced[::PKT] = np.float32(2.0**-30)
    return [mixed, forced]


def rank_main(address: str, rank: int, codec: str, jobs: tuple[int, int], device_ranks: tuple[int, ...]) -> dict:
    """Job jobs[0]: every rank on the host; job jobs[1]: the device_ranks through DeviceAllreducer, the others on
    the host. Returns both jobs' results and sent values, per allreduce."""
    out: dict = {"host": [], "mixed": [], "reencoded": []}
    options = dict(rank=rank, world_size=N, token=TOKEN, codec=codec, packet_elements=PKT, pool_size=POOL,
                   seed=SEED, timeout=30)
    with Worker(address, job=jobs[0], **options) as w:
        for x, op in zip(inputs(rank), OPS, strict=True):
            sent = np.empty_like(x)
            out["host"].append((w.allreduce(x, op, sent=sent), sent))
    with Worker(address, job=jobs[1], **options) as w:
        device = DeviceAllreducer(w, piece_elements=3 * PKT)
        stream = cuda.stream()
        for x, op in zip(inputs(rank), OPS, strict=True):
            if rank in device_ranks:
                xd = cuda.to_device(x)
                result, sent = cuda.device_array_like(xd), cuda.device_array_like(xd)
                device.allreduce(xd, result, op, sent=sent, stream=stream)
                out["mixed"].append((result.copy_to_host(), sent.copy_to_host()))
                out["reencoded"].append(device.reencoded_chunks)
            else:
                sent = np.empty_like(x)
                out["mixed"].append((w.allreduce(x, op, sent=sent), sent))
    return out


@pytest.fixture(scope="module")
def agg():
    # a rank that compiles kernels on a cold cache may leave its job idle for tens of seconds, under load
    with aggregator(idle_timeout=120) as a:
        yield a
        assert a.alive(), f"the shared aggregator died:\n{a.stderr()}"


@pytest.mark.parametrize("codec", ["cnat8", "int32"])
def test_device_allreduce_equals_host(agg, codec):
    jobs = (100 + 2 * len(codec), 101 + 2 * len(codec))
    device_ranks = (0, 1)
    got = run_ok(rank_main, [(agg.address, r, codec, jobs, device_ranks) for r in range(N)], timeout=240,
                 start_method=START)
    for r in range(N):
        for i, ((want, want_sent), (result, sent)) in enumerate(zip(got[r]["host"], got[r]["mixed"], strict=True)):
            assert result.view(np.uint32).tolist() == want.view(np.uint32).tolist(), (r, i)
            assert sent.view(np.uint32).tolist() == want_sent.view(np.uint32).tolist(), (r, i)
            assert result.tobytes() == got[0]["mixed"][i][0].tobytes()  # the same at every rank
    if codec == "cnat8":
        first, both = got[0]["reencoded"]
        assert both - first == 6  # every chunk of rank 0's second allreduce
        assert got[1]["reencoded"][1] == got[1]["reencoded"][0]


def test_non_finite_values_pass_through_as_on_the_host(agg):
    """NaN and infinities in the bucket: the device codes them as the host does (its exponents over the finite
    values), and the result and sent values are the host's, bit for bit (powers of two, which every allreduce
    number's random words code exactly)."""
    with Worker(agg.address, job=5, rank=0, world_size=1, token=TOKEN, packet_elements=PKT, pool_size=POOL) as w:
        x = (2.0 ** (np.arange(300) % 7 - 3) * np.where(np.arange(300) % 2, -1, 1)).astype(np.float32)
        x[[170, 171, 299]] = [np.nan, np.inf, -np.inf]
        want_sent = np.empty(300, np.float32)
        want = w.allreduce(x, "sum", sent=want_sent).copy()
        result, sent = cuda.device_array(300, np.float32), cuda.device_array(300, np.float32)
        DeviceAllreducer(w).allreduce(cuda.to_device(x), result, sent=sent)
        assert result.copy_to_host().tobytes() == want.tobytes() and np.isnan(want[170]) and want[171] == np.inf
        assert sent.copy_to_host().tobytes() == want_sent.tobytes()


def test_codes_landing_late_are_waited_for(agg, monkeypatch):
    """Copies that complete slowly (one piece of one chunk per third look at its event): slots wait, parked, for
    their codes, and the result and sent values are still the host's, bit for bit (world size 1)."""
    looks = itertools.count()
    monkeypatch.setattr(driver, "_finished", lambda event: next(looks) % 3 == 2)
    x = inputs(0)[0]
    options = dict(rank=0, world_size=1, token=TOKEN, packet_elements=PKT, pool_size=POOL, seed=SEED)
    with Worker(agg.address, job=7, **options) as w:
        want_sent = np.empty_like(x)
        want = w.allreduce(x, "mean", sent=want_sent)
    with Worker(agg.address, job=8, **options) as w:
        xd = cuda.to_device(x)
        result, sent = cuda.device_array_like(xd), cuda.device_array_like(xd)
        driver.DeviceAllreducer(w, piece_elements=PKT).allreduce(xd, result, "mean", sent=sent)
    assert next(looks) > 3 * (x.size // PKT)  # every piece was found unfinished twice first
    assert result.copy_to_host().tobytes() == want.tobytes()
    assert sent.copy_to_host().tobytes() == want_sent.tobytes()


def half_rank(address: str, rank: int, codec: str, jobs: tuple[int, int]) -> list[tuple[bytes, bytes]]:
    """A bfloat16 sum and a float16 mean of rank-dependent words: on the host (job jobs[0]) and on the device (job
    jobs[1], same seed: the same random words), each result's bytes."""
    options = dict(rank=rank, world_size=N, token=TOKEN, codec=codec, packet_elements=PKT, pool_size=POOL,
                   seed=SEED, timeout=30)
    x = inputs(rank)[0]
    calls = [(half.from_float32(x, half.BFLOAT16).view(np.int16), "bfloat16", "sum"),
             (x.astype(np.float16), "float16", "mean")]
    with Worker(address, job=jobs[0], **options) as w:
        host = [w.allreduce(words, op, dtype=dtype).tobytes() for words, dtype, op in calls]
    with Worker(address, job=jobs[1], **options) as w:
        device = DeviceAllreducer(w, piece_elements=3 * PKT)
        got = []
        for words, dtype, op in calls:
            xd = cuda.to_device(words)
            out = cuda.device_array_like(xd)
            device.allreduce(xd, out, op, dtype=dtype)
            got.append(out.copy_to_host().tobytes())
    return list(zip(host, got, strict=True))


@pytest.mark.parametrize("codec", ["cnat8", "int32"])
def test_16bit_device_allreduce_equals_host(agg, codec):
    """bfloat16 and float16 device arrays (their words, encoded on the device with no float32 copy) give the host's
    16-bit allreduce, bit for bit, at every rank."""
    jobs = (200 + 2 * len(codec), 201 + 2 * len(codec))
    got = run_ok(half_rank, [(agg.address, r, codec, jobs) for r in range(N)], timeout=240,
                 start_method=START)
    for r in range(N):
        for i, (host, device) in enumerate(got[r]):
            assert device == host, (r, i)
            assert device == got[0][i][1]


def scatter_rank(address: str, rank: int, codec: str, jobs: tuple[int, int],
                 device_ranks: tuple[int, ...]) -> tuple[list[tuple[bytes, bytes]], int]:
    """Reduce-scatters of inputs() cut to a multiple of N (shards of 601 and 510 elements: none starts on a chunk of
    PKT), float32 sum and mean, bfloat16 sum, float16 mean: job jobs[0] on the host at every rank, job jobs[1] with
    device_ranks through DeviceAllreducer. Each call's (host, mixed) result bytes, and the chunks encoded again."""
    options = dict(rank=rank, world_size=N, token=TOKEN, codec=codec, packet_elements=PKT, pool_size=POOL,
                   seed=SEED, timeout=30)
    mixed, forced = (x[:x.size - x.size % N] for x in inputs(rank))
    calls = [(mixed, None, "sum"), (forced, None, "mean"),
             (half.from_float32(mixed, half.BFLOAT16).view(np.int16), "bfloat16", "sum"),
             (forced.astype(np.float16), "float16", "mean")]
    with Worker(address, job=jobs[0], **options) as w:
        host = [w.reduce_scatter(x, op, dtype=dtype).tobytes() for x, dtype, op in calls]
    with Worker(address, job=jobs[1], **options) as w:
        device = DeviceAllreducer(w, piece_elements=PKT)  # pieces of a chunk: a shard decodes in several
        got = []
        for x, dtype, op in calls:
            if rank in device_ranks:
                out = cuda.device_array(x.size // N, x.dtype)
                device.reduce_scatter(cuda.to_device(x), out, op, dtype=dtype)
                got.append(out.copy_to_host().tobytes())
            else:
                got.append(w.reduce_scatter(x, op, dtype=dtype).tobytes())
    return list(zip(host, got, strict=True)), device.reencoded_chunks


@pytest.mark.parametrize("codec", ["cnat8", "int32"])
def test_device_reduce_scatter_equals_host(agg, codec):
    """Device reduce-scatters (ranks 0 and 1) beside a CPU rank give every rank the host's shard, bit for bit:
    float32 sum and mean (rank 0's chunks all encoded again in the mean), bfloat16 and float16."""
    jobs = (300 + 2 * len(codec), 301 + 2 * len(codec))
    got = run_ok(scatter_rank, [(agg.address, r, codec, jobs, (0, 1)) for r in range(N)], timeout=240,
                 start_method=START)
    for r in range(N):
        results, _ = got[r]
        for i, (host, device) in enumerate(results):
            assert device == host, (r, i)
    shards = [[np.frombuffer(got[r][0][i][0], np.uint8) for r in range(N)] for i in range(4)]
    assert all(not np.array_equal(s[0], s[1]) for s in shards)  # each rank got its own shard
    if codec == "cnat8":
        assert got[0][1] >= 6  # every chunk of rank 0's float32 forced input (and whichever others must be)


def test_reduce_scatter_sizes_are_checked(agg):
    with Worker(agg.address, job=9, rank=0, world_size=2, token=TOKEN, packet_elements=PKT, pool_size=POOL) as w:
        device = DeviceAllreducer(w)
        with pytest.raises(ValueError, match="multiple of the world size 2"):
            device.reduce_scatter(cuda.device_array(5, np.float32), cuda.device_array(2, np.float32))
        with pytest.raises(ValueError, match="out must have 3 elements"):
            device.reduce_scatter(cuda.device_array(6, np.float32), cuda.device_array(6, np.float32))
