"""`intml-aggregator`: the switch-emulating aggregator.

    intml-aggregator --host 127.0.0.1 --port 48879 --cores 2 --stats-interval 5

Core i listens on port + i and owns slots s with s % cores == i (s % total_cores == first_core + i for a job
spread over several aggregators, docs/protocol.md "Several aggregators"). Once every socket is bound and every kernel of
the data plane is compiled (or loaded from Numba's cache), it prints one line,
``intml-aggregator listening on HOST:PORT cores K``, which scripts can wait for: a JOIN sent after it is answered
at once.

Engines: ``--engine kernel`` (the default) runs each core's data path in the Numba burst kernel;
``--engine p4model`` runs it through the P4 pipeline model (intml.p4.engine), packet by packet in Python: slow,
with bit-identical results, for showing that the switch program computes what the kernel does. It refuses a JOIN
with data_mac or with more elements per packet than the switch parses. ``--engine bmv2 --bmv2-program intml.json``
runs it on a real BMv2 ``simple_switch`` (intml.p4.bmv2; one core, root), with the same refusals.

Metrics: ``--metrics-port PORT`` (with ``--metrics-address``, default 127.0.0.1) serves every core's counters in
Prometheus's text format at http://ADDRESS:PORT/metrics (intml.aggregator.metrics; needs the ``metrics`` extra,
prometheus-client), and prints ``intml-aggregator metrics on http://ADDRESS:PORT/metrics`` before the ready line
(port 0 picks a free port). ``--job-history N``: how many finished jobs each core keeps for STATS_REPLY.

Tokens: a job can only be created with a token the aggregator knows: one per non-empty line of ``--token-file``
(one per tenant) and the environment variable ``INTML_TOKEN``. With neither it runs open: only the empty token
joins, and it says so in one line on stderr (``OPEN_WARNING``).
"""

from __future__ import annotations

import atexit
import errno
import functools
import ipaddress
import mmap
import multiprocessing
import os
import random
import signal
import socket
import sys
from collections.abc import Callable
from types import ModuleType
from typing import Any

from intml.aggregator.cli import (PORTS, OneLineParser, count, default_cores, multicast_group, non_negative, port,
                                  positive)
from intml.protocol.codec import Codec
from intml.protocol.job import (
    AGGREGATOR_IDLE_TIMEOUT,
    AGGREGATOR_JOB_HISTORY,
    AGGREGATOR_MAX_ELEMENTS,
    AGGREGATOR_MAX_JOBS,
    AGGREGATOR_MAX_POOL,
    AGGREGATOR_SLOTS,
    BURST,
    MAX_CORES,
    ControlLimits,
)
from intml.protocol.wire import DEFAULT_PORT, max_packet_elements

MAX_ELEMENTS_LIMIT = max_packet_elements(Codec.CNAT8)  # jobs are further limited by their codec at join
ENGINES = ("kernel", "p4model", "bmv2")
OPEN_WARNING = ("intml-aggregator: warning: no --token-file or INTML_TOKEN: any host that can reach this port can "
                "join jobs")


def _tokens(parser: OneLineParser, path: str | None, env: dict[str, str]) -> list[str]:
    """The accepted tokens: the non-empty lines of --token-file, then INTML_TOKEN; none: the open mode."""
    tokens = []
    if path is not None:
        try:
            with open(path, encoding="utf-8") as f:
                tokens = [line.strip() for line in f if line.strip()]
        except (OSError, UnicodeDecodeError) as exc:
            parser.option_error("--token-file", f"{path}: {getattr(exc, 'strerror', None) or exc}")
        if not tokens:
            parser.option_error("--token-file", f"{path} holds no token (one per non-empty line)")
    if env.get("INTML_TOKEN"):
        tokens.append(env["INTML_TOKEN"])
    return tokens


def _bind(host: str, port: int, cores: int) -> list[socket.socket]:
    """Bind `cores` consecutive UDP ports from `port`; port 0 picks a free run of them (trying others only while
    the ports it drew are in use)."""
    for _ in range(100 if port == 0 else 1):
        base = random.randint(20000, 60000 - cores) if port == 0 else port
        socks: list[socket.socket] = []
        try:
            for i in range(cores):
                s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
                socks.append(s)
                s.bind((host, base + i))
            return socks
        except OSError as exc:
            for s in socks:
                s.close()
            if isinstance(exc, socket.gaierror):
                raise SystemExit(f"intml-aggregator: cannot resolve --host {host} ({exc.strerror}); give an address "
                                 f"of this host, e.g. 127.0.0.1") from None
            if port != 0 or exc.errno != errno.EADDRINUSE:
                raise SystemExit(f"intml-aggregator: cannot bind {host}:{base}..{base + cores - 1} ({exc.strerror}); "
                                 f"choose another --port or --host") from None
    raise SystemExit(f"intml-aggregator: found no {cores} free consecutive ports on {host}; pass --port")


def _multicast_group(parser: OneLineParser, text: str | None, max_jobs: int) -> int | None:
    """--multicast as an integer (job table entry j sends to GROUP + j), or a one-line usage error."""
    if text is None:
        return None
    parser.check("--multicast", multicast_group, text, max_jobs, "one per job, --max-jobs")
    return int(ipaddress.IPv4Address(text))


def _multicast_sender(sock: socket.socket, host: str, ttl: int) -> None:
    """Send multicast through the interface of `host` (loopback for 127.0.0.1), looped back to local members."""
    sock.setsockopt(socket.IPPROTO_IP, socket.IP_MULTICAST_IF, socket.inet_aton(socket.gethostbyname(host)))
    sock.setsockopt(socket.IPPROTO_IP, socket.IP_MULTICAST_LOOP, 1)
    sock.setsockopt(socket.IPPROTO_IP, socket.IP_MULTICAST_TTL, ttl)


def _core_factory(parser: OneLineParser, args) -> Callable[..., Any]:
    """What makes a core of --engine (with the kernel's options), or a one-line usage error where the P4 switch
    cannot hold the configuration."""
    if args.engine == "kernel":
        from intml.aggregator.core import AggregatorCore

        return functools.partial(AggregatorCore, burst=args.burst)
    from intml.p4.engine import engine_problem, p4model_core

    problem = engine_problem(args.slots, args.max_jobs, args.engine)
    if problem:
        parser.error(problem)
    if args.engine == "p4model":
        return p4model_core  # the model builds each output burst to its size
    from intml.p4.bmv2 import bmv2_core
    from intml.testbed.bmv2 import Bmv2Error, Bmv2Switch, missing

    if args.cores != 1:
        parser.option_error("--cores", "--engine bmv2 drives one switch: run it with --cores 1")
    if args.bmv2_program is None:
        parser.error("--engine bmv2 needs --bmv2-program PATH: the JSON p4c-bm2-ss compiles from p4/intml.p4 "
                     "(p4c-bm2-ss -o intml.json p4/intml.p4)")
    problem = missing()
    if problem:
        parser.error(f"--engine bmv2: {problem}")
    try:
        switch = Bmv2Switch(args.bmv2_program)
    except Bmv2Error as exc:
        parser.error(f"--engine bmv2: {exc}")
    atexit.register(switch.close)  # on exit, SIGTERM's too: the switch and its namespace go with the process
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    return functools.partial(bmv2_core, switch=switch)


def _metrics(parser: OneLineParser, args) -> ModuleType | None:
    """The metrics module for --metrics-port (None without it), or a one-line error naming the missing extra."""
    if args.metrics_port is None:
        return None
    try:
        from intml.aggregator import metrics
    except ModuleNotFoundError as exc:
        if not (exc.name or "").startswith("prometheus_client"):
            raise
        parser.error("--metrics-port needs prometheus-client: pip install 'intml[metrics]'")
    return metrics


def _announce(args, metrics: ModuleType | None, counters: list | None, base: int) -> None:
    """Serve the metrics (if asked), then print the line(s) scripts wait for."""
    if metrics is not None:
        try:
            port = metrics.serve(counters, args.metrics_address, args.metrics_port)
        except OSError as exc:
            raise SystemExit(f"intml-aggregator: cannot serve metrics on {args.metrics_address}:{args.metrics_port} "
                             f"({exc.strerror or exc}); choose another --metrics-port or --metrics-address") from None
        print(f"intml-aggregator metrics on http://{args.metrics_address}:{port}/metrics", flush=True)
    print(f"intml-aggregator listening on {args.host}:{base} cores {args.cores}", flush=True)


def build_parser() -> OneLineParser:
    p = OneLineParser(prog="intml-aggregator", description="Switch-emulating C_nat aggregator.")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=port, default=DEFAULT_PORT, help=f"first UDP port (default {DEFAULT_PORT}; 0 = any)")
    p.add_argument("--cores", type=count(1, MAX_CORES, "a job's cores: one byte in the JOIN"),
                   default=default_cores(),
                   help=f"data-plane processes, one port each (default {default_cores()}: half the CPUs this "
                        f"process may use, as the kernel's packet processing needs about as much again; pass fewer "
                        f"where workers share the host)")
    p.add_argument("--max-jobs", type=positive(int), default=AGGREGATOR_MAX_JOBS,
                   help=f"jobs per core at once (default {AGGREGATOR_MAX_JOBS})")
    p.add_argument("--max-pool", type=positive(int), default=AGGREGATOR_MAX_POOL,
                   help=f"slots one job may reserve (default {AGGREGATOR_MAX_POOL}), so that no JOIN takes the table")
    p.add_argument("--tenant-max-jobs", type=positive(int), default=None,
                   help="jobs the holders of one token may have on a core at once (default: --max-jobs), so that "
                        "one tenant cannot take every job entry")
    p.add_argument("--tenant-max-slots", type=positive(int), default=None,
                   help="slot rows the jobs of one token may hold on a core at once (default: --slots), so that "
                        "one tenant cannot take the table")
    p.add_argument("--slots", type=positive(int), default=AGGREGATOR_SLOTS,
                   help="slot rows per core, shared by jobs; memory is 16 bytes x slots x max packet elements "
                        f"(default {AGGREGATOR_SLOTS})")
    p.add_argument("--max-packet-elements", type=count(1, MAX_ELEMENTS_LIMIT, "one UDP datagram of cnat8"),
                   default=AGGREGATOR_MAX_ELEMENTS,
                   help=f"largest packet a job may use (default {AGGREGATOR_MAX_ELEMENTS}, at most {MAX_ELEMENTS_LIMIT})")
    p.add_argument("--idle-timeout", type=positive(float), default=AGGREGATOR_IDLE_TIMEOUT,
                   help=f"seconds without traffic before a job is torn down (default {AGGREGATOR_IDLE_TIMEOUT:g}: "
                        "longer than a training pause for evaluation or a checkpoint)")
    p.add_argument("--stats-interval", type=non_negative, default=0.0,
                   help="print statistics every N seconds (0 = never)")
    p.add_argument("--multicast", metavar="GROUP", default=None,
                   help="send each job's results to one IPv4 multicast group (GROUP + the job's table index, port "
                        "= --port), one datagram per completion as a switch's replication engine does, instead "
                        "of one per worker; for workers that share the aggregator's link or host (loopback), or "
                        "behind a multicast router (then raise --multicast-ttl)")
    p.add_argument("--multicast-ttl", type=positive(int, 255), default=1,
                   help="the results' IP TTL (default 1: they stay on the aggregator's link; each multicast router "
                        "on the way takes one off)")
    control = ControlLimits()
    p.add_argument("--control-rate", type=positive(float), default=control.source_rate,
                   help=f"JOIN/LEAVE/STATS datagrams per second one source address may send (default "
                        f"{control.source_rate:g}); the excess is dropped in the kernel as drop_control_rate")
    p.add_argument("--control-burst", type=positive(int), default=control.source_burst,
                   help=f"control datagrams one source may send at once (default {control.source_burst})")
    p.add_argument("--control-global-rate", type=positive(float), default=control.global_rate,
                   help=f"control datagrams per second a core hands to its control plane from all sources (default "
                        f"{control.global_rate:g}): bounds the CPU a flood from many sources can take")
    p.add_argument("--control-global-burst", type=positive(int), default=control.global_burst,
                   help=f"control datagrams a core takes at once from all sources (default {control.global_burst})")
    p.add_argument("--control-per-burst", type=positive(int), default=control.per_burst,
                   help=f"control datagrams one received burst may hand to the control plane (default "
                        f"{control.per_burst})")
    p.add_argument("--token-file", metavar="PATH", default=None,
                   help="the tokens jobs may be created with, one per non-empty line (one per tenant); INTML_TOKEN "
                        "adds one. With neither, only the empty token joins (open mode, with a warning)")
    p.add_argument("--engine", choices=ENGINES, default=ENGINES[0],
                   help="data path: the Numba burst kernel (default) or the P4 pipeline model (slow; no data_mac, "
                        "at most 1 KB of payload per packet), or that model's program on a real BMv2 simple_switch "
                        "(--bmv2-program; one core, root)")
    p.add_argument("--bmv2-program", metavar="PATH", default=None,
                   help="--engine bmv2: the program p4c-bm2-ss compiled from p4/intml.p4 (intml.json)")
    p.add_argument("--burst", type=positive(int), default=BURST,
                   help=f"datagrams per recvmmsg/sendmmsg (default {BURST})")
    p.add_argument("--job-history", type=count(0), default=AGGREGATOR_JOB_HISTORY, metavar="N",
                   help=f"finished jobs each core keeps, with their final counters and when and why they ended, for "
                        f"STATS_REPLY (default {AGGREGATOR_JOB_HISTORY}: a full job table's worth)")
    p.add_argument("--metrics-port", type=count(0, PORTS - 1, "a TCP port; 0 picks a free one"), default=None, metavar="PORT",
                   help="serve Prometheus metrics (every core's counters) at http://ADDRESS:PORT/metrics; 0 picks a "
                        "free port, printed on a line before the ready line (needs: pip install 'intml[metrics]')")
    p.add_argument("--metrics-address", default="127.0.0.1", metavar="ADDRESS",
                   help="address the metrics endpoint listens on (default 127.0.0.1; 0.0.0.0 for a remote "
                        "Prometheus: the counters carry job ids, no addresses or secrets)")
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.port + args.cores > PORTS:
        parser.option_error("--port", f"{args.port}..{args.port + args.cores - 1} (one port per core) runs past "
                                      f"{PORTS - 1}: use a lower --port or fewer --cores")
    metrics = _metrics(parser, args)
    group = _multicast_group(parser, args.multicast, args.max_jobs)
    make_core = _core_factory(parser, args)
    if group is not None and args.host in ("", "0.0.0.0"):
        parser.error("--multicast needs --host to name the interface the results go out on (for example "
                     "--host 127.0.0.1, or this host's address on the workers' link), not 0.0.0.0")
    tokens = _tokens(parser, args.token_file, dict(os.environ))
    socks = _bind(args.host, args.port, args.cores)
    base = socks[0].getsockname()[1]
    if group is not None:
        for s in socks:
            _multicast_sender(s, args.host, args.multicast_ttl)

    from intml.aggregator.counters import CoreCounters
    from intml.aggregator.dataplane import run_core, warm_up

    limits = ControlLimits(args.control_rate, args.control_burst, args.control_global_rate,
                           args.control_global_burst, args.control_per_burst)
    # with metrics, each core's counters live in an anonymous shared mapping: the main process reads them all
    size = CoreCounters.nbytes(args.max_jobs, args.slots)
    counters = None if metrics is None else [CoreCounters(args.max_jobs, args.slots, mmap.mmap(-1, size))
                                             for _ in range(args.cores)]

    def new_core(i: int):
        return make_core(core=i, cores=args.cores, rows=args.slots, max_elements=args.max_packet_elements,
                          idle_timeout=args.idle_timeout, results_group=None if group is None else (group, base),
                          max_jobs=args.max_jobs, max_pool=args.max_pool, control_limits=limits,
                          tokens=tokens or [""],  # no token: the open mode's empty one
                          job_history=args.job_history, counters=None if counters is None else counters[i],
                          tenant_max_jobs=args.tenant_max_jobs, tenant_max_slots=args.tenant_max_slots)

    def core_main(i: int) -> None:
        run_core(new_core(i), socks[i], args.burst, args.stats_interval)

    try:  # one core's tables before the ready line: a configuration this host cannot hold fails here, in one line
        first = new_core(0)
    except MemoryError as exc:
        raise SystemExit(f"intml-aggregator: a core's tables do not fit in memory ({exc}); lower --slots, "
                         f"--max-packet-elements, --max-jobs or --burst") from None
    if not tokens:  # warned only once everything else is valid
        print(OPEN_WARNING, file=sys.stderr, flush=True)
    warm_up(args.max_packet_elements, args.burst)  # before the ready line: the first JOIN is answered at once
    if args.cores == 1 and metrics is None:
        _announce(args, metrics, counters, base)
        run_core(first, socks[0], args.burst, args.stats_interval)
        return 0
    del first  # each child builds its own
    # one process per core; with metrics even for one core, so that a scrape never holds a core's GIL
    ctx = multiprocessing.get_context("fork")  # the children inherit the bound sockets and counter mappings
    children = [ctx.Process(target=core_main, args=(i,), daemon=True) for i in range(args.cores)]
    for c in children:
        c.start()
    _announce(args, metrics, counters, base)  # after the fork: no server thread is copied into the cores
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    try:
        for c in children:
            c.join()
    except (KeyboardInterrupt, SystemExit):
        pass
    finally:
        for c in children:
            if c.is_alive():
                os.kill(c.pid, signal.SIGINT)
        for c in children:
            c.join(timeout=2)
            if c.is_alive():
                c.kill()
    return 0


if __name__ == "__main__":
    sys.exit(main())
