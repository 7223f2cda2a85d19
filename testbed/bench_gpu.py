"""`intml-testbed bench gpu`: the CUDA path (intml.worker.gpu) on a GPU, beside its anchors in the same run.

1. Device kernels, in this process: G elements/s of ``chunk_stats``, the per-chunk encode and decode on a
   float32 CUDA tensor, against a device-to-device copy of the same tensor (the memory-bound anchor), and the
   device-to-host copies the path makes (uint8 codes) against the one it avoids (float32), into pinned memory.
2. End to end: ``workers`` ranks (processes; rank r on GPU r mod the device count) each average a CUDA bucket of
   ``elements`` float32 through the DDP hook (``intml_hook``) and a local aggregator, then the same bucket through
   Gloo's ``all_reduce`` on the same CUDA tensor (Gloo stages it through the host), alternately, after a barrier;
   a round takes as long as its slowest rank. Each rank checks that the hook's counters saw every bucket take
   the CUDA path.

First run on an NVIDIA H200 (docs/gpu.md, "On a GPU"). Without a usable CUDA device it stops with one line saying
so.
"""

from __future__ import annotations

import json
import statistics
import time
from datetime import timedelta

import numpy as np

from intml.testbed.bench_allreduce import aggregator
from intml.testbed.procs import free_port, run_ranks, slowest_per_round
from intml.testbed.timing import emit, median_seconds
from intml.worker.traffic import intml_bytes, ring_bytes

TIMEOUT = timedelta(seconds=300)


def cuda_problem() -> str | None:
    """Why this benchmark cannot run here (torch without CUDA, no device, no intml[cuda]), or None."""
    try:
        import torch
    except ImportError:
        return "it needs torch (pip install intml[torch])"
    if not torch.cuda.is_available():
        return "it needs a CUDA GPU and a CUDA build of torch (torch.cuda.is_available() is False)"
    from intml.worker.torch import gpu

    problem = gpu.PATH.problem()
    return None if problem is None else f"intml's CUDA path cannot run: {problem}"


def _timed(fn) -> float:
    """Seconds of fn() with the device drained before and after."""
    import torch

    torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - start


def kernel_rows(elements: int, packet_elements: int, repeats: int) -> list[dict]:
    import torch
    from numba import cuda

    from intml.protocol.arith import value_bits
    from intml.worker.gpu import cnat_cuda
    from intml.worker.gpu.driver import cnat_floors

    x = torch.randn(elements, device="cuda") * 1e-3  # gradient-like magnitudes
    y = torch.empty_like(x)
    codes = torch.empty(elements, dtype=torch.uint8, device="cuda")
    xd, yd, cd = cuda.as_cuda_array(x), cuda.as_cuda_array(y), cuda.as_cuda_array(codes)
    stats = cnat_cuda.chunk_stats(xd, packet_elements)
    exponents = stats.exponents.astype(np.int64)
    floors = cnat_floors(exponents, value_bits(2), np.empty(exponents.size, np.int64))
    pinned_codes = cuda.pinned_array(elements, np.uint8)
    pinned_floats = cuda.pinned_array(elements, np.float32)
    kernels = {
        "device copy float32 (anchor)": lambda: y.copy_(x),
        "chunk_stats (exponents, lows)": lambda: cnat_cuda.chunk_stats(xd, packet_elements),
        "encode (a floor per chunk)": lambda: cnat_cuda.launch_encode(xd, cd, 12345, 0, floors, packet_elements,
                                                                      True),
        "decode (a floor per chunk)": lambda: cnat_cuda.decode_chunks(cd, floors=floors,
                                                                      chunk_elements=packet_elements, out=yd),
        "codes to pinned host (uint8)": lambda: cd.copy_to_host(pinned_codes),
        "floats to pinned host (float32)": lambda: xd.copy_to_host(pinned_floats),
    }
    seconds = {name: median_seconds(lambda fn=fn: _timed(fn), repeats, warmup=2) for name, fn in kernels.items()}
    anchor = seconds["device copy float32 (anchor)"]
    return [{"kernel": name, "median_ms": 1e3 * t, "g_elements_per_s": elements / t / 1e9, "ratio_to_copy": anchor / t}
            for name, t in seconds.items()]


def rank_main(rank: int, world: int, port: int, address: str, elements: int, packet_elements: int, pool: int,
              warmup: int, rounds: int) -> dict:
    """One rank: alternate hook allreduces and Gloo allreduces of the same CUDA bucket; seconds of each."""
    import torch
    import torch.distributed as dist

    import intml.worker.torch as intml

    device = torch.device("cuda", rank % torch.cuda.device_count())
    torch.cuda.set_device(device)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=TIMEOUT)
    try:
        state = intml.IntmlHookState(aggregator=address, codec="cnat8", packet_elements=packet_elements,
                                     pool_size=pool, seed=1)
        generator = torch.Generator(device=device).manual_seed(rank)
        x = torch.randn(elements, device=device, generator=generator) * 1e-3
        bucket = _Bucket(x.clone())
        times: dict[str, list[float]] = {"intml": [], "gloo": []}

        def hook():
            intml.intml_hook(state, bucket).wait()

        def gloo():
            dist.all_reduce(bucket.flat)
            bucket.flat.div_(world)

        for call in range(warmup + rounds):
            for name, fn in (("intml", hook), ("gloo", gloo)):
                bucket.flat.copy_(x)
                torch.cuda.synchronize()
                dist.barrier()
                seconds = _timed(fn)
                if call >= warmup:
                    times[name].append(seconds)
        traffic = state.traffic
        if traffic.intml_cuda_allreduces != warmup + rounds or traffic.gloo_allreduces:
            raise RuntimeError(f"the hook's buckets did not all take the CUDA path: {traffic}")
        state.close()
        return {"rank": rank, "per_round_s": times["intml"], "gloo_per_round_s": times["gloo"]}
    finally:
        dist.destroy_process_group()


class _Bucket:
    """What intml_hook reads of a DDP GradBucket, for one flat bucket buffer."""

    def __init__(self, flat) -> None:
        self.flat = flat

    def buffer(self):
        return self.flat

    def is_last(self) -> bool:
        return True

    def index(self) -> int:
        return 0

    def parameters(self) -> list:
        return []


def command(rank: int, world: int, port: int, address: str, elements: int, packet_elements: int, pool: int,
            warmup: int, rounds: int) -> list[str]:
    import sys

    return [sys.executable, "-m", "intml.testbed.bench_gpu", json.dumps(
        [rank, world, port, address, elements, packet_elements, pool, warmup, rounds])]


def run(elements: int, workers: int, packet_elements: int, pool: int, cores: int, warmup: int, rounds: int,
        repeats: int, as_json: bool) -> dict:
    if problem := cuda_problem():
        raise SystemExit(f"intml-testbed: bench gpu: {problem}")
    import torch

    kernels = kernel_rows(elements, packet_elements, repeats)
    emit(kernels, as_json, "intml CUDA path: device kernels",
         [("kernel", "kernel", ""), ("median_ms", "median ms", ".3f"), ("g_elements_per_s", "G elem/s", ".1f"),
          ("ratio_to_copy", "x copy", ".2f")],
         {"device": torch.cuda.get_device_name(), "elements": elements, "packet_elements": packet_elements})
    with aggregator(cores, packet_elements) as port:
        address = f"127.0.0.1:{port}"
        rendezvous = free_port()
        reports = run_ranks([command(r, workers, rendezvous, address, elements, packet_elements, pool, warmup,
                                     rounds) for r in range(workers)], "bench gpu", timeout=600)
    hook = slowest_per_round(reports)
    gloo = slowest_per_round([{"per_round_s": r["gloo_per_round_s"]} for r in reports])
    rows = [{"system": "intml hook, CUDA path (cnat8)", "median_s": statistics.median(hook),
             "mb_per_worker": intml_bytes(elements, "cnat8", packet_elements, pool) / 1e6},
            {"system": "gloo all_reduce (anchor)", "median_s": statistics.median(gloo),
             "mb_per_worker": ring_bytes(elements, workers) / 1e6}]
    for row in rows:
        row["gloo_over_this"] = rows[1]["median_s"] / row["median_s"]
    emit(rows, as_json, "hook allreduce of a CUDA bucket through a local aggregator, beside Gloo",
         [("system", "system", ""), ("median_s", "median s", ".4f"), ("mb_per_worker", "MB/worker/way", ".1f"),
          ("gloo_over_this", "Gloo/this", ".2f")],
         {"workers": workers, "elements": elements, "bucket_mb": 4 * elements / 1e6, "rounds": rounds,
          "gpus": torch.cuda.device_count()})
    return {"kernels": kernels, "rows": rows}


def main() -> None:
    import sys

    print(json.dumps(rank_main(*json.loads(sys.argv[1]))))


if __name__ == "__main__":
    main()
