#ifndef _INTML_LANE_AGGREGATE_
#define _INTML_LANE_AGGREGATE_

// One lane's 32-bit sum and non-finite flags per (row, set, pass): open writes them, add adds the value and ORs
// the flags, a re-send reads them (int32 mode: the sum is the result). A lane with flags (a C_nat code 0x01-0x03,
// which cnat_decode has no entry for, or an int32 word NONFINITE_WORD + flags) adds 0 (docs/arithmetic.md,
// "Non-finite values"); an int32 lane with flags leaves as NONFINITE_WORD + flags (C_nat: LaneEncode's code).
control LaneAggregate(inout lane_t lane, in lane_index_t cell, in bit<2> step, in bool cnat8) {
    register<bit<32>, lane_index_t>(LANE_ENTRIES) lane_sum;
    register<bit<2>, lane_index_t>(LANE_ENTRIES) lane_flags;

    apply {
        bit<2> flags = 0;
        if (cnat8 && lane.code[7:2] == 0) {
            flags = lane.code[1:0];
        } else if (!cnat8 && (lane.value & 0xFFFFFFFC) == NONFINITE_WORD) {
            flags = lane.value[1:0];
            lane.value = 0;
        }
        if (step == STEP_OPEN) {
            lane.sum = lane.value;
            lane.flags = flags;
            lane_sum.write(cell, lane.sum);
            lane_flags.write(cell, lane.flags);
        } else if (step == STEP_ADD) {
            lane_sum.read(lane.sum, cell);
            lane.sum = lane.sum + lane.value;
            lane_sum.write(cell, lane.sum);
            lane_flags.read(lane.flags, cell);
            lane.flags = lane.flags | flags;
            lane_flags.write(cell, lane.flags);
        } else if (step == STEP_RESEND) {
            lane_sum.read(lane.sum, cell);
            lane_flags.read(lane.flags, cell);
        }
        if (!cnat8 && lane.flags != 0) {
            lane.sum = NONFINITE_WORD | (30w0 ++ lane.flags);
        }
    }
}

#endif
