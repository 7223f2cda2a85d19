#ifndef _INTML_EXPONENT_
#define _INTML_EXPONENT_

// The round's agreed exponent, the max of its contributions' next_exp, its element count and its owners code (0:
// every rank; a reduce-scatter chunk's otherwise). An add must agree with the exponent, the count and the owners;
// then any contribution must have passed pass 0's lane check (LaneCheck), and only then is a register written:
// open writes the packet's values, add raises next_exp. The owners travel to egress (bridged), which truncates
// the replicas of ranks that are not among them; a re-send carries the round's code, not the request's.
control Exponent(inout headers_t hdr, inout metadata_t meta) {
    @name(".round_exp") register<bit<8>, lane_index_t>(LANE_ENTRIES) round_exp;
    @name(".round_next_exp") register<bit<8>, lane_index_t>(LANE_ENTRIES) round_next_exp;
    @name(".round_elements") register<bit<16>, lane_index_t>(LANE_ENTRIES) round_elements;
    @name(".round_owners") register<bit<8>, lane_index_t>(LANE_ENTRIES) round_owners;
    bit<8> exp;
    bit<8> next_exp;
    bit<16> elements;
    bit<8> owners;

    apply {
        round_exp.read(exp, meta.cell);
        round_next_exp.read(next_exp, meta.cell);
        round_elements.read(elements, meta.cell);
        round_owners.read(owners, meta.cell);
        if (meta.step == STEP_ADD && hdr.intml.exp != exp) {
            meta.drop_stat = STAT_DROP_EXPONENT_MISMATCH;
            meta.step = STEP_NONE;
        } else if (meta.step == STEP_ADD && hdr.intml.count != elements) {
            meta.drop_stat = STAT_DROP_WRONG_COUNT;
            meta.step = STEP_NONE;
        } else if (meta.step == STEP_ADD && hdr.intml.owners != owners) {
            meta.drop_stat = STAT_DROP_BAD_OWNER;
            meta.step = STEP_NONE;
        } else if ((meta.step == STEP_OPEN || meta.step == STEP_ADD) && !meta.lanes_ok) {
            meta.drop_stat = STAT_DROP_INVALID_CODE;
            meta.step = STEP_NONE;
        }
        if (meta.step == STEP_OPEN) {
            exp = hdr.intml.exp;
            next_exp = hdr.intml.next_exp;
            elements = hdr.intml.count;
            owners = hdr.intml.owners;
            round_exp.write(meta.cell, exp);
            round_next_exp.write(meta.cell, next_exp);
            round_elements.write(meta.cell, elements);
            round_owners.write(meta.cell, owners);
        } else if (meta.step == STEP_ADD && (int<8>) hdr.intml.next_exp > (int<8>) next_exp) {
            next_exp = hdr.intml.next_exp;
            round_next_exp.write(meta.cell, next_exp);
        }
        meta.exp = exp;
        meta.next_exp = next_exp;
        meta.elements = elements;
        meta.owners = owners;
    }
}

#endif
