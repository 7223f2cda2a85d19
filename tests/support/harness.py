"""In-process test harness: one or more AggregatorCores and n StreamEngines exchanging datagrams without sockets.

Everything runs on a virtual clock that advances by ``dt`` per ``step``. Each step

1. delivers the datagrams the workers sent (through the uplink's faults) to the aggregator core they are
   addressed to, and queues the core's replies on the downlink;
2. delivers the downlink datagrams (through its faults) to the workers, and queues the engines' next packets;
3. fires the engines' retransmission timers.

Faults are seeded (``random.Random``), per direction: each datagram is dropped with probability ``drop``, else
duplicated with probability ``duplicate``, and each copy is held back for 1-3 steps with probability ``reorder``
(delivered batches are also shuffled when ``reorder`` > 0). Addresses are burstio address keys
(``ipv4 << 16 | port``): aggregator core i listens on 127.0.0.1:(AGG_PORT + i), rank r on 127.0.0.2:(5000 + r).

The low-level helpers (``core_receive``, ``engine_receive``, ...) move Python ``bytes`` in and out of the
numpy burst arrays, so tests can also craft and inject single datagrams.
"""

from __future__ import annotations

import random
from collections import defaultdict
from collections.abc import Iterable, Sequence

import numpy as np

from intml.aggregator.congestion import mark_results
from intml.aggregator.core import AggregatorCore
from intml.protocol import keys, reference, wire
from intml.protocol.burst import Burst
from intml.protocol.codec import Codec
from intml.protocol.codecs import host as host_codecs
from intml.protocol.job import CODEC_NAMES, JobParams, host_aggregator_elements
from intml.protocol.packet import HDR
from intml.protocol.wire import MsgType
from intml.worker.engine import StreamEngine
from intml.worker.host import HostStreamEngine
from intml.worker.session import STATS_REQUEST_SIZE, JobJoined, WorkerSession
from intml.worker.state import HELD, IDLE, PARKED

AGG_PORT = 48879
ENDPOINT_PORTS = 100  # ports between the aggregators of a Network with several
WORKER_PORT = 5000
AGG_IP = 0x7F000001  # 127.0.0.1
WORKER_IP = 0x7F000002  # 127.0.0.2

Datagram = tuple[bytes, int]  # (payload, address key: source on receive, destination on send)


def addr_key(ip: int, port: int) -> int:
    return (ip << 16) | port


def agg_addr(core: int = 0) -> int:
    return addr_key(AGG_IP, AGG_PORT + core)


def worker_addr(rank: int, base: int = WORKER_PORT) -> int:
    return addr_key(WORKER_IP, base + rank)


def core_receive(core: AggregatorCore, datagrams: Sequence[Datagram], now: float,
                 lengths: Sequence[int] | None = None) -> list[Datagram]:
    """Feed datagrams (payload, source) to core.receive; returns every datagram it sends (payload, dest): the
    results, then the control replies. ``lengths`` overrides the received lengths (e.g. -1: truncated)."""
    rx = Burst.rows_of(len(datagrams), max([HDR] + [len(d) for d, _ in datagrams]))
    rx.fill(datagrams)
    if lengths is not None:
        rx.length[: len(lengths)] = lengths
    return core.receive(rx, now).datagrams() + core.take_replies()


def marking(congested: bool):
    """core_receive with every result the core sends marked congested (or cleared) by aggregator.congestion, as a
    driver whose socket queue is deep (or not) marks them: ``monkeypatch.setattr(harness, "core_receive", ...)``."""

    def receive(core: AggregatorCore, datagrams: Sequence[Datagram], now: float,
                lengths: Sequence[int] | None = None) -> list[Datagram]:
        rx = Burst.rows_of(len(datagrams), max([HDR] + [len(d) for d, _ in datagrams]))
        rx.fill(datagrams)
        tx = core.receive(rx, now)
        mark_results(tx, congested)
        return tx.datagrams() + core.take_replies()
    return receive


def check_window(cur_chunk: np.ndarray, parked: np.ndarray, window: int) -> None:
    """An engine's slots obey its send window (worker.window): at most the window in flight, or one more: the
    lowest chunk held, lower than every chunk in flight; a chunk is held only while the window is full, and never
    below every chunk in flight."""
    flying = [int(c) if c != PARKED else int(parked[s]) for s, c in enumerate(cur_chunk) if c not in (IDLE, HELD)]
    held = [int(parked[s]) for s, c in enumerate(cur_chunk) if c == HELD]
    assert len(flying) <= window + 1
    if held:
        assert len(flying) >= window and min(held) > min(flying)


def engine_start(engine: StreamEngine, x: np.ndarray, now: float, out: np.ndarray | None = None, *,
                 scatter: bool = False, **options) -> list[Datagram]:
    """engine.start's datagrams (options: its dtype and mean)."""
    return engine.start(x, now, out, scatter=scatter, **options).datagrams()


def engine_receive(engine: StreamEngine, datagrams: Sequence[Datagram], now: float) -> list[Datagram]:
    """Feed datagrams (payload, source) to engine.receive; returns what it sends (payload, dest)."""
    rx = Burst.rows_of(len(datagrams), max([engine.max_datagram, HDR] + [len(d) for d, _ in datagrams]))
    rx.fill(datagrams)
    return engine.receive(rx, now).datagrams()


def engine_timer(engine: StreamEngine, now: float) -> list[Datagram]:
    return engine.handle_timer(now).datagrams()


TOKEN = "harness-token"  # the token of the harness's cores and Networks
NONCE = bytes(range(1, 17))  # the harness's client nonce (a Worker draws a fresh one per JOIN)


def new_core(**options) -> AggregatorCore:
    """An AggregatorCore that knows the harness's TOKEN (options as AggregatorCore's)."""
    return AggregatorCore(tokens=[TOKEN], **options)


def join_datagram(job: int, rank: int, *, nonce: bytes = NONCE, cookie: bytes = bytes(16), token: str | None = None,
                  **params) -> bytes:
    """A JOIN with these fields; with ``token``, proved (its MAC under the token key)."""
    datagram = wire.pack_join({"type": int(MsgType.JOIN), "job": job, "rank": rank},
                              {"cores": 0, "nonce": nonce, "cookie": cookie, **params})
    return datagram if token is None else keys.seal(keys.token_key(token), datagram, wire.JOIN_MAC)


def cookie_of(challenge: bytes) -> bytes:
    return bytes(wire.unpack_challenge(challenge)[1]["cookie"])


def handshake(core: AggregatorCore, src: int, now: float, job: int, rank: int, *, token: str,
              nonce: bytes = NONCE, **params) -> list[Datagram]:
    """The JOIN handshake with a core (JOIN, its CHALLENGE, the JOIN proved with ``token``); returns the core's
    replies to the proved JOIN."""
    [(challenge, _)] = core_receive(core, [(join_datagram(job, rank, nonce=nonce, **params), src)], now)
    assert msg_type(challenge) == MsgType.CHALLENGE, challenge
    proved = join_datagram(job, rank, nonce=nonce, cookie=cookie_of(challenge), token=token, **params)
    return core_receive(core, [(proved, src)], now)


def msg_type(datagram: bytes) -> int:
    return datagram[wire.OFFSETS["type"]]


def header(datagram: bytes) -> np.void:
    return np.frombuffer(datagram, wire.HEADER, count=1)[0]


stored = wire.marked_stored  # a result as a re-send carries it


class Link:
    """One direction of the network: seeded drop, duplication and reordering of datagrams."""

    def __init__(self, *, drop: float = 0.0, duplicate: float = 0.0, reorder: float = 0.0, seed: int = 0) -> None:
        self.drop, self.duplicate, self.reorder = drop, duplicate, reorder
        self.random = random.Random(seed)
        self.tick = 0
        self.held: list[tuple[int, object]] = []
        self.counts = {"dropped": 0, "duplicated": 0, "reordered": 0}

    def carry(self, items: Iterable) -> list:
        """The items delivered this step: survivors of ``items`` plus held-back items now due."""
        self.tick += 1
        out = []
        for item in items:
            if self.drop and self.random.random() < self.drop:
                self.counts["dropped"] += 1
                continue
            copies = 1
            if self.duplicate and self.random.random() < self.duplicate:
                copies = 2
                self.counts["duplicated"] += 1
            for _ in range(copies):
                if self.reorder and self.random.random() < self.reorder:
                    self.held.append((self.tick + self.random.randint(1, 3), item))
                    self.counts["reordered"] += 1
                else:
                    out.append(item)
        due = [item for t, item in self.held if t <= self.tick]
        self.held = [(t, item) for t, item in self.held if t > self.tick]
        out += due
        if self.reorder:
            self.random.shuffle(out)
        return out

    @property
    def busy(self) -> bool:
        return bool(self.held)


class Network:
    """``cores`` AggregatorCores (one job's data plane split by slot) and ``n`` StreamEngines of one job."""

    def __init__(self, n: int, *, codec: Codec | str = Codec.CNAT8, packet_elements: int = 64, pool_size: int = 4,
                 seed: int = 123, job: int = 7, token: str = TOKEN, cores: int = 1, rows: int = 256,
                 max_elements: int | None = None, idle_timeout: float = 30.0, rto: float = 0.02,
                 min_rto: float = 0.005, max_rto: float = 1.0, dt: float = 0.001, drop: float = 0.0, duplicate: float = 0.0,
                 reorder: float = 0.0, fault_seed: int = 0, record: bool = False, join: bool = True,
                 aggregators: list[AggregatorCore] | None = None, worker_port: int = WORKER_PORT,
                 data_mac_key: tuple[int, int] | None = None, endpoints: Sequence[int] | None = None,
                 nearest: bool = False) -> None:
        """``data_mac_key``: the DATA/RESULT MAC under this fixed key (k0, k1) on every core and engine, put in the
        cores' job tables once joined (in place of the key the handshake derives), so tests can forge and check tags.
        ``endpoints``: the job's slots spread over several aggregators, with these many cores each (in place of
        ``cores``); aggregator e's core i listens on agg_addr(ENDPOINT_PORTS * e + i). ``nearest``: the job's
        deterministic C_nat rounding (JOIN flag)."""
        self.nearest = nearest
        self.data_mac_key = data_mac_key
        self.n = n
        # a host codec by its name (protocol.codecs.host): the aggregator's host mode, HostStreamEngines
        self.host_codec = host_codecs.parse(codec) if isinstance(codec, str) and codec not in CODEC_NAMES else None
        self.codec = (self.host_codec.wire_id if self.host_codec else Codec.CNAT8 if codec == "cnat8"
                      else Codec.INT32 if codec == "int32" else Codec(codec))
        self.codec_param = self.host_codec.wire_param() if self.host_codec else 0
        # the cores' --max-packet-elements, unless given: what the job's packets need
        self.max_elements = host_aggregator_elements(packet_elements) if self.host_codec else packet_elements
        self.packet_elements, self.pool_size = packet_elements, pool_size
        self.seed, self.job, self.token = seed, job, token
        self.now = 0.0
        self.dt = dt
        self.worker_port = worker_port
        endpoints = [len(aggregators) if aggregators else cores] if endpoints is None else list(endpoints)
        self.endpoints = [agg_addr(ENDPOINT_PORTS * e) for e in range(len(endpoints))]  # each one's core 0
        self.core_addrs = [base + i for base, k in zip(self.endpoints, endpoints) for i in range(k)]
        if aggregators is None:
            aggregators = [AggregatorCore(core=i, cores=k, rows=rows, idle_timeout=idle_timeout,
                                          max_elements=max_elements or self.max_elements, tokens=[token])
                           for k in endpoints for i in range(k)]
        cores = len(aggregators)
        self.cores = aggregators
        self.core_of = {addr: i for i, addr in enumerate(self.core_addrs)}
        self.rank_of = {self.addr(r): r for r in range(n)}
        engine = dict(job=job, world_size=n, packet_elements=packet_elements, pool_size=pool_size, seed=seed,
                      agg_addrs=self.core_addrs, rto=rto, min_rto=min_rto, max_rto=max_rto,
                      data_mac_keys=None if data_mac_key is None else np.array([data_mac_key] * cores, np.uint64))
        self.engines = [
            HostStreamEngine(rank=r, codec=self.host_codec, **engine) if self.host_codec
            else StreamEngine(rank=r, codec=self.codec, nearest=nearest, **engine)
            for r in range(n)
        ]
        self.uplink = Link(drop=drop, duplicate=duplicate, reorder=reorder, seed=2 * fault_seed + 1)
        self.downlink = Link(drop=drop, duplicate=duplicate, reorder=reorder, seed=2 * fault_seed + 2)
        self.up: list[tuple[bytes, int, int]] = []  # (payload, source, destination) in flight to the aggregator
        self.down: list[tuple[bytes, int, int]] = []  # (payload, source, destination) in flight to workers
        self.stray: list[tuple[bytes, int, int]] = []  # aggregator output to addresses that are no worker
        self.group = 0  # address key of the job's results multicast group, if the aggregator uses one
        self.record = record
        self.sent_up: list[tuple[bytes, int, int]] = []  # everything the engines sent (if record)
        self.sent_down: list[tuple[bytes, int, int]] = []  # everything the cores sent (if record)
        self.steps = 0
        self.sessions: dict[int, WorkerSession] = {}  # rank -> its joined control plane (join_all)
        if join:
            self.join_all()

    def addr(self, rank: int) -> int:
        """The address key rank ``rank`` of this network sends from."""
        return worker_addr(rank, self.worker_port)

    # ---- control plane --------------------------------------------------------------------------------------
    def join_params(self, **overrides) -> dict:
        return {"world_size": self.n, "packet_elements": self.packet_elements, "pool_size": self.pool_size,
                "codec": int(self.codec), "codec_param": self.codec_param, "seed": self.seed, **overrides}

    def join(self, rank: int, *, core: int = 0, src: int | None = None, job: int | None = None,
             token: str | None = None, nonce: bytes = NONCE, **overrides) -> list[Datagram]:
        """The JOIN handshake of rank ``rank`` (this network's parameters and token, with overrides) with a core
        through core.receive; returns the replies to the proved JOIN."""
        return handshake(self.cores[core], self.addr(rank) if src is None else src, self.now,
                         self.job if job is None else job, rank, token=self.token if token is None else token,
                         nonce=nonce, **self.join_params(**overrides))

    def session(self, rank: int) -> WorkerSession:
        """The control plane of rank ``rank`` with this network's parameters, as a Worker builds it."""
        params = JobParams(world_size=self.n, packet_elements=self.packet_elements, pool_size=self.pool_size,
                           codec=self.codec, codec_param=self.codec_param, seed=self.seed, nearest=self.nearest)
        return WorkerSession(job=self.job, rank=rank, params=params, token=self.token, aggregator=self.endpoints)

    def join_all(self) -> list[Datagram]:
        """Join every rank through its WorkerSession, on every core; asserts each JOIN got exactly one reply (a
        CHALLENGE, then a JOIN_ACK) and returns the JOIN_ACKs (rank by rank, core by core)."""
        replies = []
        for rank in range(self.n):
            session = self.sessions[rank] = self.session(rank)
            session.connect(self.now)
            while not session.joined:
                requests = session.datagrams_to_send(self.now)
                assert requests, f"rank {rank}: the session sent no JOIN but has not joined: {session.next_event()}"
                for data, dst in requests:
                    got = self.to_core(self.core_of[dst], [(data, self.addr(rank))])
                    assert len(got) == 1 and msg_type(got[0][0]) in (MsgType.CHALLENGE, MsgType.JOIN_ACK), got
                    session.receive(got[0][0], dst, self.now)
                    replies += [g for g in got if msg_type(g[0]) == MsgType.JOIN_ACK]
            events = iter(session.next_event, None)
            [joined] = [e for e in events if isinstance(e, JobJoined)]
            assert len(joined.groups) <= 1, f"the harness routes one results group per job, got {joined.groups}"
            if joined.groups:  # the job's results are multicast: every rank listens to the group
                self.group = joined.groups[0]
        if self.data_mac_key is not None:
            for core in self.cores:
                j = core.info[self.job].index
                if self.host_codec:
                    core.datapath.host.jobs[self.job].mac_key = tuple(np.uint64(k) for k in self.data_mac_key)
                else:
                    core.datapath.jobs.data_mac[j], core.datapath.jobs.mac_key[j] = True, self.data_mac_key
        return replies

    def leave(self, rank: int, core: int = 0) -> bytes:
        """Rank ``rank``'s LEAVE to a core, MAC'd under its session key (join_all)."""
        return self.sessions[rank].sealed(MsgType.LEAVE, self.core_addrs[core])

    def stats_request(self, rank: int, core: int = 0, size: int = STATS_REQUEST_SIZE) -> bytes:
        """Rank ``rank``'s STATS_REQUEST of ``size`` bytes to a core, MAC'd under its session key (join_all)."""
        return self.sessions[rank].sealed(MsgType.STATS_REQUEST, self.core_addrs[core], size - HDR - keys.MAC_SIZE)

    def to_core(self, core: int, datagrams: Sequence[Datagram], lengths: Sequence[int] | None = None) -> list[Datagram]:
        """Deliver datagrams straight to a core at the current time; returns its output (not routed)."""
        return core_receive(self.cores[core], datagrams, self.now, lengths)

    # ---- data plane -----------------------------------------------------------------------------------------
    def start(self, xs: Sequence[np.ndarray], outs: Sequence[np.ndarray | None] | None = None, *,
              scatter: bool = False, **options) -> None:
        """Begin the next allreduce (``scatter``: reduce-scatter) on every engine (xs[r] is rank r's input, outs[r]
        its result buffer; options: StreamEngine.start's dtype and mean)."""
        assert len(xs) == self.n
        for r, (engine, x) in enumerate(zip(self.engines, xs)):
            self._from_worker(r, engine_start(engine, x, self.now, None if outs is None else outs[r], scatter=scatter,
                                              **options))

    def _from_worker(self, rank: int, datagrams: list[Datagram]) -> None:
        for data, dst in datagrams:
            item = (data, self.addr(rank), dst)
            self.up.append(item)
            if self.record:
                self.sent_up.append(item)

    def step(self) -> None:
        """Advance the clock by dt and move every datagram one hop (see the module docstring)."""
        Network.step_together([self])

    @staticmethod
    def step_together(nets: Sequence[Network], shuffle_seed: int | None = None) -> None:
        """One step of several Networks (jobs) sharing the same aggregator cores and clock: their uplink
        datagrams reach each core in one burst, interleaved (shuffled if ``shuffle_seed`` is given)."""
        cores = nets[0].cores
        assert all(len(net.cores) == len(cores) and all(a is b for a, b in zip(net.cores, cores)) for net in nets), \
            "step_together needs Networks built on the same aggregator cores"
        for net in nets:
            net.steps += 1
            net.now += net.dt
        now = nets[0].now
        assert all(net.now == now for net in nets), "step_together needs Networks on the same clock"
        by_core: dict[int, list[Datagram]] = defaultdict(list)
        for net in nets:
            for data, src, dst in net.uplink.carry(net.up):
                by_core[net.core_of[dst]].append((data, src))
            net.up = []
        owner = {addr: net for net in nets for addr in net.rank_of}
        groups = {net.group: net for net in nets if net.group}
        addrs = nets[0].core_addrs
        for core, datagrams in sorted(by_core.items()):
            if shuffle_seed is not None:
                random.Random(shuffle_seed + core + 1000 * nets[0].steps).shuffle(datagrams)
            for data, dst in core_receive(cores[core], datagrams, now):
                item = (data, addrs[core], dst)
                net = owner.get(dst) or groups.get(dst)
                if net is None:
                    nets[0].stray.append(item)
                    continue
                if net.record:
                    net.sent_down.append(item)
                if dst == net.group:  # multicast: a copy for each rank, each lost or delayed on its own
                    net.down += [(data, addrs[core], net.addr(r)) for r in range(net.n)]
                else:
                    net.down.append(item)
        for net in nets:
            net._to_workers()

    def _to_workers(self) -> None:
        by_rank: dict[int, list[Datagram]] = defaultdict(list)
        for data, src, dst in self.downlink.carry(self.down):
            by_rank[self.rank_of[dst]].append((data, src))
        self.down = []
        for rank, datagrams in sorted(by_rank.items()):
            self._from_worker(rank, engine_receive(self.engines[rank], datagrams, self.now))
        for rank, engine in enumerate(self.engines):
            self._from_worker(rank, engine_timer(engine, self.now))

    @property
    def done(self) -> bool:
        return all(e.done for e in self.engines)

    def run(self, max_steps: int = 50_000) -> None:
        """Step until every engine has its result."""
        for _ in range(max_steps):
            if self.done:
                return
            self.step()
        raise AssertionError(f"allreduce did not finish in {max_steps} steps: "
                             f"{[e.progress for e in self.engines]}")

    @staticmethod
    def run_together(nets: Sequence[Network], shuffle_seed: int | None = None, max_steps: int = 50_000) -> None:
        """step_together until every engine of every network has its result."""
        for _ in range(max_steps):
            if all(net.done for net in nets):
                return
            Network.step_together(nets, shuffle_seed)
        raise AssertionError(f"allreduces did not finish in {max_steps} steps")

    def allreduce(self, xs: Sequence[np.ndarray], max_steps: int = 50_000) -> list[np.ndarray]:
        """One allreduce on every rank; returns copies of every rank's result."""
        self.start(xs)
        self.run(max_steps)
        return [e.result.copy() for e in self.engines]

    # ---- inspection -----------------------------------------------------------------------------------------
    def stats(self, core: int = 0) -> dict:
        return self.cores[core].stats(self.now)

    def job_counters(self, core: int = 0, job: int | None = None) -> dict[str, int]:
        return self.stats(core)["jobs"][str(self.job if job is None else job)]["counters"]

    def core_counters(self, core: int = 0) -> dict[str, int]:
        return self.stats(core)["core_counters"]

    def total_job_counters(self) -> dict[str, int]:
        totals: dict[str, int] = defaultdict(int)
        for i in range(len(self.cores)):
            for k, v in self.job_counters(i).items():
                totals[k] += v
        return dict(totals)


# ---- helpers for tests ---------------------------------------------------------------------------------------


def counter_diff(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    """The counters that changed, with their increments."""
    return {k: after[k] - before[k] for k in after if after[k] != before[k]}


def table_snapshot(core: AggregatorCore, job: int) -> dict[str, np.ndarray]:
    """Copies of the slot-table rows of ``job`` on ``core``."""
    rows = core.info[job].rows
    table = core.datapath.table
    return {name: getattr(table, name)[rows.start:rows.stop].copy() for name in table._fields}


def assert_table_equal(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> None:
    for name, value in a.items():
        assert np.array_equal(value, b[name]), f"slot table field {name!r} changed"


def with_header(datagram: bytes, **fields) -> bytes:
    """``datagram`` with some header fields replaced (the payload kept verbatim)."""
    record = np.frombuffer(datagram, wire.HEADER, count=1).copy()
    for name, value in fields.items():
        record[name] = value
    return record.tobytes() + datagram[HDR:]


def with_payload_byte(datagram: bytes, index: int, value: int) -> bytes:
    b = bytearray(datagram)
    b[HDR + index] = value
    return bytes(b)


def make_inputs(n: int, size: int, packet_elements: int, kind: str, seed: int) -> list[np.ndarray]:
    """float32 inputs of n ranks.

    normal: Gaussian at a random scale; zero_chunks: Gaussian with whole chunks zero on every rank (and others
    zero on rank 0 only); zeros: all zero; huge: log-uniform over 2**9 .. 2**128 (up to float32's largest, where
    a C_nat sum may overflow to Inf); tiny: magnitudes below 2**-50, denormals included; mixed: log-uniform over
    2**-60 .. 2**12 with zeros.
    """
    rng = np.random.default_rng(seed)
    chunks = -(-size // packet_elements)
    all_zero = rng.random(chunks) < 0.4
    xs = []
    for r in range(n):
        sign = np.where(rng.random(size) < 0.5, -1.0, 1.0)
        if kind == "normal":
            x = rng.standard_normal(size) * 10.0 ** rng.uniform(-2, 2)
        elif kind == "zero_chunks":
            x = rng.standard_normal(size)
            for c in np.flatnonzero(all_zero):
                x[c * packet_elements:(c + 1) * packet_elements] = 0
            if r == 0:
                x[1 * packet_elements:2 * packet_elements] = 0
        elif kind == "zeros":
            x = np.zeros(size)
        elif kind == "huge":
            x = sign * np.minimum(2.0 ** rng.uniform(9, 128, size), float(np.finfo(np.float32).max))
        elif kind == "tiny":
            x = sign * 2.0 ** rng.uniform(-149, -50.5, size)
        elif kind == "mixed":
            x = sign * 2.0 ** rng.uniform(-60, 12, size) * (rng.random(size) < 0.9)
        else:
            raise ValueError(kind)
        xs.append(x.astype(np.float32))
    return xs


def reference_saturation(xs: Sequence[np.ndarray], *, seed: int, allreduce_seq: int,
                         packet_elements: int) -> tuple[list[int], int]:
    """(saturated elements of each rank's encode, always 0, and elements of the switch's re-encode beyond float32)
    of a C_nat allreduce, from the oracle, chunk by chunk as protocol.reference.allreduce does."""
    n = len(xs)
    worker, switch = [0] * n, 0
    size = xs[0].size
    for lo in range(0, size, packet_elements):
        parts = [x.reshape(-1)[lo:lo + packet_elements] for x in xs]
        _, encoded = reference.worker_codes(parts, seed=seed, allreduce_seq=allreduce_seq, offset=lo)
        for rank, (_, sat) in enumerate(encoded):
            worker[rank] += sat
        switch += reference.cnat8_chunk_codes(parts, seed=seed, allreduce_seq=allreduce_seq, offset=lo)[2]
    return worker, switch
