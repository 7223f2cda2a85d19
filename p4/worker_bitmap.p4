#ifndef _INTML_WORKER_BITMAP_
#define _INTML_WORKER_BITMAP_

// The round key and the bitmap of the (row, shadow set): which event the packet is against the set's round
// (protocol.slot_reference ShadowSet.event), and, once the next step is decided, the set's new round (open) or
// the rank's bit (add). An EMPTY set (bitmap 0) takes any round.
// Order: read here, then WorkerCounter reads the count, NextStep decides, Exponent checks and writes, WorkerCounter
// writes, and this control writes last: every check precedes every register write.
control WorkerBitmap(inout headers_t hdr, inout metadata_t meta) {
    @name(".round_key") register<bit<64>, lane_index_t>(LANE_ENTRIES) round_key;
    @name(".worker_bitmap") register<bit<64>, lane_index_t>(LANE_ENTRIES) worker_bitmap;
    WorkerCounter() worker_counter;
    bit<64> key;
    bit<64> current;
    bit<64> bitmap;

    apply {
        key = hdr.intml.allreduce ++ (hdr.intml.chunk ^ 0x80000000);  // allreduce << 32 | (chunk + 2**31)
        round_key.read(current, meta.cell);
        worker_bitmap.read(bitmap, meta.cell);
        meta.have = bitmap;
        bit<32> ahead = key[63:32] - current[63:32];  // RFC 1982: newer iff 0 < ahead < 2**31
        meta.empty = bitmap == 0;
        if (meta.empty) {
            meta.event = EVENT_NEWER;
        } else if (ahead != 0) {
            if (ahead < 0x80000000) { meta.event = EVENT_NEWER; } else { meta.event = EVENT_OLDER; }
        } else if (key[31:0] > current[31:0]) {
            meta.event = EVENT_NEWER;
        } else if (key[31:0] < current[31:0]) {
            meta.event = EVENT_OLDER;
        } else if ((bitmap & meta.worker_bit) != 0) {
            meta.event = EVENT_SAME_KNOWN_RANK;
        } else {
            meta.event = EVENT_SAME_NEW_RANK;
        }
        worker_counter.apply(hdr, meta);
        if (meta.step == STEP_OPEN) {
            round_key.write(meta.cell, key);
            worker_bitmap.write(meta.cell, meta.worker_bit);
        } else if (meta.step == STEP_ADD) {
            worker_bitmap.write(meta.cell, bitmap | meta.worker_bit);
        }
    }
}

#endif
