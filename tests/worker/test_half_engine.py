"""16-bit allreduces in the worker's engine (protocol.half): a bfloat16 or float16 input is encoded a chunk at a
time from its own bits and the result written straight into a 16-bit output, bit for bit the float32 allreduce
of the widened values rounded to nearest even, under loss, duplication and reordering; with no float32 copy of
the tensor (tracemalloc); NaN and infinities passed on."""

from __future__ import annotations

import tracemalloc

import numpy as np
import pytest
from support.harness import Network, make_inputs

from intml.protocol import half, reference
from intml.worker.engine import StreamEngine

P = 32
FORMATS = {"bfloat16": half.BFLOAT16, "float16": half.FLOAT16}


def sixteen(xs: list[np.ndarray], dtype: str) -> list[np.ndarray]:
    """Each rank's float32 input rounded to the format, as bits (uint16; float16 as a float16 array)."""
    out = [reference.float32_to_half(np.asarray(x, np.float32), FORMATS[dtype]) for x in xs]
    return [b.view(np.float16) if dtype == "float16" else b for b in out]


def run(xs: list[np.ndarray], *, codec: str, scatter: bool = False, seed: int = 5, **options) -> list[np.ndarray]:
    net = Network(len(xs), codec=codec, packet_elements=P, pool_size=4, seed=seed, drop=0.1, duplicate=0.1,
                  reorder=0.1, fault_seed=seed)
    net.start(xs, scatter=scatter, **options)
    net.run()
    return [e.result.copy() for e in net.engines]


@pytest.mark.parametrize("codec", ["cnat8", "int32"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("scatter, mean", [(False, False), (True, False), (False, True)])
def test_16bit_result_is_the_float32_result_rounded(codec, dtype, scatter, mean):
    """Three ranks (a mean divides by 3, inexactly), 11 chunks of 32 with a partial last one."""
    n, size = 3, 3 * 111
    xs16 = sixteen(make_inputs(n, size, P, "normal", seed=2), dtype)
    wide = [reference.half_to_float32(x.view(np.uint16), FORMATS[dtype]) for x in xs16]
    got = run(xs16, codec=codec, scatter=scatter, mean=mean, dtype=dtype)
    want = run(wide, codec=codec, scatter=scatter, mean=mean)
    for r in range(n):
        assert got[r].dtype == (np.float16 if dtype == "float16" else np.uint16)
        np.testing.assert_array_equal(got[r].view(np.uint16), reference.float32_to_half(want[r], FORMATS[dtype]))
        if not scatter:  # every rank has the same bits
            np.testing.assert_array_equal(got[r].view(np.uint16), got[0].view(np.uint16))


def test_float16_arrays_are_float16_by_default_and_ranges_overflow_to_inf():
    """Two float16 ranks of 40000 sum past float16's 65504: +-Inf, as a float16 sum; the rest is the float32
    allreduce rounded."""
    xs = [np.float16([40000, -40000, 1.5, 0.25] * 8), np.float16([40000, -40000, 2.5, -0.125] * 8)]
    got = run(xs, codec="int32")
    assert got[0].dtype == np.float16
    np.testing.assert_array_equal(got[0][:4], np.float16([np.inf, -np.inf, 4.0, 0.125]))


@pytest.mark.parametrize("codec", ["cnat8", "int32"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_nonfinite_16bit_values_pass_through(codec, dtype):
    """+Inf, -Inf and NaN words come back as the format's +-Inf and its quiet NaN (0x7FC0 bfloat16, 0x7E00
    float16), where the float32 allreduce has +-Inf and 0x7FC00000."""
    fmt = FORMATS[dtype]
    inf, nan = (0x7F80, 0x7FA1) if fmt == half.BFLOAT16 else (0x7C00, 0x7D01)
    one = reference.float32_to_half(np.float32([1.0]), fmt)[0]
    a = np.full(P, one, np.uint16)
    b = a.copy()
    a[:4] = [inf, inf, nan, one]
    b[:4] = [one, inf | 0x8000, one, inf | 0x8000]
    got = run([a, b], codec=codec, dtype=dtype)
    want_nan = reference.HALF_NAN[fmt]
    np.testing.assert_array_equal(got[1].view(np.uint16)[:4], [inf, want_nan, want_nan, inf | 0x8000])


def test_no_float32_copy_of_the_tensor():
    """A 2**18-element bfloat16 allreduce into a given output allocates less than a quarter of its 16-bit size
    (tracemalloc sees numpy's allocations); the float32 route of the same words allocates their float32 copy."""
    n, size = 2, 1 << 18
    xs = [np.full(size, 0x3FC0 + r, np.uint16) for r in range(n)]  # 1.5 and 1.5078125
    outs = [np.empty(size, np.uint16) for _ in range(n)]
    peaks = {}
    for dtype in ("bfloat16", "float32"):
        net = Network(n, packet_elements=1024, pool_size=8, seed=1)
        routed = outs if dtype == "bfloat16" else [np.empty(size, np.float32) for _ in range(n)]
        tracemalloc.start()
        net.start(xs, routed, dtype=dtype)
        net.run()
        peaks[dtype] = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    assert peaks["bfloat16"] < size * 2 // 4, peaks
    assert peaks["float32"] >= size * 4, peaks
    assert set(np.unique(outs[0]).tolist()) == {0x4000, 0x4080}  # cnat8 sums of 1.5 + 1.5078125: 2.0 or 4.0


def test_dtype_errors():
    e = StreamEngine(job=1, rank=0, world_size=2, codec=0, packet_elements=P, pool_size=2, seed=1, agg_addrs=[1])
    with pytest.raises(TypeError, match="16-bit words"):
        e.start(np.float32([1, 2]), 0.0, dtype="bfloat16")
    with pytest.raises(ValueError, match="dtype must be one of"):
        e.start(np.float32([1, 2]), 0.0, dtype="half")
    with pytest.raises(ValueError, match="16-bit"):
        e.start(np.uint16([1, 2]), 0.0, np.empty(2, np.float32), dtype="bfloat16")
    with pytest.raises(ValueError, match="float32"):
        e.start(np.float16([1, 2]), 0.0, np.empty(2, np.float16), dtype="float32")
