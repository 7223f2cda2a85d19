"""The CUDA path of the hook and the backend: which tensors go through ``intml.worker.gpu`` (encoded and decoded on
their device, one byte per element over PCIe), and how a torch tensor becomes the device array its kernels take.

``intml.worker.gpu`` is imported on the first CUDA tensor only, so a CPU-only job never loads numba's CUDA
target. Where it cannot be imported (no ``intml[cuda]`` extra, no driver or device), CUDA tensors go to Gloo
under routing.CUDA, with one warning naming the cause.

``simulate()`` makes this process treat float32, bfloat16 and float16 CPU tensors as device tensors: their
allreduces take the CUDA path (the same Link code, DeviceAllreducer and kernels) on numba's CUDA simulator. It is
how the CUDA path is tested without a GPU, and shows, on any machine, that a job's results do not depend on the
path.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator
from typing import Any

import torch


class CudaPath:
    """The real CUDA path: CUDA tensors, viewed with ``numba.cuda.as_cuda_array``, on a side stream per device
    that waits for the caller's stream and is synchronised before a result is handed back."""

    def __init__(self) -> None:
        self._problem: str | None = None
        self._gpu: Any = None
        self._streams: dict[torch.device, Any] = {}

    def owns(self, tensor: torch.Tensor) -> bool:
        """Whether `tensor` is one of this path's device tensors."""
        return tensor.device.type == "cuda"

    def problem(self) -> str | None:
        """Why this path cannot run here (imports intml.worker.gpu the first time), or None."""
        if self._gpu is None and self._problem is None:
            try:
                from intml.worker.gpu import driver
            except ImportError as exc:  # no numba CUDA target, no driver, no device
                self._problem = str(exc)
            else:
                self._gpu = driver
        return self._problem

    def allreducer(self, worker: Any) -> Any:
        """A DeviceAllreducer for `worker` (problem() must be None)."""
        return self._gpu.DeviceAllreducer(worker)

    def view(self, tensor: torch.Tensor) -> Any:
        """A flat numba device array sharing `tensor`'s memory."""
        from numba import cuda

        return cuda.as_cuda_array(tensor.detach().reshape(-1))

    def ready_marker(self, tensor: torch.Tensor) -> Any:
        """Taken where the collective is called: an event after the work queued so far on the caller's stream
        (which produced the tensor), for the allreduce's stream to wait on."""
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(tensor.device))
        return event

    @contextlib.contextmanager
    def stream(self, tensor: torch.Tensor, marker: Any) -> Iterator[Any]:
        """Run the body's torch ops on the device's side stream, after `marker`; yields that stream for numba.
        The stream is synchronised on exit, so the tensors written are complete for every stream."""
        from numba import cuda

        side = self._streams.get(tensor.device)
        if side is None:
            side = self._streams[tensor.device] = torch.cuda.Stream(tensor.device)
        side.wait_event(marker)
        with cuda.gpus[tensor.device.index], torch.cuda.stream(side):
            yield cuda.external_stream(side.cuda_stream)
        side.synchronize()


class SimulatedCudaPath(CudaPath):
    """float32 and 16-bit float CPU tensors as device tensors, on numba's CUDA simulator (see the module
    docstring)."""

    def owns(self, tensor: torch.Tensor) -> bool:
        return tensor.device.type == "cpu" and tensor.dtype in (torch.float32, torch.bfloat16, torch.float16)

    def view(self, tensor: torch.Tensor) -> Any:
        from numba.cuda.simulator.cudadrv.devicearray import FakeCUDAArray

        return FakeCUDAArray(tensor.detach().reshape(-1).numpy())

    def ready_marker(self, tensor: torch.Tensor) -> Any:
        return None

    @contextlib.contextmanager
    def stream(self, tensor: torch.Tensor, marker: Any) -> Iterator[Any]:
        from numba import cuda

        yield cuda.stream()


PATH: CudaPath = CudaPath()


def simulate() -> None:
    """From now on, in this process, float32, bfloat16 and float16 CPU tensors take the CUDA path on numba's CUDA
    simulator. Call it before numba.cuda is first imported (it sets NUMBA_ENABLE_CUDASIM) and before the hook state
    or process group is built."""
    global PATH
    from numba.core import config

    if "numba.cuda" in sys.modules and not config.ENABLE_CUDASIM:
        raise RuntimeError("intml: simulate() must be called before numba.cuda is imported (it was, for a real "
                           "device)")
    os.environ["NUMBA_ENABLE_CUDASIM"] = "1"
    config.ENABLE_CUDASIM = True
    PATH = SimulatedCudaPath()
