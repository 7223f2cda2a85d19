"""p4.syntax: the lark P4_16 grammar and the structural checks, on small programs that must pass and mutations of
them that must fail (a table applied twice on one path, a register index too wide, a wrong constant, a syntax
error)."""

from pathlib import Path

import pytest

from intml.p4 import syntax

PROGRAM = """
const bit<16> LANES = 4;
const bit<32> ROWS = 1 << 3;
typedef bit<4> row_t;

header eth_h { bit<48> dst; bit<48> src; bit<16> ether_type; }
struct headers_t { eth_h eth; }
struct meta_t { @field_list(1) row_t row; bit<1> set; bit<32> sum; bool ok; }
enum bit<8> Kind { A = 1, B = 2 }

parser P(packet_in pkt, out headers_t hdr, inout meta_t meta, inout standard_metadata_t sm) {
    state start {
        pkt.extract(hdr.eth);
        transition select(hdr.eth.ether_type, sm.ingress_port) {
            (0x0800, _): accept;
            (0x86dd &&& 0xffff, 0 .. 3): reject;
            default: accept;
        }
    }
}

control Inner(inout meta_t meta) {
    table t2 { key = { meta.row : exact; } actions = { NoAction; } size = 16; }
    apply { t2.apply(); }
}

control I(inout headers_t hdr, inout meta_t meta, inout standard_metadata_t sm) {
    register<bit<32>, bit<5>>(ROWS * 4) sums;
    Inner() inner;
    bit<32> tmp;
    action add(bit<32> v) {
        sums.read(tmp, meta.row ++ meta.set);
        tmp = tmp + v;
        sums.write((bit<5>) meta.row, tmp);
        meta.sum = tmp >> 2;
        meta.ok = tmp[3:0] == 4w0 && !(tmp >= 8);
    }
    action drop() { mark_to_drop(sm); }
    table t {
        key = { meta.row : exact @name("row"); hdr.eth.ether_type : ternary; }
        actions = { add; drop; @defaultonly NoAction; }
        const entries = {
            (0, 0x0800 &&& 0xffff) : add(32w1);
            (_, _) : drop();
        }
        const default_action = NoAction();
    }
    apply {
        if (hdr.eth.isValid()) {
            switch (t.apply().action_run) {
                add: { inner.apply(meta); }
                default: {}
            }
        } else if (meta.ok) {
            random<bit<32>>(tmp, 0, 0xFFFF_FFFF);
            inner.apply(meta);
        }
        sm.egress_spec = (bit<9>) (meta.sum |+| 1)[8:0];
        meta.set = meta.ok ? 1w1 : 1w0;
    }
}

control E(inout headers_t hdr, inout meta_t meta, inout standard_metadata_t sm) {
    apply { recirculate_preserving_field_list(1); }
}
control C(inout headers_t hdr, inout meta_t meta) { apply { } }
control D(packet_out pkt, in headers_t hdr) { apply { pkt.emit(hdr.eth); } }
V1Switch(P(), C(), I(), E(), C(), D()) main;
"""
EXPECTED = {"LANES": 4, "ROWS": 8}


def errors(text: str, expected=EXPECTED) -> list[str]:
    tree = syntax.parse_text(text)
    return syntax.check_applies(tree) + syntax.check_register_indexes(tree) + syntax.check_constants(tree, expected)


def mutate(old: str, new: str) -> str:
    assert PROGRAM.count(old) == 1, old
    return PROGRAM.replace(old, new)


@pytest.mark.slow
def test_program_passes():
    assert errors(PROGRAM) == []


def test_constants_are_read():
    assert syntax.constants(syntax.parse_text(PROGRAM)) == {"LANES": (4, 16), "ROWS": (8, 32)}


@pytest.mark.parametrize("old, new, message", [
    ("apply { t2.apply(); }", "apply { t2.apply(); if (meta.ok) { t2.apply(); } }", "t2 is applied 2 times"),
    ("        sm.egress_spec", "        inner.apply(meta);\n        sm.egress_spec", "inner is applied 2 times"),
])
def test_table_or_control_applied_twice_on_a_path_fails(old, new, message):
    assert any(message in e for e in errors(mutate(old, new)))


def test_applies_on_separate_branches_pass():
    # the then and else branches each apply inner once: two paths, once each (the program above already has it)
    assert syntax.check_applies(syntax.parse_text(PROGRAM)) == []


@pytest.mark.parametrize("old, new, message", [
    ("(bit<5>) meta.row", "(bit<6>) meta.row", "sums.write index is bit<6>"),
    ("meta.row ++ meta.set", "meta.row", "sums.read index is bit<4>"),
    ("(ROWS * 4) sums", "(ROWS * 3) sums", "beyond its 24 entries"),
    ("(bit<5>) meta.row", "meta.sum + meta.sum", "sums.write index is bit<32>"),
    ("(bit<5>) meta.row", "meta.nothing", "of unknown width"),
])
def test_register_index_too_wide_or_unknown_fails(old, new, message):
    assert any(message in e for e in errors(mutate(old, new)))


def test_constant_index_checked_by_value():
    small = mutate("(ROWS * 4) sums", "(ROWS * 3) sums").replace("meta.row ++ meta.set", "5w23")
    assert errors(small.replace("(bit<5>) meta.row", "5w0")) == []
    assert errors(small.replace("(bit<5>) meta.row", "5w24")) == [
        "line 34: sums.write index 24 is beyond its 24 entries"]


def test_wrong_or_missing_constant_fails():
    assert errors(PROGRAM, {"LANES": 5, "ROWS": 8}) == ["const LANES = 4, the Python configuration says 5"]
    assert errors(PROGRAM, {**EXPECTED, "MAX_WORLD": 32}) == ["const MAX_WORLD is missing (expected 32)"]
    assert errors(mutate("bit<16> LANES = 4", "bit<2> LANES = 4"), EXPECTED) == [
        "const LANES = 4 does not fit bit<2>"]


@pytest.mark.parametrize("old, new", [
    ("tmp = tmp + v;", "tmp = tmp + ;"),
    ("state start {", "state start"),
    ("table t {", "table {"),
    ("const entries = {", "const entries {"),
])
def test_syntax_error_fails(old, new):
    with pytest.raises(syntax.P4SyntaxError, match="line"):
        syntax.parse_text(mutate(old, new))


def test_includes_and_guards(tmp_path: Path):
    (tmp_path / "types.p4").write_text("#ifndef _TYPES_\n#define _TYPES_\nconst bit<16> LANES = 4;\n#endif\n")
    main = tmp_path / "main.p4"
    main.write_text('#include <core.p4>\n#include "types.p4"\n#include "types.p4"\nconst bit<8> X = LANES;\n')
    assert syntax.constants(syntax.parse(main)) == {"LANES": (4, 16), "X": (4, 8)}
    main.write_text('#include "types.p4"\n#define LANES 4\n')
    with pytest.raises(syntax.P4SyntaxError, match="main.p4:2: unsupported preprocessor line"):
        syntax.parse(main)
    main.write_text('#include "types.p4"\n\nconst bit<8> X = ;\n')
    with pytest.raises(syntax.P4SyntaxError, match="main.p4:3"):
        syntax.parse(main)


def test_conditionals_keep_what_the_defines_select(tmp_path: Path):
    main = tmp_path / "main.p4"
    main.write_text("#ifdef TEST\nconst bit<8> A = 1;\n#else\nconst bit<8> A = 2;\n#endif\n"
                    "#ifndef TEST\nconst bit<8> B = 3;\n#endif\n")
    assert syntax.constants(syntax.parse(main)) == {"A": (2, 8), "B": (3, 8)}
    assert syntax.constants(syntax.parse(main, ["TEST"])) == {"A": (1, 8)}
    main.write_text("#ifdef TEST\nconst bit<8> A = 1;\n")
    with pytest.raises(syntax.P4SyntaxError, match="#if without #endif"):
        syntax.parse(main)
    main.write_text("const bit<8> A = 1;\n#else\n")
    with pytest.raises(syntax.P4SyntaxError, match="main.p4:2: #else without #if"):
        syntax.parse(main)


DECLARATIONS = """
error { NoError, PacketTooShort }
match_kind { exact, ternary, lpm }
extern packet_in {
    void extract<T>(out T hdr);
    T lookahead<T>();
    void advance(in bit<32> bits);
}
extern Checker<T> {
    Checker(bit<32> size);
    @pure bool check(in T value);
}
extern void log_value<T>(in T value);
action NoAction() {}
parser Parse<H>(packet_in b, out H hdr);
control Pipe<H>(inout H hdr);
package Switch<H>(Parse<H> p, Pipe<H> c);
typedef bit<8> small_t;
type bit<16> port_t;
enum Color { RED, GREEN }
header a_h { small_t x; varbit<32> opts; }
header b_h { bit<8> y; }
header_union ab_u { a_h a; b_h b; }
struct pair_t { tuple<bit<8>, bool> t; a_h[4] stack; int<8> s; bit c; }
const Color FAVOURITE = Color.GREEN;

bit<8> twice(in bit<8> x) {
    return x + x;
}

parser MyParse(packet_in b, out pair_t hdr) {
    bit<8> n = 0;
    state start {
        b.extract(hdr.stack.next);
        n = b.lookahead<bit<8>>();
        transition select(n, hdr.stack.last.x) {
            (1 .. 4, 8w0 &&& 8w0xF0): start;
            (_, default): accept;
        }
    }
}

control MyPipe(inout pair_t hdr) {
    action set(bit<8> v) { hdr.s = (int<8>) v; hdr.c = hdr.s < 0 ? 1w1 : 1w0; }
    table t {
        key = { hdr.stack[0].x : lpm; }
        actions = { set; NoAction; }
        default_action = NoAction();
        @name("t_size") size = 4;
    }
    apply {
        switch (t.apply().action_run) {
            set: {}
            default: { exit; }
        }
        if (!t.apply().hit) { return; }
        hdr.stack[1].x = twice(hdr.stack[0].x)[7:0] |-| 8w1 ^ ~8w3 % 3;
        log_value<bit<8>>(hdr.stack[0].x);
    }
}

Switch(MyParse(), MyPipe()) main;
"""


def test_grammar_covers_the_declarations_of_p4_16():
    """Architecture-file declarations (extern objects and functions, generic types, packages, error and
    match_kind), type, header_union, tuple, varbit, functions, keyset ranges and masks, switch on action_run."""
    tree = syntax.parse_text(DECLARATIONS)
    kinds = {sub.data for sub in tree.iter_subtrees()}
    assert {"extern_object", "extern_function", "package_type_declaration", "header_union_declaration",
            "function_declaration", "switch_statement", "range", "mask", "typedef_declaration",
            "serializable_enum"} - kinds == {"serializable_enum"}
    # the table is applied twice on one path (the switch, then the if): the check says so
    assert syntax.check_applies(tree) == ["control MyPipe: t is applied 2 times on one path"]
