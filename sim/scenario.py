"""Scenarios: TOML files of flat keys (``sim/scenarios/*.toml``). A key given a list is swept: a run is the grid of
every combination, each point run for every system. ``ScenarioError`` carries a one-line message for the CLI.

Keys (defaults in ``DEFAULTS``): ``name``, ``mode`` ("analytic" or "packet": the packet-level engine with the real
cores for intml-cnat8 and switchml-int32; the ring and the parameter server are flow models unless ``baselines =
"packet"``), ``systems``, ``seed``, ``workers``, ``elements``, ``rate`` ("10gbit", "100mbit" or bit/s), ``delay``
("1us" or seconds, one way per link), ``mtu``, ``loss`` (per link direction), ``pool``, ``packet_elements`` (0: the
largest for the MTU), ``rounds``, ``switch`` ("asic" or "software"), ``engine`` (the switch's data path: "kernel",
or "p4model": the P4 pipeline model, packet by packet), ``passes`` (the ASIC's pipeline passes per aggregated
packet; 0: the engine's, 1 for the kernel and the P4 program's for p4model), ``host_costs``, ``alpha`` (the ring's
per-step latency), ``queue_bytes``, ``cpus`` (packet mode: > 0 puts every rank and a software switch's aggregator on
one machine of that many CPUs, each sender paying the kernel's forwarding, as the netns testbed; 0: every host its
own CPU), ``baselines`` ("flow": the ring and the parameter server as flow models; "packet": in packet mode, over
the engine's TCP, ``sim.collectives``), ``racks`` (> 1: a two-level leaf-spine, the ranks split over that many
leaves in order; intml-cnat8, switchml-int32 and gloo-ring only, packet-level for the in-network systems with the
kernel engine on ASICs), ``uplink_rate`` (each leaf's link to the spine; 0: ``rate``) and ``uplink_queue`` (bytes of
that link's queue each way, whose depth marks the partials going up; 0: ``queue_bytes``).
"""

from __future__ import annotations

import hashlib
import itertools
import json
import re
import tomllib
from pathlib import Path

from intml.sim.models import SYSTEMS


class ScenarioError(ValueError):
    """A bad scenario file or --set value; its message is one line."""


DEFAULTS: dict[str, object] = {
    "name": "scenario", "mode": "analytic", "systems": ["intml-cnat8", "switchml-int32", "gloo-ring"], "seed": 1,
    "workers": 4, "elements": 25_000_000, "rate": "10gbit", "delay": "1us", "mtu": 1500, "loss": 0.0, "pool": 64,
    "packet_elements": 0, "rounds": 1, "switch": "asic", "host_costs": True, "alpha": "20us",
    "queue_bytes": 1 << 20, "passes": 0, "engine": "kernel", "cpus": 0, "baselines": "flow", "racks": 1,
    "uplink_rate": 0, "uplink_queue": 0,
}
LEAF_SPINE_SYSTEMS = ("intml-cnat8", "switchml-int32", "gloo-ring")
SWEEPABLE = set(DEFAULTS) - {"name", "mode", "systems"}
UNITS = {"": 1.0, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}
TIMES = {"s": 1.0, "ms": 1e-3, "us": 1e-6, "ns": 1e-9}
PACKET_SYSTEMS = {"intml-cnat8": "cnat8", "switchml-int32": "int32"}
TCP_SYSTEMS = {"gloo-ring": "ring", "ps-colocated": "ps-colocated", "ps-dedicated": "ps-dedicated"}


def parse_rate(value: object) -> float:
    """Bit/s from 10e9, "10gbit", "500mbit"."""
    if isinstance(value, (int, float)) and value > 0:
        return float(value)
    m = re.fullmatch(r"([0-9.]+(?:e[0-9]+)?)\s*([kmgt]?)(?:bit|bps)?", str(value).strip().lower())
    if not m or float(m[1]) <= 0:
        raise ScenarioError(f"rate must be like 10gbit, 100mbit or bits per second, got {value!r}")
    return float(m[1]) * UNITS[m[2]]


def parse_time(value: object) -> float:
    """Seconds from 1e-6, "1us", "5ms"."""
    if isinstance(value, (int, float)) and value >= 0:
        return float(value)
    m = re.fullmatch(r"([0-9.]+(?:e-?[0-9]+)?)\s*(s|ms|us|ns)", str(value).strip().lower())
    if not m:
        raise ScenarioError(f"a time must be like 1us, 5ms or seconds, got {value!r}")
    return float(m[1]) * TIMES[m[2]]


def load(path: str | Path) -> dict:
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except OSError as exc:
        raise ScenarioError(f"cannot read {path}: {exc.strerror}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ScenarioError(f"{path} is not valid TOML: {exc}") from None
    return check({**DEFAULTS, **data})


def check(s: dict) -> dict:
    unknown = sorted(set(s) - set(DEFAULTS))
    if unknown:
        raise ScenarioError(f"unknown key {unknown[0]!r} (known: {', '.join(sorted(DEFAULTS))})")
    if s["mode"] not in ("analytic", "packet"):
        raise ScenarioError(f"mode must be analytic or packet, got {s['mode']!r}")
    systems = s["systems"] if isinstance(s["systems"], list) else [s["systems"]]
    for name in systems:
        if name not in SYSTEMS:
            raise ScenarioError(f"unknown system {name!r} (known: {', '.join(SYSTEMS)})")
    s["systems"] = systems
    for point in grid(s):
        p = point_params(point)
        if p["racks"] > 1:
            leaf_spine_problem(p, s["mode"], systems)
    return s


def leaf_spine_problem(p: dict, mode: str, systems: list[str]) -> None:
    """Raise a ScenarioError if a leaf-spine point asks for what has no leaf-spine model."""
    if p["racks"] > p["workers"]:
        raise ScenarioError(f"racks must be at most workers ({p['workers']}), got {p['racks']}")
    other = [name for name in systems if name not in LEAF_SPINE_SYSTEMS]
    if other:
        raise ScenarioError(f"{other[0]} has no leaf-spine model (racks > 1 takes {', '.join(LEAF_SPINE_SYSTEMS)})")
    if mode == "packet" and (p["switch"], p["engine"], p["cpus"], p["baselines"]) != ("asic", "kernel", 0, "flow"):
        raise ScenarioError("a packet-level leaf-spine runs switch = asic, engine = kernel, cpus = 0 and "
                            "baselines = flow")


def apply_sets(s: dict, sets: list[str]) -> dict:
    """--set key=v1,v2,...: replace a key by a list of values (numbers where they parse)."""
    s = dict(s)
    for item in sets:
        key, eq, values = item.partition("=")
        if not eq or key not in SWEEPABLE:
            raise ScenarioError(f"--set needs key=v1,v2,... with a key among {', '.join(sorted(SWEEPABLE))}, "
                                f"got {item!r}")
        s[key] = [_number(v) for v in values.split(",")]
    return check(s)


def _number(v: str) -> object:
    for kind in (int, float):
        try:
            return kind(v)
        except ValueError:
            pass
    return {"true": True, "false": False}.get(v.lower(), v)


def grid(s: dict) -> list[dict]:
    """Every point of the scenario's swept keys, in file order."""
    keys = sorted(SWEEPABLE)
    values = [s[k] if isinstance(s[k], list) else [s[k]] for k in keys]
    return [dict(zip(keys, combo)) for combo in itertools.product(*values)]


def point_params(p: dict) -> dict:
    """A point with its units parsed and checked."""
    out = dict(p)
    out["rate"] = parse_rate(p["rate"])
    out["delay"] = parse_time(p["delay"])
    out["alpha"] = parse_time(p["alpha"])
    out["uplink_rate"] = parse_rate(p["uplink_rate"]) if p["uplink_rate"] else out["rate"]
    for key, low in (("workers", 1), ("elements", 1), ("mtu", 68), ("pool", 1), ("rounds", 1),
                     ("queue_bytes", 1), ("packet_elements", 0), ("seed", 0), ("passes", 0), ("cpus", 0),
                     ("racks", 1), ("uplink_queue", 0)):
        if not isinstance(p[key], int) or isinstance(p[key], bool) or p[key] < low:
            raise ScenarioError(f"{key} must be an integer >= {low}, got {p[key]!r}")
    if p["mtu"] > 65535:
        raise ScenarioError(f"mtu must be at most 65535 (one IPv4 datagram), got {p['mtu']}")
    if not isinstance(p["loss"], (int, float)) or not 0 <= p["loss"] < 1:
        raise ScenarioError(f"loss must be in [0, 1), got {p['loss']!r}")
    if p["switch"] not in ("asic", "software"):
        raise ScenarioError(f"switch must be asic or software, got {p['switch']!r}")
    if p["baselines"] not in ("flow", "packet"):
        raise ScenarioError(f"baselines must be flow or packet, got {p['baselines']!r}")
    if p["engine"] not in ("kernel", "p4model"):
        raise ScenarioError(f"engine must be kernel or p4model, got {p['engine']!r}")
    return out


def digest(s: dict) -> str:
    """The scenario's hash: sha256 of its canonical JSON (after --set), first 16 hex digits."""
    return hashlib.sha256(json.dumps(s, sort_keys=True).encode()).hexdigest()[:16]
