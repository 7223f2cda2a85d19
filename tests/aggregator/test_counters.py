"""The aggregator's counters are true: after known allreduces without loss, every per-core and per-job counter
equals the number the protocol predicts (docs/protocol.md, "Drop reasons" and "Exponent agreement on the wire"),
a finished job's counters stay in a bounded history with when and why it ended, and a reader of the counter
block (aggregator.counters) sees only whole jobs."""

from __future__ import annotations

import numpy as np
import pytest

from support.harness import TOKEN, Network, new_core, worker_addr
from intml.aggregator.counters import CoreCounters
from intml.protocol.stats import STAT_NAMES

GROUP = (0xEF000000, 4000)  # 239.0.0.0:4000
NO_RTO = {"rto": 100.0, "min_rto": 100.0, "max_rto": 100.0}  # far beyond any run: no retransmission, exact counts


def rounds_on_core(core: int, cores: int, chunks: int, pool: int) -> int:
    """The rounds one allreduce of ``chunks`` chunks over ``pool`` slots makes on ``core``: one bootstrap round
    for each of its slots that the allreduce uses, then one per chunk of each of those slots."""
    used = range(core, min(pool, chunks), cores)
    return sum(1 + len(range(s, chunks, pool)) for s in used)


def expected(rounds: int, n: int, multicast: bool) -> dict[str, int]:
    """Every counter (zero unless named) of a job, or of a core's DATA, after ``rounds`` loss-free rounds."""
    counts = dict.fromkeys(STAT_NAMES, 0)
    counts.update(packets_in=rounds * n, contributions=rounds * n, completions=rounds,
                  packets_out=rounds * (1 if multicast else n))
    return counts


def network(n: int, cores: int, pool: int, elements: int, multicast: bool) -> Network:
    aggregators = [new_core(core=i, cores=cores, rows=64, max_elements=elements,
                            results_group=GROUP if multicast else None) for i in range(cores)]
    return Network(n, packet_elements=elements, pool_size=pool, aggregators=aggregators, token=TOKEN, **NO_RTO)


@pytest.mark.parametrize("n, cores, chunks, pool, multicast", [(3, 2, 11, 4, False), (4, 2, 5, 8, True),
                                                                (2, 3, 20, 6, False), (5, 1, 3, 4, True)])
def test_counters_equal_the_rounds_of_known_allreduces(n: int, cores: int, chunks: int, pool: int,
                                                       multicast: bool) -> None:
    elements, allreduces = 16, 3
    net = network(n, cores, pool, elements, multicast)
    rng = np.random.default_rng(1)
    for _ in range(allreduces):
        net.allreduce([rng.standard_normal(chunks * elements - 3).astype(np.float32) for _ in range(n)])
    for i in range(cores):
        rounds = allreduces * rounds_on_core(i, cores, chunks, pool)
        job = expected(rounds, n, multicast)
        assert net.job_counters(i) == job, i
        joins = 2 * n  # each rank's JOIN and proved JOIN: datagrams of no job
        assert net.core_counters(i) == {**job, "packets_in": job["packets_in"] + joins}, i
    assert sum(net.job_counters(i)["completions"] for i in range(cores)) == allreduces * (chunks + min(pool, chunks))

    for rank in range(n):  # every rank leaves: the job ends, its counters stay in the core's totals and history
        for i in range(cores):
            net.to_core(i, [(net.leave(rank, i), net.addr(rank))])
    for i in range(cores):
        stats = net.stats(i)
        rounds = allreduces * rounds_on_core(i, cores, chunks, pool)
        job = expected(rounds, n, multicast)
        assert stats["jobs"] == {}
        [past] = stats["finished"]
        assert past["job"] == net.job and past["ended"] == "leave" and past["ended_s_ago"] == 0
        assert past["lasted_s"] == pytest.approx(net.now)
        assert past["counters"] == {k: v for k, v in job.items() if v}
        assert stats["finished_total"] == {"leave": 1, "idle": 0, "evicted": 0}
        assert stats["core_counters"] == {**job, "packets_in": job["packets_in"] + 2 * n + n}, i  # + the LEAVEs


def test_core_totals_add_live_and_finished_jobs_and_strangers() -> None:
    """Two jobs on one core: the core's counters are the sum of both jobs' and of the datagrams of no job, before
    and after one of the jobs is torn down; a new job on the freed entry starts from zero."""
    core = new_core(rows=64, max_elements=16)
    first = Network(2, packet_elements=16, pool_size=2, aggregators=[core], token=TOKEN, job=1, **NO_RTO)
    second = Network(3, packet_elements=16, pool_size=2, aggregators=[core], token=TOKEN, job=2, **NO_RTO,
                     worker_port=6000)
    first.allreduce([np.ones(40, np.float32)] * 2)
    second.now = first.now
    second.allreduce([np.ones(20, np.float32)] * 3)
    net = first
    net.to_core(0, [(b"junk", worker_addr(9))])  # one short datagram: counted by the core only

    def totals() -> dict[str, int]:
        stats = core.stats(second.now)
        live = [job["counters"] for job in stats["jobs"].values()]
        finished = [past["counters"] for past in stats["finished"]]
        return {k: sum(c.get(k, 0) for c in live + finished) for k in STAT_NAMES}

    before = core.stats(second.now)["core_counters"]
    joins = 2 * (2 + 3)
    assert before == {**totals(), "packets_in": totals()["packets_in"] + joins + 1, "drop_short": 1}
    core.teardown(1, second.now)
    after = core.stats(second.now)
    assert after["core_counters"] == before
    assert [past["ended"] for past in after["finished"]] == ["evicted"]
    entry = core.info[2].index
    third = Network(2, packet_elements=16, pool_size=2, aggregators=[core], token=TOKEN, job=3, **NO_RTO,
                    worker_port=7000)
    assert core.info[3].index != entry and core.stats(third.now)["jobs"]["3"]["counters"] == dict.fromkeys(
        STAT_NAMES, 0)  # the first job's entry, reused: none of its counts


def test_idle_teardown_is_remembered_with_its_reason() -> None:
    net = Network(2, packet_elements=16, pool_size=2, cores=1, idle_timeout=5.0, **NO_RTO)
    net.allreduce([np.ones(16, np.float32)] * 2)
    core = net.cores[0]
    deadline = core.get_timer()
    assert core.handle_timer(deadline) == [net.job]
    [past] = core.stats(deadline + 1.0)["finished"]
    assert past["ended"] == "idle" and past["ended_s_ago"] == 1.0
    assert past["lasted_s"] == pytest.approx(deadline)
    assert past["counters"]["completions"] == 2  # one bootstrap round and one chunk


def test_history_keeps_the_newest_n_finished_jobs() -> None:
    """N + 10 jobs come and go: the N newest are kept, newest first; every one of them is counted by reason."""
    kept = 6
    core = new_core(rows=8, max_elements=16, max_jobs=2, job_history=kept)
    for job in range(kept + 10):
        net = Network(1, packet_elements=16, pool_size=1, aggregators=[core], token=TOKEN, job=job, **NO_RTO,
                      worker_port=5000 + job, join=False)  # each from its own address: within its control rate
        net.now = float(job)
        net.join_all()
        net.allreduce([np.ones(16, np.float32)])
        net.to_core(0, [(net.leave(0), net.addr(0))])
    stats = core.stats(100.0)
    assert [past["job"] for past in stats["finished"]] == list(range(kept + 9, 9, -1))
    assert len(core.history) == kept
    assert stats["finished_total"]["leave"] == kept + 10
    assert core.stats(100.0, 12)["finished"][0]["job"] == 12  # one job's statistics include its history
    assert core.stats(100.0, 3)["finished"] == []  # dropped


def test_a_row_that_changes_while_read_is_left_out() -> None:
    """A reader copies a job row only between two equal, even reads of its generation: a row whose writer
    stopped half-way (odd generation) is skipped, a stable one is read."""
    counters = CoreCounters(max_jobs=3, rows=4)
    counters.stats[:] = 5
    counters.start_job(0, 10)
    counters.start_job(2, 12)
    counters.stats[2, 0] += 7
    counters.generation[0] += 1  # a writer stopped inside start_job or end_job
    [sample] = counters.live_jobs()
    assert (sample.index, sample.job_id) == (2, 12) and sample.counters[0] == 7 and not sample.counters[1:].any()
    counters.generation[0] += 1
    assert [s.job_id for s in counters.live_jobs()] == [10, 12]


def test_counters_block_over_a_given_buffer() -> None:
    """The block lives in the buffer it is given (the aggregator passes a shared mmap): a second view of the
    same buffer reads what the core writes."""
    buffer = np.zeros(CoreCounters.nbytes(2, 8), np.uint8)  # numpy aligns it
    core = new_core(rows=8, max_elements=16, max_jobs=2, counters=CoreCounters(2, 8, buffer))
    reader = CoreCounters(2, 8, buffer)
    net = Network(2, packet_elements=16, pool_size=2, aggregators=[core], token=TOKEN, **NO_RTO)
    net.allreduce([np.ones(32, np.float32)] * 2)
    assert dict(zip(STAT_NAMES, reader.totals().tolist())) == net.core_counters()
    [sample] = reader.live_jobs()
    assert sample.job_id == net.job and dict(zip(STAT_NAMES, sample.counters.tolist())) == net.job_counters()
    assert reader.row_used.sum() == 2
    with pytest.raises(ValueError, match="for 2 jobs and 8 rows"):
        new_core(rows=16, max_elements=16, max_jobs=2, counters=CoreCounters(2, 8))
