"""The Prometheus endpoint (intml-aggregator --metrics-port, aggregator/metrics.py): a real aggregator process is
scraped over HTTP while a job is live and after it left, and every metric equals what the operator's STATS_REPLY
says; the collector alone against an in-process core; the one-line error without prometheus-client."""

from __future__ import annotations

import re
import socket
import subprocess
import sys
import threading
import time
import urllib.request

import numpy as np
import pytest

from support.cluster import REPO_ROOT, Aggregator, repo_env
from support.harness import TOKEN, Network, new_core

parser = pytest.importorskip("prometheus_client.parser")
from intml.aggregator.metrics import AggregatorCollector  # noqa: E402  (needs prometheus_client)
from intml.protocol.stats import STAT_NAMES  # noqa: E402
from intml.worker import Worker  # noqa: E402

_METRICS_LINE = re.compile(r"intml-aggregator metrics on (http://\S+/metrics)")


def samples(text: str) -> dict[tuple[str, tuple], float]:
    """Every sample of an exposition: (name, sorted labels) -> value."""
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in parser.text_string_to_metric_families(text) for s in family.samples}


def expected_samples(stats: list[dict]) -> dict[tuple[str, tuple], float]:
    """The samples the STATS_REPLY of each core (core i at index i) says the endpoint must serve."""
    want = {}

    def counters(prefix: str, labels: dict, values: dict) -> None:
        for name in STAT_NAMES:
            value = values.get(name, 0)
            if name.startswith("drop_"):
                want[(f"{prefix}drops_total", tuple(sorted({**labels, "reason": name[5:]}.items())))] = value
            else:
                want[(f"{prefix}{name}_total", tuple(sorted(labels.items())))] = value

    for reply in stats:
        core = {"core": str(reply["core"])}
        counters("intml_aggregator_", core, reply["core_counters"])
        for job, info in reply["jobs"].items():
            # a job of another tenant than 0 is named 5@1 in the view of every tenant's jobs
            counters("intml_aggregator_job_", {**core, "tenant": str(info["tenant"]), "job": job.split("@")[0]},
                     info["counters"])
        for reason, count in reply["finished_total"].items():
            want[("intml_aggregator_finished_jobs_total", tuple(sorted({**core, "reason": reason}.items())))] = count
        want[("intml_aggregator_active_jobs", tuple(core.items()))] = len(reply["jobs"])
    return want


def scrape(url: str) -> dict[tuple[str, tuple], float]:
    with urllib.request.urlopen(url, timeout=5) as response:
        assert response.status == 200
        assert response.headers["Content-Type"].startswith("text/plain")
        return samples(response.read().decode())


def check(url: str, agg: Aggregator) -> dict[tuple[str, tuple], float]:
    """Scrape, then ask every core for its statistics: equal, but for the request each core counted since."""
    got = scrape(url)
    stats = agg.stats()
    for reply in stats:
        reply["core_counters"]["packets_in"] -= 1  # the STATS_REQUEST itself
    want = expected_samples(stats)
    assert {k: got.get(k) for k in want} == want
    served_jobs = {dict(labels)["job"] for (name, labels) in got if name.startswith("intml_aggregator_job_")}
    assert served_jobs == {job for reply in stats for job in reply["jobs"]}  # no finished job's series
    return got


@pytest.mark.process
@pytest.mark.parametrize("cores", [1, 2])
def test_scrape_equals_the_stats_reply(cores: int) -> None:
    n, job, pool, elements = 2, 41, 4, 32
    with Aggregator("--metrics-port", "0", cores=cores) as agg:
        match = _METRICS_LINE.search(agg.stdout())
        assert match, agg.stdout()
        url = match.group(1)
        assert agg.stdout().index("metrics on") < agg.stdout().index("listening on")
        joined, go, done = threading.Barrier(n + 1), threading.Barrier(n + 1), threading.Barrier(n + 1)

        def rank(r: int) -> None:
            with Worker(agg.address, job=job, rank=r, world_size=n, token="t", pool_size=pool,
                        packet_elements=elements) as w:
                for _ in range(3):
                    w.allreduce(np.ones(elements * 7, np.float32))
                joined.wait(30)
                go.wait(30)  # stay joined while the endpoint is scraped
            done.wait(30)

        threads = [threading.Thread(target=rank, args=(r,)) for r in range(n)]
        for t in threads:
            t.start()
        joined.wait(60)
        live = check(url, agg)
        for core in range(cores):
            labels = (("core", str(core)),)
            completions = live[("intml_aggregator_completions_total", labels)]
            assert completions > 0  # the core's counters count its jobs' events
            assert completions == live[("intml_aggregator_job_completions_total",
                                        (("core", str(core)), ("job", str(job)), ("tenant", "0")))]
            assert live[("intml_aggregator_slots_in_use", labels)] == len(range(core, pool, cores))
            assert live[("intml_aggregator_slots", labels)] == 512
        go.wait(30)
        done.wait(60)
        for t in threads:
            t.join(30)
        deadline = time.monotonic() + 10
        while agg.job_ids() and time.monotonic() < deadline:  # the LEAVEs are on their way
            time.sleep(0.05)
        after = check(url, agg)  # the job left: its series are gone, the core's totals and the finished count stay
        for core in range(cores):
            labels = (("core", str(core)),)
            assert after[("intml_aggregator_completions_total", labels)] == live[
                ("intml_aggregator_completions_total", labels)]
            assert after[("intml_aggregator_finished_jobs_total", (("core", str(core)), ("reason", "leave")))] == 1
            assert after[("intml_aggregator_active_jobs", labels)] == 0
            assert after[("intml_aggregator_slots_in_use", labels)] == 0
        [past] = agg.stats()[0]["finished"]
        assert past["job"] == job and past["ended"] == "leave" and "seed" not in past["params"]


def test_collector_reads_an_in_process_core() -> None:
    """The collector over a core's own counter block: every counter of the core and of its live job."""
    core = new_core(rows=16, max_elements=16)
    net = Network(3, packet_elements=16, pool_size=4, aggregators=[core], token=TOKEN)
    net.allreduce([np.ones(100, np.float32)] * 3)
    net.to_core(0, [(b"short", net.addr(0))])
    got = {}
    for family in AggregatorCollector([core.counters]).collect():
        for s in family.samples:
            got[(s.name, tuple(sorted(s.labels.items())))] = s.value
    stats = core.stats(net.now)
    want = expected_samples([stats])
    assert {k: got.get(k) for k in want} == want
    assert got[("intml_aggregator_drops_total", (("core", "0"), ("reason", "short")))] == 1
    assert got[("intml_aggregator_slots_in_use", (("core", "0"),))] == 4


@pytest.mark.process
def test_without_prometheus_client_one_line_names_the_extra() -> None:
    hide = ("import sys; sys.modules['prometheus_client'] = None; from intml.aggregator.__main__ import main; "
            "sys.exit(main(['--port', '0', '--metrics-port', '0']))")
    done = subprocess.run([sys.executable, "-c", hide], cwd=REPO_ROOT, env=repo_env(), capture_output=True, text=True,
                          timeout=60, check=False)
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.count("\n") == 1 and "pip install 'intml[metrics]'" in done.stderr, done.stderr


@pytest.mark.process
@pytest.mark.parametrize("args, message", [(["--metrics-port", "70000"], "at most 65535 (a TCP port"),
                                           (["--job-history", "-1"], "--job-history: must be at least 0")])
def test_bad_metrics_options_are_one_line(args: list[str], message: str) -> None:
    done = subprocess.run([sys.executable, "-m", "intml.aggregator", "--port", "0", *args], cwd=REPO_ROOT,
                          env=repo_env(), capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 2 and done.stderr.count("\n") == 1 and message in done.stderr, done.stderr


@pytest.mark.process
def test_metrics_port_in_use_is_one_line() -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        agg = Aggregator("--metrics-port", str(port), cores=2)
        with pytest.raises(RuntimeError, match="exited"):
            agg.start()
        stderr = agg.stderr()
        agg.cleanup()
    assert stderr.count("\n") == 1 and "cannot serve metrics" in stderr, stderr
