#ifndef _INTML_JOB_TABLE_
#define _INTML_JOB_TABLE_

// Header validation, then the packet against its job, in the aggregator core's order (protocol.slot_reference
// _validate and _check): each failing check sets the drop reason and stops. Core-scope reasons are counted in
// core_counter, the rest in the job's counters.
// A rank's Ethernet address, learned from its packets here and written into its result copies by IntmlEgress:
// at top level, so that both controls share it.
@name(".member_mac") register<bit<48>, member_index_t>(MEMBER_ENTRIES) member_mac;

control Judge(inout headers_t hdr, inout metadata_t meta, inout standard_metadata_t sm) {
    @name(".member_seen") register<bit<48>, member_index_t>(MEMBER_ENTRIES) member_seen;
    ControlMeter() control_meter;

    action set_job_cnat8(bit<8> job_index, bit<8> world, bit<8> value_bits, bit<16> pool, bit<16> packet_elements,
                          bit<32> value_limit, bit<48> group, bit<64> seed, bit<1> nearest) {
        meta.job_index = job_index;
        meta.world = world;
        meta.value_bits = value_bits;
        meta.pool = pool;
        meta.packet_elements = packet_elements;
        meta.value_limit = value_limit;
        meta.group = group;
        meta.seed = seed;
        meta.nearest = nearest;
        meta.codec = CODEC_CNAT8;
    }

    action set_job_int32(bit<8> job_index, bit<8> world, bit<8> value_bits, bit<16> pool, bit<16> packet_elements,
                          bit<32> value_limit, bit<48> group, bit<64> seed, bit<1> nearest) {
        meta.job_index = job_index;
        meta.world = world;
        meta.value_bits = value_bits;
        meta.pool = pool;
        meta.packet_elements = packet_elements;
        meta.value_limit = value_limit;
        meta.group = group;
        meta.seed = seed;
        meta.nearest = nearest;
        meta.codec = CODEC_INT32;
    }

    action unknown_job() {
        meta.drop_stat = STAT_DROP_UNKNOWN_JOB;
    }

    @name(".job_table")
    table job_table {
        key = { hdr.intml.job : exact; }
        actions = { set_job_cnat8; set_job_int32; unknown_job; }
        default_action = unknown_job();
        size = 64;
    }

    action set_worker(bit<64> worker_bit) {
        meta.worker_bit = worker_bit;
    }

    action not_member() {
        meta.drop_stat = STAT_DROP_UNREGISTERED_SOURCE;
    }

    @name(".membership")
    table membership {
        key = { meta.job_index : exact; hdr.intml.rank : exact; meta.src_addr : exact; }
        actions = { set_worker; not_member; }
        default_action = not_member();
        size = 4096;
    }

    action set_row(bit<16> row) {
        meta.row = row;
    }

    action slot_out_of_range() {
        meta.drop_stat = STAT_DROP_SLOT_OUT_OF_RANGE;
    }

    @name(".slot_table")
    table slot_table {
        key = { meta.job_index : exact; hdr.intml.slot : exact; }
        actions = { set_row; slot_out_of_range; }
        default_action = slot_out_of_range();
        size = 512;
    }

    apply {
        if (!hdr.intml.isValid()) {
            meta.drop_stat = STAT_DROP_SHORT;
        } else if (hdr.intml.magic != MAGIC) {
            meta.drop_stat = STAT_DROP_BAD_MAGIC;
        } else if (hdr.intml.version != VERSION) {
            meta.drop_stat = STAT_DROP_BAD_VERSION;
        } else if (hdr.intml.type != TYPE_DATA) {
            if (hdr.intml.type == TYPE_JOIN || hdr.intml.type == TYPE_LEAVE || hdr.intml.type == TYPE_STATS_REQUEST) {
                control_meter.apply(hdr, meta, sm);
            } else {
                meta.drop_stat = STAT_DROP_UNKNOWN_TYPE;
            }
        } else if (job_table.apply().hit) {
            meta.job_known = true;
            bit<16> payload_bytes = meta.codec == CODEC_CNAT8 ? hdr.intml.count : hdr.intml.count << 2;
            bit<8> owner_code = hdr.intml.owners - 1;  // first owner: its low 6 bits; owners after it: its top 2
            if (hdr.intml.rank >= meta.world) {
                meta.drop_stat = STAT_DROP_RANK_OUT_OF_RANGE;
            } else if (!membership.apply().hit) {
                meta.drop_stat = STAT_DROP_UNREGISTERED_SOURCE;
            } else {
                if (meta.pass_no == 0) {
                    member_seen.write(meta.job_index[5:0] ++ hdr.intml.rank[5:0],
                                      sm.ingress_global_timestamp);
                    member_mac.write(meta.job_index[5:0] ++ hdr.intml.rank[5:0], hdr.ethernet.src_addr);
                }
                if (!slot_table.apply().hit) {
                    meta.drop_stat = STAT_DROP_SLOT_OUT_OF_RANGE;
                } else if (hdr.intml.codec != meta.codec) {
                    meta.drop_stat = STAT_DROP_WRONG_CODEC;
                } else if (hdr.intml.count > meta.packet_elements
                           || hdr.udp.length != (bit<16>) (UDP_BYTES + HEADER_BYTES) + payload_bytes) {
                    meta.drop_stat = STAT_DROP_WRONG_COUNT;
                } else if (hdr.intml.shadow > 1) {
                    meta.drop_stat = STAT_DROP_BAD_SHADOW;
                } else if (((int<8>) hdr.intml.exp != NO_EXP
                            && ((int<8>) hdr.intml.exp < EXP_MIN || (int<8>) hdr.intml.exp > EXP_MAX))
                           || ((int<8>) hdr.intml.next_exp != NO_EXP
                            && ((int<8>) hdr.intml.next_exp < EXP_MIN || (int<8>) hdr.intml.next_exp > EXP_MAX))) {
                    meta.drop_stat = STAT_DROP_BAD_EXPONENT;
                } else if (hdr.intml.owners != 0
                           && (2w0 ++ owner_code[5:0]) + (6w0 ++ owner_code[7:6]) >= meta.world) {
                    meta.drop_stat = STAT_DROP_BAD_OWNER;  // a last owner >= n
                } else {
                    meta.is_data = true;
                    meta.slot_index = (bit<16>) (meta.row[8:0] ++ hdr.intml.shadow[0:0]);
                    meta.cell = meta.slot_index[9:0] ++ meta.pass_no[3:0];
                    meta.rank = hdr.intml.rank;
                }
            }
        }
    }
}

#endif
