#ifndef _INTML_PARSER_
#define _INTML_PARSER_

parser IntmlParser(packet_in pkt, out headers_t hdr, inout metadata_t meta, inout standard_metadata_t sm) {
    state start {
        pkt.extract(hdr.ethernet);
        transition select(hdr.ethernet.ether_type) {
            ETHERTYPE_IPV4: parse_ipv4;
#ifdef INTML_TEST_RANDOM
            ETHERTYPE_TEST_RANDOM: parse_test_random;
#endif
            default: accept;
        }
    }
#ifdef INTML_TEST_RANDOM
    // the test build's random words, between the Ethernet and the IPv4 header (IntmlEgress removes them)
    state parse_test_random {
        pkt.extract(hdr.test_random);
        transition select(hdr.test_random.ether_type) { ETHERTYPE_IPV4: parse_ipv4; default: accept; }
    }
#endif
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
        pkt.emit(hdr.test_random);
        pkt.emit(hdr.ipv4);
        pkt.emit(hdr.udp);
        pkt.emit(hdr.intml);
        pkt.emit(hdr.have);
        pkt.emit(hdr.done);
        pkt.emit(hdr.codes);
        pkt.emit(hdr.words);
    }
}

#endif
