"""`intml-testbed train`: does DDP (or FSDP2) training converge with intml as it does with Gloo?

The seed-001 network shape adapted to scikit-learn's bundled digits (8x8 images, so 64 inputs instead of
MNIST's 784): a 64-392-50-10 MLP with tanh hidden layers (softmax cross-entropy output), trained with plain
SGD and an exponential learning-rate decay, as in seed 001. N ranks under torchrun on 127.0.0.1, each with a
disjoint shard of the training set; the test split is fixed (25%, stratified) so that seeds vary only the
initialisation and the shuffling.

Runs (``--runs``; every run is repeated for each seed):

* ``gloo``: plain DDP over Gloo (the anchor);
* ``int32``, ``cnat8``: DDP with the intml communication hook (``worker.torch.intml_hook``) and that codec;
* suffixes: ``-ef`` error feedback, ``-wK`` K warm-up steps through Gloo, ``-backend`` the process-group
  backend (``init_process_group("intml")``, DDP without a hook) instead of the hook, ``-thread`` allreduces
  on the background thread (``INTML_THREAD=1``) instead of completed in the hook.

``--parallel average`` is seed 001's own scheme, periodic model averaging: each rank trains its copy on its shard
alone (no gradient allreduce), and after every epoch the ranks average their parameters with torch's
``PeriodicModelAverager`` over the default group (Gloo for ``gloo``, intml for ``<codec>-backend``: any model gets
it by passing an intml group). Its table adds bits per parameter on the wire per averaging, and what gzip
(deflate, level 9; the median over epochs) and LZW (``protocol.lzw``, 16-bit codes; the final parameters) make of
the raw float32 parameters.

``--parallel fsdp2`` trains the same model with FSDP2 instead of DDP: ``fully_shard`` on each Linear layer and on
the root over a 1-D DeviceMesh of all ranks, so the gradients are reduce-scattered (each rank keeps its shard of
the parameters) and the parameters all-gathered; its runs are ``gloo`` and ``<codec>-backend`` (the hook is a DDP
hook). Its gradient reduce-scatters go wherever the backend's ``reduce_scatter_tensor`` sends them, and each report
carries the group's traffic counters, which say how many collectives of each kind went through intml and Gloo.

With DDP, each rank checks after every step that all ranks hold bit-identical parameters (a BLAKE2 hash of them,
all-gathered over Gloo) and fails the run otherwise. Rank 0 writes one JSON report per run; the parent prints
the table (median over seeds of the final test accuracy, epochs to reach ``--target``, time per step, bytes
per step), writes all reports to ``--json-out`` and plots test accuracy against epoch to ``--plot``.

Bytes per step and worker, each way: intml from the packet format (``worker.traffic.intml_bytes``: payload plus
a 26-byte header per data packet and per slot-opening bootstrap packet, retransmissions counted apart);
Gloo from the ring model 2(n-1)/n x 4 bytes per element, not measured. A host codec's are measured (its packages
vary with the data): the packages sent plus a header per packet; what comes back is in the report's traffic
(``host_result_bytes``).
"""

from __future__ import annotations

import argparse
import contextlib
import faulthandler
import hashlib
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import zlib
from collections.abc import Callable
from pathlib import Path

import numpy as np

from intml.protocol import lzw
from intml.protocol.codecs.host import parse as host_codec
from intml.protocol.job import CODEC_NAMES, MAX_WORLD, JobParams, host_aggregator_elements
from intml.protocol.packet import HDR
from intml.sim.compare import epochs_to
from intml.worker.traffic import ring_bytes
from intml.testbed.procs import free_port, rank_env

BASES = ("gloo", *CODEC_NAMES, "auto")  # auto: the hook's tuner picks each bucket's codec (worker.torch.auto)
DEFAULT_RUNS = ("gloo", "int32", "cnat8", "cnat8-ef")
PARALLEL = ("ddp", "fsdp2", "average")
BACKEND_RUNS = ("gloo", "int32-backend", "cnat8-backend")  # the default runs of --parallel fsdp2 and average
HIDDEN = (392, 50)  # seed 001: 784-392-50-10 tanh; digits has 64 inputs
CLASSES = 10
TEST_FRACTION = 0.25
SPLIT_SEED = 0


# ---- run specs -------------------------------------------------------------------------------------------
def parse_run(spec: str, parallel: str = "ddp") -> dict:
    """'cnat8-ef-w20' -> {'name', 'codec', 'error_feedback', 'warmup_steps', 'integration', 'threaded'}. The codec
    may be a host codec's name (protocol.codecs.host: 'uniform8-backend', 'topk0.01-ef'), through the hook or the
    backend as cnat8 is; with --parallel average a bare one ('uniform8', 'adaptive-huffman-c6') averages through a
    Worker of the aggregator's host mode: integration 'worker'."""
    parts = spec.split("-")
    not_host = ""
    for cut in range(len(parts), 0, -1):  # the longest prefix that names a codec: host codecs' names hold '-'
        base = "-".join(parts[:cut])
        if base in BASES:
            break
        try:
            host_codec(base)
        except ValueError as exc:
            not_host = not_host or str(exc)  # the whole spec's reason ('uniform99': N out of range)
        else:
            break
    else:
        raise ValueError(f"run {spec!r}: must start with one of {', '.join(BASES)}, or be a host codec's name: "
                         f"{not_host}")
    flags = parts[cut:]
    if parallel == "average" and base not in BASES and not flags:
        return {"name": spec, "codec": spec, "error_feedback": False, "warmup_steps": 0, "integration": "worker",
                "threaded": False}
    run = {"name": spec, "codec": None if base == "gloo" else base, "error_feedback": False, "warmup_steps": 0,
           "integration": "gloo" if base == "gloo" else "hook", "threaded": False}
    for flag in flags:
        if base == "gloo":
            raise ValueError(f"run {spec!r}: the gloo run takes no options")
        if flag == "ef":
            run["error_feedback"] = True
        elif flag == "backend":
            run["integration"] = "backend"
        elif flag == "thread":
            run["threaded"] = True
        elif flag.startswith("w") and flag[1:].isdigit():
            run["warmup_steps"] = int(flag[1:])
        else:
            raise ValueError(f"run {spec!r}: unknown option {flag!r} (use ef, wK, backend or thread)")
    if run["integration"] == "backend" and (base == "auto" or base.startswith("powersgd")):
        raise ValueError(f"run {spec!r}: {base} runs in the DDP hook, not the backend")
    if run["integration"] == "backend" and (run["error_feedback"] or run["warmup_steps"]):
        raise ValueError(f"run {spec!r}: error feedback and warm-up are options of the hook, not the backend")
    return run


def check_parallel(specs: tuple[str, ...], parallel: str) -> None:
    """FSDP2 and model averaging have no DDP communication hook: their intml runs go through the backend."""
    if parallel not in PARALLEL:
        raise ValueError(f"parallel must be one of {', '.join(PARALLEL)}, got {parallel!r}")
    hooked = [s for s in specs if parse_run(s, parallel)["integration"] == "hook"]
    if parallel != "ddp" and hooked:
        raise ValueError(f"runs {', '.join(hooked)} use the DDP hook, which {parallel} cannot take; use the backend "
                         f"instead (for example {parse_run(hooked[0])['codec']}-backend)")


# ---- data and model -------------------------------------------------------------------------------------------
def load_data():
    """(x_train, y_train, x_test, y_test) as numpy: load_digits standardised with the training statistics."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    x, y = load_digits(return_X_y=True)
    x_tr, x_te, y_tr, y_te = train_test_split(x, y, test_size=TEST_FRACTION, random_state=SPLIT_SEED, stratify=y)
    mean, std = x_tr.mean(axis=0), x_tr.std(axis=0)
    std[std == 0] = 1.0
    return ((x_tr - mean) / std).astype(np.float32), y_tr, ((x_te - mean) / std).astype(np.float32), y_te


DATA_KEYS = ("x_train", "y_train", "x_test", "y_test")


def save_data(path: Path) -> None:
    """load_data's arrays in one .npz file, which each rank reads."""
    np.savez(path, **dict(zip(DATA_KEYS, load_data())))


def shards(n_train: int, world: int, seed: int) -> list[np.ndarray]:
    """Disjoint shards of the training indices, one per rank (a seeded permutation, split evenly)."""
    return np.array_split(np.random.default_rng([seed, 1]).permutation(n_train), world)


def make_model(seed: int):
    import torch

    torch.manual_seed(seed)
    layers, width = [], 64
    for hidden in HIDDEN:
        layers += [torch.nn.Linear(width, hidden), torch.nn.Tanh()]
        width = hidden
    layers.append(torch.nn.Linear(width, CLASSES))
    return torch.nn.Sequential(*layers)


def shard_fsdp2(model, world: int):
    """FSDP2: each Linear layer a unit of its own, then the root, over a 1-D mesh of all ranks (on the default
    process group, so with the intml backend the mesh's group is the intml group)."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world,))
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def parameter_hash(model) -> int:
    """A 56-bit BLAKE2 digest of all parameters' bytes (fits an int64 tensor)."""
    h = hashlib.blake2b(digest_size=7)
    for p in model.parameters():
        h.update(p.detach().numpy().tobytes())
    return int.from_bytes(h.digest(), "big")


# ---- one rank (run by torchrun) -------------------------------------------------------------------------------
def rank_main(cfg: dict) -> None:
    """Train one rank. torchrun sets RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT; INTML_* configure intml."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.set_num_threads(1)
    run = parse_run(cfg["run"], cfg.get("parallel", "ddp"))
    if run["integration"] == "gloo":
        dist.init_process_group("gloo")
    elif run["integration"] == "backend":
        import intml.worker.torch  # noqa: F401 -- registers the "intml" backend

        os.environ["INTML_CODEC"] = run["codec"]
        os.environ["INTML_THREAD"] = "1" if run["threaded"] else "0"
        os.environ["INTML_MIN_ELEMENTS"] = "0"  # every bucket through intml: the model is below the 64 Ki default
        dist.init_process_group("intml")
    else:
        dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    worker = None
    if run["integration"] == "worker":  # a host codec: the averages go through a Worker of the aggregator's host mode
        from intml.worker import Worker

        worker = Worker(os.environ["INTML_AGGREGATOR"], job=cfg["job"], rank=rank, world_size=world,
                        token=os.environ.get("INTML_TOKEN", ""), codec=run["codec"],
                        packet_elements=int(os.environ["INTML_PACKET_ELEMENTS"]), seed=int(os.environ["INTML_SEED"]))
    with np.load(cfg["data"]) as data:  # run() loaded it once: importing scikit-learn costs each rank 1.5 s of CPU
        x_tr, y_tr, x_te, y_te = (data[k] for k in DATA_KEYS)
    mine = shards(len(x_tr), world, cfg["seed"])[rank]
    batch = cfg["batch"]
    steps_per_epoch = min(len(s) for s in shards(len(x_tr), world, cfg["seed"])) // batch  # same at every rank
    x_mine, y_mine = torch.from_numpy(x_tr[mine]), torch.from_numpy(y_tr[mine])
    x_test, y_test = torch.from_numpy(x_te), torch.from_numpy(y_te)

    model = make_model(cfg["seed"])
    parameters = sum(p.numel() for p in model.parameters())  # before FSDP2 leaves each rank its shards
    fsdp2, average = cfg.get("parallel", "ddp") == "fsdp2", cfg.get("parallel") == "average"
    averager = None
    if fsdp2:
        ddp = shard_fsdp2(model, world)  # the same module, its parameters now this rank's shards
    elif average:
        from torch.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager

        ddp = model  # local SGD; the averager averages the parameters at each epoch's last step
        averager = (PeriodicModelAverager(period=steps_per_epoch, warmup_steps=steps_per_epoch - 1)
                    if worker is None else None)
    elif cfg.get("bucket_cap_mb") is None:
        ddp = DDP(model)
    else:
        ddp = DDP(model, bucket_cap_mb=cfg["bucket_cap_mb"])
    state = None
    if run["integration"] == "hook":
        from intml.worker.torch import IntmlHookState, intml_hook

        state = IntmlHookState(codec=run["codec"], error_feedback=run["error_feedback"],
                               warmup_steps=run["warmup_steps"], threaded=run["threaded"])
        ddp.register_comm_hook(state, intml_hook)
    pg = dist.distributed_c10d._get_default_group()
    traffic = state.traffic if state is not None else getattr(pg, "traffic", None)
    control = getattr(pg, "gloo", pg)  # the hash check goes over Gloo in every run
    opt = torch.optim.SGD(ddp.parameters(), lr=cfg["lr"])
    sched = torch.optim.lr_scheduler.ExponentialLR(opt, cfg["lr_decay"])
    generator = torch.Generator().manual_seed(cfg["seed"] * 1000 + rank)

    step_s, accuracy, loss_curve, checked, gzip_bits, lzw_bits = [], [], [], 0, [], None
    hashes = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
    for epoch in range(cfg["epochs"]):
        perm = torch.randperm(len(mine), generator=generator)
        total = 0.0
        for i in range(steps_per_epoch):
            idx = perm[i * batch:(i + 1) * batch]
            start = time.perf_counter()
            opt.zero_grad(set_to_none=False)
            loss = torch.nn.functional.cross_entropy(ddp(x_mine[idx]), y_mine[idx])
            loss.backward()
            opt.step()
            aside = 0.0  # seconds measuring what gzip and LZW would send: not the step's
            if average:
                if i == steps_per_epoch - 1:  # what a gzip (LZW: the final weights, rank 0) exchange would send
                    aside = time.perf_counter()
                    raw = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).numpy().tobytes()
                    gzip_bits.append(8 * len(zlib.compress(raw, 9)) / parameters)
                    if rank == 0 and epoch == cfg["epochs"] - 1:  # pure Python: 0.4 s for this model
                        lzw_bits = 8 * len(lzw.encode(raw)) / parameters
                    aside = time.perf_counter() - aside
                    if worker is not None:
                        average_through(worker, model, world)
                if averager is not None:
                    averager.average_parameters(model.parameters())
            step_s.append(time.perf_counter() - start - aside)
            total += loss.item()
            if fsdp2 or (average and i != steps_per_epoch - 1):  # shards, or replicas that differ until averaged
                continue
            # consistency: every rank holds the same parameters after every step
            control.allgather([hashes], [torch.tensor([parameter_hash(model)])]).wait()
            values = {int(h) for h in hashes}
            if len(values) != 1:
                raise RuntimeError(f"{cfg['run']} seed {cfg['seed']}: ranks hold different parameters after "
                                   f"epoch {epoch} step {i}: hashes {[int(h) for h in hashes]}")
            checked += 1
        sched.step()
        with torch.no_grad():
            accuracy.append(float((model(x_test).argmax(dim=1) == y_test).float().mean()))
        loss_curve.append(total / steps_per_epoch)
    steps = cfg["epochs"] * steps_per_epoch
    exchanges = cfg["epochs"] if average else steps  # the collectives whose bytes are counted: per epoch or step
    report = {
        "run": cfg["run"], "parallel": cfg.get("parallel", "ddp"), "seed": cfg["seed"], "world_size": world,
        "epochs": cfg["epochs"],
        "steps_per_epoch": steps_per_epoch, "batch_per_rank": batch, "bucket_cap_mb": cfg.get("bucket_cap_mb"),
        "lr": cfg["lr"], "lr_decay": cfg["lr_decay"],
        "parameters": parameters,
        "test_accuracy": accuracy, "train_loss": loss_curve, "final_accuracy": accuracy[-1],
        "step_s_median": statistics.median(step_s[steps_per_epoch:] or step_s),
        "epoch_s": [sum(step_s[e * steps_per_epoch:(e + 1) * steps_per_epoch]) for e in range(cfg["epochs"])],
        "hash_checked_steps": checked,
        "using_intml": bool(getattr(state if state is not None else pg, "using_intml", False)),
    }
    if traffic is not None:
        report["traffic"] = dict(vars(traffic))
    if getattr(state, "auto", None) is not None and state.auto.decision is not None:  # the tuner's last choice
        report["tuned"] = state.auto.decision.as_dict()
    if fsdp2:  # all-gathers and reduce-scatters: the allreduce byte models do not apply
        report["bytes_per_step"] = None
    elif traffic is not None:
        report["bytes_per_step"] = (traffic.intml_bytes + traffic.gloo_bytes) / exchanges
    else:  # plain Gloo: the ring model for every parameter once per exchange
        report["bytes_per_step"] = ring_bytes(report["parameters"], world)
    if worker is not None:  # the codec's packages as built, the header of each packet, resends apart
        c = worker.counters()
        report["using_intml"] = True
        # per averaging (host mode sends no bootstrap round)
        packets = -(-parameters // int(os.environ["INTML_PACKET_ELEMENTS"]))
        report["bytes_per_step"] = c["package_bytes"] / exchanges + packets * HDR
        report["traffic"] = {"intml_allreduces": cfg["epochs"], "gloo_allreduces": 0, "gloo_bytes": 0,
                             "intml_bytes": report["bytes_per_step"] * exchanges,
                             "retransmissions": c["retransmissions"]}
        worker.close()
    if average:  # per averaging: bytes each way per worker, as bits per parameter
        report["bits_per_parameter"] = 8 * report["bytes_per_step"] / parameters
        report["gzip_bits_per_parameter"] = statistics.median(gzip_bits)
        report["lzw_bits_per_parameter"] = lzw_bits
    if rank == 0:
        Path(cfg["out"]).write_text(json.dumps(report))
    if state is not None:
        state.close()
    dist.destroy_process_group()


def average_through(worker, model, world: int) -> None:
    """Average the model's parameters over the job through ``worker`` (what PeriodicModelAverager does through
    the default group): their sum divided by the world size, written back in place."""
    import torch

    params = list(model.parameters())
    flat = torch.cat([p.detach().reshape(-1) for p in params]).numpy()
    mean = torch.from_numpy(worker.allreduce(flat) / np.float32(world))
    with torch.no_grad():
        torch.nn.utils.vector_to_parameters(mean, params)


# ---- the parent: torchrun per run and seed, the table, the plot ----------------------------------------------
def launch(run: str, seed: int, workers: int, args: dict, env: dict, out: Path, timeout: float) -> dict:
    """One torchrun of `workers` ranks on 127.0.0.1; returns rank 0's report."""
    cfg = dict(args, run=run, seed=seed, out=str(out))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=1", f"--nproc-per-node={workers}",
           "--master-addr=127.0.0.1", f"--master-port={free_port()}", "-m", "intml.testbed.train", "--rank",
           json.dumps(cfg)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, check=False)
    if proc.returncode != 0 or not out.exists():
        lines = (proc.stdout + proc.stderr).strip().splitlines()
        # the ranks' own errors (torchrun prefixes them with [rankN]) and the stacks of a rank that aborted, then
        # torchrun's summary
        errors = [line for line in lines if line.startswith(("[rank", "Fatal Python", "Current thread", "Thread 0x",
                                                             '  File "')) or "terminate" in line or "Error" in line]
        text = "\n".join(errors[-40:] + ["..."] + lines[-12:])
        raise RuntimeError(f"run {run} seed {seed} failed (torchrun exit code {proc.returncode}):\n{text}")
    return json.loads(out.read_text())


def summarise(reports: list[dict], target: float) -> list[dict]:
    rows = []
    for name in dict.fromkeys(r["run"] for r in reports):
        mine = [r for r in reports if r["run"] == name]
        finals = [r["final_accuracy"] for r in mine]
        reach = [epochs_to(r["test_accuracy"], target) for r in mine]
        reached = sorted(e for e in reach if e is not None)
        rows.append({
            "run": name,
            "seeds": len(mine),
            "final_acc_median": statistics.median(finals),
            "final_acc_min": min(finals),
            "final_acc_max": max(finals),
            "epochs_to_target_median": statistics.median(reached) if len(reached) == len(mine) else None,
            "reached": f"{len(reached)}/{len(mine)}",
            "step_ms_median": 1e3 * statistics.median(r["step_s_median"] for r in mine),
            "bytes_per_step": (None if mine[0]["bytes_per_step"] is None
                               else statistics.median(r["bytes_per_step"] for r in mine)),
            **({key: statistics.median(r[key] for r in mine) for key in ("bits_per_parameter",
                                                                          "gzip_bits_per_parameter",
                                                                          "lzw_bits_per_parameter")}
               if "bits_per_parameter" in mine[0] else {}),
            "collectives": collectives(mine[0]),
            "retransmissions": sum(r.get("traffic", {}).get("retransmissions", 0) for r in mine),
            "hash_checked_steps": sum(r["hash_checked_steps"] for r in mine),
        })
    return rows


def collectives(report: dict) -> dict[str, float] | None:
    """Per step: how many collectives of each kind went through intml and through Gloo, from the group's traffic
    counters (``Traffic.intml_<kind>s`` and ``gloo_<kind>s``; a kind they do not count is left out), and the bytes
    of all of them per worker each way (``intml_bytes``, ``gloo_bytes``). None without counters (plain Gloo)."""
    traffic = report.get("traffic")
    if traffic is None:
        return None
    steps = report["epochs"] * report["steps_per_epoch"]
    return {f"{path}_{kind}s": traffic[f"{path}_{kind}s"] / steps
            for kind in ("allreduce", "reduce_scatter") for path in ("intml", "gloo")
            if f"{path}_{kind}s" in traffic} | {f"{path}_bytes": traffic[f"{path}_bytes"] / steps
                                                 for path in ("intml", "gloo")}


def collectives_text(rows: list[dict]) -> str:
    """One line per run with traffic counters: each kind of collective per step, through intml and through Gloo."""
    lines = []
    for r in rows:
        c = r["collectives"]
        if not c:
            continue
        kinds = [f"{kind.replace('_', '-')}s {c[f'intml_{kind}s']:g} through intml, {c[f'gloo_{kind}s']:g} through "
                 f"Gloo" for kind in ("allreduce", "reduce_scatter") if f"intml_{kind}s" in c]
        lines.append(f"{r['run']}, per step and worker (seed 0): {'; '.join(kinds)}; bytes each way "
                     f"{c['intml_bytes']:,.0f} through intml, {c['gloo_bytes']:,.0f} through Gloo")
    return "\n".join(lines)


def table(rows: list[dict], target: float) -> str:
    """Markdown; with model averaging, bytes are per averaging and two columns give them as bits per parameter."""
    average = "bits_per_parameter" in rows[0]
    per = "averaging" if average else "step"
    head = ("| run | final test accuracy, median (min–max) | epochs to " f"{target:.0%}" " (median) | "
            f"time per step, median | bytes per {per} per worker, each way | "
            + ("bits per parameter on the wire | gzip of the raw weights, bits per parameter | LZW of the final raw "
               "weights, bits per parameter | " if average else "")
            + "retransmissions | steps hash-checked |")
    lines = [head, "|" + "---|" * (10 if average else 7)]
    for r in rows:
        reach = "—" if r["epochs_to_target_median"] is None else f"{r['epochs_to_target_median']:g}"
        bits = (f"{r['bits_per_parameter']:.2f} | {r['gzip_bits_per_parameter']:.2f} | "
                f"{r['lzw_bits_per_parameter']:.2f} | " if average else "")
        lines.append(f"| {r['run']} | {100 * r['final_acc_median']:.2f}% ({100 * r['final_acc_min']:.2f}–"
                     f"{100 * r['final_acc_max']:.2f}) | {reach} ({r['reached']} seeds) | "
                     f"{r['step_ms_median']:.2f} ms | {bytes_text(r['bytes_per_step'])} | {bits}"
                     f"{r['retransmissions']} | {r['hash_checked_steps']} |")
    return "\n".join(lines)


def bytes_text(per_step: float | None) -> str:
    return "—" if per_step is None else f"{per_step:,.0f}"


def verdict(rows: list[dict], tolerance_pp: float = 1.0) -> str:
    by = {r["run"]: r for r in rows}
    if "gloo" not in by:
        return "no gloo run: no target to compare with"
    ref = 100 * by["gloo"]["final_acc_median"]
    out = []
    for name, r in by.items():
        if name == "gloo" or not name.startswith("cnat8"):
            continue
        gap = 100 * r["final_acc_median"] - ref
        ok = "met" if gap >= -tolerance_pp else "NOT met"
        out.append(f"{name}: {100 * r['final_acc_median']:.2f}% vs gloo {ref:.2f}% ({gap:+.2f} pp; target within "
                   f"{tolerance_pp:g} pp: {ok})")
    return "\n".join(out)


def plot(reports: list[dict], path: Path, target: float) -> None:
    """Left: test accuracy against epoch (median over seeds; band: min-max of the Gloo runs). Right: each run's
    accuracy minus Gloo's with the same seed (mean over seeds: test accuracy moves in steps of 1/450, so a
    median is mostly exactly 0), against the 1-point target band."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(dict.fromkeys(r["run"] for r in reports))
    curves = {name: {r["seed"]: np.array(r["test_accuracy"]) * 100 for r in reports if r["run"] == name}
              for name in names}
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2), dpi=120)
    for name in names:
        stack = np.array(list(curves[name].values()))
        epochs = np.arange(1, stack.shape[1] + 1)
        style = {"linewidth": 2.2, "color": "black"} if name == "gloo" else {"linewidth": 1.3}
        line, = left.plot(epochs, np.median(stack, axis=0), label=f"{name} (median of {len(stack)})", **style)
        if name == "gloo":
            left.fill_between(epochs, stack.min(axis=0), stack.max(axis=0), color="grey", alpha=0.25,
                              label="gloo min-max")
        elif "gloo" in curves:
            paired = [curves[name][s] - curves["gloo"][s] for s in curves[name] if s in curves["gloo"]]
            right.plot(epochs, np.mean(paired, axis=0), color=line.get_color(), linewidth=1.3, label=name)
    left.axhline(100 * target, color="grey", linestyle=":", linewidth=1)
    left.set(xlabel="epoch", ylabel="test accuracy (%)", ylim=(88, 100))
    left.grid(alpha=0.3)
    left.legend(loc="lower right", fontsize=8)
    right.axhspan(-1, 1, color="green", alpha=0.08, label="target: within 1 point")
    right.axhline(0, color="black", linewidth=1)
    right.set(xlabel="epoch", ylabel="accuracy minus Gloo's, same seed, mean (points)", ylim=(-2, 2))
    right.grid(alpha=0.3)
    right.legend(loc="lower right", fontsize=8)
    meta = reports[0]
    fig.suptitle(f"64-392-50-10 tanh MLP on load_digits, {meta['world_size']} workers under torchrun, "
                 f"{meta.get('parallel', 'ddp').upper()}, "
                 f"{len(curves[names[0]])} seeds", fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)


def run(workers: int = 4, seeds: int = 5, epochs: int = 30, runs: tuple[str, ...] | None = None, batch: int = 16,
        lr: float = 0.2, lr_decay: float = 0.95, target: float = 0.95, packet_elements: int = JobParams.packet_elements,
        bucket_cap_mb: float | None = None, json_out: str | None = None, plot_out: str | None = None,
        run_timeout: float = 600.0, quiet: bool = False, parallel: str = "ddp",
        on_report: Callable[[dict], None] | None = None) -> dict:
    """The whole experiment: one aggregator, then every run for every seed (seeds 0..seeds-1) in turn, each
    run's report passed to ``on_report`` as it comes. `runs` defaults to DEFAULT_RUNS with DDP and BACKEND_RUNS
    otherwise."""
    from intml.testbed.bench_allreduce import aggregator

    if runs is None:
        runs = DEFAULT_RUNS if parallel == "ddp" else BACKEND_RUNS
    specs = [parse_run(r)["name"] for r in runs]
    check_parallel(tuple(specs), parallel)
    args = {"epochs": epochs, "batch": batch, "lr": lr, "lr_decay": lr_decay, "bucket_cap_mb": bucket_cap_mb,
            "parallel": parallel}
    reports = []
    hosted = any(parse_run(s)["codec"] not in (None, *CODEC_NAMES) for s in specs)  # host codecs' packages
    most = max(packet_elements, host_aggregator_elements(packet_elements)) if hosted else packet_elements
    with aggregator(cores=1, max_packet_elements=most) as port, \
            tempfile.TemporaryDirectory(prefix="intml-train-") as tmp:
        args["data"] = str(Path(tmp, "digits.npz"))
        save_data(Path(args["data"]))
        env = rank_env()
        env.update(INTML_AGGREGATOR=f"127.0.0.1:{port}", INTML_PACKET_ELEMENTS=str(packet_elements))
        for seed in range(seeds):
            for spec in specs:
                started = time.monotonic()
                # the job seed of the stochastic rounding follows the run's seed, so the table is reproducible
                env["INTML_SEED"] = str(1000 + seed)
                job = {"job": 60_000 + 100 * seed + specs.index(spec)}  # a host-codec run's own job id
                report = launch(spec, seed, workers, dict(args, **job), env, Path(tmp, f"{spec}-{seed}.json"),
                                run_timeout)
                if parse_run(spec)["codec"] is not None and not report["using_intml"]:
                    raise RuntimeError(f"run {spec} seed {seed} did not use intml")
                reports.append(report)
                if on_report:
                    on_report(report)
                if not quiet:
                    print(f"  {spec:>14} seed {seed}: final accuracy {100 * report['final_accuracy']:.2f}%, "
                          f"{1e3 * report['step_s_median']:.2f} ms/step ({time.monotonic() - started:.0f} s)",
                          file=sys.stderr, flush=True)
    rows = summarise(reports, target)
    result = {"parallel": parallel, "workers": workers, "seeds": seeds, "epochs": epochs, "batch_per_rank": batch,
              "lr": lr,
              "lr_decay": lr_decay, "target_accuracy": target, "packet_elements": packet_elements,
              "bucket_cap_mb": bucket_cap_mb,
              "rows": rows, "verdict": verdict(rows), "reports": reports}
    if json_out:
        Path(json_out).write_text(json.dumps(result, indent=1))
    if plot_out:
        plot(reports, Path(plot_out), target)
    if not quiet:
        print(f"{parallel.upper()} training on load_digits: {workers} workers, {seeds} seeds, {epochs} epochs, batch "
              f"{batch} per rank, SGD lr {lr} x {lr_decay}/epoch")
        print(table(rows, target))
        if parallel != "ddp":
            print(collectives_text(rows))
        print(result["verdict"])
    return result


def _runs_arg(text: str) -> str:
    try:
        for spec in text.split(","):
            parse_run(spec)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of `intml-testbed train`; pass the parsed namespace to run_from_args."""
    from intml.aggregator.cli import count, output_file, positive
    from intml.protocol.wire import max_packet_elements

    parser.add_argument("--workers", type=count(1, MAX_WORLD, "ranks per job: MAX_WORLD"), default=4,
                        help="ranks under torchrun (default 4)")
    parser.add_argument("--seeds", type=positive(), default=5, help="seeds 0..N-1 per run (default 5)")
    parser.add_argument("--epochs", type=positive(), default=30)
    parser.add_argument("--parallel", choices=PARALLEL, default="ddp",
                        help="DDP; FSDP2 (fully_shard); or average: local SGD, parameters averaged after every "
                             "epoch (seed 001); the last two's intml runs take -backend (default ddp)")
    parser.add_argument("--runs", type=_runs_arg, default=None,
                        help="comma-separated: gloo, or a codec (int32, cnat8, or a host codec: uniform8, topk0.01, "
                             "adaptive-huffman: docs/codecs.md), or auto (the tuner picks per bucket: docs/tuner.md), "
                             "with optional -ef, -wK, -backend (not auto), -thread; with --parallel average a bare "
                             "host codec averages through the aggregator's host mode "
                             f"(default {','.join(DEFAULT_RUNS)}; otherwise {','.join(BACKEND_RUNS)})")
    parser.add_argument("--batch", type=positive(), default=16, help="batch per rank (default 16)")
    parser.add_argument("--lr", type=positive(float), default=0.2)
    parser.add_argument("--lr-decay", type=positive(float), default=0.95, help="per-epoch factor (default 0.95)")
    parser.add_argument("--target", type=positive(float, 1.0, "an accuracy"), default=0.95,
                        help="accuracy for the epochs-to-target column (default 0.95)")
    most = min(max_packet_elements(codec) for codec in CODEC_NAMES.values())  # every codec's runs use it
    parser.add_argument("--packet-elements", type=count(1, most, "what one datagram holds for every codec"),
                        default=JobParams.packet_elements)
    parser.add_argument("--bucket-cap-mb", type=positive(float), default=None,
                        help="DDP bucket size (default DDP's: the 45 640 parameters fit one bucket)")
    parser.add_argument("--json-out", metavar="PATH", type=output_file,
                        help="write the table and every run's report as JSON")
    parser.add_argument("--plot", metavar="PATH", type=output_file, help="plot test accuracy vs epoch (PNG)")
    parser.add_argument("--run-timeout", type=positive(float), default=600.0, help="seconds per torchrun")


def run_from_args(args: argparse.Namespace) -> dict:
    runs = None if args.runs is None else tuple(args.runs.split(","))
    if runs is not None:
        try:
            check_parallel(runs, args.parallel)
        except ValueError as exc:
            raise SystemExit(f"intml-testbed: {exc}") from None
    return run(workers=args.workers, seeds=args.seeds, epochs=args.epochs, runs=runs, parallel=args.parallel,
               batch=args.batch, lr=args.lr, lr_decay=args.lr_decay, target=args.target,
               packet_elements=args.packet_elements, bucket_cap_mb=args.bucket_cap_mb, json_out=args.json_out,
               plot_out=args.plot, run_timeout=args.run_timeout)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--rank"]:  # a rank started by torchrun
        faulthandler.enable()  # a rank that aborts in C++ prints every thread's Python stack, for launch's error
        rank_main(json.loads(argv[1]))
        # Its report written and its group destroyed, the rank ends without the interpreter's finalization: there,
        # under load, a host-codec rank (torch, Gloo and Numba loaded) now and then died with SIGABRT ("terminate
        # called without an active exception"), the mark of a thread unwound through C++ while Python shuts down
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    from intml.aggregator.cli import OneLineParser

    parser = OneLineParser(prog="python -m intml.testbed.train", description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    run_from_args(parser.parse_args(argv))
    return 0


if __name__ == "__main__":
    with contextlib.suppress(BrokenPipeError):
        sys.exit(main())
