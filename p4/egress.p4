#ifndef _INTML_EGRESS_
#define _INTML_EGRESS_

// A duplicate's PENDING (Forward) goes back to its rank as a re-send does, cut after its bitmap (pending_only).
// Each copy of a result gets its destination (job index, rank) from egress_dest, with the switch's address as
// its source; a pass that is not the last recirculates with the bridged metadata. packets_out is counted here,
// where the replicas exist (a v1model counter belongs to one control: this is the egress's).
// A reduce-scatter round (owners code != 0): the copy for a rank that is not among the owners becomes the
// header-only completion: count 0, the lengths of the headers alone, and truncate() cuts the payload off the
// deparsed packet (a replica is a copy: the owners' copies keep theirs).
// A copy that found its egress queue MARK_DEPTH packets deep or more (enq_qdepth: the packets ahead of it) leaves
// with the congestion mark in its shadow byte (docs/window.md), as a queue marks ECN; the results' MAC covers the
// byte with the bit clear, so marking here, last, leaves it valid.
control IntmlEgress(inout headers_t hdr, inout metadata_t meta, inout standard_metadata_t sm) {
    @name(".egress_job_counter") counter<bit<32>>(MAX_JOBS * N_STATS, CounterType.packets) job_counter;

    action set_dest(bit<48> addr) {
        hdr.ipv4.src_addr = hdr.ipv4.dst_addr;
        hdr.udp.src_port = hdr.udp.dst_port;
        hdr.ipv4.dst_addr = addr[47:16];
        hdr.udp.dst_port = addr[15:0];
        hdr.udp.checksum = 0;
    }

    action no_dest() {
        mark_to_drop(sm);
    }

    @name(".egress_dest")
    table egress_dest {
        key = { meta.job_index : exact; meta.rid : exact; }
        actions = { set_dest; no_dest; }
        default_action = no_dest();
        size = 4160;
    }

    action completion_only() {
        hdr.intml.count = 0;
        hdr.udp.length = UDP_BYTES + HEADER_BYTES;
        hdr.ipv4.total_len = IPV4_BYTES + UDP_BYTES + HEADER_BYTES;
        truncate(ETHERNET_BYTES + IPV4_BYTES + UDP_BYTES + HEADER_BYTES);
    }

    action pending_only() {
        hdr.udp.length = UDP_BYTES + HEADER_BYTES + HAVE_BYTES;
        hdr.ipv4.total_len = IPV4_BYTES + UDP_BYTES + HEADER_BYTES + HAVE_BYTES;
        truncate(ETHERNET_BYTES + IPV4_BYTES + UDP_BYTES + HEADER_BYTES + HAVE_BYTES);
    }

    apply {
#ifdef INTML_TEST_RANDOM
        if (!meta.recirculate && hdr.test_random.isValid()) {  // the words are for the passes only
            hdr.ethernet.ether_type = hdr.test_random.ether_type;
            hdr.test_random.setInvalid();
        }
#endif
        if (meta.recirculate) {
            recirculate_preserving_field_list(1);
        } else if (meta.step != STEP_NONE || hdr.have.isValid()) {
            if (meta.step == STEP_RESEND || hdr.have.isValid()) {
                meta.rid = (bit<16>) meta.rank;
            } else {
                meta.rid = sm.egress_rid;
            }
            if (egress_dest.apply().hit) {
                // the copy's Ethernet addresses: from the switch (the address the workers sent to) to the rank,
                // or to the results group's IPv4 multicast address
                hdr.ethernet.src_addr = hdr.ethernet.dst_addr;
                if (meta.rid == GROUP_RID) {
                    hdr.ethernet.dst_addr = 24w0x01005e ++ 1w0 ++ hdr.ipv4.dst_addr[22:0];
                } else {
                    member_mac.read(hdr.ethernet.dst_addr, meta.job_index[5:0] ++ meta.rid[5:0]);
                }
                job_counter.count((bit<32>) meta.job_index * N_STATS + STAT_PACKETS_OUT);
                bit<8> owner_code = meta.owners - 1;
                bit<8> first = 2w0 ++ owner_code[5:0];
                if (hdr.have.isValid()) {
                    pending_only();  // a PENDING: never marked (the mark is a RESULT's)
                } else {
                    if (meta.owners != 0
                        && (meta.rid[7:0] < first || meta.rid[7:0] > first + (6w0 ++ owner_code[7:6]))) {
                        completion_only();
                    }
                    if (sm.enq_qdepth >= MARK_DEPTH) {
                        hdr.intml.shadow = hdr.intml.shadow | CONGESTED;
                    }
                    if (meta.step == STEP_RESEND) {  // the stored result again, answering the rank's duplicate
                        hdr.intml.shadow = hdr.intml.shadow | STORED;
                    }
                }
            }
        }
    }
}

#endif
