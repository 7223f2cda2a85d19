#ifndef _INTML_LANE_AGGREGATE_
#define _INTML_LANE_AGGREGATE_

// One lane's 32-bit sum per (row, set, pass): open writes the value, add adds it, a re-send reads it (int32 mode:
// the sum is the result).
control LaneAggregate(inout lane_t lane, in lane_index_t cell, in bit<2> step) {
    register<bit<32>, lane_index_t>(LANE_ENTRIES) lane_sum;

    apply {
        if (step == STEP_OPEN) {
            lane.sum = lane.value;
            lane_sum.write(cell, lane.sum);
        } else if (step == STEP_ADD) {
            lane_sum.read(lane.sum, cell);
            lane.sum = lane.sum + lane.value;
            lane_sum.write(cell, lane.sum);
        } else if (step == STEP_RESEND) {
            lane_sum.read(lane.sum, cell);
        }
    }
}

#endif
