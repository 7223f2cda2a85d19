"""The aggregator's data path as a plain-Python reference: one DATA packet at a time, dicts and ints, driven by
the slot state machine ``TRANSITIONS`` below. It is the oracle the Numba burst kernel (``aggregator.slots``) is
held to bit for bit: same datagrams out in the same order, same counters, same slot state. The arithmetic is
``protocol.reference``'s and the MAC is protocol.siphash's plain-Python reference; nothing here is shared with the
kernel. docs/protocol.md ("Slot state table") has the same table. A job with a data key (``mac_key``) checks the
tag of a DATA packet right after finding the job, before anything else, and appends one to its results.

Reduce-scatter (docs/protocol.md, "Reduce-scatter"): a DATA packet's rank field carries the rank in its low byte
and the chunk's owners code in its high byte. The round takes the code of the packet that opens it; on completion
(and on a re-send) a rank among the owners gets the result, any other its header-only completion, by unicast.

A shadow set of a slot holds one round (the use of the slot by one chunk of one allreduce, ordered by the round
key ``allreduce << 32 | (chunk + 2**31)``, the allreduces in 32-bit serial number order, RFC 1982, so that the
order survives their wrap). Its state is EMPTY (never used), FILLING (some ranks contributed) or
COMPLETE (all n did; the result is kept for re-sends). A DATA packet that passed the header checks is an event
against the set: its round is OLDER than the set's, NEWER, or the SAME round from a rank whose bit is clear
(SAME_NEW_RANK) or already set (SAME_KNOWN_RANK).

Control datagrams (JOIN, LEAVE, STATS_REQUEST) are admitted for the control plane by token buckets
(``ControlAdmission``): one per source address hash and one for the core, each a GCRA theoretical arrival time,
and at most ``per_burst`` per received burst (``new_burst`` marks a burst's start); the rest are counted as
``drop_control_rate``.
"""

from __future__ import annotations

import dataclasses
import math
from collections import Counter

import numpy as np

from intml.protocol import reference
from intml.protocol.codec import Codec
from intml.protocol.job import CONTROL_SOURCE_BUCKETS, ControlLimits
from intml.protocol.siphash import tag_ref
from intml.protocol.wire import (
    HAVE_SIZE,
    HEADER,
    HEADER_SIZE,
    MAGIC,
    NO_EXP,
    TAG_SIZE,
    VERSION,
    MsgType,
    marked_stored,
)

EMPTY, FILLING, COMPLETE = "EMPTY", "FILLING", "COMPLETE"
OLDER, SAME_NEW_RANK, SAME_KNOWN_RANK, NEWER = "OLDER", "SAME_NEW_RANK", "SAME_KNOWN_RANK", "NEWER"

# Actions. "open" and "add" take the packet's values after the payload checks (an "add" first checks that the
# packet agrees with the round's exponent, element count and owners); either completes the round when the count
# reaches n, which sends the result to all ranks (or the job's multicast group; by unicast to each, header-only to
# ranks that are not among the owners, for a round with owners).
DROP_STALE = "drop_stale"  # a delayed duplicate of a round the set has left
DROP_DUPLICATE = "drop_duplicate_incomplete"  # a retransmission before the round completed: never added twice;
# answered with a PENDING, the ranks the round has, to that rank alone
RESEND = "resend"  # a retransmission after completion: the stored result again, marked STORED, to that rank alone
ADD = "add"  # a contribution to the round: set the rank's bit, count it, add its values
OPEN = "open"  # the set's next round: reset bitmap and count, the values are written (no zeroing)

# (state, event) -> action. A missing pair cannot happen: an EMPTY set has round key -1, below every packet's,
# and a COMPLETE set has every rank's bit set.
TRANSITIONS = {
    (EMPTY, NEWER): OPEN,
    (FILLING, OLDER): DROP_STALE,
    (FILLING, SAME_NEW_RANK): ADD,
    (FILLING, SAME_KNOWN_RANK): DROP_DUPLICATE,
    (FILLING, NEWER): OPEN,  # the unfinished round is abandoned (no conforming worker moves on without it)
    (COMPLETE, OLDER): DROP_STALE,
    (COMPLETE, SAME_KNOWN_RANK): RESEND,
    (COMPLETE, NEWER): OPEN,  # every rank got the result of the round in between (self-clocking)
}

EXPONENTS = (reference.EXP_MIN, reference.EXP_MAX)  # both codecs
CONTROL_TYPES = (MsgType.JOIN, MsgType.LEAVE, MsgType.STATS_REQUEST)


class ControlAdmission:
    """The token buckets of one core, in seconds on the caller's clock. A bucket is its theoretical arrival time
    (TAT): it has a token at ``now`` iff max(TAT, now) - now <= (burst - 1) / rate; taking one adds 1 / rate."""

    def __init__(self, limits: ControlLimits) -> None:
        self.interval = {"source": 1.0 / limits.source_rate, "core": 1.0 / limits.global_rate}
        self.tolerance = {"source": self.interval["source"] * (limits.source_burst - 1),
                          "core": self.interval["core"] * (limits.global_burst - 1)}
        self.per_burst = limits.per_burst
        self.tat: dict[tuple[str, int], float] = {}  # ("source", bucket) or ("core", 0) -> TAT; absent: full
        self.in_burst = 0

    @staticmethod
    def bucket(addr: int) -> int:
        """The top bits of the address key's Fibonacci hash (its product with 2**64 / golden ratio, mod 2**64)."""
        return (addr * 0x9E3779B97F4A7C15 % (1 << 64)) >> (64 - (CONTROL_SOURCE_BUCKETS.bit_length() - 1))

    def admit(self, addr: int, now: float) -> bool:
        buckets = (("source", self.bucket(addr)), ("core", 0))
        tats = [max(self.tat.get(b, -math.inf), now) for b in buckets]
        if self.in_burst >= self.per_burst or any(t - now > self.tolerance[b[0]] for t, b in zip(tats, buckets)):
            return False
        for t, b in zip(tats, buckets):
            self.tat[b] = t + self.interval[b[0]]
        self.in_burst += 1
        return True


@dataclasses.dataclass
class Job:
    job_id: int
    world: int
    packet_elements: int
    pool: int
    codec: int
    seed: int
    members: dict[int, int]  # rank -> address key it joined from
    group: int = 0  # address key of the job's results multicast group, 0 = unicast
    mac_key: tuple[int, int] | None = None  # (k0, k1) of a job with data_mac: DATA and RESULT end in a SipHash tag
    stats: Counter = dataclasses.field(default_factory=Counter)


@dataclasses.dataclass
class ShadowSet:
    key: int = -1
    ranks: set[int] = dataclasses.field(default_factory=set)
    exp: int = 0
    next_exp: int = 0
    elements: int = 0
    owners: int = 0
    sums: list[int] = dataclasses.field(default_factory=list)
    flags: list[int] = dataclasses.field(default_factory=list)  # each lane's non-finite flags, ORed
    result: bytes = b""
    completion: bytes = b""  # the header-only completion of a round with owners

    def state(self, n: int) -> str:
        if self.key < 0:
            return EMPTY
        return COMPLETE if len(self.ranks) == n else FILLING

    def event(self, key: int, rank: int) -> str:
        if self.key < 0:
            return NEWER  # an EMPTY set: any round opens it
        (allreduce, chunk), (current, current_chunk) = divmod(key, 1 << 32), divmod(self.key, 1 << 32)
        if allreduce != current:  # RFC 1982: a is after b iff 0 < (a - b) mod 2**32 < 2**31
            return NEWER if (allreduce - current) % (1 << 32) < 1 << 31 else OLDER
        if chunk != current_chunk:
            return NEWER if chunk > current_chunk else OLDER
        return SAME_KNOWN_RANK if rank in self.ranks else SAME_NEW_RANK


class SlotReference:
    """Data-plane core ``core`` of ``cores``: slots s with s % cores == core of every joined job."""

    def __init__(self, core: int = 0, cores: int = 1, control_limits: ControlLimits = ControlLimits()) -> None:
        self.core, self.cores = core, cores
        self.admission = ControlAdmission(control_limits)
        self.jobs: dict[int, Job] = {}
        self.sets: dict[tuple[int, int, int], ShadowSet] = {}  # (job, slot, shadow)
        self.core_stats: Counter = Counter()
        self.control: list[tuple[bytes, int]] = []  # control datagrams admitted for the control plane
        self.transitions: Counter = Counter()  # (state, event) pairs taken, for coverage checks

    def join(self, job: Job) -> None:
        self.jobs[job.job_id] = job

    def new_burst(self) -> None:
        """The next datagrams are another received burst (the per-burst count of control datagrams restarts)."""
        self.admission.in_burst = 0

    def receive(self, datagram: bytes | None, addr: int, now: float = 0.0) -> list[tuple[bytes, int]]:
        """One received datagram (None: truncated on receive) at time ``now`` (which only control datagrams'
        admission reads); returns the datagrams to send, in order."""
        self.core_stats["packets_in"] += 1
        reason, job, h, datagram = self._validate(datagram, addr)
        if reason == "control":
            if self.admission.admit(addr, now):
                self.control.append((datagram, addr))
            else:
                self.core_stats["drop_control_rate"] += 1
            return []
        if job is None:
            self.core_stats[reason] += 1
            return []
        job.stats["packets_in"] += 1
        if reason:
            job.stats[reason] += 1
            return []
        return self._data(job, h, datagram)

    def _validate(self, datagram: bytes | None, addr: int) -> tuple[str, Job | None, dict, bytes | None]:
        """(drop reason or "", job, header fields, the datagram without its tag)."""
        if datagram is None:
            return "drop_truncated", None, {}, datagram
        if len(datagram) < HEADER_SIZE:
            return "drop_short", None, {}, datagram
        rec = np.frombuffer(datagram[:HEADER_SIZE], HEADER)[0]
        h = {name: int(rec[name]) for name in HEADER.names}
        h["owners"], h["rank"] = divmod(h["rank"], 256)  # the rank field: owners code, rank
        if h["magic"] != MAGIC:
            return "drop_bad_magic", None, h, datagram
        if h["version"] != VERSION:
            return "drop_bad_version", None, h, datagram
        if h["type"] != MsgType.DATA:
            return ("control" if h["type"] in CONTROL_TYPES else "drop_unknown_type"), None, h, datagram
        job = self.jobs.get(h["job"])
        if job is None:
            return "drop_unknown_job", None, h, datagram
        if job.mac_key is not None:  # first: nothing unauthenticated is judged further
            body, tag = datagram[:-TAG_SIZE], datagram[-TAG_SIZE:]
            if tag != tag_ref(*job.mac_key, body):  # the header's HEADER_SIZE bytes > TAG_SIZE are there
                return "drop_bad_mac", job, h, datagram
            datagram = body
        return self._check(job, h, addr, len(datagram)), job, h, datagram

    def _check(self, job: Job, h: dict, addr: int, length: int) -> str:
        """The checks of a DATA packet of `length` bytes (without a tag) against its job."""
        if h["rank"] >= job.world:
            return "drop_rank_out_of_range"
        if job.members.get(h["rank"]) != addr:
            return "drop_unregistered_source"
        if h["slot"] >= job.pool or h["slot"] % self.cores != self.core:
            return "drop_slot_out_of_range"
        if h["codec"] != job.codec:
            return "drop_wrong_codec"
        width = 1 if job.codec == Codec.CNAT8 else 4
        if h["count"] > job.packet_elements or length != HEADER_SIZE + width * h["count"]:
            return "drop_wrong_count"
        if h["shadow"] > 1:
            return "drop_bad_shadow"
        lo, hi = EXPONENTS
        if any(e != NO_EXP and not lo <= e <= hi for e in (h["exp"], h["next_exp"])):
            return "drop_bad_exponent"
        if h["owners"] and _owners(h["owners"])[1] >= job.world:
            return "drop_bad_owner"
        return ""

    def _data(self, job: Job, h: dict, datagram: bytes) -> list[tuple[bytes, int]]:
        n, rank = job.world, h["rank"]
        key = h["allreduce"] << 32 | (h["chunk"] + (1 << 31))
        s = self.sets.setdefault((job.job_id, h["slot"], h["shadow"]), ShadowSet())
        transition = s.state(n), s.event(key, rank)
        self.transitions[transition] += 1
        action = TRANSITIONS[transition]
        if action == DROP_STALE:
            job.stats[DROP_STALE] += 1
            return []
        if action in (DROP_DUPLICATE, RESEND):
            job.stats["retransmissions"] += 1
            if action == DROP_DUPLICATE:
                job.stats[DROP_DUPLICATE] += 1
                return self._send(job, [(self._pending(job, s, datagram), job.members[rank])])
            job.stats["results_resent"] += 1
            return self._send(job, [(marked_stored(self._result_for(s, rank, job.world)), job.members[rank])])
        if action == ADD and (h["exp"] != s.exp or h["count"] != s.elements or h["owners"] != s.owners):
            job.stats["drop_exponent_mismatch" if h["exp"] != s.exp else "drop_wrong_count"
                      if h["count"] != s.elements else "drop_bad_owner"] += 1
            return []
        lanes = self._values(job, h, datagram[HEADER_SIZE:])
        if lanes is None:
            job.stats["drop_invalid_code"] += 1
            return []
        values, flags = lanes
        if action == OPEN:
            s.key, s.ranks, s.exp, s.elements, s.next_exp = key, set(), h["exp"], h["count"], h["next_exp"]
            s.owners = h["owners"]
            s.sums, s.flags = values, flags
        else:
            s.next_exp = max(s.next_exp, h["next_exp"])
            s.sums = [a + v for a, v in zip(s.sums, values)]
            s.flags = [a | f for a, f in zip(s.flags, flags)]
        s.ranks.add(rank)
        job.stats["contributions"] += 1
        if len(s.ranks) < n:
            return []
        job.stats["completions"] += 1
        s.result, s.completion = self._result(job, h, s)
        if job.group and not s.owners:
            return self._send(job, [(s.result, job.group)])
        return self._send(job, [(self._result_for(s, r, n), job.members[r]) for r in range(n)])

    @staticmethod
    def _pending(job: Job, s: ShadowSet, datagram: bytes) -> bytes:
        """The PENDING that answers a retransmission into the incomplete round of ``s``: the DATA's header with
        type PENDING and count 0, the ranks the round has, and the job's tag."""
        header = np.frombuffer(datagram[:HEADER_SIZE], HEADER).copy()
        header["type"], header["count"] = MsgType.PENDING, 0
        body = header.tobytes() + sum(1 << r for r in s.ranks).to_bytes(HAVE_SIZE, "big")
        return body if job.mac_key is None else body + tag_ref(*job.mac_key, body)

    @staticmethod
    def _result_for(s: ShadowSet, rank: int, n: int) -> bytes:
        """What rank gets of a completed round: its result, or its header-only completion if the round has owners
        and the rank is not one of them."""
        if not s.owners:
            return s.result
        first, last = _owners(s.owners)
        return s.result if first <= rank <= last else s.completion

    @staticmethod
    def _send(job: Job, datagrams: list[tuple[bytes, int]]) -> list[tuple[bytes, int]]:
        job.stats["packets_out"] += len(datagrams)
        return datagrams

    @staticmethod
    def _value_bits(n: int) -> int:
        return 31 - n.bit_length()  # s(n): n contributions of at most 2**s(n) fit a signed 32-bit register

    def _values(self, job: Job, h: dict, payload: bytes) -> tuple[list[int], list[int]] | None:
        """(The packet's values as integers in the round's unit, each lane's non-finite flags), or None if one is
        out of range. A non-finite lane (cnat8 code 0x01-0x03, int32 word INT32_MIN + 1..3) adds 0."""
        if job.codec == Codec.INT32:
            words = [int(v) for v in np.frombuffer(payload, ">i4")]
            flags = [w - reference.INT32_NONFINITE if 1 <= w - reference.INT32_NONFINITE <= 3 else 0 for w in words]
            values = [0 if f else w for w, f in zip(words, flags)]
            limit = 1 << self._value_bits(job.world)
            return (values, flags) if all(-limit <= v <= limit for v in values) else None
        flags = [c if 1 <= c <= 3 else 0 for c in payload]
        if not all(f or reference.data_code_ok(code, h["exp"], job.world) for code, f in zip(payload, flags)):
            return None
        return [int(v) for v in reference.to_fixed(np.frombuffer(payload, np.uint8))], flags

    def _result(self, job: Job, h: dict, s: ShadowSet) -> tuple[bytes, bytes]:
        """The round's result datagram and its header-only completion (b"" for a round without owners)."""
        allreduce, chunk = s.key >> 32, (s.key & 0xFFFFFFFF) - (1 << 31)
        header = {"type": int(MsgType.RESULT), "job": job.job_id, "allreduce": allreduce, "chunk": chunk,
                  "rank": s.owners << 8, "slot": h["slot"], "count": s.elements, "codec": job.codec, "shadow": h["shadow"],
                  "exp": s.exp, "next_exp": s.next_exp}
        job.stats["nonfinite_elements"] += sum(1 for f in s.flags if f)
        if job.codec == Codec.INT32:
            payload = np.array([reference.INT32_NONFINITE + f if f else v for v, f in zip(s.sums, s.flags)],
                               ">i4").tobytes()
        else:
            floor = reference.cnat_floor(s.exp, job.world)
            codes, saturated = reference.sum_to_codes(np.array(s.sums, np.int64), floor, seed=job.seed,
                                                      stream=(allreduce << 24) | (2 << 16),
                                                      offset=chunk * job.packet_elements % (1 << 64))
            job.stats["saturated_elements"] += saturated
            payload = bytes(f or c for c, f in zip(codes.tolist(), s.flags))
        rec = np.zeros(1, HEADER)
        rec["magic"], rec["version"] = MAGIC, VERSION
        for name, value in header.items():
            rec[name] = value
        result = rec.tobytes() + payload
        rec["count"] = 0
        completion = rec.tobytes() if s.owners else b""
        if job.mac_key is None:
            return result, completion
        return result + tag_ref(*job.mac_key, result), completion and completion + tag_ref(*job.mac_key, completion)


def _owners(code: int) -> tuple[int, int]:
    """The first and last rank of a nonzero owners code (docs/protocol.md, "Reduce-scatter"): code - 1 = 64 span +
    first. Written out here, apart from protocol.packet.owner_range, so that the reference checks the kernel."""
    first, span = (code - 1) % 64, (code - 1) // 64
    return first, first + span
