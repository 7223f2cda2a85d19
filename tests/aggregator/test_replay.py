"""A captured JOIN, replayed: it never revives a finished job, takes back a seat, or brings back a job nonce, and
DATA recorded from an earlier run of the same job id fails the new run's DATA/RESULT MAC."""

from __future__ import annotations

import pytest
from support.harness import TOKEN, core_receive, join_datagram, msg_type, new_core, worker_addr

from intml.protocol import keys, wire
from intml.protocol.job import ControlLimits
from intml.protocol.siphash import key_words, tag_ref
from intml.protocol.wire import NO_EXP, FLAG_DATA_MAC, MsgType

JOB = 7
PARAMS = {"world_size": 1, "packet_elements": 64, "pool_size": 4, "codec": 0, "seed": 9, "flags": FLAG_DATA_MAC}
ADDR = worker_addr(0)
NONCE, FRESH = bytes(range(1, 17)), bytes(range(101, 117))


def _core():
    return new_core(rows=16, max_elements=64, control_limits=ControlLimits(source_burst=1000, global_burst=100_000))


def _proved_join(core, now: float, nonce: bytes = NONCE) -> tuple[bytes, bytes]:
    """The handshake's proved JOIN (as captured on the wire) and the core's answer to it."""
    [(challenge, _)] = core_receive(core, [(join_datagram(JOB, 0, nonce=nonce, **PARAMS), ADDR)], now)
    cookie = bytes(wire.unpack_challenge(challenge)[1]["cookie"])
    proved = join_datagram(JOB, 0, nonce=nonce, cookie=cookie, token=TOKEN, **PARAMS)
    [(ack, _)] = core_receive(core, [(proved, ADDR)], now)
    assert msg_type(ack) == MsgType.JOIN_ACK
    return proved, ack


def _job_nonce(ack: bytes) -> bytes:
    return bytes(wire.unpack_join(ack)[1]["job_nonce"])


def _leave(core, ack: bytes, nonce: bytes, now: float) -> None:
    body = wire.unpack_join(ack)[1]
    session = keys.session_key(keys.token_key(TOKEN), JOB, 0, nonce, bytes(body["cookie"]))
    leave = wire.pack({"type": MsgType.LEAVE, "job": JOB, "rank": 0}, bytes(keys.MAC_SIZE))
    assert core_receive(core, [(keys.seal(session, leave, len(leave) - keys.MAC_SIZE), ADDR)], now) == []


def _tagged_bootstrap(job_nonce: bytes) -> bytes:
    """Slot 0's bootstrap DATA of allreduce 0, tagged under the data key that job nonce gives."""
    data = wire.pack({"type": MsgType.DATA, "job": JOB, "allreduce": 0, "chunk": -4, "rank": 0, "slot": 0,
                      "count": 0, "codec": 0, "shadow": 0, "exp": NO_EXP, "next_exp": 3})
    k0, k1 = key_words(keys.data_key(keys.token_key(TOKEN), JOB, job_nonce))
    return data + tag_ref(k0, k1, data)


@pytest.mark.parametrize("later", [0.0, 2.5 * keys.COOKIE_EPOCH], ids=["within the window", "after it"])
def test_a_replayed_join_revives_nothing(later):
    core = _core()
    proved, ack = _proved_join(core, 0.0)
    old_nonce = _job_nonce(ack)
    # a repeat while the seat is held (the JOIN_ACK was lost) is answered again, with the same job nonce
    [(again, _)] = core_receive(core, [(proved, ADDR)], 0.1)
    assert msg_type(again) == MsgType.JOIN_ACK and _job_nonce(again) == old_nonce
    old_data = _tagged_bootstrap(old_nonce)
    assert core_receive(core, [(old_data, ADDR)], 0.2)  # the first run's DATA (world 1: a result at once)
    _leave(core, ack, NONCE, 0.3)
    assert core.info == {}  # the job ended
    bad_mac = core.stats(0.0)["core_counters"].get("drop_bad_mac", 0)
    [(reply, _)] = core_receive(core, [(proved, ADDR)], 0.4 + later)
    assert msg_type(reply) == MsgType.CHALLENGE and core.info == {}  # no revived job, no data key
    assert core.stats(0.0)["core_counters"]["drop_bad_mac"] == bad_mac + 1
    # a new run of the same job id: a fresh job nonce, and the first run's DATA fails its MAC
    _, ack = _proved_join(core, 0.5 + later, nonce=FRESH)
    assert _job_nonce(ack) != old_nonce
    assert core_receive(core, [(old_data, ADDR)], 0.6 + later) == []
    counters = core.stats(0.0)["jobs"][str(JOB)]["counters"]
    assert counters["drop_bad_mac"] == 1 and counters["contributions"] == 0


def test_a_replayed_join_cannot_take_back_a_seat():
    """A rank that rejoined (a new incarnation, say after a crash) keeps its seat against its old JOIN."""
    core = _core()
    proved, _ = _proved_join(core, 0.0)
    _, ack = _proved_join(core, 0.1, nonce=FRESH)  # the same rank again: it takes the seat
    session = keys.session_key(keys.token_key(TOKEN), JOB, 0, FRESH, bytes(wire.unpack_join(ack)[1]["cookie"]))
    [(reply, _)] = core_receive(core, [(proved, ADDR)], 0.2)
    assert msg_type(reply) == MsgType.CHALLENGE
    assert core.info[JOB].sessions[0] == session


def test_the_job_nonce_depends_on_the_incarnation_and_the_core_secret():
    """The same client nonce and cookie give another job nonce in another incarnation, or on another core."""
    nonce, cookie = b"n" * 16, b"c" * 16
    derived = {keys.job_nonce(secret, nonce, cookie, k) for secret in (b"s" * 16, b"t" * 16) for k in (1, 2)}
    assert len(derived) == 4
