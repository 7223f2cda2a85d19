#ifndef _INTML_FORWARD_
#define _INTML_FORWARD_

// The end of every pass: recirculate for the next pass, or, at the last, send the result (the RESULT header as
// the aggregator core writes it) if every pass put the round's result into the packet (all_in): a completion to
// the job's multicast group (a replica per rank, or one for the results group; a round with owners: the job's rank
// group, a replica per rank), a re-send back to the one rank; a duplicate of an incomplete round gets its PENDING
// (the DATA's header, type PENDING, count 0, then this pass's bitmap; the egress cuts the payload off) back to
// the one rank. Anything else is dropped: a contribution
// that does not complete the round, or one that completed its last pass after another packet's passes
// interleaved with it (the round is complete in every pass: the ranks' retransmissions read it).
control Forward(inout headers_t hdr, inout metadata_t meta, inout standard_metadata_t sm) {
    apply {
        if (!meta.last_pass) {
            meta.pass_no = meta.pass_no + 1;
            meta.recirculate = true;
            sm.egress_spec = meta.in_port;  // egress recirculates it
        } else if (meta.all_in == 1 && (meta.step == STEP_RESEND || meta.completes == 1)) {
            hdr.intml.type = TYPE_RESULT;
            hdr.intml.owners = meta.owners;
            hdr.intml.rank = 0;
            hdr.intml.count = meta.elements;
            hdr.intml.exp = meta.exp;
            hdr.intml.next_exp = meta.next_exp;
            if (meta.step == STEP_RESEND) {
                sm.egress_spec = meta.in_port;
            } else if (meta.owners != 0) {
                sm.mcast_grp = RANK_GROUP_BASE + (bit<16>) meta.job_index + 1;
            } else {
                sm.mcast_grp = (bit<16>) meta.job_index + 1;
            }
        } else if (meta.duplicate) {  // a duplicate of an incomplete round: its PENDING, back to the one rank
            hdr.intml.type = TYPE_PENDING;
            hdr.intml.count = 0;
            hdr.have.setValid();
            hdr.have.have = meta.have;
            sm.egress_spec = meta.in_port;
        } else {
            mark_to_drop(sm);
        }
    }
}

#endif
