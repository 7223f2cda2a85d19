"""C_nat on a CUDA device (the ``intml[cuda]`` extra): kernels bit for bit the CPU ones (protocol.cnat,
``cnat_cuda``), and the allreduce of a device array through the aggregator that moves one byte per element
between device and host (``driver``; intml.worker.torch routes CUDA tensors there).

Importing this package needs a usable CUDA device and driver, or numba's CUDA simulator
(``NUMBA_ENABLE_CUDASIM=1``, for tests); ``import intml.worker`` never imports it.
"""

from __future__ import annotations

from numba import cuda

if not cuda.is_available():
    raise ImportError(
        "intml.worker.gpu needs a CUDA GPU with its driver (numba.cuda.is_available() is False); "
        "set NUMBA_ENABLE_CUDASIM=1 to run its kernels on the CUDA simulator instead"
    )
