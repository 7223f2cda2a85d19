"""The device C_nat kernels (worker.gpu.cnat_cuda) equal the CPU kernels (protocol.cnat, protocol.arith) bit for bit.

Without a GPU they run on numba's CUDA simulator: the module switches numba's config to it before numba.cuda is
first imported (nothing else in the suite imports numba.cuda, and the switch changes nothing else). With
INTML_TEST_CUDA_DEVICE=1 the same tests run on the real device. The simulator runs each kernel as Python over
the same shared functions, so the tests check the kernels' walk (global indices, block keys across 2**32,
per-chunk reductions, atomics, saturation and non-finite reporting); test_ptx_wraps checks what the device
compiles the hash to.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from numba.core import config

from intml.protocol import arith, cnat, half
from intml.protocol.rng import BLOCK, stream_key

if "numba.cuda" not in sys.modules and os.environ.get("INTML_TEST_CUDA_DEVICE") != "1":
    config.ENABLE_CUDASIM = True

from numba import cuda  # noqa: E402  (after choosing the simulator)

if not cuda.is_available():
    pytest.skip("numba.cuda was imported for a real device before this module, and there is none",
                allow_module_level=True)

from intml.worker.gpu import cnat_cuda  # noqa: E402

SIMULATED = config.ENABLE_CUDASIM
# The simulator runs the kernels' uint32 arithmetic on numpy scalars, which warn where they wrap (the device and
# the CPU kernels wrap silently, as intended).
pytestmark = [pytest.mark.gpu, pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")]
FEW = settings(max_examples=25 if SIMULATED else 300, deadline=None,
               suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

# Floors at every edge: the lowest, the denormal/normal boundary around -126, where 2**(f + 63) leaves float32
# (f = 64: k = 63 is the largest finite), the highest.
EDGE_FLOORS = [cnat.F_MIN, cnat.F_MIN + 1, -128, -127, -126, -125, -100, -1, 0, 1, 63, 64, 65, 100, 126, 127]
floors = st.one_of(st.sampled_from(EDGE_FLOORS), st.integers(cnat.F_MIN, cnat.F_MAX))
# Offsets whose elements straddle a block, a 2**32 boundary (a new block key), or lie far up.
offsets = st.one_of(st.sampled_from([0, BLOCK - 7, 2**32 - 40, 2**33 - 3, 2**40 + 5]), st.integers(0, 2**48))
SPECIAL = np.array([0x00000000, 0x80000000, 0x00000001, 0x80000001, 0x007FFFFF, 0x00800000, 0x80800000,
                    0x7F7FFFFF, 0xFF7FFFFF, 0x7F000000, 0x3F800000, 0x3FC00000, 0xBFC00000, 0x3FBFFFFF], np.uint32)


def _to_float(bits: list[int]) -> np.ndarray:
    return np.array(bits, np.uint32).view(np.float32)


@st.composite
def finite_values(draw, floor: int, max_size: int = 300) -> np.ndarray:
    """float32 values mixing raw finite bit patterns, the special magnitudes above, and values within 2**-40..2**70
    of 2**floor (below it, at it, and up to saturation), each sign."""
    near = st.tuples(st.integers(-40, 70), st.integers(0, 2**23 - 1), st.booleans()).map(
        lambda t: _near_floor(floor, *t))
    raw = st.integers(0, 2**32 - 1).filter(lambda b: (b & 0x7FFFFFFF) < 0x7F800000)
    bits = draw(st.lists(st.one_of(raw, st.sampled_from(SPECIAL.tolist()), near), min_size=1, max_size=max_size))
    return _to_float(bits)


def _near_floor(floor: int, dexp: int, mantissa: int, negative: bool) -> int:
    """Float32 bits of +-(1 + mantissa / 2**23) * 2**(floor + dexp), clipped to the finite range (denormals below)."""
    value = np.float32(np.ldexp(1.0 + mantissa / 2**23, min(floor + dexp, 127)))
    value = np.float32(min(float(value), float(np.finfo(np.float32).max)))
    return int(np.array(-value if negative else value, np.float32).view(np.uint32))


def _bits(a) -> np.ndarray:
    return np.asarray(a).view(np.uint32)


@FEW
@given(data=st.data(), floor=floors, offset=offsets, seed=st.integers(0, 2**64 - 1), stream=st.integers(0, 2**40))
def test_encode_equals_cpu(data, floor, offset, seed, stream):
    """Stochastic and nearest encodes: the same codes and saturation counts as protocol.cnat."""
    x = data.draw(finite_values(floor))
    want = cnat.encode(x, seed=seed, stream=stream, floor=floor, offset=offset)
    got = cnat_cuda.encode(cuda.to_device(x), seed=seed, stream=stream, floor=floor, offset=offset)
    assert got.codes.copy_to_host().tolist() == want.codes.tolist()
    assert got.saturated == want.saturated
    nearest = cnat.encode_nearest(x, floor=floor)
    got = cnat_cuda.encode_nearest(cuda.to_device(x), floor=floor)
    assert got.codes.copy_to_host().tolist() == nearest.codes.tolist()
    assert got.saturated == nearest.saturated


@FEW
@given(data=st.data(), chunk=st.sampled_from([1, 7, 64, 100]), offset=offsets, seed=st.integers(0, 2**64 - 1))
def test_per_chunk_floors_equal_cpu(data, chunk, offset, seed):
    """A floor per chunk (a bucket's chunks at their own or agreed floors): each chunk's codes are the CPU's encode
    of that chunk at its floor and offset, and each chunk's values its decode."""
    x = data.draw(finite_values(data.draw(floors), max_size=200))
    chunks = -(-x.size // chunk)
    chunk_floors = data.draw(st.lists(floors, min_size=chunks, max_size=chunks))
    parts = [cnat.encode(x[c * chunk : (c + 1) * chunk], seed=seed, stream=9, floor=f, offset=offset + c * chunk)
             for c, f in enumerate(chunk_floors)]
    got = cnat_cuda.encode_chunks(cuda.to_device(x), key=stream_key(seed, 9), floors=chunk_floors,
                                  chunk_elements=chunk, offset=offset)
    codes = np.concatenate([p.codes for p in parts])
    assert got.codes.copy_to_host().tolist() == codes.tolist()
    assert got.saturated == sum(p.saturated for p in parts)
    values = cnat_cuda.decode_chunks(got.codes, floors=chunk_floors, chunk_elements=chunk).copy_to_host()
    want = np.concatenate([cnat.decode(codes[c * chunk : (c + 1) * chunk], floor=f)
                           for c, f in enumerate(chunk_floors)])
    assert _bits(values).tolist() == _bits(want).tolist()
    # a window a..b that need not start or end on a chunk (a reduce-scatter's shard): the same values
    a = data.draw(st.integers(0, x.size))
    b = data.draw(st.integers(a, x.size))
    if a < b:
        window = cnat_cuda.decode_chunks(got.codes[a:b], floors=chunk_floors[a // chunk:-(-b // chunk)],
                                         chunk_elements=chunk, lead=a % chunk).copy_to_host()
        assert _bits(window).tolist() == _bits(want[a:b]).tolist()


def test_per_chunk_floors_are_checked():
    x = cuda.to_device(np.zeros(10, np.float32))
    with pytest.raises(ValueError, match="3 floors for 10 elements"):
        cnat_cuda.encode_chunks(x, key=1, floors=[0, 0, 0], chunk_elements=2)
    with pytest.raises(ValueError, match="1 floors for 4 elements from 3 into chunks of 5"):
        cnat_cuda.decode_chunks(cuda.to_device(np.zeros(4, np.uint8)), floors=[0], chunk_elements=5, lead=3)
    with pytest.raises(ValueError, match="lead must be in"):
        cnat_cuda.decode_chunks(cuda.to_device(np.zeros(4, np.uint8)), floors=[0], chunk_elements=5, lead=5)
    with pytest.raises(ValueError, match="floors must be in"):
        cnat_cuda.decode_chunks(cuda.to_device(np.zeros(10, np.uint8)), floors=[0, -150], chunk_elements=5)


def test_encode_saturates_and_chunks_like_cpu():
    """A tensor encoded in pieces (offsets) gives the one-call codes; saturated values are counted, not dropped."""
    x = np.concatenate([np.float32([3e38, -3e38, 2.0**64, 2.0**63]), np.linspace(-1, 1, 900, dtype=np.float32)])
    want = cnat.encode(x, seed=1, stream=2, floor=0)
    assert want.saturated == 3  # 3e38 twice and 2**64 exceed 2**(0 + 63); 2**63 is k = 63 itself
    device = cuda.to_device(x)
    whole = cnat_cuda.encode(device, seed=1, stream=2, floor=0)
    assert whole.saturated == 3 and whole.codes.copy_to_host().tolist() == want.codes.tolist()
    pieces = [cnat_cuda.encode(device[a:b], seed=1, stream=2, floor=0, offset=a).codes.copy_to_host()
              for a, b in ((0, 10), (10, 517), (517, x.size))]
    assert np.concatenate(pieces).tolist() == want.codes.tolist()


@settings(max_examples=10, deadline=None)
@given(floor=floors, where=st.integers(0, 99), bad=st.sampled_from([np.nan, np.inf, -np.inf]),
       first=st.integers(0, 99))
def test_non_finite_values_code_like_cpu(floor, where, bad, first):
    """NaN and Inf: the CPU's non-finite codes from encode, and its exponents over the finite values; they decode
    to the same bits."""
    x = np.linspace(-5, 5, 100, dtype=np.float32)
    x[where] = bad
    x[max(where, first)] = np.inf
    cpu = cnat.encode(x, seed=3, stream=4, floor=floor).codes
    device = cnat_cuda.encode(cuda.to_device(x), seed=3, stream=4, floor=floor).codes.copy_to_host()
    assert device.tolist() == cpu.tolist() and cpu[max(where, first)] == 1
    stats = cnat_cuda.chunk_stats(cuda.to_device(x), 16)
    assert stats.exponents.tolist() == arith.chunk_exponents(x, 16, arith.CNAT_RANGE).tolist()
    decoded = cnat_cuda.decode(cuda.to_device(cpu), floor=floor).copy_to_host()
    assert decoded.tobytes() == cnat.decode(cpu, floor=floor).tobytes()


@FEW
@given(data=st.data(), floor=floors, chunk=st.sampled_from([1, 7, 64, 100, 1000]))
def test_chunk_stats_equal_cpu(data, floor, chunk):
    """Per-chunk exponents equal protocol.arith.chunk_exponents, and each chunk's exponent and low equal
    precode_chunk's (the worker's read a window ahead), all-zero chunks included."""
    x = data.draw(finite_values(floor))
    if data.draw(st.booleans()):
        x[: min(x.size, chunk)] = 0  # an all-zero chunk: NO_EXP and low 2**32 - 1
    stats = cnat_cuda.chunk_stats(cuda.to_device(x), chunk)
    assert stats.exponents.tolist() == arith.chunk_exponents(x, chunk, arith.CNAT_RANGE).tolist()
    for c in range(stats.exponents.size):
        part = x[c * chunk : (c + 1) * chunk]
        _, _, exponent, low = arith.precode_chunk(part, np.empty(part.size, np.uint8), np.uint64(5),
                                                  c * chunk, 24, True, np.empty(BLOCK, np.uint32))
        assert (int(stats.exponents[c]), int(stats.lows[c]) | arith.PRECODED) == (exponent, int(low))


@FEW
@given(codes=st.lists(st.integers(0, 255), min_size=1, max_size=300), floor=floors,
       acc=st.lists(st.floats(-(2.0**100), 2.0**100, width=32), min_size=300, max_size=300))
def test_decode_equals_cpu(codes, floor, acc):
    """Every code (invalid ones too) decodes to the same float32 bits; decode-accumulate into float32 and float64
    gives the same sums (NaNs compared as NaN: a device's NaN payload may differ from the CPU's)."""
    c = np.array(codes, np.uint8)
    want = cnat.decode(c, floor=floor)
    got = cnat_cuda.decode(cuda.to_device(c), floor=floor).copy_to_host()
    assert _bits(got).tolist() == _bits(want).tolist()
    for dtype in (np.float32, np.float64):
        start = np.array(acc[: c.size], dtype)
        want_acc = cnat.decode_accumulate(c, start.copy(), floor=floor)
        got_acc = cuda.to_device(start)
        cnat_cuda.decode_accumulate(cuda.to_device(c), got_acc, floor=floor)
        got_acc = got_acc.copy_to_host()
        nan = np.isnan(want_acc)
        assert np.isnan(got_acc).tolist() == nan.tolist()
        assert got_acc[~nan].tobytes() == want_acc[~nan].tobytes()


def test_all_codes_at_every_floor():
    """The whole decode table (all 256 codes) at every floor (every 11th under the simulator)."""
    codes = np.arange(256, dtype=np.uint8)
    device_codes = cuda.to_device(codes)
    for floor in range(cnat.F_MIN, cnat.F_MAX + 1, 1 if not SIMULATED else 11):
        values = cnat_cuda.decode(device_codes, floor=floor).copy_to_host()
        assert _bits(values).tolist() == _bits(cnat.decode_table(floor)).tolist()


def test_rejects_host_arrays_and_wrong_dtypes():
    with pytest.raises(TypeError, match="CUDA device array"):
        cnat_cuda.encode(np.zeros(4, np.float32), seed=0, stream=0, floor=0)
    with pytest.raises(TypeError, match="float32"):
        cnat_cuda.encode(cuda.to_device(np.zeros(4, np.float64)), seed=0, stream=0, floor=0)
    with pytest.raises(ValueError, match="floor"):
        cnat_cuda.decode(cuda.to_device(np.zeros(4, np.uint8)), floor=128)


@pytest.mark.parametrize("fmt", [half.BFLOAT16, half.FLOAT16])
def test_16bit_words_equal_cpu(fmt):
    """bfloat16 and float16 words (random patterns, NaN and infinities among them): the device's encode, chunk
    statistics and rounding back to 16 bits are protocol.half's, bit for bit."""
    words = np.random.default_rng(fmt).integers(0, 1 << 16, 700 if SIMULATED else 1 << 16).astype(np.uint16)
    device = cuda.to_device(words.view(np.int16))
    wide = half.to_float32(words, fmt)
    for seed in (None, 5):
        want = half.encode(words, fmt, floor=-20, seed=seed, stream=3)
        got = cnat_cuda.encode_chunks(device, key=0 if seed is None else stream_key(seed, 3), floors=[-20],
                                      chunk_elements=words.size, stochastic=seed is not None, fmt=fmt)
        assert got.codes.copy_to_host().tolist() == want.codes.tolist() and got.saturated == want.saturated
    stats = cnat_cuda.chunk_stats(device, 64, fmt=fmt)
    want_stats = cnat_cuda.chunk_stats(cuda.to_device(wide), 64)
    assert stats.exponents.tolist() == want_stats.exponents.tolist()
    assert stats.lows.tolist() == want_stats.lows.tolist()
    with np.errstate(invalid="ignore"):  # a signalling NaN's product
        tripled = wide * np.float32(3)  # values that round, and overflow to Inf
    out = cuda.device_array(words.size, np.uint16)
    cnat_cuda.narrow(cuda.to_device(tripled), out, fmt)
    assert out.copy_to_host().tolist() == half.from_float32(tripled, fmt).tolist()
    with pytest.raises(TypeError, match="16-bit words"):
        cnat_cuda.chunk_stats(cuda.to_device(wide), 64, fmt=fmt)


def _run(code: str, *args: str) -> subprocess.CompletedProcess:
    environment = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code), *args], capture_output=True, text=True,
                          env=environment, timeout=120)


@pytest.mark.process
def test_kernels_restore_numpy_row_stack():
    """numba-cuda 0.30 overloads np.row_stack when it compiles its first kernel, and numpy 2.5 removed that alias:
    on an H200 with numpy 2.5.2 and numba-cuda 0.30.4 every launch raised AttributeError. Loading the kernels
    puts the alias back (numpy < 2.5 keeps its own)."""
    result = _run("""
        import os
        import numpy as np
        os.environ["NUMBA_ENABLE_CUDASIM"] = "1"
        had = hasattr(np, "row_stack")
        if had:
            del np.row_stack
        from intml.worker.gpu import cnat_cuda
        print(had, np.row_stack is np.vstack)
        """)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split()[1] == "True"


@pytest.mark.process
def test_import_needs_cuda_and_worker_does_not_import_it():
    """Without a GPU (and without the simulator) importing intml.worker.gpu is one clear ImportError;
    importing intml.worker never imports it."""
    result = _run("""
        import sys
        import intml.worker
        assert "intml.worker.gpu" not in sys.modules and "numba.cuda" not in sys.modules
        from numba import cuda
        if cuda.is_available():
            raise SystemExit(77)
        try:
            import intml.worker.gpu
        except ImportError as e:
            print(e)
        """)
    if result.returncode == 77:
        pytest.skip("this machine has a CUDA device")
    assert result.returncode == 0, result.stderr
    assert "needs a CUDA GPU" in result.stdout and "NUMBA_ENABLE_CUDASIM=1" in result.stdout


@pytest.mark.process
def test_ptx_wraps():
    """On the device the hash multiplies at 32 and 64 bits (mul.lo: the low half, i.e. mod 2**32 / 2**64) with no
    floating point, and (with numba-cuda, the cuda extra) every kernel compiles for sm_90. Needs NVVM (the CUDA
    toolkit, or the nvidia-cuda-nvcc wheel with CUDA_HOME pointing at it); numba compiles device functions for
    the current device, so without one the compute capability is supplied."""
    result = _run("""
        import re, sys, types
        try:
            import _numba_cuda_redirector  # numba-cuda's .pth does this, except when on PYTHONPATH
        except ImportError:
            pass
        import numba.cuda.dispatcher as dispatcher
        from numba import cuda, types as t
        if not cuda.is_available():
            dispatcher.get_current_device = lambda: types.SimpleNamespace(compute_capability=(9, 0))
        try:
            from numba.cuda.cudadrv.nvvm import NVVM
            NVVM()
        except Exception as e:
            print(e)
            raise SystemExit(77)
        from intml.protocol.rng import block_key, lowbias32
        import importlib.util
        # the module's file, not the package: intml.worker.gpu refuses to import without a device
        spec = importlib.util.spec_from_file_location("cnat_cuda_ptx", sys.argv[1])
        kernels = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(kernels)

        def hash_kernel(words, key):
            words[0] = lowbias32(words[0])
            words[1] = block_key(key, key)

        u32 = t.Array(t.uint32, 1, "C")
        ptx, _ = cuda.compile_ptx(hash_kernel, (u32, t.uint64), cc=(9, 0))
        print(" ".join(sorted(set(re.findall(r"^\\s*([a-z]+\\.[\\w.]+)", ptx, re.M)))))
        if getattr(cuda, "implementation", "") != "NVIDIA":
            raise SystemExit(0)  # numba's deprecated built-in CUDA target: the hash only (the extra is numba-cuda)
        print("kernels-compiled")
        u8, i64 = t.Array(t.uint8, 1, "C"), t.Array(t.int64, 1, "C")
        f32 = t.Array(t.float32, 1, "C")
        for name, sig in [("_encode_kernel", (u32, u8, t.uint64, t.uint64, i64, t.int64, t.boolean, i64)),
                          ("_chunk_stats_kernel", (u32, t.int64, t.int64, t.int64, t.Array(t.int8, 1, "C"), u32,
                                                   i64)),
                          ("_decode_kernel", (u8, u32, i64, t.int64)), ("_decode_accumulate_kernel", (u8, f32, f32))]:
            cuda.compile_ptx(getattr(kernels, name).py_func, sig, cc=(9, 0))
        """, cnat_cuda.__file__)
    if result.returncode == 77:
        pytest.skip(f"no NVVM here: {result.stdout.strip()[:200]}")
    assert result.returncode == 0, result.stderr[-3000:]
    print(result.stdout)
    instructions = set(result.stdout.split()) - {"kernels-compiled"}
    assert {"mul.lo.s32", "mul.lo.s64"} <= instructions
    assert not {i for i in instructions if ".f32" in i or ".f64" in i or i.startswith("cvt.rn")}
