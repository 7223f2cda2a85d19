"""C_nat encode, chunk exponents and decode as CUDA kernels, bit for bit the CPU kernels' (protocol.cnat).

Kernel technology: numba's CUDA target. It compiles the very ``@njit`` functions the CPU kernels are made of
(``protocol.rng.block_key``/``lowbias32``, ``protocol.cnat.fast_code``/``small_code``/``decode_bits``,
``protocol.arith.chunk_exponent``) as device functions, so the arithmetic has one source: only the walk over
the elements differs (a grid-stride loop here, aligned blocks with a scalar fix-up pass there). Numba types
every integer at a fixed width and those functions cast each step with ``np.uint32``/``np.uint64`` (or use the
32-bit LLVM intrinsics of protocol.lanes), so the hash wraps mod 2**32 and 2**64 on the device as on the CPU;
``tests/gpu/test_gpu_codec.py`` checks the codes under the CUDA simulator (``NUMBA_ENABLE_CUDASIM=1``) and, where
NVVM is installed, that the PTX multiplies at those widths.

Per element, at its chunk's floor (``floors[j // chunk_elements]``: a bucket's chunks at their own or agreed
floors in one launch; the single-floor functions are one chunk), the device computes what the CPU computes:

* the random word of global element g = offset + j: ``lowbias32(lo ^ block_key(key, hi))``, lo and hi being
  g's low and high 32 bits (the CPU derives the block key once per block; it is the same number);
* its code: ``small_code`` for a nonzero magnitude below 2**max(floor, -126), else ``fast_code``;
* saturation (a magnitude above 2**(floor + 63), code k = 63, counted) and non-finite values (their flags'
  code, ``nonfinite_flags``, counted).

Inputs and outputs are device arrays, or anything with ``__cuda_array_interface__`` (a CUDA torch tensor):
C-contiguous float32 values and uint8 codes. The encode and the chunk statistics also take bfloat16 or float16
values as their 16-bit words (uint16 or int16, ``fmt`` BFLOAT16 or FLOAT16: protocol.half), each widened to
float32 in the thread that reads it, and ``narrow`` rounds decoded float32 values to 16-bit words. Every launch
takes an optional CUDA stream.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np
from numba import config, cuda

# numba-cuda 0.30 registers an overload of np.row_stack when its first kernel compiles, and numpy 2.5 removed that
# alias of np.vstack: every launch raised AttributeError (NVIDIA/numba-cuda#907, closed unfixed: numba-cuda is in
# maintenance). Restoring the alias is all it needs; nothing in intml calls it.
if not hasattr(np, "row_stack"):
    np.row_stack = np.vstack

from intml.protocol.arith import EXP_MAX, EXP_MIN, chunk_exponent
from intml.protocol.cnat import (
    F32_LARGEST,
    F_MAX,
    F_MIN,
    check_floor,
    decode_bits,
    decode_origin,
    encode_params,
    encode_word,
    fast_code,
    nonfinite_flags,
    small_code,
)
from intml.protocol.half import FLOAT32, narrow_bits, word_bits
from intml.protocol.rng import block_key, stream_key

_U32 = np.uint32
_U64 = np.uint64

# Threads per block and the most blocks a grid-stride launch uses. The simulator runs each thread as a Python
# thread, so it gets a small grid (the loops cover any size either way).
THREADS = 32 if config.ENABLE_CUDASIM else 256
MAX_BLOCKS = 2 if config.ENABLE_CUDASIM else 4096


class Encoded(NamedTuple):
    codes: Any  # device array of uint8
    saturated: int


class ChunkStats(NamedTuple):
    exponents: np.ndarray  # int8, one per chunk: the exponent-agreement proposal (protocol.arith.chunk_exponents)
    lows: np.ndarray  # uint32, one per chunk: the smallest nonzero magnitude minus one (encode_kernel's low)


@cuda.jit
def _encode_kernel(words, out, key, offset, floors, chunk_elements, stochastic, counts, fmt):
    """out = codes of words (float32 bits, or 16-bit words of format fmt, of elements offset.. of the tensor),
    element j at floors[j // chunk_elements]; counts[0] += saturated elements, counts[1] += non-finite ones."""
    for j in range(cuda.grid(1), words.size, cuda.gridsize(1)):
        floor = floors[j // chunk_elements]
        fast_floor, kfl, small_bits, bias, sat_bits = encode_params(floor)
        g = _U64(_U64(offset) + _U64(j))
        r = encode_word(stochastic, _U32(g & _U64(0xFFFFFFFF)), block_key(key, g >> _U64(32)))
        b = word_bits(words[j], fmt)
        ab = _U32(b & _U32(0x7FFFFFFF))
        if ab != _U32(0) and ab < small_bits:
            out[j] = small_code(b, r, floor)
        else:
            out[j] = fast_code(b, r, kfl, bias)
        if ab > sat_bits:
            if ab > _U32(F32_LARGEST):
                out[j] = nonfinite_flags(b)
                cuda.atomic.add(counts, 1, 1)
            else:
                cuda.atomic.add(counts, 0, 1)


@cuda.jit
def _chunk_stats_kernel(words, chunk_elements, lo, hi, exponents, lows, fmt):
    """One block per chunk (grid-stride over chunks): exponents[c] = chunk_exponent of the largest finite
    magnitude, lows[c] = the smallest nonzero magnitude minus one."""
    top = cuda.shared.array(1, np.uint32)
    low = cuda.shared.array(1, np.uint32)
    for c in range(cuda.blockIdx.x, exponents.size, cuda.gridDim.x):
        if cuda.threadIdx.x == 0:
            top[0] = _U32(0)
            low[0] = _U32(0xFFFFFFFF)
        cuda.syncthreads()
        my_top = _U32(0)
        my_low = _U32(0xFFFFFFFF)
        end = min(words.size, (c + 1) * chunk_elements)
        for j in range(c * chunk_elements + cuda.threadIdx.x, end, cuda.blockDim.x):
            ab = _U32(word_bits(words[j], fmt) & _U32(0x7FFFFFFF))
            my_top = max(my_top, ab if ab <= _U32(F32_LARGEST) else _U32(0))  # Inf and NaN travel as flags
            my_low = min(my_low, _U32(ab - _U32(1)))  # zeros wrap to the maximum and drop out
        cuda.atomic.max(top, 0, my_top)
        cuda.atomic.min(low, 0, my_low)
        cuda.syncthreads()
        if cuda.threadIdx.x == 0:
            exponents[c] = chunk_exponent(top[0], lo, hi)
            lows[c] = low[0]
        cuda.syncthreads()  # the next chunk's reset waits for this read


@cuda.jit
def _decode_kernel(codes, out, floors, chunk_elements, lead):
    """out (uint32 view of float32) = the values of codes, code j at floors[(lead + j) // chunk_elements] (the codes
    begin lead elements into their first chunk)."""
    for j in range(cuda.grid(1), codes.size, cuda.gridsize(1)):
        out[j] = decode_bits(codes[j], decode_origin(floors[(lead + j) // chunk_elements]))


@cuda.jit
def _narrow_kernel(bits, out, fmt):
    """out (16-bit words) = float32 bits rounded to format fmt (protocol.half.narrow_bits)."""
    for j in range(cuda.grid(1), bits.size, cuda.gridsize(1)):
        out[j] = narrow_bits(bits[j], fmt)


@cuda.jit
def _decode_accumulate_kernel(codes, acc, table):
    """acc += table[codes]: the value table of the floor (float32, as protocol.cnat.decode_accumulate's)."""
    for j in range(cuda.grid(1), codes.size, cuda.gridsize(1)):
        acc[j] += table[codes[j]]


def _blocks(n: int) -> int:
    return max(1, min(MAX_BLOCKS, -(-n // THREADS)))


def _as_device(a: Any, name: str) -> Any:
    if cuda.devicearray.is_cuda_ndarray(a):
        return a
    if hasattr(a, "__cuda_array_interface__"):  # a CUDA torch tensor, CuPy array...: a view, no copy
        return cuda.as_cuda_array(a)
    raise TypeError(f"{name} must be a CUDA device array (or have __cuda_array_interface__), got {type(a).__name__}")


def _device(a: Any, dtype: type, name: str) -> Any:
    """A flat device view of a C-contiguous device array (or CUDA array interface) of dtype."""
    array = _as_device(a, name)
    if array.dtype != np.dtype(dtype):
        raise TypeError(f"{name} must hold {np.dtype(dtype).name}, got {array.dtype}")
    if not array.is_c_contiguous():
        raise ValueError(f"{name} must be C-contiguous")
    return array.reshape(array.size)


def words(x: Any, fmt: int, name: str = "x") -> Any:
    """The flat input words of a device array: a float32 one's bits (fmt FLOAT32), or a 16-bit one's words
    (uint16, int16 or float16: the values' bits in format fmt)."""
    if fmt == FLOAT32:
        return _device(x, np.float32, name).view(np.uint32)
    array = _as_device(x, name)
    if array.dtype.itemsize != 2 or array.dtype.kind not in "uif":
        raise TypeError(f"{name} must hold 16-bit words (uint16, int16 or float16), got {array.dtype}")
    if not array.is_c_contiguous():
        raise ValueError(f"{name} must be C-contiguous")
    return array.reshape(array.size).view(np.uint16)


def _out(out: Any, n: int, dtype: type, stream: Any) -> Any:
    if out is None:
        return cuda.device_array(n, dtype, stream=stream)
    flat = _device(out, dtype, "out")
    if flat.size != n:
        raise ValueError(f"out has {flat.size} elements, needs {n}")
    return flat


def _floors(floors: Any, n: int, chunk_elements: int, stream: Any, lead: int = 0) -> Any:
    """The per-chunk floors as an int64 device array, checked: one per chunk of chunk_elements (the last may be
    short) covering n elements that begin lead elements into the first."""
    if chunk_elements < 1:
        raise ValueError(f"chunk_elements must be >= 1, got {chunk_elements}")
    if not 0 <= lead < chunk_elements:
        raise ValueError(f"lead must be in [0, {chunk_elements}), got {lead}")
    host = np.asarray(floors, np.int64).reshape(-1)
    if host.size != max(1, -(-(lead + n) // chunk_elements)):
        raise ValueError(f"{host.size} floors for {n} elements from {lead} into chunks of {chunk_elements}")
    if host.size and not (F_MIN <= host.min() and host.max() <= F_MAX):
        raise ValueError(f"floors must be in [{F_MIN}, {F_MAX}], got [{host.min()}, {host.max()}]")
    return cuda.to_device(host, stream=stream)


def launch_encode(x: Any, out: Any, key: int, offset: int, floors: Any, chunk_elements: int, stochastic: bool,
                  stream: Any = 0, fmt: int = FLOAT32) -> Any:
    """Queue the encode of float32 x (or 16-bit words of format fmt) into uint8 out on stream, element j at
    floors[j // chunk_elements] (host values, one per chunk), without waiting: returns the device array counts,
    [saturated elements, non-finite elements], valid once the stream has run."""
    flat = words(x, fmt)
    codes = _out(out, flat.size, np.uint8, stream)
    if offset < 0:
        raise ValueError(f"offset must be >= 0, got {offset}")
    counts = cuda.to_device(np.array([0, 0], np.int64), stream=stream)
    _encode_kernel[_blocks(flat.size), THREADS, stream](
        flat, codes, _U64(key), _U64(offset), _floors(floors, flat.size, chunk_elements, stream), chunk_elements,
        bool(stochastic), counts, fmt
    )
    return counts


def encode_chunks(x: Any, *, key: int, floors: Any, chunk_elements: int, offset: int = 0, out: Any = None,
                  stochastic: bool = True, cuda_stream: Any = 0, fmt: int = FLOAT32) -> Encoded:
    """Codes of float32 x (or 16-bit words of format fmt), chunk c (elements c * chunk_elements..) at floors[c],
    random words keyed by (key, offset + j): each chunk's codes are protocol.cnat's encode of that chunk (its
    values) at its floor and offset."""
    codes = _out(out, words(x, fmt).size, np.uint8, cuda_stream)
    counts = launch_encode(x, codes, key, offset, floors, chunk_elements, stochastic, cuda_stream, fmt)
    saturated, _ = counts.copy_to_host(stream=cuda_stream)
    return Encoded(codes, int(saturated))


def encode(x: Any, *, seed: int, stream: int, floor: int, offset: int = 0, out: Any = None,
           cuda_stream: Any = 0) -> Encoded:
    """protocol.cnat.encode on the device: the same codes and saturation count."""
    n = _device(x, np.float32, "x").size
    return encode_chunks(x, key=stream_key(seed, stream), floors=[check_floor(floor)], chunk_elements=max(1, n),
                         offset=offset, out=out, cuda_stream=cuda_stream)


def encode_nearest(x: Any, *, floor: int, out: Any = None, cuda_stream: Any = 0) -> Encoded:
    """protocol.cnat.encode_nearest on the device."""
    n = _device(x, np.float32, "x").size
    return encode_chunks(x, key=0, floors=[check_floor(floor)], chunk_elements=max(1, n), out=out,
                         stochastic=False, cuda_stream=cuda_stream)


def chunk_stats(x: Any, chunk_elements: int, codec_range: tuple[int, int] = (EXP_MIN, EXP_MAX),
                cuda_stream: Any = 0, fmt: int = FLOAT32) -> ChunkStats:
    """Per-chunk exponents (protocol.arith.chunk_exponents) and lows (precode_chunk's low, without the PRECODED
    tag) of a flat float32 device array, or of 16-bit words of format fmt (the exponents over the finite
    values)."""
    flat = words(x, fmt)
    if chunk_elements < 1:
        raise ValueError(f"chunk_elements must be >= 1, got {chunk_elements}")
    chunks = -(-flat.size // chunk_elements)
    exponents = cuda.device_array(chunks, np.int8, stream=cuda_stream)
    lows = cuda.device_array(chunks, np.uint32, stream=cuda_stream)
    _chunk_stats_kernel[max(1, min(MAX_BLOCKS, chunks)), THREADS, cuda_stream](
        flat, chunk_elements, codec_range[0], codec_range[1], exponents, lows, fmt
    )
    return ChunkStats(exponents.copy_to_host(stream=cuda_stream), lows.copy_to_host(stream=cuda_stream))


def decode_chunks(codes: Any, *, floors: Any, chunk_elements: int, out: Any = None, cuda_stream: Any = 0,
                  lead: int = 0) -> Any:
    """float32 values of uint8 codes, chunk c at floors[c] (protocol.cnat.decode of each chunk; invalid codes give
    NaN): a result's chunks decode straight into the bucket at their agreed floors. ``lead``: the codes begin that
    many elements into their first chunk (a reduce-scatter's shard, which need not start on a chunk)."""
    flat = _device(codes, np.uint8, "codes")
    values = _out(out, flat.size, np.float32, cuda_stream)
    _decode_kernel[_blocks(flat.size), THREADS, cuda_stream](
        flat, values.view(np.uint32), _floors(floors, flat.size, chunk_elements, cuda_stream, lead), chunk_elements,
        lead)
    return values


def narrow(values: Any, out: Any, fmt: int, cuda_stream: Any = 0) -> Any:
    """out (16-bit words of format fmt, as many as values) = float32 values rounded to nearest even
    (protocol.half); returns out."""
    flat = _device(values, np.float32, "values")
    target = words(out, fmt, "out")
    if target.size != flat.size:
        raise ValueError(f"out has {target.size} elements, needs {flat.size}")
    _narrow_kernel[_blocks(flat.size), THREADS, cuda_stream](flat.view(np.uint32), target, fmt)
    return out


def decode(codes: Any, *, floor: int, out: Any = None, cuda_stream: Any = 0) -> Any:
    """protocol.cnat.decode on the device: float32 values of uint8 codes at floor (invalid codes give NaN)."""
    n = _device(codes, np.uint8, "codes").size
    return decode_chunks(codes, floors=[check_floor(floor)], chunk_elements=max(1, n), out=out,
                         cuda_stream=cuda_stream)


def decode_accumulate(codes: Any, acc: Any, *, floor: int, cuda_stream: Any = 0) -> Any:
    """acc += decode(codes, floor=floor) in place, for a float32 or float64 device accumulator; returns acc."""
    flat = _device(codes, np.uint8, "codes")
    dtype = _as_device(acc, "acc").dtype
    if dtype not in (np.float32, np.float64):
        raise TypeError(f"acc must hold float32 or float64, got {dtype}")
    target = _out(acc, flat.size, dtype, cuda_stream)
    table = decode(cuda.to_device(np.arange(256, dtype=np.uint8), stream=cuda_stream), floor=floor,
                   cuda_stream=cuda_stream)
    _decode_accumulate_kernel[_blocks(flat.size), THREADS, cuda_stream](flat, target, table)
    return acc
