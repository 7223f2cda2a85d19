"""The Tofino (TNA) sketch of the switch program, p4/tna/*.p4: the v1model program's design (the same layout,
per-pass slot state and const entries) written with Tofino's stateful-ALU idioms, following SwitchML
(p4lang/p4app-switchML dev_root/p4). p4test checks it against tna.p4 (tests/p4/test_p4_compile.py);
p4/tna_account.py checks every RegisterAction against a Tofino-1 stateful ALU (SALU) and accounts for its stages,
PHV and throughput. No Tofino back end has compiled it.

Each group g of 64 elements takes two passes, and a completing contribution (or a re-send) then harvests:
- a judge pass checks the group's codes (lane_check: four codes and k_limit per ternary lookup), then orders the
  packet's round against the group's (round_allreduce: 32-bit serial order; round_chunk: the chunk, unsigned)
  and agrees on the round's exponents (round_exp): one register per SALU, each in its own stage;
- a consume pass marks the rank (worker_bitmap_lo and _hi: both halves' bits before, SwitchML's bitmap, a
  SALU each so that a duplicate's PENDING carries all 64) and counts down the contributions still to come
  (worker_countdown: zero means complete, SwitchML's count split from the bitmap), decodes the codes (one exact
  lookup per lane) and adds them in the processors (two lanes per 64-bit pair); after the last group a duplicate
  of a round still filling becomes its PENDING, back through the DATA's port (the v1model program's Forward);
- harvest passes read one half of the pairs each (one 32-bit output per SALU), last group first; the sums ride
  in the bridge to the next pass, which encodes them (leading_one, then round_up: two lookups, no
  ``x < y ? a : b``) and prepends their codes; one last pass encodes the last half.
The rounding words are a hash of the round key and the lane (``Hash``, not ``Random``), so a re-send re-encodes
the sums still in the processors to the same codes and the sketch needs no code stores (their 8 SALUs).
"""

from __future__ import annotations

from intml.p4 import layout as L
from intml.p4.entries import Entry
from intml.p4.p4text import HEADER_NOTE, entry_text, guard, literal, log2
from intml.worker.costs import WIRE_OVERHEAD

LANES = L.LANES_PER_PASS
HALF = LANES // 2  # lanes per register pair half: the sums a harvest pass reads
CHECK_GROUP = 4  # codes per lane_check lookup (p4/tna_account.py counts its TCAM)
WORDS = LANES // CHECK_GROUP  # 32-bit words of codes in a pass
SLOT_BITS, PASS_BITS = log2(L.SLOT_ENTRIES), log2(L.MAX_PASSES)
CELL = f"ig_md.bridge.slot_index[{SLOT_BITS - 1}:0] ++ ig_md.bridge.pass_no[{PASS_BITS - 1}:0]"
K_LIMIT_MAX = 255
CELL_BYTES = 80  # Tofino-1's buffer cell: the unit of its queue depths
RESULT_FRAME = WIRE_OVERHEAD + L.HEADER_BYTES + L.MAX_PAYLOAD_BYTES  # the largest result copy, Ethernet to payload
MARK_CELLS = L.MARK_DEPTH * -(-RESULT_FRAME // CELL_BYTES)  # layout.MARK_DEPTH packets of the largest results
TNA_BRIDGED = (  # the sketch's own bridge fields, after layout.BRIDGED
    ("phase", 2),  # PHASE_JUDGE, PHASE_CONSUME or PHASE_HARVEST
    ("order", 2),  # the judge pass's ORDER_OLDER / ORDER_SAME / ORDER_NEWER
    ("agreed", 1),  # the judge pass found the round's exponents and owners the packet's
    ("lanes_ok", 1),  # the judge pass found every code of the group valid
    ("half", 1),  # a harvest pass reads the second halves of the pairs (1) or the first (0)
    ("reading", 1),  # a harvest pass reads sums (0: the last pass, which only encodes)
    ("carries", 1),  # the packet carries the sums the previous pass read (the sums header)
    ("port", 9),  # the DATA's ingress port: a duplicate's PENDING goes back through it
)


def code_slice(lane: int) -> str:
    """Lane ``lane``'s code in the codes headers (four codes per 32-bit word, first code in the high byte)."""
    word, byte = divmod(lane, CHECK_GROUP)
    header = "codes_lo" if word < WORDS // 2 else "codes_hi"
    return f"hdr.{header}.q{word}[{31 - 8 * byte}:{24 - 8 * byte}]"


def types() -> str:
    bridged = list(L.BRIDGED) + list(TNA_BRIDGED)
    pad = (-sum(w for _, w in bridged)) % 8

    def words(lo: int, hi: int) -> str:
        return "\n".join(f"    bit<32> q{w};" for w in range(lo, hi))

    return guard("TNA_TYPES", f"""
typedef bit<{SLOT_BITS + PASS_BITS}> cell_t;  // slot_index ++ pass_no: the group's slot state and lanes
const int RECIRCULATION_PORT = 68;  // Tofino-1 pipe 0's recirculation port: one port keeps a slot's passes in order
const int PHASE_JUDGE = 0;
const int PHASE_CONSUME = 1;
const int PHASE_HARVEST = 2;
const int ORDER_OLDER = 0;
const int ORDER_SAME = 1;
const int ORDER_NEWER = 2;
const int DISAGREES = 0xffffffff;  // round_exp's output when the round's word is not the packet's
const int CONFORMS = 1;  // a GCRA bucket's output: the datagram takes a token
const int MARK_CELLS = {MARK_CELLS};  // the congestion mark's depth in cells: layout.MARK_DEPTH of the largest results

// the bridge header: layout.BRIDGED and the sketch's own fields, carried from pass to pass
header bridge_h {{
{chr(10).join(f"    bit<{w}> {name};" for name, w in bridged)}
    bit<{pad}> pad;
}}

// one pass's codes, four per word: the lanes 0-{HALF - 1} (a harvest pass writes its codes here) and {HALF}-{LANES - 1}
header codes_lo_h {{
{words(0, WORDS // 2)}
}}

header codes_hi_h {{
{words(WORDS // 2, WORDS)}
}}

// the sums a harvest pass read, for the next pass to encode
header sums_h {{
{chr(10).join(f"    bit<32> s{i};" for i in range(HALF))}
}}

struct tna_headers_t {{
    bridge_h bridge;
    sums_h sums;
    ethernet_h ethernet;
    ipv4_h ipv4;
    udp_h udp;
    intml_h intml;
    have_h have;  // never parsed: a duplicate's PENDING (the ingress's last consume pass makes it)
    codes_lo_h codes_lo;
    codes_hi_h codes_hi;
}}

struct pair_t {{
    bit<32> first;
    bit<32> second;
}}

// a consume pass's decoded values; a harvest pass's rounding words (0-{HALF - 1}) and the sums it reads
// ({HALF}-{LANES - 1}): the same containers, as the passes never need both
struct lane_words_t {{
{chr(10).join(f"    bit<32> w{i};" for i in range(LANES))}
}}

// the judge pass's invalid-code flags, one per lane_check lookup, OR-ed into f0
struct check_flags_t {{
{chr(10).join(f"    bit<8> f{t};" for t in range(WORDS))}
}}

struct tna_metadata_t {{
    bridge_h bridge;
    cell_t cell;
    bit<32> worker_bit;  // the rank's bit in its half of the bitmap (job_table)
    bool rank_hi;  // the rank is 32 or above
    bit<8> others;  // world - 1: the countdown a new round starts from (job_table)
    bit<32> have_lo;  // the set's bitmap as this consume pass read it, ranks 0-31 and 32-63
    bit<32> have_hi;
    bool duplicate;  // this consume pass found the rank in a round still filling: its PENDING, if the last
    bit<8> k_limit;  // data_bound
    bit<8> last_group;  // the round's groups - 1
    bit<32> chunk_key;  // chunk + 2**31: chunks order unsigned
    bit<32> round_word;  // owners ++ count ++ exp: what every contribution of the round must agree on
    bit<32> next_exp_key;  // next_exp + 128: exponents order unsigned
    bit<32> now;  // ingress time in 1.024 us units (ns >> 10), 32 bits: wraps in 73 minutes
    bit<32> source_deadline;  // now + the source bucket's tolerance
    bit<32> core_deadline;
    bit<32> source_tolerance;  // control_limits
    bit<32> core_tolerance;
    bit<{log2(L.CONTROL_SOURCE_BUCKETS)}> bucket;
    bool drop;
    check_flags_t flags;
    lane_words_t words;
}}
""")


def control_meter() -> str:
    gcra = "\n\n".join(f"""    // GCRA in one SALU: first = the theoretical arrival time, second = the interval
    RegisterAction<pair_t, {index}, bit<32>>(control_{name}_tat) take_{name} = {{
        void apply(inout pair_t value, out bit<32> verdict) {{
            verdict = CONFORMS;
            if ((int<32>)(value.first - ig_md.now) <= 0) {{
                value.first = value.second + ig_md.now;  // idle: the arrival time restarts from now
            }} else if ((int<32>)(value.first - ig_md.{name}_deadline) > 0) {{
                verdict = 0;  // beyond the tolerance: no token
            }} else {{
                value.first = value.first + value.second;
            }}
        }}
    }};""" for name, index in (("source", "bucket_t"), ("core", "core_cell_t")))
    return guard("TNA_METER", f"""
// JOIN, LEAVE and STATS_REQUEST go to the controller through two GCRA buckets (the v1model program's
// ControlMeter), in 32-bit time: ingress nanoseconds >> 10, compared as serial numbers (signed differences), so
// intervals and tolerances must stay under 2**31 units (36 minutes). Departures: the source bucket is a CRC
// hash of the address (Tofino has no 64-bit multiply for Fibonacci hashing), and a datagram the core bucket
// refuses has spent its source bucket's token (each register is one SALU in its own stage; the v1model
// program checks both before taking either).
control ControlMeter(inout tna_headers_t hdr, inout tna_metadata_t ig_md,
                     in ingress_intrinsic_metadata_from_parser_t ig_prsr_md) {{
    Register<pair_t, bucket_t>(CONTROL_SOURCE_BUCKETS) control_source_tat;
    Register<pair_t, core_cell_t>(1) control_core_tat;
    Hash<bucket_t>(HashAlgorithm_t.CRC16) source_hash;

{gcra}

    action set_limits(bit<32> source_tolerance, bit<32> core_tolerance) {{
        ig_md.source_tolerance = source_tolerance;
        ig_md.core_tolerance = core_tolerance;
    }}

    table control_limits {{
        actions = {{ set_limits; }}
        default_action = set_limits(0, 0);
        size = 1;
    }}

    apply {{
        ig_md.now = ig_prsr_md.global_tstamp[41:10];
        ig_md.bucket = source_hash.get({{hdr.ipv4.src_addr, hdr.udp.src_port}});
        control_limits.apply();
        ig_md.source_deadline = ig_md.now + ig_md.source_tolerance;
        ig_md.core_deadline = ig_md.now + ig_md.core_tolerance;
        ig_md.drop = true;
        if (take_source.execute(ig_md.bucket) == CONFORMS) {{
            if (take_core.execute(1w0) == CONFORMS) {{
                ig_md.drop = false;
            }}
        }}
    }}
}}
""")


def slot_state() -> str:
    return guard("TNA_SLOT", """
// The judge pass's slot state for its group (cell = slot_index ++ pass_no, as the v1model program's): three
// registers, one SALU each, in dependency order; each action is chosen by the control flow (SwitchML's idiom),
// so that a SALU decides from at most two predicates. Opening writes happen only when every code is valid.
control SlotJudge(inout tna_headers_t hdr, inout tna_metadata_t ig_md, in bool lanes_ok) {
    Register<bit<32>, cell_t>(LANE_ENTRIES) round_allreduce;
    Register<bit<32>, cell_t>(LANE_ENTRIES) round_chunk;
    Register<pair_t, cell_t>(LANE_ENTRIES) round_exp;

    // RFC 1982: the packet's allreduce is newer iff 0 < allreduce - current < 2**31 (as a signed difference)
    RegisterAction<bit<32>, cell_t, bit<8>>(round_allreduce) advance_allreduce = {
        void apply(inout bit<32> value, out bit<8> order) {
            if (value == hdr.intml.allreduce) {
                order = ORDER_SAME;
            } else if ((int<32>)(hdr.intml.allreduce - value) > 0) {
                order = ORDER_NEWER;
                value = hdr.intml.allreduce;
            } else {
                order = ORDER_OLDER;
            }
        }
    };

    RegisterAction<bit<32>, cell_t, bit<8>>(round_allreduce) peek_allreduce = {
        void apply(inout bit<32> value, out bit<8> order) {
            if (value == hdr.intml.allreduce) {
                order = ORDER_SAME;
            } else if ((int<32>)(hdr.intml.allreduce - value) > 0) {
                order = ORDER_NEWER;
            } else {
                order = ORDER_OLDER;
            }
        }
    };

    // a newer allreduce: its chunk opens the round whatever the chunk before
    RegisterAction<bit<32>, cell_t, bit<8>>(round_chunk) open_chunk = {
        void apply(inout bit<32> value, out bit<8> order) {
            value = ig_md.chunk_key;
            order = ORDER_NEWER;
        }
    };

    // the same allreduce: a later chunk is newer, an earlier one older (the model's serial order)
    RegisterAction<bit<32>, cell_t, bit<8>>(round_chunk) advance_chunk = {
        void apply(inout bit<32> value, out bit<8> order) {
            if (value == ig_md.chunk_key) {
                order = ORDER_SAME;
            } else if (ig_md.chunk_key > value) {
                order = ORDER_NEWER;
                value = ig_md.chunk_key;
            } else {
                order = ORDER_OLDER;
            }
        }
    };

    RegisterAction<bit<32>, cell_t, bit<8>>(round_chunk) peek_chunk = {
        void apply(inout bit<32> value, out bit<8> order) {
            if (value == ig_md.chunk_key) {
                order = ORDER_SAME;
            } else if (ig_md.chunk_key > value) {
                order = ORDER_NEWER;
            } else {
                order = ORDER_OLDER;
            }
        }
    };

    // first = owners ++ count ++ exp, second = next_exp + 128; returns the round's next_exp + 128 (raised to the
    // packet's), or DISAGREES
    RegisterAction<pair_t, cell_t, bit<32>>(round_exp) open_round = {
        void apply(inout pair_t value, out bit<32> merged) {
            value.first = ig_md.round_word;
            value.second = ig_md.next_exp_key;
            merged = value.second;
        }
    };

    // One departure from the v1model program: next_exp is raised before the bitmap tells a duplicate from a new
    // rank (a conforming worker's duplicate carries the same next_exp, so the max is the same).
    RegisterAction<pair_t, cell_t, bit<32>>(round_exp) join_round = {
        void apply(inout pair_t value, out bit<32> merged) {
            merged = DISAGREES;
            if (value.first == ig_md.round_word) {
                if (value.second < ig_md.next_exp_key) {
                    value.second = ig_md.next_exp_key;
                }
                merged = value.second;
            }
        }
    };

    apply {
        ig_md.chunk_key = hdr.intml.chunk ^ 0x80000000;
        ig_md.round_word = hdr.intml.owners ++ hdr.intml.count ++ hdr.intml.exp;
        ig_md.next_exp_key = 24w0 ++ (hdr.intml.next_exp ^ 0x80);
        bit<8> order;
        if (lanes_ok) {
            order = advance_allreduce.execute(ig_md.cell);
        } else {
            order = peek_allreduce.execute(ig_md.cell);
        }
        if (order == ORDER_NEWER && lanes_ok) {
            order = open_chunk.execute(ig_md.cell);
        } else if (order == ORDER_SAME && lanes_ok) {
            order = advance_chunk.execute(ig_md.cell);
        } else if (order == ORDER_SAME) {
            order = peek_chunk.execute(ig_md.cell);
        }
        bit<32> merged = DISAGREES;
        if (order == ORDER_NEWER && lanes_ok) {
            merged = open_round.execute(ig_md.cell);
        } else if (order == ORDER_SAME) {
            merged = join_round.execute(ig_md.cell);
        }
        ig_md.bridge.order = order[1:0];
        ig_md.bridge.agreed = merged == DISAGREES ? 1w0 : 1w1;
        ig_md.bridge.next_exp = merged[7:0] ^ 0x80;
        ig_md.bridge.lanes_ok = lanes_ok ? 1w1 : 1w0;
        // the round's, when the packet agrees with it (a packet that does not is dropped)
        ig_md.bridge.owners = hdr.intml.owners;
        ig_md.bridge.elements = hdr.intml.count;
        ig_md.bridge.exp = hdr.intml.exp;
    }
}

// The consume pass's count: the bitmap (ranks 0-31 in worker_bitmap_lo, 32-63 in worker_bitmap_hi, one SALU
// each, so a pass reads all 64 bits: a duplicate's PENDING carries them) returns the bits before, so a rank
// already counted is known; the countdown starts at world - 1 on a new round and returns what remains after this
// contribution, so zero completes (SwitchML's bitmap and count, split: each register one SALU, and the count
// needs the bitmap's answer).
control SlotTally(inout tna_metadata_t ig_md, inout ingress_intrinsic_metadata_for_deparser_t ig_dprsr_md) {
""" + "\n".join(f"    Register<bit<32>, cell_t>(LANE_ENTRIES) worker_bitmap_{half};" for half in ("lo", "hi")) + """
    Register<bit<8>, cell_t>(LANE_ENTRIES) worker_countdown;
""" + "\n".join(f"""
    RegisterAction<bit<32>, cell_t, bit<32>>(worker_bitmap_{half}) open_{half} = {{
        void apply(inout bit<32> value) {{
            value = ig_md.worker_bit;
        }}
    }};

    RegisterAction<bit<32>, cell_t, bit<32>>(worker_bitmap_{half}) clear_{half} = {{
        void apply(inout bit<32> value) {{
            value = 0;
        }}
    }};

    RegisterAction<bit<32>, cell_t, bit<32>>(worker_bitmap_{half}) mark_{half} = {{
        void apply(inout bit<32> value, out bit<32> before) {{
            before = value;
            value = value | ig_md.worker_bit;
        }}
    }};

    RegisterAction<bit<32>, cell_t, bit<32>>(worker_bitmap_{half}) peek_{half} = {{
        void apply(inout bit<32> value, out bit<32> before) {{
            before = value;
        }}
    }};""" for half in ("lo", "hi")) + """

    RegisterAction<bit<8>, cell_t, bit<8>>(worker_countdown) start_count = {
        void apply(inout bit<8> value, out bit<8> remaining) {
            value = ig_md.others;
            remaining = value;
        }
    };

    RegisterAction<bit<8>, cell_t, bit<8>>(worker_countdown) count_down = {
        void apply(inout bit<8> value, out bit<8> remaining) {
            value = value - 1;
            remaining = value;
        }
    };

    RegisterAction<bit<8>, cell_t, bit<8>>(worker_countdown) peek_count = {
        void apply(inout bit<8> value, out bit<8> remaining) {
            remaining = value;
        }
    };

    apply {
        bit<8> remaining = 1;
        bool contributes = ig_md.bridge.agreed == 1 && ig_md.bridge.lanes_ok == 1;
        ig_md.bridge.step = STEP_NONE;
        ig_md.duplicate = false;
        if (ig_md.bridge.order == ORDER_NEWER) {
            if (ig_md.rank_hi) {
                open_hi.execute(ig_md.cell);
                clear_lo.execute(ig_md.cell);
            } else {
                open_lo.execute(ig_md.cell);
                clear_hi.execute(ig_md.cell);
            }
            remaining = start_count.execute(ig_md.cell);
            ig_md.bridge.step = STEP_OPEN;
        } else {
            if (contributes && !ig_md.rank_hi) {
                ig_md.have_lo = mark_lo.execute(ig_md.cell);
            } else {
                ig_md.have_lo = peek_lo.execute(ig_md.cell);
            }
            if (contributes && ig_md.rank_hi) {
                ig_md.have_hi = mark_hi.execute(ig_md.cell);
            } else {
                ig_md.have_hi = peek_hi.execute(ig_md.cell);
            }
            bit<32> before = ig_md.have_lo;
            if (ig_md.rank_hi) {
                before = ig_md.have_hi;
            }
            if ((before & ig_md.worker_bit) != 0) {  // a duplicate, or a re-send once the round is complete
                remaining = peek_count.execute(ig_md.cell);
                if (remaining == 0) {
                    ig_md.bridge.step = STEP_RESEND;
                } else {
                    ig_md.duplicate = true;  // the round waits on others: its PENDING (the last pass's)
                }
            } else if (contributes) {
                remaining = count_down.execute(ig_md.cell);
                ig_md.bridge.step = STEP_ADD;
            } else {
                ig_dprsr_md.drop_ctl = 1;  // drop_exponent_mismatch or drop_invalid_code: nothing was written
            }
        }
        ig_md.bridge.completes = remaining == 0 && ig_md.bridge.step != STEP_RESEND ? 1w1 : 1w0;
        if (ig_md.bridge.completes == 0 && ig_md.bridge.step != STEP_RESEND) {
            ig_md.bridge.all_in = 0;
        }
    }
}
""")


def processor() -> str:
    return guard("TNA_PROCESSOR", f"""
// Two lanes' sums in one 64-bit register pair (SwitchML's processor), lanes p and p + {HALF}: a consume pass
// writes (open) or adds (add) both; a SALU returns one 32-bit value per pass, so a harvest pass reads one half.
control Processor(in bit<32> value_first, in bit<32> value_second, inout bit<32> sum, in cell_t cell,
                  in bridge_h bridge) {{
    Register<pair_t, cell_t>(LANE_ENTRIES) lane_sum;

    RegisterAction<pair_t, cell_t, bit<32>>(lane_sum) write_pair = {{
        void apply(inout pair_t value) {{
            value.first = value_first;
            value.second = value_second;
        }}
    }};

    RegisterAction<pair_t, cell_t, bit<32>>(lane_sum) add_pair = {{
        void apply(inout pair_t value) {{
            value.first = value.first + value_first;
            value.second = value.second + value_second;
        }}
    }};
""" + "\n".join(f"""
    RegisterAction<pair_t, cell_t, bit<32>>(lane_sum) read_{half} = {{
        void apply(inout pair_t value, out bit<32> {half}) {{
            {half} = value.{half};
        }}
    }};""" for half in ("first", "second")) + """

    apply {
        if (bridge.phase == PHASE_CONSUME && bridge.step == STEP_OPEN) {
            write_pair.execute(cell);
        } else if (bridge.phase == PHASE_CONSUME && bridge.step == STEP_ADD) {
            add_pair.execute(cell);
        } else if (bridge.phase == PHASE_HARVEST && bridge.reading == 1 && bridge.half == 0) {
            sum = read_first.execute(cell);
        } else if (bridge.phase == PHASE_HARVEST && bridge.reading == 1) {
            sum = read_second.execute(cell);
        }
    }
}
""")


def check_entries() -> list[str]:
    """lane_check's entries: a word of four codes with an invalid one (layout.lane_ok) for k_limit. A code is
    valid iff it is 0, or it has NONZERO and its k is below k_limit: so a byte with NONZERO clear and another bit
    set is invalid for any k_limit, and NONZERO | k (either sign) for k_limit at most k."""
    rows = []
    for byte in range(CHECK_GROUP):
        shift = 24 - 8 * byte
        for bit in (0, 1, 2, 3, 4, 5, 7):
            value, mask = (1 << bit) << shift, ((1 << bit) | L.NONZERO) << shift
            rows.append(f"({literal(value, 32)} &&& {literal(mask, 32)}, 8w0 .. 8w{K_LIMIT_MAX}) : invalid();")
        for k in range(L.K_MASK + 1):
            value, mask = (L.NONZERO | k) << shift, (L.NONZERO | L.K_MASK) << shift
            rows.append(f"({literal(value, 32)} &&& {literal(mask, 32)}, 8w0 .. 8w{k}) : invalid();")
    return rows


def encode_actions(entries: list[Entry]) -> str:
    """leading_one's actions: the code's k is the leading one's position b (round_up adds 1 when the word
    rounds up), and the bits below the leading one move to the top of the word, to be compared with the
    rounding word (constant shifts only)."""
    out = []
    for b in range(32):
        shift = f"magnitude = magnitude << {32 - b};" if b else "magnitude = 0;"
        out.append(f"""    action encode_b{b}() {{
        code = code | {literal(L.NONZERO | b, 8)};
        {shift}
    }}""")
    out.append("""    action encode_zero() {
        code = 0;
        magnitude = 0;
    }""")
    rows = "\n".join(f"            {entry_text(L.TABLE['leading_one'], e)}" for e in entries)
    names = " ".join(f"encode_b{b};" for b in range(32))
    return "\n\n".join(out) + f"""

    table leading_one {{
        key = {{ magnitude : ternary; }}
        actions = {{ {names} encode_zero; }}
        const default_action = encode_zero();
        const entries = {{
{rows}
        }}
    }}"""


def codec(static: list[Entry]) -> str:
    checks = "\n".join(f"            {row}" for row in check_entries())
    decodes = "\n".join(f"            {entry_text(L.TABLE['cnat_decode'], e)}" for e in static
                        if e.table == "cnat_decode")
    return guard("TNA_CODEC", f"""
// The judge pass's check of {CHECK_GROUP} codes (one 32-bit word) against the job's k_limit: one ternary lookup;
// a hit is an invalid code (layout.lane_ok), and the flags of all {WORDS} words are OR-ed before the slot state.
control LaneCheck(in bit<32> codes, in bit<8> k_limit, out bit<8> invalid_codes) {{
    action invalid() {{
        invalid_codes = 1;
    }}

    action valid() {{
        invalid_codes = 0;
    }}

    table lane_check {{
        key = {{ codes : ternary; k_limit : range; }}
        actions = {{ invalid; valid; }}
        const default_action = valid();
        const entries = {{
{checks}
        }}
    }}

    apply {{
        lane_check.apply();
    }}
}}

// A consume pass's lane: code -> +-2**k in the slot's unit (an exact lookup; the judge pass checked the code).
control LaneDecode(in bit<8> code, out bit<32> value) {{
    action decode(bit<32> decoded) {{
        value = decoded;
    }}

    action invalid_code() {{
        value = 0;
    }}

    table cnat_decode {{
        key = {{ code : exact; }}
        actions = {{ decode; invalid_code; }}
        const default_action = invalid_code();
        const entries = {{
{decodes}
        }}
    }}

    apply {{
        cnat_decode.apply();
    }}
}}

// A harvest pass's encode, first lookup: the magnitude's leading one (TCAM) gives k and the fraction.
control LeadingOne(inout bit<32> magnitude, inout bit<8> code) {{
{encode_actions([e for e in static if e.table == "leading_one"])}

    apply {{
        leading_one.apply();
    }}
}}

// ... second lookup: the fraction minus the rounding word, saturated, is nonzero iff word < fraction: round up
// (protocol/arith.py::_sum_code's rounding, probability fraction / 2**b).
control RoundUp(in bit<32> excess, inout bit<8> code) {{
    action round_up() {{
        code = code + 1;
    }}

    table round_up_table {{
        key = {{ excess : ternary; }}
        actions = {{ round_up; NoAction; }}
        const default_action = round_up();
        const entries = {{
            32w0 &&& 32w0xffffffff : NoAction();
        }}
    }}

    apply {{
        round_up_table.apply();
    }}
}}
""")


def top() -> str:
    declarations = "\n".join(
        [f"    LaneCheck() lane_check_{t};" for t in range(WORDS)]
        + [f"    LaneDecode() lane_decode_{i};" for i in range(LANES)]
        + [f"    Processor() processor_{p};" for p in range(HALF)]
        + [f"    LeadingOne() leading_one_{i};" for i in range(HALF)]
        + [f"    RoundUp() round_up_{i};" for i in range(HALF)]
        + [f"    Hash<bit<32>>(HashAlgorithm_t.CRC32) rounding_{i};" for i in range(HALF)])
    check = [f"            lane_check_{t}.apply(hdr.{'codes_lo' if t < WORDS // 2 else 'codes_hi'}.q{t}, "
             f"ig_md.k_limit, ig_md.flags.f{t});" for t in range(WORDS)]
    width = WORDS
    while width > 1:  # OR the flags in pairs: one step per level
        width //= 2
        check += [f"            ig_md.flags.f{t} = ig_md.flags.f{t} | ig_md.flags.f{t + width};" for t in range(width)]
    decode = [f"            lane_decode_{i}.apply({code_slice(i)}, ig_md.words.w{i});" for i in range(LANES)]
    processors = "\n".join(
        f"        processor_{p}.apply(ig_md.words.w{p}, ig_md.words.w{p + HALF}, ig_md.words.w{p + HALF}, "
        f"ig_md.cell, ig_md.bridge);" for p in range(HALF))
    sums = [f"hdr.sums.s{i}" for i in range(HALF)]
    codes = [code_slice(i) for i in range(HALF)]
    words = [f"ig_md.words.w{i}" for i in range(HALF)]
    encode = (
        [f"            {w} = (bit<32>)((int<32>){s} >> 31);  // the sign mask" for s, w in zip(sums, words)]
        + [f"            {c} = {s}[31:31] ++ 7w0;" for s, c in zip(sums, codes)]
        + [f"            {s} = {s} ^ {w};" for s, w in zip(sums, words)]
        + [f"            {s} = {s} - {w};  // |sum|" for s, w in zip(sums, words)]
        + [f"            {w} = rounding_{i}.get({{hdr.intml.allreduce, hdr.intml.chunk, ig_md.cell, 8w{i}}});"
           for i, w in enumerate(words)]
        + [f"            leading_one_{i}.apply({s}, {c});" for i, (s, c) in enumerate(zip(sums, codes))]
        + [f"            {w} = {s} |-| {w};" for s, w in zip(sums, words)]
        + [f"            round_up_{i}.apply({w}, {c});" for i, (w, c) in enumerate(zip(words, codes))])
    bridge_sums = [f"            hdr.sums.s{i} = ig_md.words.w{i + HALF};" for i in range(HALF)]
    return f"""{HEADER_NOTE}
// The Tofino sketch's top level (TNA). Per group of {LANES} elements: a judge pass (LaneCheck, SlotJudge), a
// consume pass (SlotTally, LaneDecode, the processors; the codes are removed), and after the last group, if
// every group completed or re-sends, harvest passes, last group first, each reading {HALF} sums into the bridge
// and encoding (and prepending) the sums the pass before it read; the last pass multicasts the result (a
// duplicate of a round still filling: its PENDING, after the last consume pass, to the one rank). Every
// other pass recirculates through one port, so a slot's passes keep their order. The judging tables (job,
// membership, slot, data_bound), the statistics and the egress rewrite are the v1model program's and appear
// in p4/README.md's account only; the egress marks congestion as the v1model program's does (docs/window.md).
#include <core.p4>
#include <tna.p4>
#include "../headers.p4"
#include "types_tna.p4"
#include "meter_tna.p4"
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
        transition select(hdr.bridge.carries) {{ 1: parse_sums; default: parse_recirculated; }}
    }}
    state parse_sums {{
        pkt.extract(hdr.sums);
        transition parse_recirculated;
    }}
    state parse_recirculated {{
        transition select(hdr.bridge.phase) {{ PHASE_HARVEST: parse_headers; default: parse_ethernet; }}
    }}
    // a harvest pass: the codes were consumed (the list repeats parse_ethernet's so that the phase is read only
    // where the bridge is valid)
    state parse_headers {{
        pkt.extract(hdr.ethernet);
        pkt.extract(hdr.ipv4);
        pkt.extract(hdr.udp);
        pkt.extract(hdr.intml);
        transition accept;
    }}
    state parse_ethernet {{
        pkt.extract(hdr.ethernet);
        pkt.extract(hdr.ipv4);
        pkt.extract(hdr.udp);
        pkt.extract(hdr.intml);
        pkt.extract(hdr.codes_lo);
        pkt.extract(hdr.codes_hi);
        transition accept;
    }}
}}

control TnaIngress(inout tna_headers_t hdr, inout tna_metadata_t ig_md,
                   in ingress_intrinsic_metadata_t ig_intr_md,
                   in ingress_intrinsic_metadata_from_parser_t ig_prsr_md,
                   inout ingress_intrinsic_metadata_for_deparser_t ig_dprsr_md,
                   inout ingress_intrinsic_metadata_for_tm_t ig_tm_md) {{
    ControlMeter() control_meter;
    SlotJudge() slot_judge;
    SlotTally() slot_tally;
{declarations}

    apply {{
        if (hdr.bridge.isValid()) {{
            ig_md.bridge = hdr.bridge;
        }} else if (hdr.intml.type != TYPE_DATA) {{
            control_meter.apply(hdr, ig_md, ig_prsr_md);
            if (ig_md.drop) {{ ig_dprsr_md.drop_ctl = 1; }} else {{ ig_tm_md.ucast_egress_port = CPU_PORT; }}
            exit;
        }} else {{
            ig_md.bridge.phase = PHASE_JUDGE;  // the job and slot tables fill the rest (the account)
            ig_md.bridge.all_in = 1;
            ig_md.bridge.port = ig_intr_md.ingress_port;
        }}
        ig_md.cell = {CELL};
        ig_md.last_group = (bit<8>)((ig_md.bridge.elements - 1) >> LANES_PER_PASS_LOG2);
        if (ig_md.bridge.phase == PHASE_JUDGE) {{
{chr(10).join(check)}
            slot_judge.apply(hdr, ig_md, ig_md.flags.f0 == 0);
            // drop_stale, or drop_invalid_code for a new round: nothing was written
            if (ig_md.bridge.order == ORDER_OLDER
                    || (ig_md.bridge.order == ORDER_NEWER && ig_md.bridge.lanes_ok == 0)) {{
                ig_dprsr_md.drop_ctl = 1;
            }}
            ig_md.bridge.phase = PHASE_CONSUME;
        }} else if (ig_md.bridge.phase == PHASE_CONSUME) {{
{chr(10).join(decode)}
            slot_tally.apply(ig_md, ig_dprsr_md);
        }} else if (ig_md.bridge.carries == 1) {{
            hdr.codes_lo.setValid();
{chr(10).join(encode)}
        }}
{processors}
        // the next pass
        if (ig_md.bridge.phase == PHASE_CONSUME) {{
            hdr.codes_lo.setInvalid();  // consumed
            hdr.codes_hi.setInvalid();
            if (ig_md.bridge.pass_no != ig_md.last_group) {{
                ig_md.bridge.phase = PHASE_JUDGE;
                ig_md.bridge.pass_no = ig_md.bridge.pass_no + 1;
            }} else if (ig_md.bridge.all_in == 1) {{
                ig_md.bridge.phase = PHASE_HARVEST;
                ig_md.bridge.half = 1;
                ig_md.bridge.reading = 1;
            }} else if (ig_md.duplicate) {{  // a duplicate of an incomplete round: its PENDING, to the one rank
                hdr.intml.type = TYPE_PENDING;
                hdr.intml.count = 0;
                hdr.have.setValid();
                hdr.have.have = ig_md.have_hi ++ ig_md.have_lo;
                hdr.udp.length = UDP_BYTES + HEADER_BYTES + HAVE_BYTES;
                hdr.ipv4.total_len = IPV4_BYTES + UDP_BYTES + HEADER_BYTES + HAVE_BYTES;
            }} else {{
                ig_dprsr_md.drop_ctl = 1;  // consumed: the result is not complete in every group
            }}
        }} else if (ig_md.bridge.phase == PHASE_HARVEST) {{
            ig_md.bridge.carries = ig_md.bridge.reading;
            if (ig_md.bridge.reading == 1) {{
                hdr.sums.setValid();
{chr(10).join(bridge_sums)}
            }} else {{
                hdr.sums.setInvalid();
            }}
            if (ig_md.bridge.half == 1) {{
                ig_md.bridge.half = 0;
            }} else if (ig_md.bridge.pass_no != 0) {{
                ig_md.bridge.half = 1;
                ig_md.bridge.pass_no = ig_md.bridge.pass_no - 1;
            }} else {{
                ig_md.bridge.reading = 0;
            }}
        }}
        if (ig_md.bridge.phase == PHASE_HARVEST && ig_md.bridge.carries == 0) {{
            hdr.bridge.setInvalid();
            ig_tm_md.mcast_grp_a = (MulticastGroupId_t) ig_md.bridge.job_index + 1;  // the whole result
            if (ig_md.bridge.step == STEP_RESEND) {{  // the stored result again, answering a duplicate
                hdr.intml.shadow = hdr.intml.shadow | STORED;
            }}
            if (ig_md.bridge.owners != 0) {{  // a reduce-scatter round: a replica per rank (egress: p4/README.md)
                ig_tm_md.mcast_grp_a = ig_tm_md.mcast_grp_a + RANK_GROUP_BASE;
            }}
        }} else if (hdr.have.isValid()) {{  // back through the DATA's port (the egress rewrite: p4/README.md)
            hdr.bridge.setInvalid();
            ig_tm_md.ucast_egress_port = (PortId_t) ig_md.bridge.port;
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
        // a pass on its way round starts with the bridge; a copy that leaves, with its headers
        transition select(eg_intr_md.egress_port) {{ RECIRCULATION_PORT: accept; default: parse_headers; }}
    }}
    state parse_headers {{
        pkt.extract(hdr.ethernet);
        pkt.extract(hdr.ipv4);
        pkt.extract(hdr.udp);
        pkt.extract(hdr.intml);
        transition accept;
    }}
}}

control TnaEgress(inout tna_headers_t hdr, inout tna_metadata_t eg_md, in egress_intrinsic_metadata_t eg_intr_md,
                  in egress_intrinsic_metadata_from_parser_t eg_prsr_md,
                  inout egress_intrinsic_metadata_for_deparser_t eg_dprsr_md,
                  inout egress_intrinsic_metadata_for_output_port_t eg_oport_md) {{
    apply {{
        // the congestion mark (docs/window.md), as the v1model egress sets it: a result copy that leaves its queue
        // MARK_CELLS deep or more (deq_qdepth, in cells); after the results' MAC, which covers the bit clear
        if (hdr.intml.isValid() && hdr.intml.type == TYPE_RESULT && eg_intr_md.deq_qdepth >= MARK_CELLS) {{
            hdr.intml.shadow = hdr.intml.shadow | CONGESTED;
        }}
    }}
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


def tna_files(static: list[Entry]) -> dict[str, str]:
    """The sketch's files (relative to p4/tna/) and their text; ``static``: the program's const entries."""
    return {"types_tna.p4": types(), "meter_tna.p4": control_meter(), "slot_tna.p4": slot_state(),
            "processor_tna.p4": processor(), "codec_tna.p4": codec(static), "intml_tna.p4": top()}
