"""The Tofino sketch (p4/tna/*.p4) against a Tofino-1 stateful ALU and its own account (p4/tna_account.py): every
RegisterAction fits one SALU, read from the generated text; the judge pass orders rounds as the model does; the
lane check is layout.lane_ok; the two-lookup encode is the kernel's rounding; and the stage, PHV and throughput
figures p4/README.md prints are the account's."""

from __future__ import annotations

import itertools
import re

import numpy as np
import pytest

from intml.p4 import layout
from intml.p4 import tna_account as account
from intml.p4.generate import HERE as P4

TEXT = account.program_text()
README = (P4 / "README.md").read_text()

# the previous sketch's bitmap action, verbatim: what the issue found a Tofino-1 SALU cannot do
PREVIOUS_MARK = """
struct pair_t { bit<32> first; bit<32> second; }
struct md_t { bit<32> worker_bit_lo; bit<32> worker_bit_hi; bit<32> full_lo; bit<32> full_hi; bit<8> order;
              bool exp_ok; }
control SlotState(inout md_t ig_md) {
    Register<pair_t, bit<10>>(1024) worker_bitmap;
    RegisterAction<pair_t, bit<10>, bit<32>>(worker_bitmap) mark = {
        void apply(inout pair_t value, out bit<32> result) {
            result = 0;
            if (ig_md.order == ORDER_NEWER) {
                if (ig_md.worker_bit_lo == ig_md.full_lo && ig_md.worker_bit_hi == ig_md.full_hi) {
                    result = COMPLETES;  // a one-rank job
                }
                value.first = ig_md.worker_bit_lo;
                value.second = ig_md.worker_bit_hi;
            } else if ((value.first & ig_md.worker_bit_lo) != 0 || (value.second & ig_md.worker_bit_hi) != 0) {
                result = KNOWN_RANK;
            } else if (ig_md.order == ORDER_SAME && ig_md.exp_ok) {
                if ((value.first | ig_md.worker_bit_lo) == ig_md.full_lo
                        && (value.second | ig_md.worker_bit_hi) == ig_md.full_hi) {
                    result = COMPLETES;
                }
                value.first = value.first | ig_md.worker_bit_lo;
                value.second = value.second | ig_md.worker_bit_hi;
            }
        }
    };
    apply { }
}
"""


def test_every_register_action_fits_one_salu():
    actions = account.register_actions(TEXT)
    assert len(actions) == 24
    assert account.salu_violations(TEXT) == []


def test_the_check_finds_what_a_salu_cannot_do():
    """The previous sketch's bitmap action breaks every limit the issue names (the previous sketch as a whole: 16
    violations in 3 of its 12 RegisterActions); so do a 64-bit register, a 64-bit operand and a concatenation."""
    found = account.salu_violations(PREVIOUS_MARK)
    assert "worker_bitmap.mark: 9 predicates (at most 2)" in found
    assert any("6 PHV operands" in v for v in found)
    assert any("(value.first & ig_md.worker_bit_lo) != 0" in v and "not register ± PHV" in v for v in found)
    wide = """
struct md_t { bit<64> now; bit<8> a; bit<8> b; }
control C(inout md_t m) {
    Register<bit<64>, bit<1>>(1) tat;
    RegisterAction<bit<64>, bit<1>, bit<64>>(tat) take = {
        void apply(inout bit<64> value, out bit<64> old) {
            old = value;
            value = m.a ++ m.b;
            if (value < m.now) { value = m.now; }
        }
    };
    apply { }
}
"""
    assert account.salu_violations(wide) == [
        "tat.take: register of bit<64>: more than two 32-bit halves",
        "tat.take: output bit<64> wider than 32 bits",
        "tat.take: value = m.a ++ m.b is not one ALU operation",
        "tat.take: PHV operand m.now wider than 32 bits"]


def _body(name: str) -> str:
    action = next(a for a in account.register_actions(TEXT) if a.name == name)
    return action.body


def _python(condition: str) -> str:
    condition = re.sub(r"\(int<32>\)\((.*?)\)", r"_signed(\1)", condition)
    for p4, py in (("hdr.intml.allreduce", "a"), ("ig_md.chunk_key", "c"), ("value", "f"), ("&&", " and "),
                   ("||", " or ")):
        condition = condition.replace(p4, py)
    return condition


def _order(body: str, scope: dict) -> str:
    same, newer = re.findall(r"if \((.*?)\) \{", body)
    scope = dict(scope, _signed=lambda x: (x & 0xFFFFFFFF) - ((x & 0x80000000) << 1))
    return "SAME" if eval(_python(same), {}, scope) else "NEWER" if eval(_python(newer), {}, scope) else "OLDER"


def test_judge_orders_rounds_as_the_model():
    """advance_allreduce then advance_chunk (or open_chunk after a newer allreduce), read from the generated text
    and evaluated as Python, give the model's serial order: an older chunk of the same allreduce is OLDER."""
    from intml.p4.model import _serial_event
    allreduce, chunk = _body("advance_allreduce"), _body("advance_chunk")
    assert "value = ig_md.chunk_key;" in _body("open_chunk") and "ORDER_NEWER" in _body("open_chunk")
    values = [0, 1, 2, 0x7FFFFFFF, 0x80000000, 0x80000001, 0xFFFFFFFE, 0xFFFFFFFF]
    for a, f, c, s in itertools.product(values, values, values[:5], values[:5]):
        order = _order(allreduce, {"a": a, "f": f})
        if order == "SAME":
            order = _order(chunk.replace("value", "s"), {"c": c, "s": s, "f": s})
        assert order == _serial_event(a << 32 | c, f << 32 | s), (a, f, c, s)


def _rows(table: str, text: str) -> list[str]:
    body = re.search(rf"table {table} \{{.*?const entries = \{{(.*?)\}}\s*\}}", text, re.S)[1]
    return [row.strip() for row in body.strip().splitlines()]


def _number(literal: str) -> int:
    return int(literal.split("w")[1], 0)


def test_lane_check_is_lane_ok():
    """lane_check's entries, read from the generated text: a word of four codes hits iff one of them is not
    layout.lane_ok for k_limit, at every position and every k_limit."""
    codec = (P4 / "tna" / "codec_tna.p4").read_text()
    rows = []
    for row in _rows("lane_check", codec):
        m = re.fullmatch(r"\((\S+) &&& (\S+), (\S+) \.\. (\S+)\) : invalid\(\);", row)
        rows.append(tuple(_number(x) for x in m.groups()))
    codes = np.arange(256, dtype=np.uint32)
    for position, k_limit in itertools.product(range(account.CHECK_GROUP), range(40)):
        word = codes << np.uint32(24 - 8 * position)
        hit = np.zeros(256, bool)
        for value, mask, low, high in rows:
            hit |= ((word & np.uint32(mask)) == value) & (low <= k_limit <= high)
        expected = np.array([not layout.lane_ok(int(code), k_limit) for code in codes])
        assert (hit == expected).all(), (position, k_limit)


def _encode(s: int, r: int, actions: dict[int, tuple[int, int]]) -> int:
    """The harvest pass's encode of sum s with rounding word r, step by step as the generated text writes it."""
    s &= 0xFFFFFFFF
    mask = 0xFFFFFFFF if s >> 31 else 0
    code = (s >> 31) << 7
    s = ((s ^ mask) - mask) & 0xFFFFFFFF
    b = next((b for b in range(31, -1, -1) if s >> b & 1), None)
    if b is None:
        code, s = 0, 0  # encode_zero
    else:
        orred, shift = actions[b]
        code, s = code | orred, (s << shift) & 0xFFFFFFFF if shift < 32 else 0
    excess = max(s - r, 0)
    return code + 1 if excess != 0 else code


def test_two_lookup_encode_is_the_kernels_rounding():
    """leading_one (its entries and encode_b<b> actions, read from the generated text), the saturating
    subtract and round_up give protocol.arith._sum_code's code, bit for bit."""
    from intml.protocol.arith import _sum_code
    codec = (P4 / "tna" / "codec_tna.p4").read_text()
    actions = {}
    for b, orred, shift in re.findall(r"action encode_b(\d+)\(\) \{\s*code = code \| 8w(\d+);\s*magnitude = "
                                      r"(?:magnitude << (\d+)|0);", codec):
        actions[int(b)] = (int(orred), int(shift) if shift else 32)
    assert sorted(actions) == list(range(32))
    rows = _rows("leading_one", codec)
    assert len(rows) == 32 and rows[5] == "32w32 &&& 32w0xffffffe0 : encode_b5();"
    assert "32w0 &&& 32w0xffffffff : NoAction();" in _rows("round_up_table", codec)
    assert "default_action = round_up();" in codec
    rng = np.random.default_rng(25)
    sums = [0, 1, -1, 2, -2, 3, -(1 << 31), (1 << 31) - 1, 5, -7]
    sums += [int(x) >> int(k) for x, k in zip(rng.integers(-(1 << 31), 1 << 31, 4000), rng.integers(0, 31, 4000))]
    for s in sums:
        r = int(rng.integers(0, 1 << 32))
        neg, a, k = (int(v) for v in _sum_code(np.int32(s), np.uint32(r)))
        expected = 0 if a == 0 else (neg << 7) | layout.NONZERO | k
        assert _encode(s, r, actions) == expected, (s, r)


def test_the_account_counts_the_programs_salus():
    """The stage account's SALUs are the program's registers, instance by instance (a processor per pair)."""
    registers = len(re.findall(r"\bRegister<", TEXT)) - 1 + len(re.findall(r"Processor\(\) processor_\d+;", TEXT))
    assert sum(step.salus for step in account.steps()) == registers == 40


def test_a_duplicate_of_an_incomplete_round_gets_its_pending():
    """As the v1model program's Forward: every consume pass that does not open the round reads both 32-bit halves
    of the bitmap (a SALU each), a known rank whose round still counts down is a duplicate, and the last consume
    pass makes its PENDING (type PENDING, count 0, the lengths of a header and a bitmap, the bitmap ranks 32-63
    high), back through the DATA's ingress port."""
    tally = (P4 / "tna" / "slot_tna.p4").read_text()
    for half in ("lo", "hi"):
        assert f"Register<bit<32>, cell_t>(LANE_ENTRIES) worker_bitmap_{half};" in tally
        assert f"ig_md.have_{half} = mark_{half}.execute(ig_md.cell);" in tally
        assert f"ig_md.have_{half} = peek_{half}.execute(ig_md.cell);" in tally
    assert "ig_md.duplicate = true;" in tally
    pending = re.search(r"else if \(ig_md\.duplicate\) \{(.*?)\}", TEXT, re.S)[1]
    for statement in ("hdr.intml.type = TYPE_PENDING;", "hdr.intml.count = 0;", "hdr.have.setValid();",
                      "hdr.have.have = ig_md.have_hi ++ ig_md.have_lo;",
                      "hdr.udp.length = UDP_BYTES + HEADER_BYTES + HAVE_BYTES;"):
        assert statement in pending
    assert "ig_md.bridge.port = ig_intr_md.ingress_port;" in TEXT
    assert "ig_tm_md.ucast_egress_port = (PortId_t) ig_md.bridge.port;" in TEXT


def test_sixty_four_lanes_need_more_stages_than_tofino1_has():
    """The list schedule of the dependency chain: 64 lanes a pass take 17 stages (Tofino-1 has 12: logical
    tables bind); they fit Tofino-2's 20, and 38 lanes fit Tofino-1."""
    stages = account.schedule()
    assert len(stages) == 17 > account.TOFINO1.stages
    assert len(account.schedule(account.TOFINO2)) <= account.TOFINO2.stages
    fitting, too_many = (len(account.schedule(plan=account.steps(lanes))) for lanes in (38, 40))
    assert fitting <= account.TOFINO1.stages < too_many
    for stage in stages:
        assert stage.salus <= 4 and stage.tables <= 16 and stage.tcam_blocks <= 24 and stage.sram_blocks <= 80


def test_the_readme_prints_the_account():
    for row in account.stage_rows(account.schedule()):
        assert row in README
    for row in account.throughput_rows():
        assert row in README
    bits = account.phv_bits(TEXT)
    assert f"judge and consume {bits['judge']:,} bits, harvest {bits['harvest']:,}" in README


def test_pass_sequence():
    seq = account.pass_sequence(1024, completes=True)
    assert seq[:4] == [("judge", 0, 0), ("consume", 0, 0), ("judge", 1, 0), ("consume", 1, 0)]
    harvest = seq[32:]
    assert harvest[:3] == [("harvest", 15, 1), ("harvest", 15, 0), ("harvest", 14, 1)]
    assert harvest[-1] == ("harvest", 0, -1) and len(harvest) == 2 * 16 + 1
    assert len(account.pass_sequence(64, completes=False)) == 2


@pytest.mark.parametrize("workers", [8, 16, 32])
def test_throughput_scales_with_recirculation(workers):
    low = account.throughput(1024, workers, 100e9)
    high = account.throughput(1024, workers, 1.6e12)
    assert high.ate_per_second == pytest.approx(16 * low.ate_per_second)
    assert low.recirculated_bytes_per_second == pytest.approx(100e9 / 8)
    assert account.throughput(1024, 2 * workers, 100e9).ate_per_second < low.ate_per_second
