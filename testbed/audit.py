"""`intml-testbed audit`: attack a live aggregator and real workers on loopback, and print a table of what held.

It starts its own aggregator (one core, on 127.0.0.1, with a fresh token) and runs, each bounded in time:

* a JOIN under a wrong token (nothing is created), a replayed JOIN after its job ended (no job comes back), a
  replayed operator STATS_REQUEST (not answered), every request type from an unjoined socket (no reply larger
  than its request), a one-second control flood (a JOIN right after it is answered);
* with a raw socket (root or CAP_NET_RAW; else those rows say "skipped"): forged RESULTs of consecutive rounds
  spoofed from the aggregator's address, and forged DATA spoofed from a rank's address that the aggregator turns
  into such RESULTs, at pool sizes 1 to 256 (the worker survives, counts them, and its next job is bit-exact),
  and a spoofed LEAVE (the job keeps running);
* fuzzed datagrams at the live aggregator (it stays up, and a job after them is bit-exact);
* two tenants (the run's token and a second one, --token-file) running a job of the same id at once (each
  allreduce is bit-exact: each job sums its own tenant's ranks only).

``--fuzz N`` adds a campaign of N fuzzed datagrams against the worker's and the aggregator's receive paths
in-process, in a Python whose Numba compiles every kernel with bounds checking (NUMBA_BOUNDSCHECK=1): an index
out of range raises there instead of corrupting memory, and is counted as a crash.
"""

from __future__ import annotations

import json
import os
import random
import secrets
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import numpy as np

from intml.protocol import keys, reference, wire
from intml.protocol.address import addr_key_of
from intml.protocol.burst import Burst
from intml.protocol.wire import Codec, MsgType
from intml.testbed.forge import forged_data, forged_result, forged_rounds, fuzzed

HOST = "127.0.0.1"
POOLS = (1, 2, 64, 256)  # the victim's pool sizes
P = 16  # elements per packet of the audit's jobs: small, so that many rounds fit in one receive burst
Row = tuple[str, str, str]  # (check, "held" | "FAILED" | "skipped", what was seen)


def join_params(pool: int, world: int = 1, flags: int = 0) -> dict:
    return {"world_size": world, "packet_elements": P, "pool_size": pool, "codec": 0, "seed": 5, "flags": flags}


def handshake(sock: socket.socket, target: tuple[str, int], job: int, rank: int, token: str,
              params: dict) -> tuple[bytes, bytes, bytes]:
    """The JOIN handshake from ``sock``: (the proved JOIN as sent, the core's reply to it, the client nonce)."""
    header = {"type": int(MsgType.JOIN), "job": job, "rank": rank}
    nonce = os.urandom(keys.NONCE_SIZE)
    sock.sendto(wire.pack_join(header, {**params, "nonce": nonce}), target)
    cookie = bytes(wire.unpack_challenge(sock.recv(1 << 16))[1]["cookie"])
    proved = keys.seal(keys.token_key(token), wire.pack_join(header, {**params, "nonce": nonce, "cookie": cookie}),
                       wire.JOIN_MAC)
    sock.sendto(proved, target)
    return proved, sock.recv(1 << 16), nonce


def leave(token: str, job: int, rank: int, nonce: bytes, ack: bytes) -> bytes:
    """The LEAVE of the rank a JOIN_ACK admitted (its session key from the token, nonce and cookie)."""
    cookie = bytes(wire.unpack_join(ack)[1]["cookie"])
    session = keys.session_key(keys.token_key(token), job, rank, nonce, cookie)
    datagram = wire.pack({"type": int(MsgType.LEAVE), "job": job, "rank": rank}, bytes(keys.MAC_SIZE))
    return keys.seal(session, datagram, len(datagram) - keys.MAC_SIZE)


def _reply(sock: socket.socket, timeout: float) -> bytes | None:
    sock.settimeout(timeout)
    try:
        return sock.recv(1 << 16)
    except TimeoutError:
        return None


def _live_jobs(port: int, token: str) -> set[int]:
    from intml.aggregator.core import operator_request

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.bind((HOST, 0))
        for _ in range(3):
            s.sendto(operator_request(token, time.time_ns(), size=4096), (HOST, port))
            reply = _reply(s, 1.0)
            if reply is not None and reply[wire.OFFSETS["type"]] == MsgType.STATS_REPLY:
                return {int(j) for j in json.loads(reply[wire.HEADER_SIZE:-keys.MAC_SIZE])["jobs"]}
    raise RuntimeError("the aggregator does not answer the operator's STATS_REQUEST")


# ---- the victim: a worker process that joins, lets forgeries land, then runs a genuine job -----------------------


def victim(agg_port: int, token: str, pools: tuple[int, ...], ports, go) -> list[dict]:
    """For each pool size: join a world-1 job (id 1000 + pool), report this rank's port on ``ports``, wait for
    ``go`` while the forgeries land in its socket, run the attacked allreduce (its outcome is the attacker's
    without the MAC), then a genuine allreduce in a fresh job (id 2000 + pool), which must be the reference's."""
    from intml.worker import AllreduceTimeout, Worker

    out = []
    for pool in pools:
        x = np.linspace(-1, 1, P * (3 * pool + 1), dtype=np.float32)
        common = dict(rank=0, world_size=1, token=token, packet_elements=P, pool_size=pool, timeout=5)
        with Worker(f"{HOST}:{agg_port}", job=1000 + pool, **common) as w:
            ports.put(w.io.sock.getsockname()[1])
            if not go.wait(60):
                raise TimeoutError("the attacker never said go")
            go.clear()
            try:
                w.allreduce(x)
                attacked = "completed"
            except AllreduceTimeout:
                attacked = "timed out"
            counters = w.counters()
        with Worker(f"{HOST}:{agg_port}", job=2000 + pool, **common) as w:
            genuine = w.allreduce(x)
        want = reference.allreduce([x], codec="cnat8", seed=w.engine.seed, allreduce_seq=0, packet_elements=P)
        out.append({"pool": pool, "attacked": attacked, "counters": counters,
                    "exact": genuine.view(np.uint32).tolist() == want.view(np.uint32).tolist()})
    return out


def forge_at(raw: socket.socket, mode: str, agg_port: int, victim_port: int, pool: int) -> int:
    """Send a fresh job's (id 1000 + pool) forged rounds 0 and 1 of every slot, each slot's two together: as
    RESULTs from the aggregator's address to the victim (mode "result"), or as DATA from the victim's address to
    the aggregator, which completes each (a world-1 job) into such a RESULT (mode "data"). Returns the count."""
    from intml.testbed.spoof import send_spoofed

    agg, rank = addr_key_of(HOST, agg_port), addr_key_of(HOST, victim_port)
    rounds = forged_rounds(job=1000 + pool, elements=P * (3 * pool + 1), packet_elements=P, pool_size=pool, rounds=2)
    rounds.sort(key=lambda d: int.from_bytes(d[18:20], "big"))
    for d in rounds:
        if mode == "result":
            send_spoofed(raw, d, agg, rank)
        else:
            h = wire.unpack(d)[0]
            data = forged_data(job=1000 + pool, rank=0, **{k: int(h[k]) for k in (
                "allreduce", "chunk", "slot", "count", "shadow", "exp", "next_exp")})
            send_spoofed(raw, data, rank, agg)
    return len(rounds)


def check_victim_reports(reports: list[dict]) -> str | None:
    """What went wrong for the victim, or None: its counters add up, it counted results it never asked for
    (drop_unsent), and every genuine job after an attack was bit-exact."""
    for res in reports:
        c = res["counters"]
        drops = sum(v for k, v in c.items() if k.startswith("drop_"))
        if c["packets_in"] != c["results"] + drops:
            return f"pool {res['pool']}: counters do not add up: {c}"
        if c["drop_unsent"] == 0:
            return f"pool {res['pool']}: no forged round was counted as drop_unsent: {c}"
        if not res["exact"]:
            return f"pool {res['pool']}: the genuine job after the attack was not bit-exact"
    return None


def _forgery(port: int, token: str, mode: str, pools: tuple[int, ...]) -> Row:
    import multiprocessing as mp

    from intml.testbed.spoof import raw_socket

    name = "forged RESULTs (spoofed aggregator)" if mode == "result" else "forged DATA (spoofed rank)"
    try:
        raw = raw_socket()
    except PermissionError:
        return name, "skipped", "needs root or CAP_NET_RAW to spoof source addresses"
    ctx = mp.get_context("fork")
    ports, go, done = ctx.Queue(), ctx.Event(), ctx.Queue()
    proc = ctx.Process(target=_victim_child, args=(done, port, token, pools, ports, go), daemon=True)
    proc.start()
    sent = 0
    try:
        with raw:
            for pool in pools:
                victim_port = get_from(ports, proc, 60)
                sent += forge_at(raw, mode, port, victim_port, pool)
                time.sleep(0.3)  # the forgeries land in the victim's socket before its allreduce reads it
                go.set()
        result = get_from(done, proc, 120)
    finally:
        if proc.is_alive():
            proc.kill()
        proc.join(5)
    if isinstance(result, str):
        return name, "FAILED", result
    problem = check_victim_reports(result)
    unsent = sum(r["counters"]["drop_unsent"] for r in result)
    return name, "FAILED" if problem else "held", problem or (
        f"{sent} forged at pools {'/'.join(map(str, pools))}: no crash, {unsent} counted as drop_unsent, "
        f"next jobs bit-exact")


def _victim_child(done, *args) -> None:
    try:
        done.put(victim(*args))
    except BaseException as exc:  # noqa: BLE001 -- reported to the parent as a failed row
        done.put(f"{type(exc).__name__}: {exc}")


def get_from(q, proc, timeout: float):
    """The next item on ``q``; RuntimeError naming the exit code if ``proc`` died first (-11: SIGSEGV)."""
    import queue

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            return q.get(timeout=0.2)
        except queue.Empty:
            if proc.exitcode is not None:
                raise RuntimeError(f"the worker died with exit code {proc.exitcode}") from None
    raise RuntimeError(f"the worker did not answer within {timeout} s")


# ---- the control-plane checks ----------------------------------------------------------------------------------


def _wrong_token(port: int, token: str) -> Row:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.bind((HOST, 0))
        s.settimeout(2)
        _, reply, _ = handshake(s, (HOST, port), 41, 0, token + "-wrong", join_params(4))
    held = reply[wire.OFFSETS["type"]] == MsgType.ERROR and 41 not in _live_jobs(port, token)
    return "JOIN under a wrong token", "held" if held else "FAILED", "refused, no job created" if held else (
        "a job was created or no refusal came")


def _replayed_join(port: int, token: str) -> Row:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.bind((HOST, 0))
        s.settimeout(2)
        proved, ack, nonce = handshake(s, (HOST, port), 42, 0, token, join_params(4, flags=wire.FLAG_DATA_MAC))
        s.sendto(leave(token, 42, 0, nonce, ack), (HOST, port))
        time.sleep(0.2)
        s.sendto(proved, (HOST, port))  # replayed within the cookie's window, after the job ended
        reply = _reply(s, 2.0)
    typ = None if reply is None else MsgType(reply[wire.OFFSETS["type"]])
    held = typ == MsgType.CHALLENGE and 42 not in _live_jobs(port, token)
    return "JOIN replayed after its job ended", "held" if held else "FAILED", (
        "answered with a CHALLENGE, no job revived" if held else f"answered with {typ}")


def _operator_replay(port: int, token: str) -> Row:
    from intml.aggregator.core import operator_request

    request = operator_request(token, time.time_ns())
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.bind((HOST, 0))
        s.sendto(request, (HOST, port))
        first = _reply(s, 2.0)
        s.sendto(request, (HOST, port))
        again = _reply(s, 1.0)
    held = first is not None and again is None
    return "operator STATS_REQUEST replayed", "held" if held else "FAILED", (
        "the first answered, the replay not" if held else f"first {first is not None}, replay {again is not None}")


def _amplification(port: int) -> Row:
    worst, requests, replies = 0.0, 0, 0
    rng = random.Random(3)
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.bind((HOST, 0))
        for typ in [*MsgType, 200]:
            for size in (wire.HEADER_SIZE, 42, 60, 120, 512):
                for job in (0, 42, 0xFFFFFFFF):
                    body = rng.randbytes(size - wire.HEADER_SIZE)
                    request = wire.pack({"type": int(typ), "job": job, "rank": rng.choice((0, 0xFFFF))}, body)
                    s.sendto(request, (HOST, port))
                    requests += 1
                    # the next request waits 0.07 s, within the per-source control budget (16/s, 32 at once): the
                    # replies are read meanwhile, not waited for on top of it
                    paced = time.monotonic() + 0.07
                    while (left := paced - time.monotonic()) > 0 and (reply := _reply(s, left)) is not None:
                        replies += 1
                        worst = max(worst, len(reply) / len(request))
    held = worst <= 1.0
    return "no reply larger than its request", "held" if held else "FAILED", (
        f"{requests} requests of every type, {replies} replies, largest {worst:.2f}x its request")


def _control_flood(port: int, token: str, seconds: float = 1.0) -> Row:
    rng = random.Random(4)
    kinds = [wire.pack_join({"type": int(MsgType.JOIN), "job": 43, "rank": 0},
                            {**join_params(4), "nonce": rng.randbytes(16)}),
             wire.pack({"type": int(MsgType.LEAVE), "job": 43}, rng.randbytes(16)),
             wire.pack({"type": int(MsgType.STATS_REQUEST), "job": 43, "rank": 0xFFFF}, rng.randbytes(100)),
             rng.randbytes(60)]
    sent = 0
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s, \
            socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as j:
        s.bind((HOST, 0))
        s.setblocking(False)
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            for d in kinds:
                try:
                    s.sendto(d, (HOST, port))
                    sent += 1
                except BlockingIOError:
                    pass
        j.bind((HOST, 0))
        j.settimeout(2)
        start = time.perf_counter()
        _, ack, nonce = handshake(j, (HOST, port), 44, 0, token, join_params(4))
        took = time.perf_counter() - start
        j.sendto(leave(token, 44, 0, nonce, ack), (HOST, port))
    held = ack[wire.OFFSETS["type"]] == MsgType.JOIN_ACK and took < 1.0
    return "control flood from one socket", "held" if held else "FAILED", (
        f"{sent} datagrams in {seconds:g} s; a JOIN right after it answered in {took * 1e3:.1f} ms")


def _live_fuzz(port: int, token: str, n: int = 20_000) -> Row:
    """Fuzzed DATA near a live job's, from an unjoined socket, and garbage; then a job must be bit-exact."""
    from intml.worker import Worker

    rng = random.Random(5)
    datagrams = fuzzed(rng, n, job=2000 + POOLS[0], elements=P * 4, packet_elements=P, pool_size=4,
                       max_len=P + 64, typ=MsgType.DATA) + [rng.randbytes(rng.randint(0, 100)) for _ in range(n // 4)]
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.bind((HOST, 0))
        for d in datagrams:
            s.sendto(d, (HOST, port))
    x = np.linspace(-3, 3, 1000, dtype=np.float32)
    with Worker(f"{HOST}:{port}", job=45, rank=0, world_size=1, token=token, packet_elements=P, pool_size=8,
                timeout=10) as w:
        got = w.allreduce(x)
    want = reference.allreduce([x], codec="cnat8", seed=w.engine.seed, allreduce_seq=0, packet_elements=P)
    held = got.view(np.uint32).tolist() == want.view(np.uint32).tolist()
    return "fuzzed datagrams at the aggregator", "held" if held else "FAILED", (
        f"{len(datagrams)} sent; the aggregator stayed up and a job after them was bit-exact" if held else
        "a job after them was not bit-exact")


def _spoofed_leave(port: int, token: str) -> Row:
    from intml.testbed.spoof import raw_socket, send_spoofed

    try:
        raw = raw_socket()
    except PermissionError:
        return "spoofed LEAVE", "skipped", "needs root or CAP_NET_RAW"
    with raw, socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.bind((HOST, 0))
        s.settimeout(2)
        _, ack, nonce = handshake(s, (HOST, port), 46, 0, token, join_params(4))
        forged = wire.pack({"type": int(MsgType.LEAVE), "job": 46, "rank": 0}, os.urandom(keys.MAC_SIZE))
        send_spoofed(raw, forged, addr_key_of(HOST, s.getsockname()[1]), addr_key_of(HOST, port))
        time.sleep(0.2)
        alive = 46 in _live_jobs(port, token)
        s.sendto(leave(token, 46, 0, nonce, ack), (HOST, port))
    return "spoofed LEAVE (bad MAC)", "held" if alive else "FAILED", (
        "dropped, the job kept its rank" if alive else "the job was torn down")


def _two_tenants(port: int, tokens: tuple[str, str]) -> Row:
    """Each of two tokens runs job 47 at once; each allreduce must be its own input's, bit-exact."""
    import threading

    from intml.worker import Worker

    xs = [np.linspace(-3, 3, 1000, dtype=np.float32), np.linspace(10, 20, 1000, dtype=np.float32)]
    got: dict[int, np.ndarray] = {}
    start = threading.Barrier(2)

    def tenant(i: int) -> None:
        with Worker(f"{HOST}:{port}", job=47, rank=0, world_size=1, token=tokens[i], packet_elements=P,
                    pool_size=8, seed=47, timeout=10) as w:
            start.wait(20)
            got[i] = w.allreduce(xs[i]).copy()

    threads = [threading.Thread(target=tenant, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    exact = [i in got and np.array_equal(got[i].view(np.uint32), reference.allreduce(
        [xs[i]], codec="cnat8", seed=47, allreduce_seq=0, packet_elements=P).view(np.uint32)) for i in range(2)]
    return "two tenants, same job id", "held" if all(exact) else "FAILED", (
        "both jobs ran at once, each bit-exact over its own ranks" if all(exact) else
        f"bit-exact: tenant 1 {exact[0]}, tenant 2 {exact[1]}")


# ---- the fuzz campaign, in-process with bounds checking ----------------------------------------------------------


def fuzz_receive_paths(n: int, seed: int = 0, burst: int = 256) -> dict:
    """n fuzzed datagrams, half to a worker's receive path (StreamEngine.receive: fuzzed RESULTs and forged
    consecutive rounds, a timer call after each burst, a new allreduce whenever one ends or every 64 bursts) and
    half to an aggregator core's (AggregatorCore.receive and its control plane: fuzzed DATA from the members'
    addresses and a stranger's, control datagrams, garbage). An exception is a crash: counted, its first
    traceback kept, and the receiver made anew."""
    import numba

    from intml.aggregator.core import AggregatorCore
    from intml.worker.engine import StreamEngine

    rng = random.Random(seed)
    agg = addr_key_of(HOST, 48879)
    members = [addr_key_of(HOST, 5000 + r) for r in range(2)]
    stats = {"boundscheck": bool(numba.config.BOUNDSCHECK), "worker_datagrams": 0, "aggregator_datagrams": 0,
             "crashes": 0, "first_crash": None, "worker_results": 0, "aggregator_completions": 0}
    start = time.perf_counter()

    def crash() -> None:
        stats["crashes"] += 1
        stats["first_crash"] = stats["first_crash"] or traceback.format_exc()

    def new_worker() -> tuple[StreamEngine, int, int]:
        pool = rng.choice((1, 3, 16, 64))
        engine = StreamEngine(job=7, rank=0, world_size=2, codec=rng.choice(list(Codec)), packet_elements=P,
                              pool_size=pool, seed=1, agg_addrs=[agg])
        return engine, pool, 0

    engine, pool, bursts = new_worker()
    rx = Burst.rows_of(burst, wire.MAX_DATAGRAM)
    elements = 0
    while stats["worker_datagrams"] < n // 2:
        try:
            if bursts % 64 == 0 or engine.done:
                elements = P * rng.randint(1, 4 * pool) - rng.randint(0, P - 1)
                engine.start(np.linspace(-2, 2, elements, dtype=np.float32), 0.0)
        except Exception:  # noqa: BLE001 -- a crash of the engine is what the campaign counts
            crash()
            stats["worker_results"] += engine.counters()["results"]
            engine, pool, bursts = new_worker()
            continue
        size = rng.randint(1, burst)
        datagrams = fuzzed(rng, size, job=7, elements=elements, packet_elements=P, pool_size=pool,
                           max_len=engine.max_datagram + 16)
        datagrams += _answers(engine, elements, rng)[:burst - size]  # the rounds the slots wait for, and after
        rng.shuffle(datagrams)
        rx.fill((d, agg) for d in datagrams)
        try:
            engine.receive(rx, 0.001 * bursts)
            engine.handle_timer(0.5 * bursts)
        except Exception:  # noqa: BLE001
            crash()
            stats["worker_results"] += engine.counters()["results"]
            engine, pool, bursts = new_worker()
        stats["worker_datagrams"] += rx.count
        bursts += 1
    stats["worker_results"] += engine.counters()["results"]

    def control(core: AggregatorCore, datagram: bytes, addr: int) -> list[tuple[bytes, int]]:
        rx.fill([(datagram, addr)])
        core.receive(rx, 0.0)
        return core.take_replies()

    def new_core() -> AggregatorCore:
        """A core with a 2-rank job of 16 slots, joined by the members' addresses."""
        core = AggregatorCore(tokens=["fuzz"], rows=64, max_elements=256)
        for r, addr in enumerate(members):
            header = {"type": int(MsgType.JOIN), "job": 7, "rank": r}
            fields = {**join_params(16, 2), "nonce": bytes(16)}
            [(challenge, _)] = control(core, wire.pack_join(header, fields), addr)
            cookie = bytes(wire.unpack_challenge(challenge)[1]["cookie"])
            proved = wire.pack_join(header, {**fields, "cookie": cookie})
            control(core, keys.seal(keys.token_key("fuzz"), proved, wire.JOIN_MAC), addr)
        return core

    core = new_core()
    now = 0.0
    while stats["aggregator_datagrams"] < n - n // 2:
        size = rng.randint(1, burst)
        datagrams = fuzzed(rng, size, job=7, elements=P * 40, packet_elements=P, pool_size=16, max_len=P * 4 + 64,
                           typ=MsgType.DATA)
        for d in datagrams[:size // 4]:  # the same round from the other rank too: rounds complete
            if len(d) > 17:
                datagrams.append(d[:17] + bytes([d[17] ^ 1]) + d[18:])
        datagrams = sorted(datagrams[:burst], key=lambda d: d[8:16])  # a round's contributions close together
        # mostly from the address of the rank the datagram names, so that rounds fill and complete
        datagrams = [(d, members[d[17] % len(members)] if len(d) > 17 and rng.random() < 0.9 else agg)
                     for d in datagrams]
        for i in rng.sample(range(len(datagrams)), len(datagrams) // 20):  # control datagrams and garbage
            d = rng.randbytes(rng.randint(0, 200))
            if rng.random() < 0.7:
                d = wire.pack({"type": rng.choice((3, 5, 6)), "job": rng.choice((7, 8)),
                               "rank": rng.choice((0, 1, 0xFFFF))}, d)
            datagrams[i] = (d, datagrams[i][1])
        rx.fill(datagrams)
        now += 0.001
        try:
            core.receive(rx, now)
            core.take_replies()
        except Exception:  # noqa: BLE001
            crash()
            core = new_core()
        stats["aggregator_datagrams"] += rx.count
    stats["aggregator_completions"] = int(core.stats(now)["core_counters"]["completions"])
    stats["seconds"] = round(time.perf_counter() - start, 1)
    return stats


def _answers(engine, elements: int, rng: random.Random) -> list[bytes]:
    """Well-formed RESULTs for the rounds ``engine``'s slots wait for, each followed by up to two consecutive later
    rounds of its slot (naming exponent 0 for the next chunk), so that the fuzz reaches the accepting paths."""
    chunks = -(-elements // P)
    window = min(engine.pool_size, chunks)
    out = []
    for s in engine.pending_slots():
        c, parity = int(engine.state.cur_chunk[s]), int(engine.parity[s])
        for k in range(rng.randint(1, 3)):
            chunk = c + k * window
            if chunk >= chunks:
                break
            exp = wire.NO_EXP if chunk < 0 else int(engine.agreed_exp[chunk]) if k == 0 else 0
            count = 0 if chunk < 0 else min(P, elements - chunk * P)
            out.append(forged_result(job=7, allreduce=engine.next_allreduce - 1, chunk=chunk, slot=s,
                                     shadow=(parity + k) % 2, count=count, exp=exp, next_exp=0, codec=engine.codec))
    return out


def boundscheck_env() -> dict[str, str]:
    """The environment of a child Python whose Numba compiles every kernel with bounds checking. Its cache is its
    own and only ever holds checked kernels (no unchecked one can be loaded), and it persists, so that the kernels
    are compiled once per machine and source, not once per run: the compile is most of a short campaign's time."""
    cache = Path(tempfile.gettempdir()) / f"intml-numba-boundscheck-{os.getuid()}"
    return dict(os.environ, NUMBA_BOUNDSCHECK="1", NUMBA_CACHE_DIR=str(cache))


def fuzz_checked(n: int, seed: int = 0) -> dict:
    """fuzz_receive_paths in a child Python with NUMBA_BOUNDSCHECK=1 and a Numba cache of its own (so that no
    kernel compiled without the checks is loaded)."""
    proc = subprocess.run([sys.executable, "-m", "intml.testbed.audit", str(n), str(seed)], env=boundscheck_env(),
                          capture_output=True, text=True, check=False)
    if proc.returncode != 0:  # the child itself died: a crash no exception caught
        return {"boundscheck": True, "crashes": 1, "first_crash": f"exit code {proc.returncode}: "
                                                                  f"{proc.stderr.strip()[-2000:]}"}
    return json.loads(proc.stdout.strip().splitlines()[-1])


# ---- the command -------------------------------------------------------------------------------------------------


def _run_checks(checks: list[Callable[[int], Row]], token_file: str) -> list[Row]:
    """Each check against one aggregator that also takes the tokens of ``token_file``; a row each."""
    from intml.testbed.bench_allreduce import aggregator

    rows: list[Row] = []
    with aggregator(1, 1024, extra=("--token-file", token_file)) as port:
        for check in checks:
            try:
                rows.append(check(port))
            except Exception as exc:  # noqa: BLE001 -- one check's failure is a row, the others still run
                rows.append((getattr(check, "__name__", "check"), "FAILED", f"{type(exc).__name__}: {exc}"))
    return rows


def run(fuzz: int, as_json: bool, pools: tuple[int, ...] = POOLS) -> int:
    """Run every check, print the table (or JSON); 0 if everything held, 1 otherwise."""
    from intml.testbed.procs import run_token

    token, second = run_token(), secrets.token_hex(16)  # the second tenant's token
    checks: list[Callable[[int], Row]] = [
        lambda port: _wrong_token(port, token), lambda port: _replayed_join(port, token),
        lambda port: _operator_replay(port, token), _amplification, lambda port: _spoofed_leave(port, token),
        lambda port: _forgery(port, token, "result", pools), lambda port: _forgery(port, token, "data", pools),
        lambda port: _live_fuzz(port, token), lambda port: _control_flood(port, token),
        lambda port: _two_tenants(port, (token, second))]
    start = time.monotonic()
    with tempfile.NamedTemporaryFile("w", suffix=".tokens") as token_file:
        token_file.write(second + "\n")
        token_file.flush()
        rows = _run_checks(checks, token_file.name)
    fuzzed_stats = None
    if fuzz:
        fuzzed_stats = fuzz_checked(fuzz)
        held = fuzzed_stats["crashes"] == 0 and fuzzed_stats["boundscheck"]
        rows.append(("fuzz campaign, bounds checked", "held" if held else "FAILED",
                     f"{fuzzed_stats.get('worker_datagrams', 0)} datagrams to a worker, "
                     f"{fuzzed_stats.get('aggregator_datagrams', 0)} to an aggregator core, "
                     f"{fuzzed_stats['crashes']} crashes" + (f": {fuzzed_stats['first_crash']}"
                                                             if fuzzed_stats["crashes"] else "")))
    seconds = time.monotonic() - start
    if as_json:
        print(json.dumps({"rows": [dict(zip(("check", "outcome", "detail"), row)) for row in rows],
                          "fuzz": fuzzed_stats, "seconds": round(seconds, 1)}))
    else:
        width = max(len(row[0]) for row in rows)
        for check, outcome, detail in rows:
            print(f"{check:<{width}}  {outcome:<7}  {detail}")
        print(f"{sum(r[1] == 'held' for r in rows)} held, {sum(r[1] == 'FAILED' for r in rows)} failed, "
              f"{sum(r[1] == 'skipped' for r in rows)} skipped in {seconds:.0f} s")
    return 0 if all(row[1] != "FAILED" for row in rows) else 1


if __name__ == "__main__":  # the fuzz campaign's child: N [SEED]
    print(json.dumps(fuzz_receive_paths(int(sys.argv[1]), int(sys.argv[2]) if len(sys.argv) > 2 else 0)))
