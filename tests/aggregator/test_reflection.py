"""No reply to a sender that has proved nothing is larger than its request, over every message type and many
shapes of each; an operator's STATS_REQUEST is answered once, so a replay gets nothing."""

from __future__ import annotations

import random

from support.harness import TOKEN, core_receive, join_datagram, msg_type, new_core, worker_addr
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from intml.aggregator.core import UNPROVED, operator_request
from intml.protocol import keys, wire
from intml.protocol.job import ControlLimits
from intml.protocol.wire import MsgType

STRANGER = worker_addr(9)
JOB = 7
PARAMS = {"world_size": 2, "packet_elements": 64, "pool_size": 4, "codec": 0, "seed": 9}


def _core():
    core = new_core(rows=64, max_elements=64, control_limits=ControlLimits(source_burst=100_000,
                                                                          global_burst=100_000))
    # a live job, so that requests naming it reach every check
    [(challenge, _)] = core_receive(core, [(join_datagram(JOB, 0, **PARAMS), worker_addr(0))], 0.0)
    cookie = bytes(wire.unpack_challenge(challenge)[1]["cookie"])
    [(ack, _)] = core_receive(core, [(join_datagram(JOB, 0, cookie=cookie, token=TOKEN, **PARAMS),
                                      worker_addr(0))], 0.0)
    assert msg_type(ack) == MsgType.JOIN_ACK
    return core


def _requests(rng: random.Random) -> list[tuple[str, bytes]]:
    """Requests an unproved sender can make, by kind: every message type, well-formed or cut or padded."""
    out = []
    for pool in (1, 8, 9, 256):
        params = {**PARAMS, "pool_size": pool}
        join = join_datagram(JOB + pool, 0, **params)
        out += [("first JOIN", join), ("JOIN, wrong cookie", join_datagram(JOB, 0, cookie=b"x" * 16, **params)),
                ("JOIN, forged proof", join_datagram(JOB + pool, 0, cookie=b"x" * 16, token="wrong", **params))]
        out += [("JOIN cut", join[:n]) for n in (wire.HEADER_SIZE, wire.HEADER_SIZE + 1, 60, len(join) - 1)]
    for typ in MsgType:
        for job in (JOB, JOB + 1, 0xFFFFFFFF):
            for rank in (0, 1, 0xFFFF):
                for size in (wire.HEADER_SIZE, wire.HEADER_SIZE + 8, 42, 58, 100, 512):
                    body = rng.randbytes(size - wire.HEADER_SIZE) if rng.random() < 0.5 else bytes(
                        size - wire.HEADER_SIZE)
                    out.append((f"{typ.name} job {job} rank {rank} {size} bytes",
                                wire.pack({"type": int(typ), "job": job, "rank": rank}, body)))
    out.append(("unknown type", wire.pack({"type": 200, "job": JOB}, bytes(30))))
    return out


def test_no_reply_to_an_unproved_sender_is_larger_than_its_request():
    core = _core()
    kinds = set()
    for name, request in _requests(random.Random(1)):
        for reply, dst in core_receive(core, [(request, STRANGER)], 1.0):
            assert dst == STRANGER and len(reply) <= len(request), (name, len(request), reply)
            kinds.add(msg_type(reply))
    assert kinds == {MsgType.CHALLENGE, MsgType.ERROR}  # the two kinds anyone may get


def test_the_smallest_join_with_a_forged_proof_gets_the_whole_refusal():
    core = _core()
    join = join_datagram(JOB + 1, 0, cookie=b"x" * 16, **{**PARAMS, "pool_size": 1})
    [(challenge, _)] = core_receive(core, [(join, STRANGER)], 1.0)
    cookie = bytes(wire.unpack_challenge(challenge)[1]["cookie"])
    forged = join_datagram(JOB + 1, 0, cookie=cookie, token="wrong", **{**PARAMS, "pool_size": 1})
    [(reply, _)] = core_receive(core, [(forged, STRANGER)], 1.0)
    assert reply[wire.HEADER_SIZE:].decode() == UNPROVED and len(reply) <= len(forged)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(typ=st.integers(0, 255), job=st.sampled_from([JOB, 0, 0xFFFFFFFF]), rank=st.integers(0, 0xFFFF),
       body=st.binary(max_size=300))
def test_no_reply_is_larger_than_its_request_property(typ, job, rank, body):
    core = _core()
    request = wire.pack({"type": typ, "job": job, "rank": rank}, body)
    for reply, _ in core_receive(core, [(request, STRANGER)], 1.0):
        assert len(reply) <= len(request)


def test_an_operator_request_is_answered_once():
    core = _core()
    stats = lambda: core.stats(0.0)["core_counters"]["drop_bad_mac"]  # noqa: E731
    [(reply, _)] = core_receive(core, [(operator_request(TOKEN, 5), STRANGER)], 1.0)
    assert msg_type(reply) == MsgType.STATS_REPLY
    before = stats()
    for seq, src in ((5, STRANGER), (5, worker_addr(8)), (4, STRANGER)):  # replays, and an older one
        assert core_receive(core, [(operator_request(TOKEN, seq), src)], 1.1) == []
    assert stats() == before + 3
    [(reply, _)] = core_receive(core, [(operator_request(TOKEN, 6), worker_addr(8))], 1.2)
    assert msg_type(reply) == MsgType.STATS_REPLY
    forged = bytearray(operator_request(TOKEN, 7))
    forged[wire.HEADER_SIZE + 7] ^= 1  # the sequence number is under the MAC
    assert core_receive(core, [(bytes(forged), STRANGER)], 1.3) == []
    # a request with no room for the number is not answered
    short = wire.pack({"type": int(MsgType.STATS_REQUEST), "job": 0xFFFFFFFF, "rank": 0xFFFF}, bytes(keys.MAC_SIZE))
    short = keys.seal(keys.token_key(TOKEN), short, len(short) - keys.MAC_SIZE)
    assert core_receive(core, [(short, STRANGER)], 1.4) == []
