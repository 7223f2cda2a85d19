"""The worker's streaming engine for a host-codec job (docs/protocol.md, "Host mode"), behind StreamEngine's API:
``Worker(codec="uniform8")`` runs it. Sans-I/O like StreamEngine: the driver passes received datagrams and ``now``,
and sends the Burst it gets back, whose rows point at the engine's stored datagrams.

It streams as StreamEngine does (chunk c in slot c mod W', the next chunk of a slot once its result is back, the
shadow set flipped on each use, the stored datagram resent byte for byte by worker.retransmit's policy, the
DATA/RESULT MAC), with what a host codec changes: a chunk's payload is the codec's package, of any length, encoded
from the float32 values with this rank's random words in the allreduce (keyed as C_nat's: protocol.rng,
worker_stream), and the result package is decoded by the codec. No exponents are agreed (exp and next_exp are
NO_EXP), so a slot starts with its first chunk, not a bootstrap round. Python per packet, as the aggregator's
host mode is; float32 allreduces only (no reduce-scatter, no 16-bit or precoded inputs).
"""

from __future__ import annotations

import numpy as np
from numba import njit

from intml.protocol.arith import worker_stream
from intml.protocol.burst import Burst
from intml.protocol.codecs.host import HostCodec, MalformedPackage
from intml.protocol.job import WorkerTimers, host_package_limit
from intml.protocol.packet import HDR, put_header
from intml.protocol.rng import derive_key
from intml.protocol.siphash import put_tag, tag_ok
from intml.protocol.wire import HEADER, MAGIC, NO_EXP, TAG_SIZE, VERSION, MsgType
from intml.worker.engine import take_result
from intml.worker.retransmit import (
    T_RTO,
    arm,
    fast_retransmit,
    next_deadline,
    restart_silences,
    silence_state,
    timer_kernel,
    timing_state,
)
from intml.worker.state import (
    DROP_BAD_MAC,
    DROP_FOREIGN,
    DROP_MALFORMED,
    DROP_STALE,
    DROP_UNSENT,
    IDLE,
    PACKETS_IN,
    P_CHUNKS,
    P_CORES,
    P_WINDOW,
    PARAMS,
    STAT_NAMES,
    State,
    queue_slot,
)


@njit(cache=True, nogil=True, boundscheck=False)
def header_kernel(p, job, allreduce, chunk, rank, slot, count, codec, shadow):
    """A host DATA header in p: no exponents (put_header, compiled once, not per process)."""
    put_header(p, MsgType.DATA, job, allreduce, chunk, rank, slot, count, codec, shadow, NO_EXP, NO_EXP)


@njit(cache=True, nogil=True, boundscheck=False)
def restart_kernel(silence, now):
    """An allreduce starts (worker.retransmit.restart_silences)."""
    restart_silences(silence, now)


@njit(cache=True, nogil=True, boundscheck=False)
def send_kernel(state, s, now, tx_ptr, tx_len, tx_addr, n_tx):
    """Slot s's new datagram (built in its buffer of its parity) goes out at now: arm its timer, queue it.
    Returns the new tx count."""
    st = State(*state)
    arm(st, s, now)
    queue_slot(st, s, tx_ptr, tx_len, tx_addr, n_tx)
    return n_tx + 1


@njit(cache=True, nogil=True, boundscheck=False)
def take_kernel(state, s, now):
    """Slot s's result was taken at now (worker.engine.take_result)."""
    take_result(State(*state), s, now)


@njit(cache=True, nogil=True, boundscheck=False)
def fast_kernel(state, now, tx_ptr, tx_len, tx_addr, n_tx):
    """After a burst of results: worker.retransmit.fast_retransmit. Returns the new tx count."""
    return fast_retransmit(State(*state), now, tx_ptr, tx_len, tx_addr, n_tx)


class HostStreamEngine:
    """One worker's side of a host-codec job's allreduces: StreamEngine's API (start, receive, handle_timer,
    get_timer, done, progress, result) for ``codec``. Construct once per job."""

    def __init__(self, *, job: int, rank: int, world_size: int, codec: HostCodec, packet_elements: int,
                 pool_size: int, seed: int, agg_addrs: list[int], rto: float = WorkerTimers.rto,
                 min_rto: float = WorkerTimers.min_rto, max_rto: float = WorkerTimers.max_rto,
                 data_mac_keys: np.ndarray | None = None) -> None:
        """Arguments as StreamEngine's; ``codec``: the job's host codec (protocol.codecs.host)."""
        self.codec = codec
        self.package_bytes = 0  # of every DATA package built (first transmissions): what the codec put on the wire
        self.result_bytes = 0  # of every RESULT package taken: what came back (topk's dense sum, signsgd's 1 bit)
        self.job, self.rank, self.world_size, self.seed = job, rank, world_size, seed
        self.packet_elements, self.pool_size = packet_elements, pool_size
        self.mac_keys = np.zeros((0, 2), np.uint64) if data_mac_keys is None else np.ascontiguousarray(
            data_mac_keys, np.uint64)
        self.agg_addr = np.array(agg_addrs, np.uint64)
        self.params = np.zeros(PARAMS, np.int64)
        self.params[P_CORES] = len(agg_addrs)
        self.timing = timing_state(rto, min_rto, max_rto)
        self.silence = silence_state(len(agg_addrs))
        self.parity = np.zeros(pool_size, np.int64)  # persists over the job's life
        self.cur_chunk = np.full(pool_size, IDLE, np.int64)
        # two datagram buffers per slot, by parity, as StreamEngine's, for the longest package
        self.packet = np.zeros((pool_size, 2, HDR + host_package_limit(packet_elements) + TAG_SIZE), np.uint8)
        self.packet_len = np.zeros(pool_size, np.int64)
        self.tx = Burst(self.packet, pool_size)
        self.stats = np.zeros(len(STAT_NAMES), np.int64)
        self.allreduce_seq = -1
        self.done_chunks = 0
        self._x = np.empty(0, np.float32)
        self._out = np.empty(0, np.float32)
        self._sent: np.ndarray | None = None
        self._mean = False
        f32, i64, u8, u16 = (np.empty(0, t) for t in (np.float32, np.int64, np.uint8, np.uint16))
        # worker.state's State, the arrays worker.retransmit reads (the others empty, typed as StreamEngine's)
        self._args = tuple(State(
            params=self.params, x=f32, out=f32, local_exp=i64, agreed_exp=i64, cur_chunk=self.cur_chunk,
            parity=self.parity, sent_at=np.zeros(pool_size), rto=np.zeros(pool_size),
            retries=np.zeros(pool_size, np.int64), overtaken=np.zeros(pool_size, np.int64), packet=self.packet,
            packet_len=self.packet_len, agg_addr=self.agg_addr, stats=self.stats, timing=self.timing,
            low=np.empty(0, np.uint32), sent=f32, mac_keys=self.mac_keys, codes=u8, parked=i64,
            silence=self.silence, x16=u16, out16=u16, scratch=f32))

    def resume(self, allreduce: int, shadow_sets: np.ndarray) -> None:
        """As StreamEngine.resume: the next ``start`` is allreduce ``allreduce``, slot s uses ``shadow_sets[s]``."""
        self.allreduce_seq = allreduce - 1
        self.parity[:] = shadow_sets

    @property
    def max_datagram(self) -> int:
        return self.packet.shape[2]

    def start(self, x: np.ndarray, now: float, out: np.ndarray | None = None, *, sent: np.ndarray | None = None,
              scatter: bool = False, dtype: str | None = None, mean: bool = False) -> Burst:
        """Begin the next allreduce of float32 ``x`` (any shape); returns its first datagrams (one per slot).
        ``out``, ``sent``, ``mean``: as StreamEngine.start's (``sent``: the values of this rank's packages, decoded
        by the codec: error feedback's compressed gradient)."""
        if scatter or dtype not in (None, "float32") or np.asarray(x).dtype == np.float16:
            raise ValueError(f"host codec {self.codec.name} runs float32 allreduces only (no reduce-scatter, no "
                             f"16-bit input)")
        self._x = np.ascontiguousarray(x, dtype=np.float32).reshape(-1)
        size = self._x.size
        for name, arr in (("out", out), ("sent", sent)):
            if arr is not None and (arr.dtype != np.float32 or arr.size != size or not arr.flags.c_contiguous):
                raise ValueError(f"{name} must be a C-contiguous float32 array of {size} elements, got {arr.dtype} "
                                 f"of {arr.size} elements")
        self._out = np.empty(size, np.float32) if out is None else out.reshape(-1)
        self._sent = None if sent is None else sent.reshape(-1)
        self._mean = mean
        chunks = -(-size // self.packet_elements)
        window = min(self.pool_size, chunks)
        self.allreduce_seq += 1
        self.params[[P_WINDOW, P_CHUNKS]] = window, chunks
        self.done_chunks = 0
        self._key = int(derive_key(np.uint64(self.seed), worker_stream(self.allreduce_seq, self.rank)))
        self.cur_chunk[:] = IDLE
        restart_kernel(self.silence, now)
        n = 0
        for s in range(window):
            n = self._send(s, s, now, n)
        return self._burst(n)

    def _send(self, s: int, c: int, now: float, n_tx: int) -> int:
        """Build chunk c's DATA datagram in slot s's buffer and queue it; returns the new tx count."""
        lo = c * self.packet_elements
        values = self._x[lo:lo + self.packet_elements]
        package = self.codec.encode(values, self._key, lo)
        self.package_bytes += len(package)
        if self._sent is not None:
            self._sent[lo:lo + values.size] = self.codec.decode(package, values.size)
        tag = TAG_SIZE if self.mac_keys.shape[0] else 0
        if len(package) > host_package_limit(self.packet_elements):
            raise ValueError(f"a {self.codec.name} package of {values.size} elements is {len(package)} bytes, more "
                             f"than the {host_package_limit(self.packet_elements)} an aggregator receives for "
                             f"{self.packet_elements} packet elements (protocol.job.host_package_limit)")
        p = self.packet[s, self.parity[s]]
        header_kernel(p, self.job, self.allreduce_seq, c, self.rank, s, values.size, self.codec.wire_id,
                      int(self.parity[s]))
        p[HDR:HDR + len(package)] = np.frombuffer(package, np.uint8)
        length = HDR + len(package)
        if tag:
            k = self.mac_keys[s % len(self.agg_addr)]
            length = put_tag(p, length, k[0], k[1])
        self.packet_len[s] = length
        self.cur_chunk[s] = c
        tx = self.tx
        return send_kernel(self._args, s, now, tx.ptr, tx.length, tx.addr, n_tx)

    def _burst(self, n: int) -> Burst:
        self.tx.count = n
        return self.tx

    def receive(self, rx: Burst, now: float) -> Burst:
        """Accept the ``rx.count`` received datagrams of ``rx``; returns the datagrams to send (next chunks and
        fast retransmissions), valid until the next call. Results that are foreign, stale, forged or malformed
        (a package the codec cannot decode) are counted and dropped, as StreamEngine's are."""
        taken = np.zeros(self.pool_size, np.bool_)
        n_tx = 0
        for i in range(rx.count):
            self.stats[PACKETS_IN] += 1
            slot, drop = self._take(rx.data[i], int(rx.length[i]), int(rx.addr[i]), taken)
            if drop >= 0:
                self.stats[drop] += 1
                continue
            taken[slot] = True
            take_kernel(self._args, slot, now)
            c = int(self.cur_chunk[slot]) + int(self.params[P_WINDOW])
            if c < self.params[P_CHUNKS]:
                n_tx = self._send(slot, c, now, n_tx)
            else:
                self.cur_chunk[slot] = IDLE
        tx = self.tx
        return self._burst(fast_kernel(self._args, now, tx.ptr, tx.length, tx.addr, n_tx))

    def _take(self, p: np.ndarray, length: int, addr: int, taken: np.ndarray) -> tuple[int, int]:
        """(slot, -1) once the result in ``p[:length]`` from ``addr`` is decoded into the output, else (slot, the
        statistic of why it is dropped)."""
        if length < HDR:
            return -1, DROP_MALFORMED
        h = np.frombuffer(p[:HDR].tobytes(), HEADER, count=1)[0]
        s = int(h["slot"])
        if h["magic"] != MAGIC or h["version"] != VERSION or h["type"] != MsgType.RESULT:
            return s, DROP_MALFORMED
        if int(h["job"]) != self.job or s >= self.pool_size or addr != self.agg_addr[s % len(self.agg_addr)]:
            return s, DROP_FOREIGN
        c = int(h["chunk"])
        if (int(h["allreduce"]) != self.allreduce_seq or s >= self.params[P_WINDOW] or c != self.cur_chunk[s]
                or int(h["shadow"]) != self.parity[s]):
            return s, DROP_STALE
        if taken[s]:  # its next chunk, queued by this call, has not been sent: a forged result
            return s, DROP_UNSENT
        if self.mac_keys.shape[0]:
            k = self.mac_keys[s % len(self.agg_addr)]
            if not tag_ok(p, length, k[0], k[1]):
                return s, DROP_BAD_MAC
            length -= TAG_SIZE
        lo = c * self.packet_elements
        count = min(self.packet_elements, self._x.size - lo)
        if (int(h["codec"]) != self.codec.wire_id or int(h["count"]) != count or int(h["rank"]) != 0
                or int(h["exp"]) != NO_EXP or int(h["next_exp"]) != NO_EXP):
            return s, DROP_MALFORMED
        try:
            values = self.codec.decode_result(p[HDR:length].tobytes(), count)
        except MalformedPackage:
            return s, DROP_MALFORMED
        if values.shape != (count,):
            return s, DROP_MALFORMED
        self.result_bytes += length - HDR
        out = self._out[lo:lo + count]
        out[:] = values
        if self._mean:
            out /= np.float32(self.world_size)
        self.done_chunks += 1
        return s, -1

    def handle_timer(self, now: float) -> Burst:
        """Retransmit as worker.retransmit's timer says; returns the datagrams to send."""
        tx = self.tx
        return self._burst(timer_kernel(self._args, now, tx.ptr, tx.length, tx.addr))

    def get_timer(self) -> float | None:
        """When handle_timer is next due; None with nothing in flight."""
        t = float(next_deadline(self._args))
        return None if t == np.inf else t

    @property
    def done(self) -> bool:
        return bool((self.cur_chunk == IDLE).all())

    @property
    def progress(self) -> tuple[int, int]:
        """(chunks whose result arrived, chunks) of the current allreduce."""
        return self.done_chunks, int(self.params[P_CHUNKS])

    @property
    def result(self) -> np.ndarray:
        """The current allreduce's output (flat)."""
        return self._out

    def pending_slots(self) -> list[int]:
        return np.flatnonzero(self.cur_chunk != IDLE).tolist()

    def counters(self) -> dict[str, int]:
        """StreamEngine's counters, ``package_bytes``: the codec's bytes sent, and ``result_bytes``: the result
        packages' bytes received; headers, MAC tags and resends apart."""
        return dict(zip(STAT_NAMES, self.stats.tolist())) | {"package_bytes": self.package_bytes,
                                                             "result_bytes": self.result_bytes}

    @property
    def rto(self) -> float:
        """The current adaptive retransmission timeout, seconds."""
        return float(self.timing[T_RTO])
