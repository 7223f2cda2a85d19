#ifndef _INTML_WORKER_COUNTER_
#define _INTML_WORKER_COUNTER_

// The contributions to the set's round: the state (EMPTY, FILLING, or COMPLETE at n), and on a contribution the
// new count, which tells whether this packet completes the round.
control WorkerCounter(inout headers_t hdr, inout metadata_t meta) {
    @name(".worker_count") register<bit<8>, lane_index_t>(LANE_ENTRIES) worker_count;
    NextStep() next_step;
    bit<8> count;

    apply {
        worker_count.read(count, meta.cell);
        if (meta.empty) {
            meta.state = STATE_EMPTY;
        } else if (count == meta.world) {
            meta.state = STATE_COMPLETE;
        } else {
            meta.state = STATE_FILLING;
        }
        next_step.apply(hdr, meta);
        if (meta.step == STEP_OPEN) {
            count = 0;  // a new round
        }
        if (meta.step == STEP_OPEN || meta.step == STEP_ADD) {
            worker_count.write(meta.cell, count + 1);
            meta.completes = count + 1 == meta.world ? 1w1 : 1w0;
        }
    }
}

#endif
