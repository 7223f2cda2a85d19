"""One rank's allreduce of a float32 (or bfloat16 or float16) tensor on a CUDA device through the aggregator: the
device encodes, the host moves one byte per element, the device decodes (docs/gpu.md).

For a cnat8 job, on one CUDA stream:

1. ``chunk_stats``: each chunk's exponent proposal and low word (N / P values, copied to the host at once: the
   engine needs them before anything is sent; a NaN or an infinity is left out of its chunk's exponent);
2. ``launch_encode``: every chunk at its own floor into device codes;
3. the codes to pinned host memory in pieces of ``piece_elements``, an event after each: the engine starts at
   once (its bootstrap rounds need only the exponents) and sends a chunk as soon as its piece has landed
   (``StreamEngine.codes_ready``), so the copy overlaps the network;
4. a chunk the engine must encode again at its agreed floor (``reencode_requests``: a value below it) is
   encoded on the device from the floats at that floor and copied over its codes (``reencoded``): exactly the
   codes the CPU path sends;
5. the result codes, written by the engine over the host codes, go back piece by piece as the chunks below
   ``completed()`` finish, and decode on the device at their agreed floors into ``out`` (divided by the world
   size for a mean); a 16-bit ``out`` through a float32 scratch of one piece, rounded into it (protocol.half);
6. ``sent`` (error feedback): the value of what this rank sent, decoded from the device codes at the floors they
   went out at (lowering a chunk's codes to its agreed floor keeps their values).

A reduce-scatter (``reduce_scatter``) runs the same steps with the engine's scatter flag: the aggregator sends each
chunk's result only to the ranks whose shards it overlaps, and step 5 copies and decodes only the rank's shard of
the result codes (``decode_chunks`` with a lead: a shard need not start on a chunk) into an output of its size.

A 16-bit tensor's words are read by the kernels as they are (steps 1, 2 and 4 widen each value in the thread that
reads it): no float32 copy of the tensor. An int32 job has nothing to precode (its encode needs the agreed
exponents): its values are staged through pinned host memory to the CPU engine and back, in their own format (4
or 2 bytes per element each way).

The same code runs on a GPU and under numba's CUDA simulator (``NUMBA_ENABLE_CUDASIM=1``), where "pinned" memory
is host memory and every stream operation is synchronous; ``_finished`` is the one place that differs (the
simulator's events have no ``query``). Inputs and outputs are numba device arrays (``cuda.as_cuda_array`` of a
CUDA torch tensor is one: intml.worker.torch does that).
"""

from __future__ import annotations

from collections import deque
from typing import Any

import numpy as np
from numba import cuda, njit

from intml.protocol.arith import PRECODED, cnat_floor
from intml.protocol.codec import Codec
from intml.protocol.half import FLOAT32, format_of
from intml.worker.api import Worker
from intml.worker.engine import P_VBITS
from intml.worker.gpu import cnat_cuda

PIECE_ELEMENTS = 1 << 20  # codes per device-to-host copy: 1 MB, about 40 us over PCIe; a multiple of any P
COPY_POLL = 20e-6  # seconds between looks at the copies in flight


@njit(cache=True)
def cnat_floors(exponents, value_bits, out):
    for c in range(exponents.size):
        out[c] = cnat_floor(exponents[c], value_bits)
    return out


def _finished(event: Any) -> bool:
    """Whether the stream work before `event` is done, without waiting. (The simulator runs every operation when
    it is issued, and its events have no query.)"""
    query = getattr(event, "query", None)
    return True if query is None else bool(query())


class _Buffers:
    """The device and pinned host buffers of one bucket size, kept between allreduces (allocating pinned memory
    costs milliseconds)."""

    def __init__(self, n: int, codec: Codec, dtype: np.dtype, piece: int) -> None:
        self.n, self.dtype = n, dtype
        if codec == Codec.CNAT8:
            self.codes_host = cuda.pinned_array(n, np.uint8)
            self.codes_dev = cuda.device_array(n, np.uint8)
            self.result_dev = cuda.device_array(n, np.uint8)
            if dtype != np.float32:  # one piece of a 16-bit result, decoded before it is rounded
                self.scratch_dev = cuda.device_array(min(n, piece), np.float32)
        else:
            self.floats_host = cuda.pinned_array(n, dtype)
            self.sent_host = cuda.pinned_array(n, np.float32)
            self.shard_host: Any = None  # a reduce-scatter's output, made on the first one


class DeviceAllreducer:
    """Allreduces and reduce-scatters of device arrays through one Worker (its engine and sockets); see the module
    docstring."""

    def __init__(self, worker: Worker, *, piece_elements: int = PIECE_ELEMENTS) -> None:
        pkt = worker.engine.packet_elements
        self.worker = worker
        self.piece = max(pkt, piece_elements // pkt * pkt)  # whole chunks per piece
        self._buffers: _Buffers | None = None
        self.reencoded_chunks = 0  # chunks encoded again at their agreed floors, over this allreducer's life

    def _buffers_for(self, n: int, dtype: np.dtype) -> _Buffers:
        if self._buffers is None or (self._buffers.n, self._buffers.dtype) != (n, dtype):
            self._buffers = _Buffers(n, self.worker.codec, dtype, self.piece)
        return self._buffers

    def allreduce(self, x: Any, out: Any, op: str = "sum", *, sent: Any = None, stream: Any = 0,
                  dtype: str | None = None) -> None:
        """out = the sum (or mean) over the ranks of the flat float32 device array x (out may be x itself), on
        `stream`; bit for bit ``Worker.allreduce`` of x's values on the host. ``dtype`` "bfloat16" or "float16": x
        and out hold 16-bit words of that format instead (uint16, int16 or float16), as Worker.allreduce takes
        them. ``sent`` (a float32 device array of x's size): receives the value of what this rank put on the wire
        (error feedback). Returns once out (and sent) are complete on the device."""
        self._run(x, out, op, sent, stream, dtype, scatter=False)

    def reduce_scatter(self, x: Any, out: Any, op: str = "sum", *, stream: Any = 0, dtype: str | None = None) -> None:
        """out = this rank's shard of the sum (or mean) over the ranks of the flat device array x (x.size a multiple
        of the world size; the shard is its x.size / world elements from rank * that), on `stream`; bit for bit
        ``Worker.reduce_scatter`` of x's values on the host. ``dtype`` as allreduce's. Returns once out is complete
        on the device."""
        self._run(x, out, op, None, stream, dtype, scatter=True)

    def _run(self, x: Any, out: Any, op: str, sent: Any, stream: Any, dtype: str | None, *, scatter: bool) -> None:
        if op not in ("sum", "mean"):
            raise ValueError(f"op must be 'sum' or 'mean', got {op!r}")
        fmt = FLOAT32 if dtype is None else format_of(dtype)
        x, out = _flat(x, fmt, "x"), _flat(out, fmt, "out")
        size = self.worker.engine.shard_elements(x.size, scatter) if scatter else x.size
        if out.size != size or (sent is not None and sent.size != x.size):
            raise ValueError(f"out must have {size} elements and sent x's {x.size}")
        if x.size == 0:
            return
        if self.worker.codec != Codec.CNAT8:
            self._staged(x, out, op, sent, stream, dtype, scatter)
            return
        _CnatRound(self, x, out, sent, stream, fmt, op == "mean", scatter).run()
        stream_sync(stream)

    def _staged(self, x: Any, out: Any, op: str, sent: Any, stream: Any, dtype: str | None, scatter: bool) -> None:
        """An int32 job: the values (float32 bits or 16-bit words) through pinned host memory and the CPU engine."""
        buf = self._buffers_for(x.size, x.dtype)
        x.copy_to_host(buf.floats_host, stream=stream)
        stream_sync(stream)
        if scatter:
            if buf.shard_host is None:
                buf.shard_host = cuda.pinned_array(out.size, x.dtype)
            result = self.worker.reduce_scatter(buf.floats_host, op, out=buf.shard_host, dtype=dtype)
        else:
            result = self.worker.allreduce(buf.floats_host, op, out=buf.floats_host,
                                           sent=None if sent is None else buf.sent_host, dtype=dtype)
        out.copy_to_device(result, stream=stream)
        if sent is not None:
            sent.copy_to_device(buf.sent_host, stream=stream)
        stream_sync(stream)


def _flat(a: Any, fmt: int, name: str) -> Any:
    """A flat device view of float32 values (fmt FLOAT32) or of 16-bit words."""
    return cnat_cuda._device(a, np.float32, name) if fmt == FLOAT32 else cnat_cuda.words(a, fmt, name)


@cuda.jit
def _divide_kernel(values, divisor):
    for j in range(cuda.grid(1), values.size, cuda.gridsize(1)):
        values[j] = values[j] / divisor


def stream_sync(stream: Any) -> None:
    """Wait for `stream` (0: the default stream)."""
    if stream == 0:
        cuda.synchronize()
    else:
        stream.synchronize()


class _CnatRound:
    """One cnat8 allreduce of a DeviceAllreducer: the steps of the module docstring, the engine's driver work in
    ``tend``."""

    def __init__(self, owner: DeviceAllreducer, x: Any, out: Any, sent: Any, stream: Any, fmt: int,
                 mean: bool, scatter: bool) -> None:
        self.owner, self.x, self.out, self.sent, self.stream = owner, x, out, sent, stream
        self.fmt, self.mean, self.scatter = fmt, mean, scatter
        worker = owner.worker
        # the elements of x whose results go into out: all of them, or the rank's shard
        self.lo = worker.rank * out.size if scatter else 0
        self.hi = self.lo + out.size
        self.engine = engine = worker.engine
        self.pkt = engine.packet_elements
        self.vbits = int(engine.params[P_VBITS])
        self.buf = owner._buffers_for(x.size, np.dtype(np.float32 if fmt == FLOAT32 else np.uint16))
        self.key = engine.stream_key(engine.next_allreduce)
        stats = cnat_cuda.chunk_stats(x, self.pkt, cuda_stream=stream, fmt=fmt)
        self.local = stats.exponents.astype(np.int64)
        self.low = stats.lows | np.uint32(PRECODED)
        # the floor each chunk's device codes are at: its own, or its agreed one once encoded again
        self.sent_floors = cnat_floors(self.local, self.vbits, np.empty(self.local.size, np.int64))
        cnat_cuda.launch_encode(x, self.buf.codes_dev, self.key, 0, self.sent_floors, self.pkt, engine.stochastic,
                                stream, fmt)
        self.pieces: deque[tuple[int, Any]] = deque()  # (end element, event after its copy) in flight
        for a in range(0, x.size, owner.piece):
            b = min(x.size, a + owner.piece)
            self.buf.codes_dev[a:b].copy_to_host(self.buf.codes_host[a:b], stream=stream)
            event = cuda.event()
            event.record(stream)
            self.pieces.append((b, event))
        self.ready = 0  # elements whose codes are on the host
        self.decoded = 0  # elements whose result is decoded into out

    def run(self) -> None:
        codes = self.buf.codes_host[: self.x.size]
        self.owner.worker.run_engine(
            lambda now: self.engine.start_precoded(codes, self.local, self.low, now, ready=self.ready,
                                                   scatter=self.scatter), self.tend)
        self._decode_results(self.x.size)
        if self.sent is not None:
            cnat_cuda.decode_chunks(self.buf.codes_dev, floors=self.sent_floors, chunk_elements=self.pkt,
                                    out=self.sent, cuda_stream=self.stream)

    def tend(self, now: float, send) -> float:
        """Between the engine's calls: pass it the codes that landed and the chunks encoded again, and start
        decoding the finished results. Returns how long the worker may wait for datagrams."""
        engine = self.engine
        ready = self.ready
        while self.pieces and _finished(self.pieces[0][1]):
            ready = self.pieces.popleft()[0]
        if ready > self.ready:
            self.ready = ready
            send(engine.codes_ready(ready, now))
        requests = engine.reencode_requests()
        if requests:
            self._reencode(requests)
            send(engine.reencoded([c for c, _ in requests], now))
        done = min(self.x.size, engine.completed() * self.pkt)
        if done - self.decoded >= self.owner.piece:
            self._decode_results(done)
        return COPY_POLL if self.pieces else np.inf

    def _reencode(self, requests: list[tuple[int, int]]) -> None:
        """Encode each requested chunk again from the floats at its agreed floor, over its device and host codes
        (a few microseconds of device time each, rare: a value below the agreed floor)."""
        buf, x, pkt = self.buf, self.x, self.pkt
        for c, floor in requests:
            a, b = c * pkt, min(x.size, (c + 1) * pkt)
            cnat_cuda.launch_encode(x[a:b], buf.codes_dev[a:b], self.key, a, [floor], b - a, self.engine.stochastic,
                                    self.stream, self.fmt)
            buf.codes_dev[a:b].copy_to_host(buf.codes_host[a:b], stream=self.stream)
            self.sent_floors[c] = floor
        stream_sync(self.stream)
        self.owner.reencoded_chunks += len(requests)

    def _decode_results(self, end: int) -> None:
        """Copy the result codes of elements decoded..end (whole chunks) that go into out (all, or the rank's
        shard) to the device and decode them into out at their chunks' agreed floors, a piece at a time."""
        buf, pkt, piece, lo = self.buf, self.pkt, self.owner.piece, self.lo
        for a in range(max(self.decoded, lo), min(end, self.hi), piece):
            b = min(end, self.hi, a + piece)
            buf.result_dev[a:b].copy_to_device(buf.codes_host[a:b], stream=self.stream)
            chunks = slice(a // pkt, -(-b // pkt))
            floors = cnat_floors(self.engine.agreed_exp[chunks], self.vbits,
                                 np.empty(chunks.stop - chunks.start, np.int64))
            values = self.out[a - lo:b - lo] if self.fmt == FLOAT32 else buf.scratch_dev[:b - a]
            cnat_cuda.decode_chunks(buf.result_dev[a:b], floors=floors, chunk_elements=pkt, out=values,
                                    cuda_stream=self.stream, lead=a % pkt)
            if self.mean:  # Worker.allreduce's float32 division of the sum, which no product by 1/n always equals
                _divide_kernel[cnat_cuda._blocks(b - a), cnat_cuda.THREADS, self.stream](
                    values, np.float32(self.owner.worker.world_size))
            if self.fmt != FLOAT32:
                cnat_cuda.narrow(values, self.out[a - lo:b - lo], self.fmt, self.stream)
        self.decoded = max(self.decoded, end)
