"""Writes every .p4 file of the switch program from p4/layout.py (constants, registers, tables, bridged fields)
and p4/entries.py (the ``const entries``): the v1model program p4/*.p4 and the Tofino sketch p4/tna/*.p4.
Repeated lanes, the per-pass load and store actions, the leading-one actions and every constant table are
generated here, so that the text cannot drift from the Python model that executes the same layout. The action
bodies of the layout's tables are in p4/actions.py, the rendering helpers in p4/p4text.py, the Tofino sketch in
p4/generate_tna.py.

``python -m intml.p4.generate`` rewrites the files; ``--check`` writes nothing and exits 1 naming the files that
differ from what it would write (tests/test_p4_generate.py runs the same comparison).
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
from intml.protocol.wire import DEFAULT_PORT, Codec

HERE = Path(__file__).resolve().parent
CPU_PORT = 255  # where admitted control datagrams leave for the controller (a deployment choice)
FIELD_LIST = 1  # the @field_list recirculate_preserving_field_list keeps: the bridged metadata

SLOT_BITS = log2(L.SLOT_ENTRIES)
PASS_BITS = log2(L.MAX_PASSES)
LANE_BITS = log2(L.LANE_ENTRIES)
JOB_BITS = log2(L.MAX_JOBS)
RANK_BITS = log2(L.MAX_WORLD)
MEMBER_BITS = log2(L.MEMBER_ENTRIES)
BUCKET_BITS = log2(L.CONTROL_SOURCE_BUCKETS)
assert SLOT_BITS + PASS_BITS == LANE_BITS and JOB_BITS + RANK_BITS == MEMBER_BITS
assert L.lane_index(1, 0) == L.MAX_PASSES  # lane cell = slot_index ++ pass_no
assert 64 - L.BUCKET_SHIFT == BUCKET_BITS
LANE_INDEX = f"meta.slot_index[{SLOT_BITS - 1}:0] ++ meta.pass_no[{PASS_BITS - 1}:0]"
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

header block_h {{ bit<{8 * BLOCK_BYTES}> bytes; }}  // payload an earlier pass took, carried through unread
header code_h {{ bit<8> code; }}  // one C_nat code of this pass
header word_h {{ bit<32> value; }}  // one int32 of this pass

// A pass parses only its own LANES_PER_PASS elements: those of earlier passes ride in opaque blocks before them
struct headers_t {{
    ethernet_h ethernet;
    ipv4_h ipv4;
    udp_h udp;
    intml_h intml;
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


def parser() -> str:
    return guard("PARSER", """
parser IntmlParser(packet_in pkt, out headers_t hdr, inout metadata_t meta, inout standard_metadata_t sm) {
    state start {
        pkt.extract(hdr.ethernet);
        transition select(hdr.ethernet.ether_type) { ETHERTYPE_IPV4: parse_ipv4; default: accept; }
    }
    state parse_ipv4 {
        pkt.extract(hdr.ipv4);
        transition select(hdr.ipv4.ihl, hdr.ipv4.protocol) { (5, PROTO_UDP): parse_udp; default: accept; }
    }
    state parse_udp {
        pkt.extract(hdr.udp);
        transition select(hdr.udp.dst_port) { INTML_PORT: parse_intml; default: accept; }
    }
    // a datagram shorter than the header ends here with PacketTooShort: hdr.intml stays invalid (drop_short)
    state parse_intml {
        pkt.extract(hdr.intml);
        meta.remaining = hdr.intml.count - ((bit<16>) meta.pass_no << LANES_PER_PASS_LOG2);
        meta.lanes_left = LANES_PER_PASS;
        transition select(hdr.intml.type, hdr.intml.codec, hdr.intml.count) {
            (_, _, 0): accept;
            (TYPE_DATA, CODEC_CNAT8, _): skip_codes;
            (TYPE_DATA, CODEC_INT32, _): skip_words;
            default: accept;
        }
    }
    // pass p's elements follow the p * LANES_PER_PASS elements of the passes before: opaque blocks, carried through
    state skip_codes {
        meta.skip = meta.pass_no;
        transition select(meta.skip) { 0: parse_code; default: skip_code_block; }
    }
    state skip_code_block {
        pkt.extract(hdr.done.next);
        meta.skip = meta.skip - 1;
        transition select(meta.skip) { 0: parse_code; default: skip_code_block; }
    }
    state skip_words {
        meta.skip = meta.pass_no << 2;  // an int32 is 4 bytes: 4 blocks a pass
        transition select(meta.skip) { 0: parse_word; default: skip_word_block; }
    }
    state skip_word_block {
        pkt.extract(hdr.done.next);
        meta.skip = meta.skip - 1;
        transition select(meta.skip) { 0: parse_word; default: skip_word_block; }
    }
    // this pass's elements, one header each; a short payload stops with an error, and the ingress drops the packet
    // by its length (drop_wrong_count), as the aggregator core does; what follows the pass stays payload
    state parse_code {
        pkt.extract(hdr.codes.next);
        meta.remaining = meta.remaining - 1;
        meta.lanes_left = meta.lanes_left - 1;
        transition select(meta.remaining, meta.lanes_left) { (0, _): accept; (_, 0): accept; default: parse_code; }
    }
    state parse_word {
        pkt.extract(hdr.words.next);
        meta.remaining = meta.remaining - 1;
        meta.lanes_left = meta.lanes_left - 1;
        transition select(meta.remaining, meta.lanes_left) { (0, _): accept; (_, 0): accept; default: parse_word; }
    }
}

control IntmlVerifyChecksum(inout headers_t hdr, inout metadata_t meta) {
    apply { }
}

control IntmlComputeChecksum(inout headers_t hdr, inout metadata_t meta) {
    apply {
        update_checksum(hdr.ipv4.isValid(),
            { hdr.ipv4.version, hdr.ipv4.ihl, hdr.ipv4.diffserv, hdr.ipv4.total_len, hdr.ipv4.identification,
              hdr.ipv4.flags, hdr.ipv4.frag_offset, hdr.ipv4.ttl, hdr.ipv4.protocol, hdr.ipv4.src_addr,
              hdr.ipv4.dst_addr },
            hdr.ipv4.hdr_checksum, HashAlgorithm.csum16);
    }
}

control IntmlDeparser(packet_out pkt, in headers_t hdr) {
    apply {
        pkt.emit(hdr.ethernet);
        pkt.emit(hdr.ipv4);
        pkt.emit(hdr.udp);
        pkt.emit(hdr.intml);
        pkt.emit(hdr.done);
        pkt.emit(hdr.codes);
        pkt.emit(hdr.words);
    }
}
""")


def control_meter() -> str:
    return guard("CONTROL_METER", f"""
// JOIN, LEAVE and STATS_REQUEST go to the controller through two GCRA buckets, each a theoretical arrival time in
// nanoseconds: one per hash bucket of the source address, one for the switch (protocol.slot_reference's
// ControlAdmission). A datagram has a token iff max(TAT, now) - now <= tolerance in both; taking it adds the
// interval. The aggregator core's cap per received burst has no switch counterpart.
control ControlMeter(inout headers_t hdr, inout metadata_t meta, inout standard_metadata_t sm) {{
    @name(".control_source_tat") register<bit<64>, bucket_t>(CONTROL_SOURCE_BUCKETS) control_source_tat;
    @name(".control_core_tat") register<bit<64>, core_cell_t>(1) control_core_tat;
    bit<64> source_interval_ns;
    bit<64> source_tolerance_ns;
    bit<64> core_interval_ns;
    bit<64> core_tolerance_ns;

{table("control_limits")}

    apply {{
        control_limits.apply();
        bit<64> now = ((bit<64>) sm.ingress_global_timestamp) * 1000;  // BMv2 counts microseconds
        bit<64> spread = ((bit<64>) meta.src_addr) * HASH_MULTIPLIER;  // Fibonacci hashing: the top bits
        bucket_t bucket = spread[63:BUCKET_SHIFT];
        bit<64> source;
        bit<64> core;
        control_source_tat.read(source, bucket);
        control_core_tat.read(core, 1w0);
        if (source < now) {{ source = now; }}
        if (core < now) {{ core = now; }}
        if (source - now > source_tolerance_ns || core - now > core_tolerance_ns) {{
            meta.drop_stat = STAT_DROP_CONTROL_RATE;
        }} else {{
            control_source_tat.write(bucket, source + source_interval_ns);
            control_core_tat.write(1w0, core + core_interval_ns);
            meta.to_cpu = true;
        }}
    }}
}}
""")


def job_table() -> str:
    return guard("JOB_TABLE", f"""
// Header validation, then the packet against its job, in the aggregator core's order (protocol.slot_reference
// _validate and _check): each failing check sets the drop reason and stops. Core-scope reasons are counted in
// core_counter, the rest in the job's counters.
control Judge(inout headers_t hdr, inout metadata_t meta, inout standard_metadata_t sm) {{
    @name(".member_seen") register<bit<{L.TIMESTAMP_BITS}>, member_index_t>(MEMBER_ENTRIES) member_seen;
    ControlMeter() control_meter;

{table("job_table")}

{table("membership")}

{table("slot_table")}

    apply {{
        if (!hdr.intml.isValid()) {{
            meta.drop_stat = STAT_DROP_SHORT;
        }} else if (hdr.intml.magic != MAGIC) {{
            meta.drop_stat = STAT_DROP_BAD_MAGIC;
        }} else if (hdr.intml.version != VERSION) {{
            meta.drop_stat = STAT_DROP_BAD_VERSION;
        }} else if (hdr.intml.type != TYPE_DATA) {{
            if (hdr.intml.type == TYPE_JOIN || hdr.intml.type == TYPE_LEAVE || hdr.intml.type == TYPE_STATS_REQUEST) {{
                control_meter.apply(hdr, meta, sm);
            }} else {{
                meta.drop_stat = STAT_DROP_UNKNOWN_TYPE;
            }}
        }} else if (job_table.apply().hit) {{
            meta.job_known = true;
            bit<16> payload_bytes = meta.codec == CODEC_CNAT8 ? hdr.intml.count : hdr.intml.count << 2;
            bit<8> owner_code = hdr.intml.owners - 1;  // first owner: its low 6 bits; owners after it: its top 2
            if (hdr.intml.rank >= meta.world) {{
                meta.drop_stat = STAT_DROP_RANK_OUT_OF_RANGE;
            }} else if (!membership.apply().hit) {{
                meta.drop_stat = STAT_DROP_UNREGISTERED_SOURCE;
            }} else {{
                if (meta.pass_no == 0) {{
                    member_seen.write(meta.job_index[{JOB_BITS - 1}:0] ++ hdr.intml.rank[{RANK_BITS - 1}:0],
                                      sm.ingress_global_timestamp);
                }}
                if (!slot_table.apply().hit) {{
                    meta.drop_stat = STAT_DROP_SLOT_OUT_OF_RANGE;
                }} else if (hdr.intml.codec != meta.codec) {{
                    meta.drop_stat = STAT_DROP_WRONG_CODEC;
                }} else if (hdr.intml.count > meta.packet_elements
                           || hdr.udp.length != (bit<16>) (UDP_BYTES + HEADER_BYTES) + payload_bytes) {{
                    meta.drop_stat = STAT_DROP_WRONG_COUNT;
                }} else if (hdr.intml.shadow > 1) {{
                    meta.drop_stat = STAT_DROP_BAD_SHADOW;
                }} else if (((int<8>) hdr.intml.exp != NO_EXP
                            && ((int<8>) hdr.intml.exp < EXP_MIN || (int<8>) hdr.intml.exp > EXP_MAX))
                           || ((int<8>) hdr.intml.next_exp != NO_EXP
                            && ((int<8>) hdr.intml.next_exp < EXP_MIN || (int<8>) hdr.intml.next_exp > EXP_MAX))) {{
                    meta.drop_stat = STAT_DROP_BAD_EXPONENT;
                }} else if (hdr.intml.owners != 0
                           && (2w0 ++ owner_code[5:0]) + (6w0 ++ owner_code[7:6]) >= meta.world) {{
                    meta.drop_stat = STAT_DROP_BAD_OWNER;  // a last owner >= n
                }} else {{
                    meta.is_data = true;
                    meta.slot_index = (bit<16>) (meta.row[{SLOT_BITS - 2}:0] ++ hdr.intml.shadow[0:0]);
                    meta.cell = {LANE_INDEX};
                    meta.rank = hdr.intml.rank;
                }}
            }}
        }}
    }}
}}
""")


def worker_bitmap() -> str:
    return guard("WORKER_BITMAP", f"""
// The round key and the bitmap of the (row, shadow set): which event the packet is against the set's round
// (protocol.slot_reference ShadowSet.event), and, once the next step is decided, the set's new round (open) or
// the rank's bit (add). An EMPTY set (bitmap 0) takes any round.
// Order: read here, then WorkerCounter reads the count, NextStep decides, Exponent checks and writes, WorkerCounter
// writes, and this control writes last: every check precedes every register write.
control WorkerBitmap(inout headers_t hdr, inout metadata_t meta) {{
    @name(".round_key") register<bit<64>, lane_index_t>(LANE_ENTRIES) round_key;
    @name(".worker_bitmap") register<bit<{L.MAX_WORLD}>, lane_index_t>(LANE_ENTRIES) worker_bitmap;
    WorkerCounter() worker_counter;
    bit<64> key;
    bit<64> current;
    bit<{L.MAX_WORLD}> bitmap;

    apply {{
        key = hdr.intml.allreduce ++ (hdr.intml.chunk ^ 0x80000000);  // allreduce << 32 | (chunk + 2**31)
        round_key.read(current, meta.cell);
        worker_bitmap.read(bitmap, meta.cell);
        bit<32> ahead = key[63:32] - current[63:32];  // RFC 1982: newer iff 0 < ahead < 2**31
        meta.empty = bitmap == 0;
        if (meta.empty) {{
            meta.event = EVENT_NEWER;
        }} else if (ahead != 0) {{
            if (ahead < 0x80000000) {{ meta.event = EVENT_NEWER; }} else {{ meta.event = EVENT_OLDER; }}
        }} else if (key[31:0] > current[31:0]) {{
            meta.event = EVENT_NEWER;
        }} else if (key[31:0] < current[31:0]) {{
            meta.event = EVENT_OLDER;
        }} else if ((bitmap & meta.worker_bit) != 0) {{
            meta.event = EVENT_SAME_KNOWN_RANK;
        }} else {{
            meta.event = EVENT_SAME_NEW_RANK;
        }}
        worker_counter.apply(hdr, meta);
        if (meta.step == STEP_OPEN) {{
            round_key.write(meta.cell, key);
            worker_bitmap.write(meta.cell, meta.worker_bit);
        }} else if (meta.step == STEP_ADD) {{
            worker_bitmap.write(meta.cell, bitmap | meta.worker_bit);
        }}
    }}
}}
""")


def worker_counter() -> str:
    return guard("WORKER_COUNTER", f"""
// The contributions to the set's round: the state (EMPTY, FILLING, or COMPLETE at n), and on a contribution the
// new count, which tells whether this packet completes the round.
control WorkerCounter(inout headers_t hdr, inout metadata_t meta) {{
    @name(".worker_count") register<bit<8>, lane_index_t>(LANE_ENTRIES) worker_count;
    NextStep() next_step;
    bit<8> count;

    apply {{
        worker_count.read(count, meta.cell);
        if (meta.empty) {{
            meta.state = STATE_EMPTY;
        }} else if (count == meta.world) {{
            meta.state = STATE_COMPLETE;
        }} else {{
            meta.state = STATE_FILLING;
        }}
        next_step.apply(hdr, meta);
        if (meta.step == STEP_OPEN) {{
            count = 0;  // a new round
        }}
        if (meta.step == STEP_OPEN || meta.step == STEP_ADD) {{
            worker_count.write(meta.cell, count + 1);
            meta.completes = count + 1 == meta.world ? 1w1 : 1w0;
        }}
    }}
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

// The end of every pass: recirculate for the next pass, or, at the last, send the result (the RESULT header as
// the aggregator core writes it) if every pass put the round's result into the packet (all_in): a completion to
// the job's multicast group (a replica per rank, or one for the results group; a round with owners: the job's rank
// group, a replica per rank), a re-send back to the one rank. Anything else is dropped: a duplicate, a contribution
// that does not complete the round, or one that completed its last pass after another packet's passes
// interleaved with it (the round is complete in every pass: the ranks' retransmissions read it).
control Forward(inout headers_t hdr, inout metadata_t meta, inout standard_metadata_t sm) {{
    apply {{
        if (!meta.last_pass) {{
            meta.pass_no = meta.pass_no + 1;
            meta.recirculate = true;
            sm.egress_spec = meta.in_port;  // egress recirculates it
        }} else if (meta.all_in == 1 && (meta.step == STEP_RESEND || meta.completes == 1)) {{
            hdr.intml.type = TYPE_RESULT;
            hdr.intml.owners = meta.owners;
            hdr.intml.rank = 0;
            hdr.intml.count = meta.elements;
            hdr.intml.exp = meta.exp;
            hdr.intml.next_exp = meta.next_exp;
            if (meta.step == STEP_RESEND) {{
                sm.egress_spec = meta.in_port;
            }} else if (meta.owners != 0) {{
                sm.mcast_grp = RANK_GROUP_BASE + (bit<16>) meta.job_index + 1;
            }} else {{
                sm.mcast_grp = (bit<16>) meta.job_index + 1;
            }}
        }} else {{
            mark_to_drop(sm);
        }}
    }}
}}
""")


def exponent() -> str:
    return guard("EXPONENT", f"""
// The round's agreed exponent, the max of its contributions' next_exp, its element count and its owners code (0:
// every rank; a reduce-scatter chunk's otherwise). An add must agree with the exponent, the count and the owners;
// then any contribution must have passed pass 0's lane check (LaneCheck), and only then is a register written:
// open writes the packet's values, add raises next_exp. The owners travel to egress (bridged), which truncates
// the replicas of ranks that are not among them; a re-send carries the round's code, not the request's.
control Exponent(inout headers_t hdr, inout metadata_t meta) {{
    @name(".round_exp") register<bit<8>, lane_index_t>(LANE_ENTRIES) round_exp;
    @name(".round_next_exp") register<bit<8>, lane_index_t>(LANE_ENTRIES) round_next_exp;
    @name(".round_elements") register<bit<16>, lane_index_t>(LANE_ENTRIES) round_elements;
    @name(".round_owners") register<bit<8>, lane_index_t>(LANE_ENTRIES) round_owners;
    bit<8> exp;
    bit<8> next_exp;
    bit<16> elements;
    bit<8> owners;

    apply {{
        round_exp.read(exp, meta.cell);
        round_next_exp.read(next_exp, meta.cell);
        round_elements.read(elements, meta.cell);
        round_owners.read(owners, meta.cell);
        if (meta.step == STEP_ADD && hdr.intml.exp != exp) {{
            meta.drop_stat = STAT_DROP_EXPONENT_MISMATCH;
            meta.step = STEP_NONE;
        }} else if (meta.step == STEP_ADD && hdr.intml.count != elements) {{
            meta.drop_stat = STAT_DROP_WRONG_COUNT;
            meta.step = STEP_NONE;
        }} else if (meta.step == STEP_ADD && hdr.intml.owners != owners) {{
            meta.drop_stat = STAT_DROP_BAD_OWNER;
            meta.step = STEP_NONE;
        }} else if ((meta.step == STEP_OPEN || meta.step == STEP_ADD) && !meta.lanes_ok) {{
            meta.drop_stat = STAT_DROP_INVALID_CODE;
            meta.step = STEP_NONE;
        }}
        if (meta.step == STEP_OPEN) {{
            exp = hdr.intml.exp;
            next_exp = hdr.intml.next_exp;
            elements = hdr.intml.count;
            owners = hdr.intml.owners;
            round_exp.write(meta.cell, exp);
            round_next_exp.write(meta.cell, next_exp);
            round_elements.write(meta.cell, elements);
            round_owners.write(meta.cell, owners);
        }} else if (meta.step == STEP_ADD && (int<8>) hdr.intml.next_exp > (int<8>) next_exp) {{
            next_exp = hdr.intml.next_exp;
            round_next_exp.write(meta.cell, next_exp);
        }}
        meta.exp = exp;
        meta.next_exp = next_exp;
        meta.elements = elements;
        meta.owners = owners;
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
// passes iff |value| <= 2**s(n).
bool code_ok(in bit<8> code, in bit<8> k_limit) {{
    return code == 0 || ((code & NONZERO) != 0 && (code & K_MASK) < k_limit);
}}

bool word_ok(in bit<32> value, in bit<32> limit) {{
    return (int<32>) value >= -(int<32>) limit && (int<32>) value <= (int<32>) limit;
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


def lane_aggregate() -> str:
    return guard("LANE_AGGREGATE", f"""
// One lane's 32-bit sum per (row, set, pass): open writes the value, add adds it, a re-send reads it (int32 mode:
// the sum is the result).
control LaneAggregate(inout lane_t lane, in lane_index_t cell, in bit<2> step) {{
    register<bit<32>, lane_index_t>(LANE_ENTRIES) lane_sum;

    apply {{
        if (step == STEP_OPEN) {{
            lane.sum = lane.value;
            lane_sum.write(cell, lane.sum);
        }} else if (step == STEP_ADD) {{
            lane_sum.read(lane.sum, cell);
            lane.sum = lane.sum + lane.value;
            lane_sum.write(cell, lane.sum);
        }} else if (step == STEP_RESEND) {{
            lane_sum.read(lane.sum, cell);
        }}
    }}
}}
""")


def cnat_encode(static: list) -> str:
    return guard("CNAT_ENCODE", f"""
// On the completing contribution, one lane's sum -> its C_nat code, stored for every re-send (which reads it):
// the leading one b of |sum| by a ternary table, then encode_b<b> rounds stochastically with v1model's random
// extern, so the round is encoded once and a retransmission can never change it.
control LaneEncode(inout lane_t lane, in lane_index_t cell, in bit<2> step, in bit<1> completes,
                   in bit<8> k_finite) {{
    register<bit<8>, lane_index_t>(LANE_ENTRIES) lane_code;

{table("leading_one", static)}

    apply {{
        if (step == STEP_RESEND) {{
            lane_code.read(lane.code, cell);
        }} else if (completes == 1) {{
            lane.sign = lane.sum[31:31] ++ 7w0;
            lane.magnitude = lane.sum[31:31] == 1 ? -lane.sum : lane.sum;
            random<bit<32>>(lane.rand, 0, 0xFFFFFFFF);
            leading_one.apply();
            lane.saturated = (lane.code & K_MASK) > k_finite;
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
                                   + "".join(f"        lanes.l{i}.{f} = 0;\n" for f in ("sum", "sign", "magnitude", "rand"))
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

    return guard("LANES", "\n" + control(
        "LoadLanes", True, "This pass's elements (the parser put them first in the stacks) into the lanes.")
        + "\n" + control("StoreLanes", False, "The lanes' results back into this pass's elements of the packet "
                                               "(the RESULT payload)."))


def egress() -> str:
    return guard("EGRESS", f"""
// Each copy of a result gets its destination (job index, rank) from egress_dest, with the switch's address as
// its source; a pass that is not the last recirculates with the bridged metadata. packets_out is counted here,
// where the replicas exist (a v1model counter belongs to one control: this is the egress's).
// A reduce-scatter round (owners code != 0): the copy for a rank that is not among the owners becomes the
// header-only completion: count 0, the lengths of the headers alone, and truncate() cuts the payload off the
// deparsed packet (a replica is a copy: the owners' copies keep theirs).
control IntmlEgress(inout headers_t hdr, inout metadata_t meta, inout standard_metadata_t sm) {{
    @name(".egress_job_counter") counter<bit<32>>(MAX_JOBS * N_STATS, CounterType.packets) job_counter;

{table("egress_dest")}

    action completion_only() {{
        hdr.intml.count = 0;
        hdr.udp.length = UDP_BYTES + HEADER_BYTES;
        hdr.ipv4.total_len = IPV4_BYTES + UDP_BYTES + HEADER_BYTES;
        truncate(ETHERNET_BYTES + IPV4_BYTES + UDP_BYTES + HEADER_BYTES);
    }}

    apply {{
        if (meta.recirculate) {{
            recirculate_preserving_field_list({FIELD_LIST});
        }} else if (meta.step != STEP_NONE) {{
            if (meta.step == STEP_RESEND) {{
                meta.rid = (bit<16>) meta.rank;
            }} else {{
                meta.rid = sm.egress_rid;
            }}
            if (egress_dest.apply().hit) {{
                job_counter.count((bit<32>) meta.job_index * N_STATS + STAT_PACKETS_OUT);
                bit<8> owner_code = meta.owners - 1;
                bit<8> first = 2w0 ++ owner_code[5:0];
                if (meta.owners != 0
                    && (meta.rid[7:0] < first || meta.rid[7:0] > first + (6w0 ++ owner_code[7:6]))) {{
                    completion_only();
                }}
            }}
        }}
    }}
}}
""")


def intml() -> str:
    instances = "\n".join(
        lanes(lambda i: f"    {kind}() {name}_{i};") for kind, name in
        (("LaneDecode", "cnat_decode"), ("LaneAggregate", "lane_aggregate"), ("LaneEncode", "cnat_encode")))
    per_lane = lanes(lambda i: f"""            if (lanes.l{i}.active) {{
                if (cnat8 && meta.step != STEP_RESEND) {{ cnat_decode_{i}.apply(lanes.l{i}); }}
                lane_aggregate_{i}.apply(lanes.l{i}, meta.cell, meta.step);
                if (cnat8) {{ cnat_encode_{i}.apply(lanes.l{i}, meta.cell, meta.step, meta.completes, meta.k_finite); }}
                if (lanes.l{i}.saturated) {{ count_job(STAT_SATURATED_ELEMENTS); }}
            }}""")
    includes = "\n".join(f'#include "{name}.p4"' for name in V1MODEL_FILES if name != "intml")
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


# file name (without .p4) -> text; the include order of intml.p4 (a control is declared before its user)
V1MODEL_FILES: dict[str, Callable[[list], str]] = {
    "headers": lambda static: headers(used_constants(
        render(static) for name, render in V1MODEL_FILES.items() if name != "headers")),
    "parser": lambda static: parser(),
    "control_meter": lambda static: control_meter(),
    "job_table": lambda static: job_table(),
    "cnat_decode": cnat_decode,
    "exponent": lambda static: exponent(),
    "next_step": next_step,
    "worker_counter": lambda static: worker_counter(),
    "worker_bitmap": lambda static: worker_bitmap(),
    "lanes": lambda static: lanes_p4(),
    "lane_aggregate": lambda static: lane_aggregate(),
    "cnat_encode": cnat_encode,
    "egress": lambda static: egress(),
    "intml": lambda static: intml(),
}


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
