"""Writes the generated .p4 files of the switch program from p4/layout.py (constants, registers, tables, bridged
fields) and p4/entries.py (the ``const entries``): what P4 cannot say itself. The v1model program's 64 unrolled
lanes (lanes.p4, the lane instances in intml.p4), the constant tables (next_step.p4, cnat_decode.p4,
cnat_encode.p4), the constants and bridged fields (headers.p4), and the Tofino sketch p4/tna/*.p4. The fixed
controls (HAND_WRITTEN: the parser, the job checks, the slot state, forwarding, egress) are written as P4, one
concern a file, and checked against the same layout by tests/p4/test_p4_generate.py. The action bodies of the
generated tables are in p4/actions.py, the rendering helpers in p4/p4text.py, the Tofino sketch in
p4/generate_tna.py.

``python -m intml.p4.generate`` rewrites the generated files; ``--check`` writes nothing and exits 1 naming the
files that differ from what it would write (tests/p4/test_p4_generate.py runs the same comparison).
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Callable, Iterable
from pathlib import Path

from intml.p4 import entries as entries_module
from intml.p4 import layout as L
from intml.p4.actions import ACTION_BODIES
from intml.p4.generate_tna import tna_files
from intml.p4.p4text import HEADER_NOTE, guard, lanes, log2, table_text
from intml.protocol.codec import Codec
from intml.protocol.wire import DEFAULT_PORT

HERE = Path(__file__).resolve().parent
CPU_PORT = 255  # where admitted control datagrams leave for the controller (a deployment choice)
FIELD_LIST = 1  # the @field_list recirculate_preserving_field_list keeps: the bridged metadata
TEST_RANDOM = "INTML_TEST_RANDOM"  # the -D of the test build: random words from the packet, not v1model's random()
TEST_RANDOM_ETHERTYPE = 0x88B5  # the test build's words header (IEEE 802 local experimental ethertype 1)

SLOT_BITS = log2(L.SLOT_ENTRIES)
PASS_BITS = log2(L.MAX_PASSES)
LANE_BITS = log2(L.LANE_ENTRIES)
JOB_BITS = log2(L.MAX_JOBS)
RANK_BITS = log2(L.MAX_WORLD)
MEMBER_BITS = log2(L.MEMBER_ENTRIES)
BUCKET_BITS = log2(L.CONTROL_SOURCE_BUCKETS)
# the hand-written controls index: lane cell = slot_index ++ pass_no, member cell = job index ++ rank
assert SLOT_BITS + PASS_BITS == LANE_BITS and JOB_BITS + RANK_BITS == MEMBER_BITS
assert L.lane_index(1, 0) == L.MAX_PASSES  # lane cell = slot_index ++ pass_no
assert 64 - L.BUCKET_SHIFT == BUCKET_BITS
BLOCK_BYTES = L.LANES_PER_PASS  # a pass of C_nat codes; an int32 pass is 4 blocks
SKIP_BLOCKS = max(p * width for codec, width in ((Codec.CNAT8, 1), (Codec.INT32, 4))
                  for p in range(L.MAX_LANES[codec] // L.LANES_PER_PASS))  # the last pass's blocks before it

# This program's own constants beside layout.CONSTANTS (the syntax check compares those with layout's).
PROGRAM_CONSTANTS = {
    "INTML_PORT": (DEFAULT_PORT, "protocol.wire.DEFAULT_PORT: the aggregator's UDP port"),
    "CPU_PORT": (CPU_PORT, "admitted control datagrams leave here for the controller"),
    "ETHERNET_BYTES": (14, "the Ethernet header"),
    "IPV4_BYTES": (20, "the IPv4 header (the parser takes ihl = 5 only)"),
    "UDP_BYTES": (8, "the UDP header"),
    "ETHERTYPE_IPV4": (0x0800, "IPv4 in the Ethernet type"),
    "PROTO_UDP": (17, "UDP in the IPv4 protocol"),
    "LANES_PER_PASS_LOG2": (log2(L.LANES_PER_PASS), "passes = (elements - 1) >> this, + 1"),
    "MEMBER_ENTRIES": (L.MEMBER_ENTRIES, "layout.MEMBER_ENTRIES: member_seen's cells"),
    "HASH_MULTIPLIER": (L.HASH_MULTIPLIER, "layout.HASH_MULTIPLIER: the control meter's Fibonacci hash"),
}


def used_constants(texts: Iterable[str]) -> dict[str, int]:
    """layout.CONSTANTS that ``texts`` (the program's other files) name: headers.p4 declares only these, since
    p4c warns of an unused const."""
    text = "\n".join(texts)
    return {name: value for name, value in L.CONSTANTS.items() if re.search(rf"\b{name}\b", text)}


def headers(constants: dict[str, int]) -> str:
    bridged = [(name, width) for name, width in L.BRIDGED] + [("in_port", 9)]
    return guard("HEADERS", f"""
// ---- p4/layout.py's CONSTANTS that the program names (p4/syntax.py checks each against it)
{chr(10).join(f"const int {name} = {value};" for name, value in constants.items())}

// ---- this program's own
{chr(10).join(f"const int {name} = {value};  // {why}" for name, (value, why) in PROGRAM_CONSTANTS.items())}
#ifdef {TEST_RANDOM}
const int ETHERTYPE_TEST_RANDOM = 0x{TEST_RANDOM_ETHERTYPE:X};  // the words header before the IPv4 header
#endif

typedef bit<{L.ADDR_BITS}> addr_key_t;  // IPv4 << 16 | UDP port (protocol.address)
typedef bit<{LANE_BITS}> lane_index_t;  // slot_index ++ pass_no: LANE_ENTRIES cells
typedef bit<{MEMBER_BITS}> member_index_t;  // job_index ++ rank: MEMBER_ENTRIES cells
typedef bit<{BUCKET_BITS}> bucket_t;  // the control meter's source buckets
typedef bit<1> core_cell_t;  // control_core_tat's one cell (index 0 only)

header ethernet_h {{ bit<48> dst_addr; bit<48> src_addr; bit<16> ether_type; }}

header ipv4_h {{
    bit<4> version; bit<4> ihl; bit<8> diffserv; bit<16> total_len; bit<16> identification; bit<3> flags;
    bit<13> frag_offset; bit<8> ttl; bit<8> protocol; bit<16> hdr_checksum; bit<32> src_addr; bit<32> dst_addr;
}}

header udp_h {{ bit<16> src_port; bit<16> dst_port; bit<16> length; bit<16> checksum; }}

// protocol.wire's data header in wire order, network byte order; the signed fields (int<W> on the wire) are
// kept as their bits and cast where they are compared
header intml_h {{
{chr(10).join(f"    bit<{bits}> {name};{'  // signed' if signed else ''}" for name, bits, signed in L.INTML_HEADER)}
}}

header have_h {{ bit<{L.MAX_WORLD}> have; }}  // a PENDING's ranks its round has (protocol.wire), after its header
header block_h {{ bit<{8 * BLOCK_BYTES}> bytes; }}  // payload an earlier pass took, carried through unread
header code_h {{ bit<8> code; }}  // one C_nat code of this pass
header word_h {{ bit<32> value; }}  // one int32 of this pass
// the {TEST_RANDOM} build's random words: word i (big-endian, in order) is lane i's in every pass
header test_random_h {{ bit<{32 * L.LANES_PER_PASS}> words; bit<16> ether_type; }}

// A pass parses only its own LANES_PER_PASS elements: those of earlier passes ride in opaque blocks before them
struct headers_t {{
    ethernet_h ethernet;
    test_random_h test_random;  // the {TEST_RANDOM} build only
    ipv4_h ipv4;
    udp_h udp;
    intml_h intml;
    have_h have;  // never parsed: Forward makes a duplicate's PENDING
    block_h[{SKIP_BLOCKS}] done;
    code_h[LANES_PER_PASS] codes;
    word_h[LANES_PER_PASS] words;
}}

// one lane of a pass: the element it carries and what the lane's controls make of it
struct lane_t {{
    bool active;  // the packet has this element
    bit<8> code;  // C_nat: the code in, then the result code out
    bit<32> value;  // the element in the slot's unit (decoded code, or the int32)
    bit<32> sum;  // the lane's sum after this contribution (int32 mode: the result)
    bit<8> sign;  // encode: SIGN or 0
    bit<32> magnitude;  // encode: |sum|
    bit<32> rand;  // encode: the random word
    bit<{L.FLAG_BITS}> flags;  // the lane's non-finite flags, ORed over the round's contributions (0: finite)
    bool saturated;  // encode: k above k_finite
}}

struct lanes_t {{
{lanes(lambda i: f"    lane_t l{i};")}
}}

struct metadata_t {{
    // bridged: carried across recirculations (p4/layout.py BRIDGED; in_port is this program's: a re-send
    // leaves by the port its request came in)
{chr(10).join(f"    @field_list({FIELD_LIST}) bit<{width}> {name};" for name, width in bridged)}
    // this pass's working state
    bit<16> remaining;  // the parser's count of payload elements left
    bit<8> skip;  // the parser's count of blocks before this pass's elements
    bit<8> lanes_left;  // the parser's count of this pass's lanes left
    lane_index_t cell;  // slot_index ++ pass_no: this pass's cell of every per-(row, set, pass) register
    addr_key_t src_addr;
{chr(10).join(f"    bit<{width}> {name};" for name, width in L.JOB_PARAMS if name != "job_index")}
    bit<8> codec;  // the job's codec
    bit<{L.MAX_WORLD}> worker_bit;
    bit<{L.MAX_WORLD}> have;  // the set's bitmap as this pass read it (a duplicate's PENDING carries it)
    bit<16> row;
    bit<8> k_limit;
    bool bound_hit;  // data_bound has an entry for (value bits, exp)
    bool lanes_ok;  // every lane of the packet passed
    bool empty;  // the set has no round (bitmap 0)
    bit<{L.STATE_BITS}> state;
    bit<{L.EVENT_BITS}> event;
    bool job_known;
    bool is_data;  // a DATA packet past the header and job checks
    bool to_cpu;
    bit<8> drop_stat;  // the STAT_ index of the drop reason; 0 (packets_in): none
    bool duplicate;  // this pass already has the rank's contribution
    bool last_pass;  // this pass is the round's last
    bool recirculate;
    bit<16> rid;  // egress: the replica (rank, or GROUP_RID) whose destination to write
}}
""")












def next_step(static: list) -> str:
    return guard("NEXT_STEP", f"""
// (state, event) -> what the packet does, from protocol.slot_reference.TRANSITIONS (p4/entries.py). Exponent then
// holds an add to the round's exponent and element count, and any contribution to pass 0's lane check.
control NextStep(inout headers_t hdr, inout metadata_t meta) {{
    Exponent() exponent;

{table("next_step", static)}

    apply {{
        next_step.apply();
        exponent.apply(hdr, meta);
    }}
}}
""")




def cnat_decode(static: list) -> str:
    codes = lanes(lambda j: f"            if (hdr.codes[{j}].isValid() && !code_ok(hdr.codes[{j}].code, meta.k_limit)) "
                            "{ meta.lanes_ok = false; }")
    words = lanes(lambda j: f"            if (hdr.words[{j}].isValid() && !word_ok(hdr.words[{j}].value, meta.value_limit)) "
                            "{ meta.lanes_ok = false; }")
    return guard("CNAT_DECODE", f"""
// Every pass checks its elements, stateless, before any register of the pass is written (a pass with one bad
// element changes nothing: drop_invalid_code; the passes before it keep the rank's lanes, as a packet lost between
// passes does, and a retransmission adds only the passes that lack it). A C_nat code passes iff it is 0, or has the NONZERO bit and
// k < k_limit, the bound of (value bits s(n), exp) from data_bound (protocol.arith.data_k_max + 1); an int32
// passes iff |value| <= 2**s(n). The non-finite flags pass too: a code 0x01-0x03, a word NONFINITE_WORD + 1..3.
bool code_ok(in bit<8> code, in bit<8> k_limit) {{
    return (code & 0xFC) == 0 || ((code & NONZERO) != 0 && (code & K_MASK) < k_limit);
}}

bool word_ok(in bit<32> value, in bit<32> limit) {{
    return ((value & 0xFFFFFFFC) == NONFINITE_WORD && value[1:0] != 0)
        || ((int<32>) value >= -(int<32>) limit && (int<32>) value <= (int<32>) limit);
}}

control LaneCheck(inout headers_t hdr, inout metadata_t meta) {{
{table("data_bound", static)}

    apply {{
        data_bound.apply();
        if (hdr.intml.codec == CODEC_CNAT8) {{
            meta.lanes_ok = meta.bound_hit;
{codes}
        }} else {{
            meta.lanes_ok = true;
{words}
        }}
    }}
}}

// One lane's code -> its value +-2**k in the slot's unit, a 32-bit word (Tofino has no variable shift: the
// table holds the powers). Every code pass 0 let through hits.
control LaneDecode(inout lane_t lane) {{
{table("cnat_decode", static)}

    apply {{
        cnat_decode.apply();
    }}
}}
""")




def cnat_encode(static: list) -> str:
    return guard("CNAT_ENCODE", f"""
// On the completing contribution, one lane's sum -> its C_nat code, stored for every re-send (which reads it):
// the leading one b of |sum| by a ternary table, then encode_b<b> rounds stochastically with v1model's random
// extern (a nearest job: the fixed word NEAREST_WORD rounds to nearest, ties away from zero), so the round is
// encoded once and a retransmission can never change it. A lane with non-finite flags is sent as their code.
// The {TEST_RANDOM} build takes its words from the packet (LoadTestRandom), so that a test can reproduce them.
control LaneEncode(inout lane_t lane, in lane_index_t cell, in bit<2> step, in bit<1> completes,
                   in bit<8> k_finite, in bit<1> nearest) {{
    register<bit<8>, lane_index_t>(LANE_ENTRIES) lane_code;

{table("leading_one", static)}

    apply {{
        if (step == STEP_RESEND) {{
            lane_code.read(lane.code, cell);
        }} else if (completes == 1) {{
            lane.sign = lane.sum[31:31] ++ 7w0;
            lane.magnitude = lane.sum[31:31] == 1 ? -lane.sum : lane.sum;
            if (nearest == 1) {{
                lane.rand = NEAREST_WORD;
            }}
#ifndef {TEST_RANDOM}
            else {{
                random<bit<32>>(lane.rand, 0, 0xFFFFFFFF);
            }}
#endif
            leading_one.apply();
            lane.saturated = (lane.code & K_MASK) > k_finite;
            if (lane.flags != 0) {{
                lane.code = 6w0 ++ lane.flags;
            }}
            lane_code.write(cell, lane.code);
        }}
    }}
}}
""")


def lanes_p4() -> str:
    def moves(kind: str, load: bool) -> str:
        field, lane_field = ("code", "code") if kind == "codes" else ("value", "value")
        if load:  # every field: the lanes are a fresh local of the pass
            other = "value" if kind == "codes" else "code"
            return lanes(lambda i: f"        lanes.l{i}.active = hdr.{kind}[{i}].isValid();\n"
                                   f"        lanes.l{i}.{lane_field} = hdr.{kind}[{i}].{field};\n"
                                   f"        lanes.l{i}.{other} = 0;\n"
                                   + "".join(f"        lanes.l{i}.{f} = 0;\n"
                                             for f in ("sum", "sign", "magnitude", "rand", "flags"))
                                   + f"        lanes.l{i}.saturated = false;")
        out = "code" if kind == "codes" else "sum"
        return lanes(lambda i: f"        hdr.{kind}[{i}].{field} = lanes.l{i}.{out};")

    def control(name: str, load: bool, why: str) -> str:
        verb = "load" if load else "store"
        actions = [f"    action {verb}_{kind}() {{\n{moves(kind, load)}\n    }}" for kind in ("codes", "words")]
        params = "in headers_t hdr, out lanes_t lanes" if load else "inout headers_t hdr, in lanes_t lanes"
        return (f"// {why}\ncontrol {name}({params}) {{\n" + "\n\n".join(actions)
                + f"\n\n    apply {{\n        if (hdr.intml.codec == CODEC_CNAT8) {{ {verb}_codes(); }} "
                  f"else {{ {verb}_words(); }}\n    }}\n}}\n")

    width = 32 * L.LANES_PER_PASS
    words = lanes(lambda i: f"        lanes.l{i}.rand = hdr.test_random.words[{width - 1 - 32 * i}:"
                            f"{width - 32 - 32 * i}];")
    test_random = (f"\n#ifdef {TEST_RANDOM}\n// The test build's random words into the lanes (LaneEncode keeps "
                   f"them where the shipped program draws\n// v1model's random()).\ncontrol LoadTestRandom(in "
                   f"headers_t hdr, inout lanes_t lanes) {{\n    apply {{\n{words}\n    }}\n}}\n#endif\n")
    return guard("LANES", "\n" + control(
        "LoadLanes", True, "This pass's elements (the parser put them first in the stacks) into the lanes.")
        + "\n" + control("StoreLanes", False, "The lanes' results back into this pass's elements of the packet "
                                               "(the RESULT payload).") + test_random)




def intml() -> str:
    instances = "\n".join(
        lanes(lambda i: f"    {kind}() {name}_{i};") for kind, name in
        (("LaneDecode", "cnat_decode"), ("LaneAggregate", "lane_aggregate"), ("LaneEncode", "cnat_encode")))
    per_lane = lanes(lambda i: f"""            if (lanes.l{i}.active) {{
                if (cnat8 && meta.step != STEP_RESEND) {{ cnat_decode_{i}.apply(lanes.l{i}); }}
                lane_aggregate_{i}.apply(lanes.l{i}, meta.cell, meta.step, cnat8);
                if (cnat8) {{
                    cnat_encode_{i}.apply(lanes.l{i}, meta.cell, meta.step, meta.completes, meta.k_finite,
                                          meta.nearest);
                }}
                if (lanes.l{i}.saturated) {{ count_job(STAT_SATURATED_ELEMENTS); }}
                if (meta.completes == 1 && lanes.l{i}.flags != 0) {{ count_job(STAT_NONFINITE_ELEMENTS); }}
            }}""")
    includes = "\n".join(f'#include "{name}.p4"' for name in INCLUDES)  # a control before its user
    return f"""{HEADER_NOTE}
// The top level: pass 0 judges the packet and updates the slot's state; every pass then runs its lanes and ends
// in Forward. p4/README.md has the diagram.
#include <core.p4>
#define V1MODEL_VERSION 20200408
#include <v1model.p4>
{includes}

control IntmlIngress(inout headers_t hdr, inout metadata_t meta, inout standard_metadata_t sm) {{
    @name(".job_counter") counter<bit<32>>(MAX_JOBS * N_STATS, CounterType.packets) job_counter;
    @name(".core_counter") counter<bit<32>>(N_STATS, CounterType.packets) core_counter;
    Judge() judge;
    LaneCheck() lane_check;
    WorkerBitmap() worker_bitmap;
    LoadLanes() load_lanes;
    StoreLanes() store_lanes;
    Forward() forward;
#ifdef {TEST_RANDOM}
    LoadTestRandom() load_test_random;
#endif
{instances}

    action count_job(bit<8> stat) {{
        job_counter.count((bit<32>) meta.job_index * N_STATS + (bit<32>) stat);
    }}

    apply {{
        if (meta.pass_no == 0) {{
            if (!hdr.udp.isValid() || hdr.udp.dst_port != INTML_PORT) {{
                mark_to_drop(sm);  // not the aggregator's
                exit;
            }}
            core_counter.count(STAT_PACKETS_IN);
            meta.in_port = sm.ingress_port;
            meta.all_in = 1;
        }}
        // every pass judges the packet again (stateless) and decides against its own (row, set, pass) state
        meta.src_addr = hdr.ipv4.src_addr ++ hdr.udp.src_port;
        meta.step = STEP_NONE;
        meta.completes = 0;
        judge.apply(hdr, meta, sm);
        if (meta.job_known && meta.pass_no == 0) {{
            count_job(STAT_PACKETS_IN);
        }}
        if (meta.is_data) {{
            lane_check.apply(hdr, meta);
            worker_bitmap.apply(hdr, meta);  // then WorkerCounter, NextStep, Exponent
        }}
        if (meta.drop_stat != 0) {{
            if (meta.job_known) {{
                count_job(meta.drop_stat);
            }} else {{
                core_counter.count((bit<32>) meta.drop_stat);
            }}
            mark_to_drop(sm);
            exit;
        }}
        if (meta.to_cpu) {{
            sm.egress_spec = CPU_PORT;
            exit;
        }}
        if (!meta.is_data) {{
            mark_to_drop(sm);
            exit;
        }}
        if (meta.step != STEP_RESEND && meta.completes == 0) {{
            meta.all_in = 0;
        }}
        meta.last_pass = meta.elements == 0
            || (bit<16>) meta.pass_no >= (meta.elements - 1) >> LANES_PER_PASS_LOG2;
        if (meta.step != STEP_NONE) {{
            bool cnat8 = hdr.intml.codec == CODEC_CNAT8;
            lanes_t lanes;
            load_lanes.apply(hdr, lanes);
#ifdef {TEST_RANDOM}
            load_test_random.apply(hdr, lanes);
#endif
{per_lane}
            if (meta.step == STEP_RESEND || meta.completes == 1) {{
                store_lanes.apply(hdr, lanes);
            }}
        }}
        if (meta.last_pass) {{  // the packet's statistics, by its last pass's decision
            if (meta.duplicate) {{
                count_job(STAT_RETRANSMISSIONS);
                count_job(STAT_DROP_DUPLICATE_INCOMPLETE);
            }} else if (meta.step == STEP_RESEND) {{
                count_job(STAT_RETRANSMISSIONS);
                if (meta.all_in == 1) {{ count_job(STAT_RESULTS_RESENT); }}
            }} else if (meta.step != STEP_NONE) {{
                count_job(STAT_CONTRIBUTIONS);
                if (meta.completes == 1) {{ count_job(STAT_COMPLETIONS); }}
            }}
        }}
        forward.apply(hdr, meta, sm);
    }}
}}

V1Switch(IntmlParser(), IntmlVerifyChecksum(), IntmlIngress(), IntmlEgress(), IntmlComputeChecksum(),
         IntmlDeparser()) main;
"""


# the generated files: file name (without .p4) -> text
V1MODEL_FILES: dict[str, Callable[[list], str]] = {
    "headers": lambda static: headers(used_constants(
        [render(static) for name, render in V1MODEL_FILES.items() if name != "headers"]
        + [(HERE / f"{name}.p4").read_text() for name in HAND_WRITTEN])),
    "cnat_decode": cnat_decode,
    "next_step": next_step,
    "lanes": lambda static: lanes_p4(),
    "cnat_encode": cnat_encode,
    "intml": lambda static: intml(),
}
# the fixed controls, written as P4 (one concern a file)
HAND_WRITTEN = ("parser", "control_meter", "job_table", "exponent", "worker_counter", "worker_bitmap",
                "lane_aggregate", "forward", "egress")
INCLUDES = ("headers", "parser", "control_meter", "job_table", "cnat_decode", "exponent", "next_step",
            "worker_counter", "worker_bitmap", "lanes", "lane_aggregate", "cnat_encode", "forward", "egress")


def table(name: str, static: list = ()) -> str:
    """A layout table with its actions; the controller-written ones and the per-switch (not per-lane) const ones
    get their layout name as control-plane name."""
    layout_table = L.TABLE[name]
    return table_text(layout_table, ACTION_BODIES[name], list(static),
                      name=None if layout_table.lanes else f".{name}")


def files() -> dict[Path, str]:
    """Every generated file (relative to p4/) and its text."""
    static = entries_module.static_entries()
    out = {Path(f"{name}.p4"): render(static) for name, render in V1MODEL_FILES.items()}
    out.update({Path("tna") / name: text for name, text in tna_files(static).items()})
    return out


def differing(root: Path = HERE) -> list[Path]:
    """The generated files whose committed text under ``root`` differs (or is missing)."""
    return [path for path, text in files().items()
            if not (root / path).exists() or (root / path).read_text() != text]


def write(root: Path = HERE) -> list[Path]:
    written = []
    for path, text in files().items():
        target = root / path
        if not target.exists() or target.read_text() != text:
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(text)
            written.append(path)
    return written


def main(argv: Iterable[str] | None = None) -> int:
    parser_ = argparse.ArgumentParser(prog="python -m intml.p4.generate", description=__doc__.split("\n\n")[0])
    parser_.add_argument("--check", action="store_true", help="write nothing; exit 1 naming the files that differ")
    args = parser_.parse_args(None if argv is None else list(argv))
    if args.check:
        stale = differing()
        for path in stale:
            print(f"p4/{path} differs from what p4/generate.py writes", file=sys.stderr)
        return 1 if stale else 0
    for path in write():
        print(f"wrote p4/{path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
