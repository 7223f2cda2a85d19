"""The Tofino (TNA) sketch of the switch program, p4/tna/*.p4: the same design as the v1model program (the same
layout, tables and const entries), written the way Tofino needs it. Not compiled (Intel's compiler is not open);
p4/syntax.py parses it and checks its register indexes, and p4/README.md accounts for its resources per stage.

What changes on Tofino, following SwitchML (p4lang/p4app-switchML dev_root/p4):
- every register is read-modify-written once per pass by one RegisterAction (a stateful ALU), so two lanes share a
  64-bit register pair (``Processor``, SwitchML's 32 processors x 2 values) and eight lanes' result codes share
  another (``CodeStore``);
- the parser holds one pass's codes in the PHV: a pass *consumes* its codes (the header is removed before the
  packet recirculates), and a completed round is *harvested* by passes that read the stored codes back, last pass
  first, each prepending its codes (SwitchML's CONSUME / HARVEST packet types);
- recirculation carries a bridge header instead of a v1model field list, and random words come from ``Random``.
"""

from __future__ import annotations

from intml.p4 import layout as L
from intml.p4.actions import ACTION_BODIES
from intml.p4.p4text import HEADER_NOTE, guard, log2, table_text

LANES = L.LANES_PER_PASS
PAIRS = LANES // 2  # lanes per 64-bit register pair: two sums, or eight codes
CODE_WORDS = LANES // 8
SLOT_BITS, PASS_BITS = log2(L.SLOT_ENTRIES), log2(L.MAX_PASSES)
LANE_INDEX = f"ig_md.bridge.slot_index[{SLOT_BITS - 1}:0] ++ ig_md.bridge.pass_no[{PASS_BITS - 1}:0]"
SLOT_INDEX = f"ig_md.bridge.slot_index[{SLOT_BITS - 1}:0]"


def types() -> str:
    codes = "\n".join(f"    bit<8> c{i};" for i in range(LANES))
    values = "\n".join(f"    bit<32> v{i};" for i in range(LANES))
    return guard("TNA_TYPES", f"""
const int SLOT_ENTRIES = {L.SLOT_ENTRIES};  // p4/layout.py: the sketch keeps one slot state per (row, set)
typedef bit<{SLOT_BITS}> slot_index_t;  // 2 * row + shadow: SLOT_ENTRIES cells
const int RECIRCULATION_PORT = 68;  // Tofino-1 pipe 0's recirculation port (an assumption of the sketch)
const int PHASE_CONSUME = 0;  // the pass adds its lanes
const int PHASE_HARVEST_FIRST = 1;  // the pass reads back the first lanes of its register pairs
const int PHASE_HARVEST_SECOND = 2;  // ... and the second
const int KNOWN_RANK = 1;
const int COMPLETES = 2;
const int ORDER_OLDER = 0;
const int ORDER_SAME = 1;
const int ORDER_NEWER = 2;

// The bridge header: what a recirculated pass needs from pass 0 (p4/layout.py BRIDGED, and the phase)
header bridge_h {{
{chr(10).join(f"    bit<{w}> {name};" for name, w in L.BRIDGED)}
    bit<8> phase;  // PHASE_CONSUME, PHASE_HARVEST_FIRST or PHASE_HARVEST_SECOND
    bit<{(-sum(w for _, w in L.BRIDGED)) % 8}> pad;
}}

// one pass's codes, the part of the payload the PHV holds
header pass_codes_h {{
{codes}
}}

// the codes a harvest pass prepends: half a pass
header half_codes_h {{
{chr(10).join(f"    bit<8> c{i};" for i in range(PAIRS))}
}}

struct tna_headers_t {{
    bridge_h bridge;
    ethernet_h ethernet;
    ipv4_h ipv4;
    udp_h udp;
    intml_h intml;
    half_codes_h result;
    pass_codes_h codes;
}}

struct pair_t {{
    bit<32> first;
    bit<32> second;
}}

// the lanes' values in the slot's unit, then their sums
struct lane_values_t {{
{values}
}}

struct tna_metadata_t {{
    bridge_h bridge;
    bit<{L.MAX_WORLD // 2}> worker_bit_lo;
    bit<{L.MAX_WORLD // 2}> worker_bit_hi;
    bit<8> world;
    bit<{L.MAX_WORLD // 2}> full_lo;  // the job's full bitmap (ranks 0..n-1), from the job table
    bit<{L.MAX_WORLD // 2}> full_hi;
    bit<{L.EVENT_BITS}> event;
    bit<{L.STATE_BITS}> state;
    bit<8> order;  // ORDER_OLDER / ORDER_SAME / ORDER_NEWER: the packet's round against the set's
    bool lanes_ok;
    bool exp_ok;
    bool new_rank;
    lane_values_t values;
    lane_values_t sums;
}}
""")


def slot_state() -> str:
    return guard("TNA_SLOT", f"""
// The slot's state in pass 0, one RegisterAction per register (a register is touched once per pass on Tofino),
// in dependency order so that each action decides from what the earlier stages returned (p4/README.md, "Tofino
// resource account"):
//   round_key: the packet's order against the round; opens the new round (NEWER, every lane valid);
//   round_exp: (owners ++ exp, biased next_exp): written on open, returns the round's owners code and exp for an
//              add's checks (and a re-send's code), raises next_exp: the owners code costs no stateful ALU;
//   worker_bitmap: (ranks 0-31, 32-63): reset to the rank's bit on open, the bit added on a same-round packet,
//                  returns the bits before (a known rank: duplicate or re-send);
// The count is the bitmap's: the round completes when the bitmap equals the job's full mask (ranks 0..n-1), so
// Tofino needs no worker_count register (its stateful ALU goes to the lanes; p4/README.md).
// One departure from the v1model program: next_exp is raised before the bitmap tells a duplicate from a new rank
// (a conforming worker's duplicate carries the same next_exp, so the max is the same).
control SlotState(inout tna_headers_t hdr, inout tna_metadata_t ig_md) {{
    Register<pair_t, slot_index_t>(SLOT_ENTRIES) round_key;
    Register<pair_t, slot_index_t>(SLOT_ENTRIES) round_exp;
    Register<pair_t, slot_index_t>(SLOT_ENTRIES) worker_bitmap;

    RegisterAction<pair_t, slot_index_t, bit<8>>(round_key) classify = {{
        void apply(inout pair_t value, out bit<8> order) {{
            if (hdr.intml.allreduce - value.first == 0 && (hdr.intml.chunk ^ 0x80000000) == value.second) {{
                order = ORDER_SAME;
            }} else if (((hdr.intml.allreduce - value.first != 0 && hdr.intml.allreduce - value.first < 0x80000000)
                        || (hdr.intml.allreduce == value.first && (hdr.intml.chunk ^ 0x80000000) > value.second))
                       && ig_md.lanes_ok) {{
                // newer: a later allreduce (RFC 1982), or a later chunk of the same one; an older chunk of the
                // same allreduce is OLDER, as in the v1model program and the kernel
                order = ORDER_NEWER;
                value.first = hdr.intml.allreduce;
                value.second = hdr.intml.chunk ^ 0x80000000;
            }} else {{
                order = ORDER_OLDER;
            }}
        }}
    }};

    RegisterAction<pair_t, slot_index_t, bit<32>>(round_exp) agree = {{
        void apply(inout pair_t value, out bit<32> exp) {{
            exp = value.first;
            if (ig_md.order == ORDER_NEWER) {{
                value.first = hdr.intml.owners ++ 16w0 ++ hdr.intml.exp;
                value.second = 24w0 ++ (hdr.intml.next_exp ^ 0x80);
            }} else if (ig_md.order == ORDER_SAME && 24w0 ++ (hdr.intml.next_exp ^ 0x80) > value.second) {{
                value.second = 24w0 ++ (hdr.intml.next_exp ^ 0x80);
            }}
        }}
    }};

    // returns KNOWN_RANK if the rank's bit was set (a duplicate or a re-send), else COMPLETES if its bit completes
    // the round, else 0
    RegisterAction<pair_t, slot_index_t, bit<32>>(worker_bitmap) mark = {{
        void apply(inout pair_t value, out bit<32> result) {{
            result = 0;
            if (ig_md.order == ORDER_NEWER) {{
                if (ig_md.worker_bit_lo == ig_md.full_lo && ig_md.worker_bit_hi == ig_md.full_hi) {{
                    result = COMPLETES;  // a one-rank job
                }}
                value.first = ig_md.worker_bit_lo;
                value.second = ig_md.worker_bit_hi;
            }} else if ((value.first & ig_md.worker_bit_lo) != 0 || (value.second & ig_md.worker_bit_hi) != 0) {{
                result = KNOWN_RANK;
            }} else if (ig_md.order == ORDER_SAME && ig_md.exp_ok) {{
                if ((value.first | ig_md.worker_bit_lo) == ig_md.full_lo
                        && (value.second | ig_md.worker_bit_hi) == ig_md.full_hi) {{
                    result = COMPLETES;
                }}
                value.first = value.first | ig_md.worker_bit_lo;
                value.second = value.second | ig_md.worker_bit_hi;
            }}
        }}
    }};

    apply {{
        ig_md.order = classify.execute({SLOT_INDEX});
        bit<32> round_word = agree.execute({SLOT_INDEX});  // owners (31:24), exp (7:0)
        ig_md.exp_ok = round_word[7:0] == hdr.intml.exp && round_word[31:24] == hdr.intml.owners;
        ig_md.bridge.owners = ig_md.order == ORDER_NEWER ? hdr.intml.owners : round_word[31:24];
        bit<32> marked = mark.execute({SLOT_INDEX});
        ig_md.new_rank = marked != KNOWN_RANK;
        if (marked == COMPLETES) {{
            ig_md.bridge.completes = 1;
        }}
    }}
}}
""")


def pair_readers(register: str, verb: str) -> str:
    """The two RegisterActions that read one half of a pair register each: <verb>_first, <verb>_second."""
    return "\n\n".join(f"""    RegisterAction<pair_t, lane_index_t, bit<32>>({register}) {verb}_{half} = {{
        void apply(inout pair_t value, out bit<32> {half}) {{
            {half} = value.{half};
        }}
    }};""" for half in ("first", "second"))


def processor() -> str:
    return guard("TNA_PROCESSOR", f"""
// Two lanes' sums in one 64-bit register pair (SwitchML's Processor), lanes p and p + {PAIRS}: a consume pass
// writes (open) or adds (add) both; a stateful ALU returns one 32-bit value per pass, so the harvest reads the
// first lanes in one pass and the second lanes in the next (SwitchML's HARVEST passes do the same).
control Processor(in bit<32> value_first, in bit<32> value_second, out bit<32> sum, in bridge_h bridge) {{
    Register<pair_t, lane_index_t>(LANE_ENTRIES) lane_sum;

    RegisterAction<pair_t, lane_index_t, bit<32>>(lane_sum) write_pair = {{
        void apply(inout pair_t value) {{
            value.first = value_first;
            value.second = value_second;
        }}
    }};

    RegisterAction<pair_t, lane_index_t, bit<32>>(lane_sum) add_pair = {{
        void apply(inout pair_t value) {{
            value.first = value.first + value_first;
            value.second = value.second + value_second;
        }}
    }};

{pair_readers("lane_sum", "read")}

    apply {{
        lane_index_t cell = {LANE_INDEX.replace("ig_md.bridge", "bridge")};
        if (bridge.phase == PHASE_CONSUME && bridge.step == STEP_OPEN) {{
            write_pair.execute(cell);
        }} else if (bridge.phase == PHASE_CONSUME && bridge.step == STEP_ADD) {{
            add_pair.execute(cell);
        }} else if (bridge.phase == PHASE_HARVEST_FIRST) {{
            sum = read_first.execute(cell);
        }} else if (bridge.phase == PHASE_HARVEST_SECOND) {{
            sum = read_second.execute(cell);
        }}
    }}
}}
""")


def codec(static: list) -> str:
    return guard("TNA_CODEC", f"""
// A consume pass's lane: code -> +-2**k (an exact table in SRAM).
control LaneDecode(inout lane_t lane) {{
{table_text(L.TABLE["cnat_decode"], ACTION_BODIES["cnat_decode"], static)}

    apply {{
        cnat_decode.apply();
    }}
}}

// A harvest pass's lane of a completed round: the leading one by a TCAM table, then encode_b<b> with the Random
// extern's word; constant shifts only, as Tofino requires.
control LaneEncode(inout lane_t lane) {{
    Random<bit<32>>() random_word;

{table_text(L.TABLE["leading_one"], ACTION_BODIES["leading_one"], static)}

    apply {{
        lane.rand = random_word.get();
        lane.sign = lane.sum[31:31] ++ 7w0;
        lane.magnitude = lane.sum[31:31] == 1 ? -lane.sum : lane.sum;
        leading_one.apply();
    }}
}}

// Eight lanes' result codes in one register pair: first = lanes 4w..4w+3, second = the same lanes of the second
// half. A completion's harvest pass writes its half, a re-send's harvest pass reads it (one 32-bit output per
// stateful ALU and pass).
control CodeStore(in bit<32> codes, out bit<32> loaded, in bridge_h bridge) {{
    Register<pair_t, lane_index_t>(LANE_ENTRIES) lane_code;

    RegisterAction<pair_t, lane_index_t, bit<32>>(lane_code) store_first = {{
        void apply(inout pair_t value) {{
            value.first = codes;
        }}
    }};

    RegisterAction<pair_t, lane_index_t, bit<32>>(lane_code) store_second = {{
        void apply(inout pair_t value) {{
            value.second = codes;
        }}
    }};

{pair_readers("lane_code", "load")}

    apply {{
        lane_index_t cell = {LANE_INDEX.replace("ig_md.bridge", "bridge")};
        if (bridge.step != STEP_RESEND && bridge.phase == PHASE_HARVEST_FIRST) {{
            store_first.execute(cell);
        }} else if (bridge.step != STEP_RESEND) {{
            store_second.execute(cell);
        }} else if (bridge.phase == PHASE_HARVEST_FIRST) {{
            loaded = load_first.execute(cell);
        }} else {{
            loaded = load_second.execute(cell);
        }}
    }}
}}
""")


def top() -> str:
    half = PAIRS
    declarations = "\n".join(
        [f"    Processor() processor_{p};" for p in range(PAIRS)]
        + [f"    LaneDecode() lane_decode_{i};" for i in range(LANES)]
        + [f"    LaneEncode() lane_encode_{i};" for i in range(half)]
        + [f"    CodeStore() code_store_{w};" for w in range(CODE_WORDS)]
        + [f"    lane_t lane{i};" for i in range(LANES)]
        + [f"    bit<32> harvested_{w};" for w in range(CODE_WORDS)])
    consume = "\n".join(
        [f"            lane{i}.code = hdr.codes.c{i};" for i in range(LANES)]
        + [f"            lane_decode_{i}.apply(lane{i});" for i in range(LANES)])
    processors = "\n".join(
        f"        processor_{p}.apply(lane{p}.value, lane{p + half}.value, lane{p}.sum, ig_md.bridge);"
        for p in range(PAIRS))
    # a harvest pass has its half's sums in lanes 0..half-1: it encodes them (a completion) or loads the stored
    # codes (a re-send), four lanes per code store, and prepends them to the payload
    harvest = "\n".join(
        [f"            if (ig_md.bridge.step != STEP_RESEND) {{ lane_encode_{i}.apply(lane{i}); }}"
         for i in range(half)]
        + [f"            code_store_{w}.apply(" + " ++ ".join(f"lane{4 * w + j}.code" for j in range(4))
           + f", harvested_{w}, ig_md.bridge);" for w in range(CODE_WORDS)]
        + ["            hdr.result.setValid();"]
        + [f"            hdr.result.c{4 * w + j} = ig_md.bridge.step == STEP_RESEND ? "
           f"harvested_{w}[{31 - 8 * j}:{24 - 8 * j}] : lane{4 * w + j}.code;"
           for w in range(CODE_WORDS) for j in range(4)])
    return f"""{HEADER_NOTE}
// The Tofino sketch's top level (TNA): not compiled. Pass 0 judges the packet and updates the slot (SlotState;
// the checks before it are the v1model program's Judge and LaneCheck); a consume pass decodes and adds its
// {LANES} lanes and drops its codes header before it recirculates; the round's completing packet, or a re-send,
// then takes harvest passes, last group first, each reading {half} sums (or stored codes) and prepending their
// codes. p4/README.md counts the passes and the resources.
#include <core.p4>
#include <tna.p4>
#include "../headers.p4"
#include "types_tna.p4"
#include "slot_tna.p4"
#include "processor_tna.p4"
#include "codec_tna.p4"

parser TnaIngressParser(packet_in pkt, out tna_headers_t hdr, out tna_metadata_t ig_md,
                        out ingress_intrinsic_metadata_t ig_intr_md) {{
    state start {{
        pkt.extract(ig_intr_md);
        pkt.advance(PORT_METADATA_SIZE);
        transition select(ig_intr_md.ingress_port) {{ RECIRCULATION_PORT: parse_bridge; default: parse_ethernet; }}
    }}
    state parse_bridge {{
        pkt.extract(hdr.bridge);
        transition parse_ethernet;
    }}
    state parse_ethernet {{
        pkt.extract(hdr.ethernet);
        pkt.extract(hdr.ipv4);
        pkt.extract(hdr.udp);
        pkt.extract(hdr.intml);
        transition select(hdr.bridge.phase) {{ PHASE_CONSUME: parse_codes; default: accept; }}
    }}
    state parse_codes {{
        pkt.extract(hdr.codes);
        transition accept;
    }}
}}

control TnaIngress(inout tna_headers_t hdr, inout tna_metadata_t ig_md,
                   in ingress_intrinsic_metadata_t ig_intr_md,
                   in ingress_intrinsic_metadata_from_parser_t ig_prsr_md,
                   inout ingress_intrinsic_metadata_for_deparser_t ig_dprsr_md,
                   inout ingress_intrinsic_metadata_for_tm_t ig_tm_md) {{
    SlotState() slot_state;
{declarations}

    apply {{
        if (!hdr.bridge.isValid()) {{
            slot_state.apply(hdr, ig_md);
        }} else {{
            ig_md.bridge = hdr.bridge;
        }}
        if (ig_md.bridge.phase == PHASE_CONSUME) {{
{consume}
            hdr.codes.setInvalid();  // consumed
        }}
{processors}
        if (ig_md.bridge.phase != PHASE_CONSUME) {{
{harvest}
        }}
        if (ig_md.bridge.pass_no == 0 && ig_md.bridge.phase == PHASE_HARVEST_FIRST) {{
            ig_tm_md.mcast_grp_a = (MulticastGroupId_t) ig_md.bridge.job_index + 1;  // the whole result
            if (ig_md.bridge.owners != 0) {{  // a reduce-scatter round: a replica per rank (egress: p4/README.md)
                ig_tm_md.mcast_grp_a = ig_tm_md.mcast_grp_a + RANK_GROUP_BASE;
            }}
        }} else {{
            hdr.bridge = ig_md.bridge;
            hdr.bridge.setValid();
            ig_tm_md.ucast_egress_port = RECIRCULATION_PORT;
        }}
    }}
}}

control TnaIngressDeparser(packet_out pkt, inout tna_headers_t hdr, in tna_metadata_t ig_md,
                           in ingress_intrinsic_metadata_for_deparser_t ig_dprsr_md) {{
    apply {{
        pkt.emit(hdr);
    }}
}}

parser TnaEgressParser(packet_in pkt, out tna_headers_t hdr, out tna_metadata_t eg_md,
                       out egress_intrinsic_metadata_t eg_intr_md) {{
    state start {{
        pkt.extract(eg_intr_md);
        transition accept;
    }}
}}

control TnaEgress(inout tna_headers_t hdr, inout tna_metadata_t eg_md, in egress_intrinsic_metadata_t eg_intr_md,
                  in egress_intrinsic_metadata_from_parser_t eg_prsr_md,
                  inout egress_intrinsic_metadata_for_deparser_t eg_dprsr_md,
                  inout egress_intrinsic_metadata_for_output_port_t eg_oport_md) {{
    apply {{ }}
}}

control TnaEgressDeparser(packet_out pkt, inout tna_headers_t hdr, in tna_metadata_t eg_md,
                          in egress_intrinsic_metadata_for_deparser_t eg_dprsr_md) {{
    apply {{
        pkt.emit(hdr);
    }}
}}

Pipeline(TnaIngressParser(), TnaIngress(), TnaIngressDeparser(), TnaEgressParser(), TnaEgress(),
         TnaEgressDeparser()) pipe;

Switch(pipe) main;
"""


def tna_files(static: list) -> dict[str, str]:
    """The sketch's files (relative to p4/tna/) and their text."""
    return {"types_tna.p4": types(), "slot_tna.p4": slot_state(), "processor_tna.p4": processor(),
            "codec_tna.p4": codec(static), "intml_tna.p4": top()}
