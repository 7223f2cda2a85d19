#ifndef _INTML_CONTROL_METER_
#define _INTML_CONTROL_METER_

// JOIN, LEAVE and STATS_REQUEST go to the controller through two GCRA buckets, each a theoretical arrival time in
// nanoseconds: one per hash bucket of the source address, one for the switch (protocol.slot_reference's
// ControlAdmission). A datagram has a token iff max(TAT, now) - now <= tolerance in both; taking it adds the
// interval. The aggregator core's cap per received burst has no switch counterpart.
control ControlMeter(inout headers_t hdr, inout metadata_t meta, inout standard_metadata_t sm) {
    @name(".control_source_tat") register<bit<64>, bucket_t>(CONTROL_SOURCE_BUCKETS) control_source_tat;
    @name(".control_core_tat") register<bit<64>, core_cell_t>(1) control_core_tat;
    bit<64> source_interval_ns;
    bit<64> source_tolerance_ns;
    bit<64> core_interval_ns;
    bit<64> core_tolerance_ns;

    action set_limits(bit<64> source_interval, bit<64> source_tolerance, bit<64> core_interval, bit<64> core_tolerance) {
        source_interval_ns = source_interval;
        source_tolerance_ns = source_tolerance;
        core_interval_ns = core_interval;
        core_tolerance_ns = core_tolerance;
    }

    @name(".control_limits")
    table control_limits {
        actions = { set_limits; }
        default_action = set_limits(0, 0, 0, 0);
        size = 1;
    }

    apply {
        control_limits.apply();
        bit<64> now = ((bit<64>) sm.ingress_global_timestamp) * 1000;  // BMv2 counts microseconds
        bit<64> spread = ((bit<64>) meta.src_addr) * HASH_MULTIPLIER;  // Fibonacci hashing: the top bits
        bucket_t bucket = spread[63:BUCKET_SHIFT];
        bit<64> source;
        bit<64> core;
        control_source_tat.read(source, bucket);
        control_core_tat.read(core, 1w0);
        if (source < now) { source = now; }
        if (core < now) { core = now; }
        if (source - now > source_tolerance_ns || core - now > core_tolerance_ns) {
            meta.drop_stat = STAT_DROP_CONTROL_RATE;
        } else {
            control_source_tat.write(bucket, source + source_interval_ns);
            control_core_tat.write(1w0, core + core_interval_ns);
            meta.to_cpu = true;
        }
    }
}

#endif
