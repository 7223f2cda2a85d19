"""A simulated worker host: the real ``WorkerSession`` (the JOIN handshake) and ``StreamEngine`` (the data plane)
glued as ``worker.api`` glues them to a socket, but on virtual time, with a CPU whose cost model charges each
burst its datagrams and the elements it encodes and decodes."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from intml.protocol import codecs
from intml.protocol.burst import Burst
from intml.protocol.job import JobParams, WorkerTimers
from intml.protocol.packet import HDR, O_TYPE
from intml.protocol.wire import MsgType
from intml.sim.costs import HostCosts
from intml.sim.engine import Datagram, Simulator
from intml.sim.network import Copier, Link, Machine, Processor, Receiver, elements_of
from intml.worker.engine import StreamEngine
from intml.worker.session import CoreJoined, JobJoined, WorkerSession

TIMER = "timer"  # the marker a due retransmission timer puts in the CPU's queue
START = "start"  # the first element of an allreduce's (START, input, output) item in the CPU's queue
ENGINE_TYPES = (int(MsgType.RESULT), int(MsgType.PENDING))  # what the engine takes (plain ints: an enum's attribute
# costs a lookup per datagram); the rest is the session's
# A timer fires this long after its deadline: the engine resends when now - sent_at >= rto, and at exactly
# now = sent_at + rto the float subtraction can fall short by an ulp; a timer that found nothing due would then be
# re-armed at the same instant for ever. (A real clock always moves on.)
TIMER_SLACK = 1e-9


class WorkerHost:
    """Rank ``rank`` at address key ``addr``, sending on ``uplink``. ``on_joined(host)`` and ``on_done(host,
    now)`` tell the driver when the JOIN completed and when an allreduce's result is complete."""

    def __init__(self, sim: Simulator, *, rank: int, addr: int, job: int, params: JobParams, token: str,
                 aggregator: int, costs: HostCosts, timers: WorkerTimers, on_joined: Callable[[WorkerHost], None],
                 on_done: Callable[[WorkerHost, float], None], nonce_seed: int,
                 machine: Machine | None = None, receiver: Receiver | None = None) -> None:
        """``machine``: the rank's process shares that machine's CPUs (None: a CPU of its own). ``receiver``: the
        receive bursts' filler, one the job's ranks share (``Receiver(width, shared=True)``: a multicast burst is
        copied once for all of them); None: one of its own."""
        self.sim, self.rank, self.addr, self.params, self.costs, self.timers = sim, rank, addr, params, costs, timers
        rng = np.random.default_rng(nonce_seed)  # deterministic client nonces: same scenario, same bytes
        self.session = WorkerSession(job=job, rank=rank, params=params, token=token, aggregator=aggregator,
                                     random_bytes=lambda k: rng.bytes(k))
        self.job = job
        self.uplink: Link | None = None
        self.engine: StreamEngine | None = None
        self.on_joined, self.on_done = on_joined, on_done
        self.cpu = Processor(sim, self._work, machine=machine)
        self._rx = receiver
        self._copy = Copier()
        self._timer_at: float | None = None
        self.running = False
        self.width = codecs.BY_ID[params.codec].WIDTH
        self.groups: list[int] = []  # the job's results multicast groups, once joined

    # ---- driver -----------------------------------------------------------------------------------------
    def connect(self, now: float) -> None:
        self.session.connect(now)
        self._send_control(now)
        self._arm_timer(now)

    def start(self, x: np.ndarray, out: np.ndarray, now: float) -> None:
        """Begin the next allreduce (the CPU encodes the first window, then sends it)."""
        self.cpu.submit([(START, x, out)], now)

    def arrive(self, datagrams: Sequence[Datagram], now: float) -> None:
        self.cpu.submit(datagrams, now)

    # ---- the CPU ----------------------------------------------------------------------------------------
    def _work(self, items: list, now: float) -> tuple[float, Callable[[float], None]]:
        engine, c = self.engine, self.costs
        out: list[Datagram] = []
        addr, copy = self.addr, self._copy
        cost = 0.0
        # the results and PENDINGs are taken together, in order, after the other items (timers, a start, control
        # datagrams)
        results = [d for d in items if d is not TIMER and d[0] is not START and d[0][O_TYPE] in ENGINE_TYPES]
        if len(results) < len(items):
            for item in items:
                if item is TIMER:
                    if engine is not None and (t := engine.get_timer()) is not None and t <= now:
                        out += copy(engine.handle_timer(now), addr)
                elif item[0] is START:
                    self.running = True
                    out += copy(engine.start(item[1], now, item[2]), addr)
                elif item[0][O_TYPE] not in ENGINE_TYPES:
                    self.session.receive(item[0], item[1], now)
        if results and engine is not None:
            if self._rx is None:
                self._rx = Receiver(max(HDR, engine.max_datagram))
            cost += c.io * len(results) + c.decode * elements_of([d[0] for d in results], self.width)
            out += copy(engine.receive(self._rx.fill(results), now), addr)
        if out:
            cost += (c.io + c.forward) * len(out) + c.encode * elements_of([d[0] for d in out], self.width)
        joined = self._poll_session()

        def then(done: float) -> None:
            if out:
                self.uplink.send_many(out, done)
            self._send_control(done)
            if joined:
                self.on_joined(self)
            if self.running and engine is not None and engine.done:
                self.running = False
                self.on_done(self, done)
            self._arm_timer(done)
        return cost, then

    def _poll_session(self) -> bool:
        """Take the session's events; build the engine on JobJoined (as worker.api does). True if it joined."""
        joined = False
        while (event := self.session.next_event()) is not None:
            if isinstance(event, JobJoined):
                p, t = self.params, self.timers
                self.engine = StreamEngine(job=self.job, rank=self.rank, world_size=p.world_size, codec=p.codec,
                                           packet_elements=p.packet_elements, pool_size=p.pool_size, seed=p.seed,
                                           agg_addrs=event.addrs, rto=t.rto, min_rto=t.min_rto, max_rto=t.max_rto,
                                           nearest=p.nearest)
                self.engine.resume(event.allreduce, event.shadow_sets)
                self.groups = event.groups
                joined = True
            elif not isinstance(event, CoreJoined):  # a refusal or a timeout ends the run: say which
                raise RuntimeError(f"rank {self.rank}: {event}")
        return joined

    def _send_control(self, now: float) -> None:
        for payload, dst in self.session.datagrams_to_send(now):
            self.uplink.send((payload, self.addr, dst), now)

    def _arm_timer(self, now: float) -> None:
        """One pending timer event at the earliest of the engine's and the session's deadlines."""
        times = [t for t in (self.session.get_timer(), self.engine.get_timer() if self.engine else None)
                 if t is not None]
        if not times:
            return
        t = max(now, min(times) + TIMER_SLACK)
        if self._timer_at is None or t < self._timer_at:
            self._timer_at = t
            self.sim.at(t, self._fire, t)

    def _fire(self, t: float) -> None:
        if self._timer_at != t:  # superseded by an earlier one
            return
        self._timer_at = None
        now = self.sim.now
        if (st := self.session.get_timer()) is not None and st <= now:
            self.session.handle_timer(now)
        self.cpu.submit([TIMER], now)
