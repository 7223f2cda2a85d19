"""The Tofino (TNA) sketch's resource account as code: what a Tofino-1 stateful ALU can do, checked against every
RegisterAction of the generated program (``salu_violations``); the stage assignment derived from the sketch's
dependency chain (``schedule``); the PHV the sketch declares (``phv_bits``); and the throughput per pipe with the
recirculation bandwidth as a parameter (``throughput``). p4/README.md ("The Tofino sketch") prints the figures.

Everything here is an estimate from public descriptions of Tofino-1 (``TOFINO1``): no Tofino back end was run.
The SALU rules are the ones the issue names: at most two predicates, each a register half compared with a PHV
operand or a constant (``register ± PHV``); one output of at most 32 bits; at most two update expressions per
register half, each one ALU operation; a 64-bit register is a pair of 32-bit halves; two 32-bit PHV operands.
"""

from __future__ import annotations

import itertools
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

from intml.p4 import layout as L

HERE = Path(__file__).resolve().parent
TNA = HERE / "tna"


@dataclass(frozen=True)
class Chip:
    """What one pipe of a Tofino offers, as commonly reported (Intel's datasheets are under NDA)."""
    stages: int
    salus_per_stage: int
    tables_per_stage: int  # logical tables
    tcam_blocks_per_stage: int  # 512 x 44 bits
    sram_blocks_per_stage: int  # 1,024 x 128 bits
    phv_bits: int  # the containers the MAU reads and writes (tagalong containers not counted)
    salu_predicates: int = 2
    salu_outputs: int = 1
    salu_half_bits: int = 32
    salu_phv_operands: int = 2
    salu_updates_per_half: int = 2


TOFINO1 = Chip(stages=12, salus_per_stage=4, tables_per_stage=16, tcam_blocks_per_stage=24,
               sram_blocks_per_stage=80, phv_bits=64 * 8 + 96 * 16 + 64 * 32)
TOFINO2 = Chip(stages=20, salus_per_stage=4, tables_per_stage=16, tcam_blocks_per_stage=24,
               sram_blocks_per_stage=80, phv_bits=80 * 8 + 120 * 16 + 80 * 32)  # per stage as Tofino-1: assumed


# ---- the stateful ALU check ------------------------------------------------------------------------------------

_REGISTER = re.compile(r"Register<\s*(\w+(?:<\d+>)?)\s*,\s*\w+(?:<\d+>)?\s*>\s*\([^)]*\)\s*(\w+)\s*;")
_TYPE = r"\w+(?:<\d+>)?"
_ACTION = re.compile(rf"RegisterAction<\s*({_TYPE})\s*,\s*{_TYPE}\s*,\s*({_TYPE})\s*>\s*\((\w+)\)\s*(\w+)\s*="
                     r"\s*\{\s*void apply\(([^)]*)\)\s*\{")
_FIELD = re.compile(r"\b(bit|int)<(\d+)>\s+(\w+)\s*;|\bbool\s+(\w+)\s*;")
_PARAMETER = re.compile(r"\b(?:in|out|inout)\s+((?:bit|int)<\d+>|\w+)\s+(\w+)\s*[,)]")
_COMPARISON = re.compile(r"(==|!=|<=|>=|<|>)")
_CAST = re.compile(r"\((?:int|bit)<\d+>\)")
_OPERATORS = ("|-|", "+", "-", "&", "|", "^")
_CONSTANT = re.compile(r"^(?:\d+w)?(?:0x[0-9a-fA-F]+|\d+)$|^[A-Z][A-Z0-9_]*$")


@dataclass
class RegisterActionText:
    """One RegisterAction as written: its name, register, value and output types, and apply body."""
    name: str
    register: str
    value_type: str
    output_type: str
    value: str  # the name of the inout value parameter
    output: str | None  # the name of the out parameter
    body: str


def _block(text: str, start: int) -> tuple[str, int]:
    """The text between the brace before ``start`` and its closing brace, and the index after that brace."""
    depth, i = 1, start
    while depth:
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        i += 1
    return text[start:i - 1], i


def _uncommented(text: str) -> str:
    return re.sub(r"//[^\n]*|/\*.*?\*/", "", text, flags=re.S)


def register_actions(text: str) -> list[RegisterActionText]:
    text = _uncommented(text)
    found = []
    for match in _ACTION.finditer(text):
        value_type, output_type, register, name, params = match.groups()
        body, _ = _block(text, match.end())
        names = [p.split()[-1] for p in params.split(",")]
        output = next((p.split()[-1] for p in params.split(",") if p.strip().startswith("out ")), None)
        found.append(RegisterActionText(name, register, value_type, output_type, names[0], output, body))
    return found


def _width(type_name: str, structs: dict[str, dict[str, int]]) -> int:
    bits = re.fullmatch(r"(?:bit|int)<(\d+)>", type_name)
    if bits:
        return int(bits[1])
    return sum(structs[type_name].values())


def declarations(text: str) -> dict[str, dict[str, int]]:
    """Every header and struct of ``text``: its fields' widths (a nested struct or header: its total)."""
    text = re.sub(r"@\w+(?:\([^)]*\))?", "", _uncommented(text))
    out: dict[str, dict[str, int]] = {}
    for match in re.finditer(r"\b(?:header|struct)\s+(\w+)\s*\{", text):
        body, _ = _block(text, match.end())
        fields = {}
        for line in body.split(";"):
            words = line.split()
            if len(words) >= 2:
                kind, name = " ".join(words[:-1]), words[-1]
                fields[name] = 1 if kind == "bool" else (_width(kind, out) if kind in out or "<" in kind else 0)
        out[match[1]] = fields
    return out


def _typed_fields(text: str) -> dict[str, dict[str, str]]:
    """Every header and struct of ``text``: its fields' type names."""
    text = re.sub(r"@\w+(?:\([^)]*\))?", "", _uncommented(text))
    out = {}
    for match in re.finditer(r"\b(?:header|struct)\s+(\w+)\s*\{", text):
        body, _ = _block(text, match.end())
        out[match[1]] = {line.split()[-1]: " ".join(line.split()[:-1]) for line in body.split(";")
                         if len(line.split()) >= 2}
    return out


def _operand_widths(text: str) -> dict[str, int]:
    """A resolver's table: the width of each control parameter and, through the types, of each dotted field."""
    fields = _typed_fields(text)
    structs = declarations(text)
    widths: dict[str, int] = {}

    def walk(name: str, type_name: str) -> None:
        widths[name] = max(widths.get(name, 0), 1 if type_name == "bool" else _width(type_name, structs)
                           if type_name in structs or "<" in type_name else 0)
        for field_name, field_type in fields.get(type_name, {}).items():
            walk(f"{name}.{field_name}", field_type)

    for type_name, name in _PARAMETER.findall(text):
        walk(name, type_name)
    return widths


def _statements(body: str) -> tuple[list[str], list[tuple[str, str]]]:
    """The conditions of every if and the (target, expression) of every assignment in an apply body."""
    conditions, assignments = [], []
    i = 0
    while i < len(body):
        if body.startswith("if", i) and re.match(r"if\s*\(", body[i:]) and (i == 0 or not body[i - 1].isalnum()):
            start = body.index("(", i) + 1
            depth, j = 1, start
            while depth:
                depth += {"(": 1, ")": -1}.get(body[j], 0)
                j += 1
            conditions.append(body[start:j - 1])
            i = j
            continue
        i += 1
    flat = re.sub(r"if\s*\((?:[^()]|\([^()]*(?:\([^()]*\))*[^()]*\))*\)", ";", body)
    for statement in re.split(r"[;{}]", flat):
        statement = statement.split("//")[0].strip()
        if "=" in statement and not _COMPARISON.fullmatch(statement):
            target, expression = statement.split("=", 1)
            if target.strip() and not target.rstrip().endswith(("!", "<", ">", "=")):
                assignments.append((target.strip(), expression.strip()))
    return conditions, assignments


def _strip(expression: str) -> str:
    expression = _CAST.sub("", expression).strip()
    while expression.startswith("(") and expression.endswith(")") and _balanced(expression[1:-1]):
        expression = expression[1:-1].strip()
    return expression


def _balanced(text: str) -> bool:
    depth = 0
    for c in text:
        depth += {"(": 1, ")": -1}.get(c, 0)
        if depth < 0:
            return False
    return depth == 0


def _split_top(expression: str, separators: tuple[str, ...]) -> list[str]:
    """``expression`` split at the top-level (unparenthesized) occurrences of any separator."""
    parts, depth, start, i = [], 0, 0, 0
    while i < len(expression):
        c = expression[i]
        depth += {"(": 1, ")": -1}.get(c, 0)
        hit = next((s for s in separators if depth == 0 and expression.startswith(s, i)), None)
        if hit:
            parts.append(expression[start:i])
            i += len(hit)
            start = i
            continue
        i += 1
    return [p.strip() for p in parts + [expression[start:]]]


class _Operands:
    """Classifies the leaves of a RegisterAction's expressions: a register half, a constant, or a PHV operand."""

    def __init__(self, action: RegisterActionText) -> None:
        self.value = action.value
        self.phv: set[str] = set()

    def kind(self, leaf: str) -> str:
        leaf = _strip(leaf)
        if re.fullmatch(rf"{self.value}(?:\.\w+)?", leaf):
            return "register"
        if _CONSTANT.match(leaf):
            return "constant"
        if re.fullmatch(r"[A-Za-z_][\w.]*", leaf):
            self.phv.add(leaf)
            return "phv"
        return "expression"

    def predicate(self, left: str, right: str) -> bool:
        """A comparison a stateful ALU evaluates: each side an operand or register half ± operand, with at most
        one register half and one PHV operand in all."""
        leaves = []
        for side in (left, right):
            parts = _split_top(_strip(side), ("+", "-"))
            if len(parts) > 2 or not all(parts):
                return False
            leaves += [self.kind(p) for p in parts]
        return "expression" not in leaves and leaves.count("register") <= 1 and leaves.count("phv") <= 1

    def one_operation(self, expression: str) -> bool:
        """One ALU operation: an operand, or two operands joined by one operator (at most one PHV operand)."""
        expression = _strip(expression)
        if self.kind(expression) != "expression":
            return True
        for operator in _OPERATORS:
            parts = _split_top(expression, (operator,))
            if len(parts) == 2 and all(parts):
                kinds = [self.kind(p) for p in parts]
                return "expression" not in kinds and kinds.count("phv") <= 1
        return False


def salu_violations(text: str, chip: Chip = TOFINO1) -> list[str]:
    """Every way a RegisterAction of ``text`` (a whole program's text) exceeds one stateful ALU of ``chip``."""
    text = _uncommented(text)
    registers = {name: type_name for type_name, name in _REGISTER.findall(text)}
    structs = declarations(text)
    widths = _operand_widths(text)
    out = []
    for action in register_actions(text):
        where = f"{action.register}.{action.name}"
        operands = _Operands(action)
        value_type = registers.get(action.register, action.value_type)
        halves = structs.get(value_type, {"": _width(value_type, structs)})
        if len(halves) > 2 or any(bits > chip.salu_half_bits for bits in halves.values()):
            out.append(f"{where}: register of {value_type}: more than two {chip.salu_half_bits}-bit halves")
        if _width(action.output_type, structs) > chip.salu_half_bits:
            out.append(f"{where}: output {action.output_type} wider than {chip.salu_half_bits} bits")
        conditions, assignments = _statements(action.body)
        predicates = set()
        for condition in conditions:
            for atom in _atoms(condition):
                sides = _split_top(atom, ("==", "!=", "<=", ">=", "<", ">"))
                if len(sides) == 1:
                    sides = [atom, "0"]  # a boolean: != 0
                if len(sides) != 2 or not operands.predicate(*sides):
                    out.append(f"{where}: predicate {atom!r} is not register ± PHV compared")
                predicates.add(" ".join(sorted(_strip(s) for s in sides)))
        if len(predicates) > chip.salu_predicates:
            out.append(f"{where}: {len(predicates)} predicates (at most {chip.salu_predicates})")
        updates: dict[str, set[str]] = {}
        outputs = set()
        for target, expression in assignments:
            if target == action.output:
                outputs.add(target)
            elif not target.startswith(action.value):
                out.append(f"{where}: writes {target}, neither the register nor the output")
                continue
            else:
                updates.setdefault(target, set()).add(expression)
            if not operands.one_operation(expression):
                out.append(f"{where}: {target} = {expression} is not one ALU operation")
        for target, expressions in updates.items():
            if len(expressions) > chip.salu_updates_per_half:
                out.append(f"{where}: {len(expressions)} different updates of {target} "
                           f"(at most {chip.salu_updates_per_half})")
        if len(operands.phv) > chip.salu_phv_operands:
            out.append(f"{where}: {len(operands.phv)} PHV operands {sorted(operands.phv)} "
                       f"(at most {chip.salu_phv_operands})")
        for name in operands.phv:
            if widths.get(name, 0) > chip.salu_half_bits:
                out.append(f"{where}: PHV operand {name} wider than {chip.salu_half_bits} bits")
        if len(outputs) > chip.salu_outputs:
            out.append(f"{where}: {len(outputs)} outputs")
    return list(dict.fromkeys(out))


def _atoms(condition: str) -> list[str]:
    """The comparisons a condition joins with && and ||, at any depth (a negation is the same predicate)."""
    condition = _strip(condition)
    parts = _split_top(condition, ("&&", "||"))
    if len(parts) == 1:
        inner = _strip(condition.lstrip("!"))
        return [inner] if inner == condition.lstrip("!").strip() or len(_split_top(inner, ("&&", "||"))) == 1 \
            else _atoms(inner)
    return [atom for part in parts for atom in _atoms(part)]


def program_text(top: Path = TNA / "intml_tna.p4") -> str:
    """The sketch's text with its local includes inlined (the architecture's files are not part of it)."""
    from intml.p4.syntax import Source
    return Source(top).text


# ---- stages: the dependency chain -------------------------------------------------------------------------------

JUDGE, CONSUME, HARVEST = "judge", "consume", "harvest"


@dataclass(frozen=True)
class Step:
    """One match-action step of the sketch: a table (or a register's stateful ALU, or a keyless ALU step),
    the pass types that run it, the steps whose results it needs, and what it holds."""
    name: str
    passes: tuple[str, ...]
    after: tuple[str, ...] = ()
    salus: int = 0
    tables: int = 1
    tcam_blocks: int = 0
    sram_blocks: int = 0


CHECK_GROUP = 4  # codes one lane_check table checks: a 32-bit ternary key (and k_limit)


def steps(lanes: int = L.LANES_PER_PASS) -> list[Step]:
    """The sketch's steps for ``lanes`` lanes a pass, each after the steps it needs, in the order that packs best
    of the orders of its blocks tried (judge tables, consume, judge chain, harvest). Sizes (estimates): a register
    of 16,384 x 64 bits fills 8 SRAM blocks; a lane_check table (CHECK_GROUP codes and k_limit, 40 bits) holds
    CHECK_GROUP x (7 + 64) ternary entries, each k_limit range expanding to a few TCAM rows: 4 blocks; a lane's
    decode table (256 exact entries) one SRAM block; leading_one (32 ternary entries) one TCAM block; round_up's
    one entry no block. A keyless step (encode_*, check_or_*, bridge_sums) is one table for all its lanes: the
    compiler merging the lanes' independent assignments into one action is assumed."""
    half = lanes // 2
    checks = lanes // CHECK_GROUP
    register = 8
    out = [
        Step("job_table", (JUDGE,), sram_blocks=2),  # job, rank -> index, world, the rank's bit and half
        Step("data_bound", (JUDGE,), sram_blocks=16),  # job, exp -> k_limit, k_finite (keyed by job: stage 0)
        Step("slot_table", (JUDGE,), ("job_table",), sram_blocks=1),
        Step("control_limits", (JUDGE,), sram_blocks=1),
        Step("control_source_tat", (JUDGE,), ("control_limits",), salus=1, sram_blocks=1),
        Step("control_core_tat", (JUDGE,), ("control_source_tat",), salus=1, sram_blocks=1),
    ]
    bitmap = ("worker_bitmap_lo", "worker_bitmap_hi")  # a SALU each: a PENDING carries both halves
    out += [Step(name, (CONSUME,), salus=1, sram_blocks=register // 2) for name in bitmap]
    out.append(Step("worker_countdown", (CONSUME,), bitmap, salus=1, sram_blocks=register // 4))
    for p in range(half):
        out += [Step(f"lane_decode_{i}", (CONSUME,), sram_blocks=1) for i in (p, p + half)]
        out.append(Step(f"processor_{p}", (CONSUME, HARVEST), bitmap + (f"lane_decode_{p}", f"lane_decode_{p + half}"),
                        salus=1, sram_blocks=register))
    out += [Step(f"lane_check_{t}", (JUDGE,), ("data_bound",), tcam_blocks=4) for t in range(checks)]
    flags, width = tuple(f"lane_check_{t}" for t in range(checks)), checks
    while width > 1:  # the invalid flags OR-ed in pairs, one keyless step per level
        width //= 2
        out.append(Step(f"check_or_{width}", (JUDGE,), flags))
        flags = (out[-1].name,)
    out += [
        Step("round_allreduce", (JUDGE,), ("slot_table", flags[0]), salus=1, sram_blocks=register // 2),
        Step("round_chunk", (JUDGE,), ("round_allreduce",), salus=1, sram_blocks=register // 2),
        Step("round_exp", (JUDGE,), ("round_chunk",), salus=1, sram_blocks=register),
    ]
    # a harvest pass encodes the sums the pass before it read (they ride in the bridge): no dependency on this
    # pass's processors, whose sums go to the bridge last. Keyless steps act on all its lanes at once.
    encode = ["encode_sign", "encode_negate", "encode_magnitude"]
    out += [Step(name, (HARVEST,), tuple(encode[:i][-1:])) for i, name in enumerate(encode)]
    out += [Step(f"leading_one_{i}", (HARVEST,), ("encode_magnitude",), tcam_blocks=1) for i in range(half)]
    out += [Step("encode_excess", (HARVEST,), tuple(f"leading_one_{i}" for i in range(half)))]
    out += [Step(f"round_up_{i}", (HARVEST,), ("encode_excess",)) for i in range(half)]
    out += [Step("bridge_sums", (HARVEST,), ("encode_excess",) + tuple(f"processor_{p}" for p in range(half))),
            Step("next_pass", (JUDGE, CONSUME, HARVEST), ("round_exp", "worker_countdown", "bridge_sums"),
                 tables=0)]
    return out


@dataclass
class Stage:
    steps: list[str] = field(default_factory=list)
    salus: int = 0
    tables: int = 0
    tcam_blocks: int = 0
    sram_blocks: int = 0


def schedule(chip: Chip = TOFINO1, plan: list[Step] | None = None) -> list[Stage]:
    """Each step, in ``plan``'s order, in the first stage after every step it needs that has room for it (a list
    scheduler without reordering). More stages than ``chip.stages``: the sketch does not fit."""
    plan = steps() if plan is None else plan
    stages: list[Stage] = []
    placed: dict[str, int] = {}
    for step in plan:
        stage = max((placed[name] + 1 for name in step.after), default=0)
        while True:
            while len(stages) <= stage:
                stages.append(Stage())
            s = stages[stage]
            if (s.salus + step.salus <= chip.salus_per_stage and s.tables + step.tables <= chip.tables_per_stage
                    and s.tcam_blocks + step.tcam_blocks <= chip.tcam_blocks_per_stage
                    and s.sram_blocks + step.sram_blocks <= chip.sram_blocks_per_stage):
                break
            stage += 1
        s.steps.append(step.name)
        s.salus += step.salus
        s.tables += step.tables
        s.tcam_blocks += step.tcam_blocks
        s.sram_blocks += step.sram_blocks
        placed[step.name] = stage
    return stages


def stage_rows(stages: list[Stage]) -> list[str]:
    """The stage table as markdown rows: runs of numbered steps (lane_decode_0..15) collapse to one range."""
    rows = []
    for number, stage in enumerate(stages):
        names: dict[str, list[int]] = {}
        for name in stage.steps:
            base, _, index = name.rpartition("_")
            if index.isdigit():
                names.setdefault(base, []).append(int(index))
            else:
                names.setdefault(name, [])
        cells = ", ".join(f"`{n}` {_runs(i)}" if i else f"`{n}`" for n, i in names.items())
        rows.append(f"| {number} | {cells} | {stage.salus} | {stage.tables} | {stage.tcam_blocks} | "
                    f"{stage.sram_blocks} |")
    return rows


def _runs(numbers: list[int]) -> str:
    """1, 2, 3, 7 -> "1-3, 7"."""
    runs: list[list[int]] = []
    for n in sorted(numbers):
        if runs and n == runs[-1][-1] + 1:
            runs[-1].append(n)
        else:
            runs.append([n])
    return ", ".join(f"{r[0]}-{r[-1]}" if len(r) > 1 else f"{r[0]}" for r in runs)


# ---- PHV --------------------------------------------------------------------------------------------------------

def phv_bits(text: str) -> dict[str, int]:
    """The bits the sketch declares per pass type: the headers a pass has valid and the metadata (every field
    counted once; the sketch overlays by construction: a harvest pass reuses the lane words of a consume pass, and
    its codes go in the consume pass's codes_lo header; the compiler's own overlays are not counted)."""
    structs = declarations(text)
    headers = structs["tna_headers_t"]
    meta = sum(structs["tna_metadata_t"].values())
    common = sum(headers[h] for h in ("bridge", "ethernet", "ipv4", "udp", "intml"))
    return {JUDGE: common + headers["codes_lo"] + headers["codes_hi"] + meta,
            CONSUME: common + headers["codes_lo"] + headers["codes_hi"] + meta,
            HARVEST: common + headers["codes_lo"] + headers["sums"] + meta}


# ---- passes and throughput --------------------------------------------------------------------------------------

WIRE_OVERHEAD = 14 + 4 + 20 + 8 + L.HEADER_BYTES + 8 + 12  # Ethernet + FCS, IPv4, UDP, intml, preamble, gap


def pass_sequence(elements: int, completes: bool) -> list[tuple[str, int, int]]:
    """The passes one contribution of ``elements`` C_nat elements takes, as (pass type, group, half): a judge
    and a consume pass per group; if the contribution completes every group (or re-sends), a harvest pass per
    half group, last group and second half first (each prepends its codes), then one that encodes the last."""
    groups = max(1, math.ceil(elements / L.LANES_PER_PASS))
    out = [(kind, g, 0) for g in range(groups) for kind in (JUDGE, CONSUME)]
    if completes:
        out += [(HARVEST, g, h) for g in reversed(range(groups)) for h in (1, 0)] + [(HARVEST, 0, -1)]
    return out


@dataclass(frozen=True)
class Throughput:
    elements: int
    workers: int
    recirculation_bps: float
    passes_per_contribution: float  # averaged over the n contributions of a round (one harvests)
    recirculations_per_second: float  # packets/s through the recirculation bandwidth
    recirculated_bytes_per_second: float
    results_per_second: float
    ate_per_second: float  # aggregated tensor elements per second


def throughput(elements: int, workers: int, recirculation_bps: float, port_bps: float = 100e9) -> Throughput:
    """One pipe's bound. Every pass but a contribution's first comes through the recirculation bandwidth R, as
    a whole packet (an upper bound: consume passes shed their codes, harvest passes grow); a round needs n
    contributions, one of which harvests. Bound: the smaller of R's and the worker ports' (n ports of
    ``port_bps``, one pipe)."""
    size = elements + WIRE_OVERHEAD
    one = len(pass_sequence(elements, False))
    last = len(pass_sequence(elements, True))
    recirculations_per_round = (workers - 1) * (one - 1) + (last - 1)
    rounds_by_recirculation = recirculation_bps / (8 * size * recirculations_per_round) \
        if recirculations_per_round else math.inf
    rounds_by_ports = port_bps / (8 * size)  # each worker sends one packet per round on its own port
    rounds = min(rounds_by_recirculation, rounds_by_ports)
    recirculations = rounds * recirculations_per_round
    return Throughput(elements, workers, recirculation_bps, (recirculations_per_round + workers) / workers,
                      recirculations, recirculations * size, rounds, rounds * elements)


# R, and what it assumes: one recirculation port of a switch shared with other traffic, or a switch dedicated to
# the job with a pipe's 16 x 100 Gb/s ports in loopback
RECIRCULATION = ((100e9, "100 Gb/s, shared switch (one recirculation port)"),
                 (1.6e12, "1.6 Tb/s, dedicated switch (16 ports in loopback)"))


def throughput_rows(elements: tuple[int, ...] = (1024, 256, 64), workers: tuple[int, ...] = (8, 16, 32)) -> list[str]:
    """The throughput table as markdown rows: per E and R, the passes a contribution takes (averaged over n = 8),
    then for each n: recirculated packets/s and bytes/s, and ATE/s."""
    rows = []
    for e, (r, assumption) in itertools.product(elements, RECIRCULATION):
        figures = [throughput(e, n, r) for n in workers]
        cells = [f"{f.recirculations_per_second:.2e} pkt/s, {f.recirculated_bytes_per_second:.2e} B/s, "
                 f"**{f.ate_per_second:.2e}**" for f in figures]
        rows.append(f"| {e} ({math.ceil(e / L.LANES_PER_PASS)}) | {assumption} | "
                    f"{figures[0].passes_per_contribution:.2f} | " + " | ".join(cells) + " |")
    return rows
