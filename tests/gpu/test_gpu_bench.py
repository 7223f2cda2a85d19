"""`intml-testbed bench gpu` without a usable CUDA device: one line saying why, exit status 1, no traceback. (With
one, the benchmark itself is what runs; it is not a test.)"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from intml.testbed import bench_gpu

pytestmark = pytest.mark.process


def test_bench_gpu_without_cuda_is_one_line():
    if bench_gpu.cuda_problem() is None:
        pytest.skip("this machine has a usable CUDA device: the benchmark would run")
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    result = subprocess.run([sys.executable, "-m", "intml.testbed", "bench", "gpu", "--json"], capture_output=True,
                            text=True, env=env, timeout=120)
    assert result.returncode == 1 and result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("intml-testbed: bench gpu: it needs "), result.stderr
    assert "CUDA" in lines[0]
