"""Every command line refuses a user's mistake in one line: a bad option value, a value that does not fit with
another option, a privilege or resource the host lacks. One line on stderr, no traceback, a non-zero exit, at once.

The option table runs in-process (the parsers and their cross-option checks, exactly as ``main`` runs them); one
case per CLI and the runtime failures run as subprocesses, through the installed console scripts."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from support.cluster import REPO_ROOT, repo_env

from intml.aggregator import __main__ as aggregator_cli
from intml.sim import __main__ as sim_cli
from intml.testbed import __main__ as testbed_cli
from intml.testbed import mroute

MAINS = {"intml-testbed": testbed_cli.main, "intml-aggregator": aggregator_cli.main, "intml-sim": sim_cli.main,
         "mroute": mroute.main}
SCENARIO = "sim/scenarios/single_switch_10g.toml"
ROUTE = ["--route", "198.18.0.1/lo", "--oif", "lo"]

# (CLI, arguments, a phrase the one line must hold)
MISUSE = [
    # the list
    ("intml-testbed", "bench allreduce --packet-elements 100000", "at most 65481 cnat8 elements"),
    ("intml-testbed", "bench allreduce --codec int32 --packet-elements 20000", "at most 16370 int32"),
    ("intml-testbed", "bench allreduce --multicast 1.2.3.4", "multicast group"),
    ("intml-testbed", "bench allreduce --pool 100000", "at most 256"),
    ("intml-testbed", "bench allreduce --workers 65", "at most 64"),
    ("intml-testbed", "bench allreduce --workers 200", "at most 64"),
    ("intml-testbed", "bench loss --loss -0.5", "[0, 1)"),
    ("intml-testbed", "cluster up --rate 0mbit", "above 0"),
    ("intml-aggregator", "--stats-interval -3", ">= 0"),
    ("intml-testbed", "bench allreduce --workers four", "expected an integer, got 'four'"),
    # found by trying every option
    ("intml-testbed", "bench allreduce --pool 200", "use at most --pool 128"),
    ("intml-testbed", "bench allreduce --cores 0", "> 0"),
    ("intml-testbed", "bench allreduce --warmup -1", "at least 0"),
    ("intml-testbed", "bench allreduce --multicast 239.255.255.250", "room for 64 groups"),
    ("intml-testbed", "bench allreduce --multicast 1.2.3", "IPv4 multicast group"),
    ("intml-testbed", "bench allreduce --multicast 239.1.1.1 --unicast", "not allowed with"),
    ("intml-testbed", "bench allreduce --elements 1e9", "expected an integer"),
    ("intml-testbed", "bench allreduce --codec int4", "invalid choice"),
    ("intml-testbed", "bench codec --elements 0", "> 0"),
    ("intml-testbed", "bench codec --elements 10000000000000", "use fewer --elements"),  # 10^13: no host has it
    ("intml-testbed", "bench allreduce --elements 10000000000000", "use fewer --elements"),
    ("intml-testbed", "bench cluster --workers 2 4 --elements 10000000000000", "4 processes"),
    ("intml-testbed", "bench burstio --size 70000", "at most 65507"),
    ("intml-testbed", "bench mac --workers 65", "at most 64"),
    ("intml-testbed", "bench percore --size cnat8:70000", "CODEC:ELEMENTS"),
    ("intml-testbed", "bench percore --seconds nan", "finite"),
    ("intml-testbed", "bench percore --blasters 17", "at most 16"),
    ("intml-testbed", "bench percore --packets 10000000000000", "use fewer --packets"),
    ("intml-testbed", "bench cluster --rate 100", "looks like 100mbit"),
    ("intml-testbed", "bench cluster --rate fast", "looks like 100mbit"),
    ("intml-testbed", "bench cluster --loss 1", "[0, 1)"),
    ("intml-testbed", "bench cluster --mtu 1400", "invalid choice"),
    ("intml-testbed", "bench cluster --workers 2 100", "at most 64"),
    ("intml-testbed", "bench cluster --aggregators 300", "at most 200"),
    ("intml-testbed", "bench cluster --aggregators 100 --cores 3", "255 cores"),
    ("intml-testbed", "bench cluster --plot /no/such/folder/x.png", "does not exist"),
    ("intml-testbed", "bench loss --rate 0.0gbit", "above 0"),
    ("intml-testbed", "cluster up --workers 201", "at most 200"),
    ("intml-testbed", "cluster up --loss 1.5", "[0, 1)"),
    ("intml-testbed", "cluster down", "invalid choice"),
    ("intml-testbed", "train --workers 65", "at most 64"),
    ("intml-testbed", "train --packet-elements 20000", "at most 16370"),
    ("intml-testbed", "train --target 1.5", "at most 1"),
    ("intml-testbed", "train --runs gloo,fast", "must start with one of"),
    ("intml-testbed", "train --parallel average --runs uniform99", "uniform takes an integer in 2..16"),
    ("intml-testbed", "train --json-out /no/such/folder/r.json", "does not exist"),
    ("intml-testbed", "bench", "required"),
    ("intml-aggregator", "--port 70000", "at most 65535"),
    ("intml-aggregator", "--port 65535 --cores 2", "runs past 65535"),
    ("intml-aggregator", "--port http", "expected an integer"),
    ("intml-aggregator", "--cores 256", "at most 255"),
    ("intml-aggregator", "--max-packet-elements 70000", "at most 65481"),
    ("intml-aggregator", "--idle-timeout 0", "> 0"),
    ("intml-aggregator", "--idle-timeout inf", "finite"),
    ("intml-aggregator", "--multicast 10.0.0.1", "multicast group"),
    ("intml-aggregator", "--multicast 239.255.255.200 --max-jobs 100", "room for 100 groups"),
    ("intml-aggregator", "--multicast 239.255.42.0 --host 0.0.0.0", "needs --host"),
    ("intml-aggregator", "--multicast-ttl 256", "at most 255"),
    ("intml-aggregator", "--control-rate -1", "> 0"),
    ("intml-aggregator", "--engine tofino", "invalid choice"),
    ("intml-aggregator", "--token-file /no/such/tokens.txt", "No such file"),
    ("intml-sim", "loss --loss 1", "[0, 1)"),
    ("intml-sim", "loss --workers 0", "> 0"),
    ("intml-sim", "loss --rto 0", "> 0"),
    ("intml-sim", "loss --rate 0gbit", "rate must be like"),
    ("intml-sim", "loss --seed -1", "at least 0"),
    ("intml-sim", "train --workers 1", "at least 2"),
    ("intml-sim", "train --rate fast", "rate must be like"),
    ("intml-sim", "bench --workers 65", "at most 64"),
    ("intml-sim", "run no/such/scenario.toml", "no file"),
    ("intml-sim", f"run {SCENARIO} --plot /no/such/folder/x.png", "does not exist"),
    ("intml-sim", f"sweep {SCENARIO} --set bogus", "--set needs key=v1,v2"),
    ("intml-sim", "validate no/such/cluster.json", "no file"),
    ("mroute", "--oif lo --group 239.1.1.1", "required: --route"),
    ("mroute", "--route 198.18.0.1 --oif lo --group 239.1.1.1", "SOURCE/DEVICE"),
    ("mroute", f"{' '.join(ROUTE)} --group 10.1.1.1", "multicast group"),
    ("mroute", f"{' '.join(ROUTE)} --group 239.255.255.255 --count 2", "room for 2 groups"),
    ("mroute", f"{' '.join(ROUTE)} --group 239.1.1.1 --count 0", "> 0"),
    ("mroute", f"--route 198.18.0.1/lo --oif {' '.join(f'v{i}' for i in range(40))} --group 239.1.1.1", "MAXVIFS"),
]


def one_line(text: str) -> str:
    lines = text.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in text, text
    return lines[0]


@pytest.mark.parametrize("cli, args, needle", MISUSE, ids=[f"{c} {a}" for c, a, _ in MISUSE])
def test_misuse_is_one_line(cli: str, args: str, needle: str, capsys, monkeypatch) -> None:
    """In-process, through each CLI's main: SystemExit with code 2 (sim's own errors: a return of 2), before
    anything starts, and exactly one line on stderr naming the problem."""
    monkeypatch.chdir(REPO_ROOT)
    try:
        code = MAINS[cli](args.split())
    except SystemExit as exc:
        code = exc.code
        if isinstance(code, str):  # SystemExit("message"): Python prints it and exits with 1
            print(code, file=sys.stderr)
            code = 1
    err = capsys.readouterr().err
    assert code != 0 and needle in one_line(err), err


def script(name: str) -> list[str]:
    """The installed console script (beside this Python), or the module where it is not installed."""
    installed = Path(sys.executable).parent / name
    return [str(installed)] if installed.exists() else [sys.executable, "-m", {
        "intml-testbed": "intml.testbed", "intml-aggregator": "intml.aggregator", "intml-sim": "intml.sim"}[name]]


def run(argv: list[str], env: dict[str, str] | None = None) -> tuple[subprocess.CompletedProcess, float]:
    start = time.monotonic()
    done = subprocess.run(argv, cwd=REPO_ROOT, env=env or repo_env(), capture_output=True, text=True, timeout=60)
    return done, time.monotonic() - start


MROUTE = [sys.executable, "-m", "intml.testbed.mroute"]


@pytest.mark.process
@pytest.mark.parametrize("argv, needle", [
    (script("intml-testbed") + ["bench", "allreduce", "--workers", "200"], "at most 64"),
    (script("intml-aggregator") + ["--stats-interval", "-3"], ">= 0"),
    (script("intml-sim") + ["loss", "--loss", "-0.5"], "[0, 1)"),
    (MROUTE + ROUTE + ["--group", "1.2.3.4"], "multicast group"),
], ids=["intml-testbed", "intml-aggregator", "intml-sim", "mroute"])
def test_each_console_script_says_one_line_at_once(argv: list[str], needle: str) -> None:
    done, seconds = run(argv)
    assert done.returncode == 2 and needle in one_line(done.stderr) and seconds < 10, (done.stderr, seconds)


@pytest.mark.process
def test_runtime_failures_are_one_line() -> None:
    """A port in use, a slot table the host cannot hold, a device that does not exist: one line, exit code 1."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as taken:
        taken.bind(("127.0.0.1", 0))
        port = taken.getsockname()[1]
        done, _ = run(script("intml-aggregator") + ["--port", str(port), "--cores", "1"])
    assert done.returncode == 1 and "Address already in use" in one_line(done.stderr), done.stderr
    done, _ = run(script("intml-aggregator") + ["--port", "0", "--cores", "1", "--slots", "100000000"])
    assert done.returncode == 1 and "do not fit in memory" in one_line(done.stderr), done.stderr
    done, _ = run(script("intml-aggregator") + ["--host", "no-such-host.invalid"])
    assert done.returncode == 1 and "cannot resolve --host" in one_line(done.stderr), done.stderr
    done, _ = run(MROUTE + ["--route", "198.18.0.1/nosuchdev", "--oif", "nosuchdev2", "--group", "239.1.1.1"])
    assert done.returncode == 1 and "no device nosuchdev, nosuchdev2" in one_line(done.stderr), done.stderr


@pytest.mark.process
def test_an_aggregator_that_does_not_start_is_one_line() -> None:
    """The benchmarks' aggregator refusing its options surfaces as its own one-line reason."""
    from intml.testbed.bench_allreduce import AggregatorError, aggregator

    with pytest.raises(AggregatorError) as failed:
        with aggregator(1, 100_000):
            pass
    assert "--max-packet-elements" in str(failed.value) and "\n" not in str(failed.value)


SETPRIV = shutil.which("setpriv")


@pytest.mark.process
@pytest.mark.skipif(os.geteuid() != 0 or SETPRIV is None, reason="needs root to drop to an unprivileged user")
@pytest.mark.parametrize("argv, needle", [
    (script("intml-testbed") + ["cluster", "up"], "need root"),
    (script("intml-testbed") + ["bench", "loss", "--rounds", "1"], "need root"),
    (MROUTE + ROUTE + ["--group", "239.1.1.1"], "needs root"),
], ids=["cluster up", "bench loss", "mroute"])
def test_root_only_commands_as_nobody(argv: list[str], needle: str) -> None:
    """Run as an unprivileged user (nobody), a root-only command says so in one line before it starts."""
    done, _ = run([SETPRIV, "--reuid=65534", "--regid=65534", "--clear-groups", *argv],
                  env={**repo_env(), "HOME": "/tmp", "NUMBA_CACHE_DIR": "/tmp/intml-numba-nobody"})
    assert done.returncode == 1 and needle in one_line(done.stderr), done.stderr


def test_ctrl_c_is_one_line(capsys, monkeypatch) -> None:
    """Ctrl-C during a run: one line and the shell's exit code for SIGINT, not a traceback."""
    from intml.aggregator.cli import INTERRUPTED
    from intml.testbed import bench_codec

    def interrupted(*_args: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(bench_codec, "run", interrupted)
    monkeypatch.setattr(sim_cli, "cmd_bench", interrupted)
    assert testbed_cli.main(["bench", "codec"]) == INTERRUPTED
    assert one_line(capsys.readouterr().err) == "intml-testbed: interrupted"
    assert sim_cli.main(["bench"]) == INTERRUPTED
    assert one_line(capsys.readouterr().err) == "intml-sim: interrupted"
