"""The aggregator core drives any data path (aggregator.datapath): a small fake one, written to the interface and
nothing else, takes the core's placement, seats, removal and bursts, answers its queries, and its refusals reach
the JOIN's ERROR. Then the structure: job placement is written once, and no implementation reaches into the core."""

from __future__ import annotations

import ast
import pathlib

import numpy as np
import pytest
from support.harness import TOKEN, core_receive, handshake, msg_type, new_core, worker_addr

from intml.aggregator.core import AggregatorCore
from intml.aggregator.host import HostDataPath
from intml.aggregator.counters import CoreCounters
from intml.aggregator.datapath import DataPath, Placed, RoundState, Slots, allocate, first_fit
from intml.aggregator.kernel import KernelDataPath
from intml.aggregator.leafspine import LeafDataPath, SpineCore
from intml.aggregator.slots import process_burst
from intml.p4.bmv2 import Bmv2DataPath
from intml.p4.controller import controller_entries
from intml.p4.engine import P4DataPath, p4model_core
from intml.protocol import keys, wire
from intml.protocol.burst import Burst
from intml.protocol.job import MAX_WORLD, JobParams
from intml.protocol.packet import round_key
from intml.protocol.wire import Codec, MsgType

ROOT = pathlib.Path(__file__).resolve().parents[2]
PARAMS = {"world_size": 2, "packet_elements": 8, "pool_size": 3, "codec": int(Codec.CNAT8), "seed": 5}
CONTROL_TYPES = (MsgType.JOIN, MsgType.LEAVE, MsgType.STATS_REQUEST)


class FakeDataPath:
    """A data path in plain Python: it echoes every datagram that is not a control datagram to its sender, lists
    every control datagram, and reports the round state and last-seen times the test sets."""

    marks = False

    def __init__(self, rows: int = 4, max_jobs: int = 2, refusal: str | None = None) -> None:
        self.counters = CoreCounters(max_jobs, rows)
        self.max_elements = 64
        self.refusal = refusal
        self.calls: list[tuple] = []
        self.rounds: dict[int, RoundState] = {}
        self.seen: dict[int, np.ndarray] = {}

    def refuse(self, job_id: int, params: JobParams, slots: Slots, rank: int) -> str | None:
        self.calls.append(("refuse", job_id, params, slots, rank))
        return self.refusal

    def place(self, job_id: int, params: JobParams, slots: Slots, data_key: bytes, now: float) -> Placed | str:
        found = allocate(self.counters, job_id, len(slots.of(params.pool_size)), "the fake")
        if isinstance(found, str):
            return found
        j, rows = found
        self.calls.append(("place", job_id, params, slots, len(data_key), now))
        self.rounds[job_id] = RoundState(np.full((len(rows), 2), -1, np.int64), np.zeros((len(rows), 2), np.uint64),
                                         np.zeros((len(rows), 2), np.int64))
        self.seen[job_id] = np.full(MAX_WORLD, now)
        return Placed(j, rows, 0)

    def seat(self, job_id: int, rank: int, addr: int, now: float) -> None:
        self.calls.append(("seat", job_id, rank, addr, now))
        self.seen[job_id][rank] = now

    def remove(self, job_id: int) -> None:
        self.calls.append(("remove", job_id))
        del self.rounds[job_id], self.seen[job_id]

    def process(self, rx: Burst, now: float) -> tuple[Burst, np.ndarray]:
        datagrams = [(bytes(rx.data[i, :rx.length[i]]), int(rx.addr[i])) for i in range(rx.count)]
        control = [i for i, (d, _) in enumerate(datagrams) if d[wire.OFFSETS["type"]] in CONTROL_TYPES]
        echoed = [d for i, d in enumerate(datagrams) if i not in control]
        out = Burst.rows_of(len(echoed), max([1] + [len(d) for d, _ in echoed]))
        out.fill(echoed)
        return out, np.array(control, np.int64)

    def round_state(self, job_id: int) -> RoundState:
        return self.rounds[job_id]

    def last_seen(self, job_id: int) -> np.ndarray:
        return self.seen[job_id]


def fake_core(**options) -> tuple[AggregatorCore, FakeDataPath]:
    path = FakeDataPath(**options)
    return AggregatorCore(path, tokens=[TOKEN], idle_timeout=10.0), path


def join(core: AggregatorCore, rank: int, now: float = 1.0, **params) -> bytes:
    [(reply, _)] = handshake(core, worker_addr(rank), now, 7, rank, token=TOKEN, **{**PARAMS, **params})
    return reply


def error_text(reply: bytes) -> str:
    assert msg_type(reply) == MsgType.ERROR
    return wire.unpack(reply)[1].tobytes().decode()


def test_every_implementation_has_the_interface():
    fake: DataPath = FakeDataPath()  # the Protocol, as a type checker reads it
    for kind in (KernelDataPath, LeafDataPath, SpineCore, P4DataPath, type(fake)):
        for name in ("refuse", "place", "seat", "remove", "process", "round_state", "last_seen"):
            assert callable(getattr(kind, name)), (kind, name)


def test_only_a_switch_with_its_own_queue_marks_and_the_core_tells_the_driver():
    """DataPath.marks: BMv2 running the P4 program marks results from its egress queue, a leaf passes the spine's
    mark on and the spine echoes the leaves' (aggregator.tiers), and the driver keeps those marks; every path that
    sends stored results again, or never queues, leaves the mark to the driver."""
    assert [k.marks for k in (KernelDataPath, HostDataPath, P4DataPath)] == [False] * 3
    assert Bmv2DataPath.marks is LeafDataPath.marks is SpineCore.marks is True
    fake = FakeDataPath()
    fake.marks = True
    assert AggregatorCore(fake, tokens=[TOKEN]).marks and not AggregatorCore(FakeDataPath(), tokens=[TOKEN]).marks


def test_the_core_places_seats_and_acks_through_the_data_path():
    core, path = fake_core()
    assert msg_type(join(core, 0, 1.0)) == MsgType.JOIN_ACK
    assert msg_type(join(core, 1, 2.0)) == MsgType.JOIN_ACK
    params = JobParams(world_size=2, packet_elements=8, pool_size=3, codec=Codec.CNAT8, seed=5)
    assert [c for c in path.calls if c[0] != "refuse"] == [
        ("place", 7, params, Slots(1, 0), 16, 1.0),
        ("seat", 7, 0, worker_addr(0), 1.0),
        ("seat", 7, 1, worker_addr(1), 2.0)]
    assert [c[1:] for c in path.calls if c[0] == "refuse"] == [(7, params, Slots(1, 0), 0),
                                                               (7, params, Slots(1, 0), 1)]
    j = core.info[7].index
    assert core.counters.active[j] and core.counters.job_id[j] == 7 and core.counters.row_used[:3].all()


def test_the_data_paths_refusal_reaches_the_join_error():
    core, path = fake_core(refusal="the fake switch cannot do this")
    assert error_text(join(core, 0)) == "the fake switch cannot do this"
    assert core.stats(1.0)["core_counters"]["drop_refused_join"] == 1
    assert core.info == {} and not any(c[0] == "place" for c in path.calls)


def test_the_data_paths_limit_reaches_the_join_error():
    core, _ = fake_core(rows=2)
    text = error_text(join(core, 0))
    assert text.startswith("the fake has no free slots for job 7: its pool needs 3 consecutive slot rows")
    assert core.info == {} and not core.counters.row_used.any()


def test_bursts_go_through_the_data_path_and_control_to_the_control_plane():
    core, _ = fake_core()
    data = wire.pack({"type": int(MsgType.DATA), "job": 9}, np.zeros(4, np.uint8))
    join_datagram = wire.pack_join({"type": int(MsgType.JOIN), "job": 7, "rank": 0}, {**PARAMS, "nonce": bytes(16)})
    out = core_receive(core, [(data, worker_addr(3)), (join_datagram, worker_addr(0))], 1.0)
    assert out[0] == (data, worker_addr(3))  # the data path's output, as it made it
    assert msg_type(out[1][0]) == MsgType.CHALLENGE and out[1][1] == worker_addr(0) and len(out) == 2


def test_statistics_and_the_resume_point_read_the_round_state():
    core, path = fake_core()
    join(core, 0)
    state = path.rounds[7]
    state.round_key[1, 1] = round_key(4, 1)  # slot 1, set 1: allreduce 4 waits for rank 1
    state.bitmap[1, 1], state.count[1, 1] = 1, 1
    job = core.stats(1.0)["jobs"]["7"]
    assert job["pending"] == [{"slot": 1, "shadow": 1, "missing_ranks": [1]}] and job["pending_total"] == 1
    ack = join(core, 1)
    _, fields, sets = wire.unpack_join(ack)
    assert int(fields["allreduce"]) == 4
    assert np.unpackbits(np.frombuffer(bytes(sets), np.uint8), bitorder="little")[:3].tolist() == [0, 1, 0]


def test_idleness_reads_last_seen_and_teardown_removes_the_job():
    core, path = fake_core()
    join(core, 0, 1.0)
    path.seen[7][0] = 5.0  # a DATA packet of rank 0 at 5 s
    assert core.get_timer() == 15.0
    assert core.stats(6.0)["jobs"]["7"]["silent_s"] == {0: 1.0}
    assert core.handle_timer(14.9) == [] and core.handle_timer(15.0) == [7]
    assert path.calls[-1] == ("remove", 7) and core.info == {}
    assert not core.counters.active.any() and core.stats(15.0)["finished"][0]["ended"] == "idle"


def test_a_core_with_its_own_data_path_takes_no_kernel_options():
    with pytest.raises(TypeError, match="rows"):
        AggregatorCore(FakeDataPath(), rows=4)


def test_one_address_one_rank_unless_a_test_clears_it():
    core = new_core(rows=4, max_elements=8)
    [(reply, _)] = handshake(core, worker_addr(0), 0.0, 7, 0, token=TOKEN, **PARAMS)
    assert msg_type(reply) == MsgType.JOIN_ACK
    [(reply, _)] = handshake(core, worker_addr(0), 0.0, 7, 1, token=TOKEN, **PARAMS)
    assert "already holds rank 0 of job 7" in error_text(reply)
    core.one_rank_per_address = False
    [(reply, _)] = handshake(core, worker_addr(0), 0.0, 7, 1, token=TOKEN, **PARAMS)
    assert msg_type(reply) == MsgType.JOIN_ACK


def test_first_fit_and_allocate():
    used = np.array([True, False, True, False, False, False])
    assert first_fit(used, 2) == range(3, 5) and first_fit(used, 1) == range(1, 2)
    assert first_fit(used, 4) is None and first_fit(used, 0) == range(0, 0)
    counters = CoreCounters(1, 4)
    assert allocate(counters, 1, 3, "here") == (0, range(0, 3)) and counters.row_used[:3].all()
    counters.active[0] = True
    assert allocate(counters, 2, 1, "here").startswith("here already holds its maximum of 1 jobs")


def test_the_p4_controller_writes_entries_when_a_job_changes_not_per_control_datagram():
    core = p4model_core(rows=8, max_elements=64, tokens=[TOKEN])
    model, writes = core.datapath.model, []
    replace = model.replace_job_entries

    def recording(entries):
        writes.append(list(entries))
        replace(writes[-1])

    model.replace_job_entries = recording
    for rank in range(2):
        [(reply, _)] = handshake(core, worker_addr(rank), 0.0, 7, rank, token=TOKEN, **PARAMS)
        assert msg_type(reply) == MsgType.JOIN_ACK
    assert len(writes) == 3  # the job placed, then each rank seated
    assert writes[-1] == controller_entries(core)  # the controller's entries: the control plane's view of the job
    leave = wire.pack({"type": int(MsgType.LEAVE), "job": 7, "rank": 0}, bytes(keys.MAC_SIZE))  # a wrong MAC
    stats = wire.pack({"type": int(MsgType.STATS_REQUEST), "job": 7, "rank": 1}, bytes(keys.MAC_SIZE))
    first_round = wire.pack_join({"type": int(MsgType.JOIN), "job": 7, "rank": 1}, {**PARAMS, "nonce": bytes(16)})
    core_receive(core, [(leave, worker_addr(0)), (stats, worker_addr(1)), (first_round, worker_addr(1))], 1.0)
    assert core.stats(1.0)["core_counters"]["drop_bad_mac"] == 2 and len(writes) == 3
    core.teardown(7)
    assert len(writes) == 4 and writes[-1] == []


def _definitions(path: pathlib.Path) -> list[ast.AST]:
    return list(ast.walk(ast.parse(path.read_text())))


def test_no_data_path_reaches_into_the_core():
    """Nothing in the tree (tests included) subclasses AggregatorCore; the leaf, the spine and the P4 model define
    none of the core's private methods and import no private name; job placement (first fit of slot rows) is
    written once, in aggregator.datapath."""
    for path in sorted(ROOT.glob("*/*.py")):
        if path.parts[-2] != ".venv":
            bases = {b.id for n in _definitions(path) if isinstance(n, ast.ClassDef) for b in n.bases
                     if isinstance(b, ast.Name)}
            assert "AggregatorCore" not in bases, path
    for path in [ROOT / "aggregator" / "leafspine.py", *sorted((ROOT / "p4").glob("*.py"))]:
        nodes = _definitions(path)
        core_private = {n.name for n in _definitions(ROOT / "aggregator" / "core.py")
                        if isinstance(n, ast.FunctionDef) and n.name.startswith("_")}
        defined = {n.name for n in nodes if isinstance(n, ast.FunctionDef)}
        assert not (defined & core_private) - {"__init__"}, path
        imported = {a.name for n in nodes if isinstance(n, ast.ImportFrom) for a in n.names}
        assert not {name for name in imported if name.startswith("_")}, path
    fits = [p.relative_to(ROOT) for p in sorted(ROOT.glob("*/*.py")) if p.parts[-2] not in (".venv", "tests")
            and any(isinstance(n, ast.FunctionDef) and "first_fit" in n.name for n in _definitions(p))]
    assert fits == [pathlib.Path("aggregator/datapath.py")]


def test_the_burst_kernel_runs_without_numbas_runtime() -> None:
    """process_burst allocates nothing, so it compiles without Numba's runtime: its atomic reference counts cost a
    third of the kernel's time (docs/benchmarks.md)."""
    assert process_burst.targetoptions["_nrt"] is False
