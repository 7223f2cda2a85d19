"""The worker's streaming engine for a host-codec job (docs/protocol.md, "Host mode"), behind StreamEngine's API:
``Worker(codec="uniform8")`` runs it. Sans-I/O like StreamEngine: the driver passes received datagrams and ``now``,
and sends the Burst it gets back, whose rows point at the engine's stored datagrams.

It streams as StreamEngine does (chunk c in slot c mod W', the next chunk of a slot once its result is back, the
shadow set flipped on each use, the stored datagram resent byte for byte by worker.retransmit's policy, the
DATA/RESULT MAC), with what a host codec changes: a chunk's payload is the codec's package, of any length, encoded
from the float32 values with this rank's random words in the allreduce (keyed as C_nat's: protocol.rng,
worker_stream), and the result package is decoded by the codec. No exponents are agreed (exp and next_exp are
NO_EXP), so a slot starts with its first chunk, not a bootstrap round. Per packet, a kernel checks a RESULT
(check_kernel) and one takes it and builds and queues the slot's next DATA (take_kernel); the codec's encode and
decode run between them, from Python. The send window is StreamEngine's (worker.window): a marked result cuts it,
and while it is below the pool a slot's next chunk is built and held, then sent after the burst when the window
admits it (release_kernel), lowest chunk first. Float32 allreduces only (no reduce-scatter, no 16-bit or precoded
inputs).
"""

from __future__ import annotations

import numpy as np
from numba import njit

from intml.protocol.arith import worker_stream
from intml.protocol.burst import Burst
from intml.protocol.codecs.host import HostCodec, MalformedPackage
from intml.protocol.job import WorkerTimers, host_package_limit
from intml.protocol.packet import (
    HDR,
    O_CHUNK,
    O_CODEC,
    O_COUNT,
    O_EXP,
    O_NEXT_EXP,
    O_RANK,
    O_SLOT,
    O_TYPE,
    get_i8,
    get_i32,
    get_u16,
    put_header,
)
from intml.protocol.rng import derive_key
from intml.protocol.siphash import put_tag
from intml.protocol.wire import NO_EXP, TAG_SIZE, MsgType
from intml.worker.engine import (
    authenticate,
    classify_result,
    goes_now,
    hold,
    result_marks,
    take_pending,
    take_stale,
    take_result,
    validate_header,
)
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
    DROP_MALFORMED,
    DROP_STALE,
    DROP_UNSENT,
    IDLE,
    PACKETS_IN,
    P_ALLREDUCE,
    P_CHUNKS,
    P_CODEC,
    P_CORES,
    P_ELEMENTS,
    P_JOB,
    P_PKT,
    P_RANK,
    P_WINDOW,
    P_WORLD,
    PARAMS,
    STAT_NAMES,
    State,
    queue_slot,
)
from intml.worker.window import W_CWND, admitted, window_state

NO_PACKAGE = np.frombuffer(b"", np.uint8)  # take_kernel's package of a slot falling idle (typed as encode's)


@njit(cache=True, nogil=True, boundscheck=False)
def restart_kernel(silence, now):
    """An allreduce starts (worker.retransmit.restart_silences)."""
    restart_silences(silence, now)


@njit(inline="always")
def _count(st, c):
    """The elements of chunk c."""
    pkt = st.params[P_PKT]
    return min(pkt, st.params[P_ELEMENTS] - c * pkt)


@njit(inline="always")
def _write_data(st, s, c, package):
    """Write chunk c's DATA datagram (header, ``package``, the MAC tag with data_mac) into slot s's buffer of its
    parity."""
    prm = st.params
    p = st.packet[s, st.parity[s]]
    put_header(p, MsgType.DATA, prm[P_JOB], prm[P_ALLREDUCE], c, prm[P_RANK], s, _count(st, c), prm[P_CODEC],
               st.parity[s], NO_EXP, NO_EXP)
    length = HDR + package.size
    p[HDR:length] = package
    if st.mac_keys.shape[0]:
        k = st.mac_keys[s % prm[P_CORES]]
        length = put_tag(p, length, k[0], k[1])
    st.packet_len[s] = length


@njit(inline="always")
def _send(st, s, c, now, tx_ptr, tx_len, tx_addr, n_tx):
    """Slot s's written datagram of chunk c goes at now: its timer armed, queued. Returns the new tx count."""
    st.cur_chunk[s] = c
    arm(st, s, now)
    queue_slot(st, s, tx_ptr, tx_len, tx_addr, n_tx)
    return n_tx + 1


@njit(cache=True, nogil=True, boundscheck=False)
def hold_kernel(state, s, c, package):
    """Slot s's first chunk of an allreduce, c, written with ``package`` and held until the send window admits it
    (release_kernel)."""
    st = State(*state)
    _write_data(st, s, c, package)
    hold(st, s, c)


@njit(cache=True, nogil=True, boundscheck=False)
def take_kernel(state, s, now, c, marks, package, tx_ptr, tx_len, tx_addr, n_tx):
    """Slot s's result, with ``marks`` (worker.engine.result_marks), was taken at now (worker.engine.take_result);
    its next chunk c, with ``package`` (empty if c is past the allreduce),
    goes now, or is written and held until the window admits it; or the slot falls idle (worker.engine.goes_now).
    Returns the new tx count."""
    st = State(*state)
    take_result(st, s, now, marks)
    go = goes_now(st, s, c)
    if st.cur_chunk[s] == IDLE:
        return n_tx
    _write_data(st, s, c, package)
    return _send(st, s, c, now, tx_ptr, tx_len, tx_addr, n_tx) if go else n_tx


@njit(cache=True, nogil=True, boundscheck=False)
def release_kernel(state, now, tx_ptr, tx_len, tx_addr, n_tx):
    """After a start or a burst of results: send the held slots' chunks the send window admits, lowest chunk first
    (worker.window.admitted, as StreamEngine's release), then worker.retransmit.fast_retransmit (after a start,
    nothing was overtaken). Returns the new tx count."""
    st = State(*state)
    while True:
        s = admitted(st.window, st.cur_chunk, st.parked, st.answered, st.params[P_WINDOW])
        if s < 0:
            return fast_retransmit(st, now, tx_ptr, tx_len, tx_addr, n_tx)
        n_tx = _send(st, s, st.parked[s], now, tx_ptr, tx_len, tx_addr, n_tx)


@njit(cache=True, nogil=True, boundscheck=False)
def check_kernel(state, p, length, addr, taken):
    """The checks of a RESULT datagram p[:length] from address key ``addr``, in StreamEngine's order:
    (slot, -1, chunk, count, the package's end, its marks) for one to decode into the output, else
    (slot, the statistic of why it is dropped, 0, 0, 0, 0). ``taken``: the slots whose result this burst already
    took."""
    if validate_header(p, length) >= 0:
        return (-1 if length < HDR else get_u16(p, O_SLOT)), DROP_MALFORMED, 0, 0, 0, 0
    st = State(*state)
    prm = st.params
    s = get_u16(p, O_SLOT)
    drop = classify_result(prm, st.parity, st.cur_chunk, st.agg_addr, p, addr)
    if drop >= 0:
        if drop == DROP_STALE:
            take_stale(st, p, length, result_marks(p))
        return s, drop, 0, 0, 0, 0
    if taken[s]:  # its next chunk, queued by this call, has not been sent: a forged result
        return s, DROP_UNSENT, 0, 0, 0, 0
    end = authenticate(prm, st.mac_keys, p, length)
    if end < 0:
        return s, DROP_BAD_MAC, 0, 0, 0, 0
    c = get_i32(p, O_CHUNK)
    count = _count(st, c)
    if (p[O_CODEC] != prm[P_CODEC] or get_u16(p, O_COUNT) != count or get_u16(p, O_RANK) != 0
            or get_i8(p, O_EXP) != NO_EXP or get_i8(p, O_NEXT_EXP) != NO_EXP):
        return s, DROP_MALFORMED, 0, 0, 0, 0
    return s, -1, c, count, end, result_marks(p)


@njit(cache=True, nogil=True, boundscheck=False)
def pending_kernel(state, p, length, addr, now):
    """A PENDING datagram p[:length] from address key ``addr``, as StreamEngine takes one (worker.engine.take_pending):
    -1 once its slot is answered, else the statistic of why it is dropped."""
    drop = validate_header(p, length)
    return drop if drop >= 0 else take_pending(State(*state), p, length, addr, now)


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
        self.params[[P_JOB, P_RANK, P_WORLD, P_CODEC, P_PKT, P_CORES]] = (job, rank, world_size, codec.wire_id,
                                                                           packet_elements, len(agg_addrs))
        self.package_limit = host_package_limit(packet_elements)
        self.timing = timing_state(rto, min_rto, max_rto)
        self.silence = silence_state(len(agg_addrs))
        self.parity = np.zeros(pool_size, np.int64)  # persists over the job's life
        self.cur_chunk = np.full(pool_size, IDLE, np.int64)
        self.parked = np.full(pool_size, IDLE, np.int64)  # the chunk a HELD slot waits to send
        self.window = window_state(pool_size)  # the send window, StreamEngine's (worker.window): over the job's life
        self.taken = np.zeros(pool_size, np.bool_)  # the slots whose result this receive burst took
        # two datagram buffers per slot, by parity, as StreamEngine's, for the longest package
        self.packet = np.zeros((pool_size, 2, HDR + self.package_limit + TAG_SIZE), np.uint8)
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
        # worker.state's State, the arrays worker.retransmit and worker.window read (the others empty, typed as
        # StreamEngine's)
        self._args = tuple(State(
            params=self.params, x=f32, out=f32, local_exp=i64, agreed_exp=i64, cur_chunk=self.cur_chunk,
            parity=self.parity, sent_at=np.zeros(pool_size), rto=np.zeros(pool_size),
            retries=np.zeros(pool_size, np.int64), overtaken=np.zeros(pool_size, np.int64), packet=self.packet,
            packet_len=self.packet_len, agg_addr=self.agg_addr, stats=self.stats, timing=self.timing,
            low=np.empty(0, np.uint32), sent=f32, mac_keys=self.mac_keys, codes=u8, parked=self.parked,
            silence=self.silence, x16=u16, out16=u16, scratch=f32, window=self.window,
            taken=self.taken, heads=np.empty(0, np.uint32), answered=np.full(pool_size, -np.inf),
            pendings=np.zeros(pool_size, np.int64)))

    def resume(self, allreduce: int, shadow_sets: np.ndarray) -> None:
        """As StreamEngine.resume: the next ``start`` is allreduce ``allreduce``, slot s uses ``shadow_sets[s]``."""
        self.allreduce_seq = allreduce - 1
        self.parity[:] = shadow_sets

    @property
    def max_datagram(self) -> int:
        return self.packet.shape[2]

    def start(self, x: np.ndarray, now: float, out: np.ndarray | None = None, *, sent: np.ndarray | None = None,
              scatter: bool = False, dtype: str | None = None, mean: bool = False) -> Burst:
        """Begin the next allreduce of float32 ``x`` (any shape); returns its first datagrams (one per slot the
        send window admits).
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
        self.params[[P_WINDOW, P_CHUNKS, P_ELEMENTS, P_ALLREDUCE]] = window, chunks, size, self.allreduce_seq
        self.done_chunks = 0
        self._key = int(derive_key(np.uint64(self.seed), worker_stream(self.allreduce_seq, self.rank)))
        self.cur_chunk[:] = IDLE
        restart_kernel(self.silence, now)
        for s in range(window):
            hold_kernel(self._args, s, s, self._package(s))
        tx = self.tx
        return self._burst(release_kernel(self._args, now, tx.ptr, tx.length, tx.addr, 0))

    def _package(self, c: int) -> np.ndarray:
        """Chunk c's DATA package, as bytes in a uint8 array."""
        lo = c * self.packet_elements
        values = self._x[lo:lo + self.packet_elements]
        package = self.codec.encode(values, self._key, lo)
        self.package_bytes += len(package)
        if self._sent is not None:
            self._sent[lo:lo + values.size] = self.codec.decode(package, values.size)
        if len(package) > self.package_limit:
            raise ValueError(f"a {self.codec.name} package of {values.size} elements is {len(package)} bytes, more "
                             f"than the {self.package_limit} an aggregator receives for {self.packet_elements} "
                             f"packet elements (protocol.job.host_package_limit)")
        return np.frombuffer(package, np.uint8)

    def _burst(self, n: int) -> Burst:
        self.tx.count = n
        return self.tx

    def receive(self, rx: Burst, now: float) -> Burst:
        """Accept the ``rx.count`` received datagrams of ``rx``; returns the datagrams to send (next chunks and
        fast retransmissions), valid until the next call. Results that are foreign, stale, forged or malformed
        (a package the codec cannot decode) are counted and dropped, as StreamEngine's are."""
        taken = self.taken
        taken[:] = False
        n_tx = 0
        tx = self.tx
        window, chunks = int(self.params[P_WINDOW]), int(self.params[P_CHUNKS])
        for i in range(rx.count):
            self.stats[PACKETS_IN] += 1
            if rx.data[i, O_TYPE] == MsgType.PENDING:  # its slot's round waits on peers (worker.retransmit)
                drop = pending_kernel(self._args, rx.data[i], rx.length[i], rx.addr[i], now)
                if drop >= 0:
                    self.stats[drop] += 1
                continue
            slot, drop, c, count, end, marks = check_kernel(self._args, rx.data[i], rx.length[i], rx.addr[i], taken)
            if drop < 0:
                drop = self._take(rx.data[i], c, count, end)
            if drop >= 0:
                self.stats[drop] += 1
                continue
            taken[slot] = True
            c += window
            n_tx = take_kernel(self._args, slot, now, c, marks, self._package(c) if c < chunks else NO_PACKAGE,
                               tx.ptr, tx.length, tx.addr, n_tx)
        return self._burst(release_kernel(self._args, now, tx.ptr, tx.length, tx.addr, n_tx))

    def _take(self, p: np.ndarray, c: int, count: int, end: int) -> int:
        """-1 once chunk c's result package ``p[HDR:end]`` (checked by check_kernel) is decoded into the output,
        else DROP_MALFORMED."""
        try:
            values = self.codec.decode_result(p[HDR:end].tobytes(), count)
        except MalformedPackage:
            return DROP_MALFORMED
        if values.shape != (count,):
            return DROP_MALFORMED
        self.result_bytes += end - HDR
        lo = c * self.packet_elements
        out = self._out[lo:lo + count]
        out[:] = values
        if self._mean:
            out /= np.float32(self.world_size)
        self.done_chunks += 1
        return -1

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

    @property
    def send_window(self) -> float:
        """The current send window, in slots (worker.window; the pool: no limit)."""
        return float(self.window[W_CWND])
