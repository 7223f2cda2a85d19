"""The switch's vocabulary, shared by every implementation of the aggregator's data path (the Numba kernel, the
leaf and spine tiers, the P4 pipeline model) and by whatever reads their counters: the names and indices of the
statistics it counts, and the codes of the events a DATA packet is to its shadow set. Plain constants, so that a
kernel compiles them in and a P4 program takes them as its own constants (p4.layout).
"""

from __future__ import annotations

# Statistics, per job (and, for packets that name no known job, per core). The drop reasons are the malformed or
# foreign packets of docs/protocol.md ("Drop reasons"); "retransmissions" and "results_resent" are normal events.
STAT_NAMES = (
    "packets_in",
    "packets_out",
    "contributions",
    "completions",
    "retransmissions",
    "results_resent",
    "saturated_elements",
    "drop_truncated",
    "drop_short",
    "drop_bad_magic",
    "drop_bad_version",
    "drop_unknown_type",
    "drop_unknown_job",
    "drop_unregistered_source",
    "drop_rank_out_of_range",
    "drop_slot_out_of_range",
    "drop_wrong_codec",
    "drop_wrong_count",
    "drop_bad_shadow",
    "drop_bad_exponent",
    "drop_exponent_mismatch",
    "drop_invalid_code",
    "drop_stale",
    "drop_duplicate_incomplete",
    "drop_bad_mac",
    "drop_bad_control",
    "drop_refused_join",
    "drop_leave_non_member",
    "drop_control_rate",
    "send_failed",
    "drop_bad_owner",
    "nonfinite_elements",
    "drop_bad_package",
    "drop_duplicate_resent",
)
(
    PACKETS_IN,
    PACKETS_OUT,
    CONTRIBUTIONS,
    COMPLETIONS,
    RETRANSMISSIONS,
    RESULTS_RESENT,
    SATURATED,
    DROP_TRUNCATED,
    DROP_SHORT,
    DROP_BAD_MAGIC,
    DROP_BAD_VERSION,
    DROP_UNKNOWN_TYPE,
    DROP_UNKNOWN_JOB,
    DROP_UNREGISTERED,
    DROP_RANK,
    DROP_SLOT,
    DROP_CODEC,
    DROP_COUNT,
    DROP_SHADOW,
    DROP_BAD_EXP,
    DROP_EXP_MISMATCH,
    DROP_INVALID_CODE,
    DROP_STALE,
    DROP_DUPLICATE_INCOMPLETE,
    DROP_BAD_MAC,  # a DATA packet of a job with data_mac whose tag is missing or wrong
    DROP_BAD_CONTROL,  # counted by the control plane (aggregator.core), which parses JOIN/LEAVE/STATS
    DROP_REFUSED_JOIN,  # control plane: a well-formed JOIN answered with ERROR
    DROP_LEAVE_NON_MEMBER,  # control plane: a LEAVE for no job, or not from the address the rank joined from
    DROP_CONTROL_RATE,  # control admission: a control datagram over its source's, the core's or the burst's budget
    SEND_FAILED,  # the driver: datagrams the kernel refused to send (their destination), skipped
    DROP_BAD_OWNER,  # an owners code naming a rank >= n, or not the round's
    NONFINITE,  # result lanes sent as +-Inf or NaN (a rank's non-finite value), once per completed round
    DROP_BAD_PACKAGE,  # host mode: a package its codec cannot decode (protocol.codecs.host.MalformedPackage)
    DROP_DUPLICATE_RESENT,  # a leaf: a rank's duplicate that the partial already re-sent for its wave answers
) = range(len(STAT_NAMES))
N_STATS = len(STAT_NAMES)

# What a DATA packet's round key and rank bit say about its set (the event of protocol.slot_reference's
# state table; docs/protocol.md has the table).
OLDER = 0  # a round the set has left behind: stale
SAME_NEW_RANK = 1  # the set's round, from a rank not yet in its bitmap: a contribution
SAME_KNOWN_RANK = 2  # the set's round, from a rank already in it: a retransmission
NEWER = 3  # a later use of the slot: opens a new round in the set
