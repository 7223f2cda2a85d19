"""The control plane's keys and MACs, all keyed BLAKE2b (16-byte keys and tags), domain-separated by ``person``.

The token never travels: a JOIN proves it with a MAC under the *token key*, and everything after derives from it
and from fresh randomness of both sides (the worker's client nonce ``Nc``, the core's cookie):

* ``cookie(secret, addr, job, rank, Nc, epoch)``: the core's stateless challenge (a SYN cookie). It binds the
  sender's address, so a JOIN replayed from another address fails; it expires after one or two epochs.
* ``session_key(token key, job, rank, Nc, cookie)``: one rank's membership on one core. LEAVE, STATS_REQUEST,
  STATS_REPLY and the JOIN_ACK carry a MAC under it; a new incarnation of the rank has a new one.
* ``job_nonce(secret, Nc, cookie, incarnation)``: chosen by a core when the job registers there: fresh from both
  sides, and from the core's count of registrations, so that a replayed JOIN can never bring back an earlier
  incarnation's nonce (and data key).
* ``data_key(token key, job, job nonce)``: the job's DATA/RESULT MAC key on that core, the same for every member;
  the data plane takes it as two uint64 words (``protocol.siphash.key_words``: SipHash's k0, k1).

A MAC covers a whole datagram with its 16 MAC bytes zeroed (``seal`` / ``verify``, given where the MAC lies).
Only hashlib and hmac: the sans-I/O cores import this module; randomness is the caller's (injectable).
"""

from __future__ import annotations

import hashlib
import hmac

KEY_SIZE = 16
NONCE_SIZE = 16
MAC_SIZE = 16
COOKIE_EPOCH = 10.0  # seconds; a cookie of the current or the previous epoch is accepted


def _mac(key: bytes, person: bytes, *parts: bytes) -> bytes:
    h = hashlib.blake2b(key=key, digest_size=MAC_SIZE, person=person)
    for part in parts:
        h.update(part)
    return h.digest()


def _ids(job: int, rank: int) -> bytes:
    return job.to_bytes(4, "big") + rank.to_bytes(2, "big")


def token_key(token: str) -> bytes:
    """The key a token stands for (a token of any length; BLAKE2b keys are at most 64 bytes)."""
    return hashlib.blake2b(token.encode(), digest_size=KEY_SIZE, person=b"intml-token").digest()


def epoch(now: float) -> int:
    return int(now // COOKIE_EPOCH)


def cookie_expiry(now: float) -> float:
    """When a cookie valid at ``now`` stops being accepted (the end of the epoch after the current one)."""
    return (epoch(now) + 2) * COOKIE_EPOCH


def cookie(secret: bytes, addr: int, job: int, rank: int, nonce: bytes, epoch_: int) -> bytes:
    return _mac(secret, b"intml-cookie", addr.to_bytes(8, "big"), _ids(job, rank), nonce,
                epoch_.to_bytes(8, "big", signed=True))


def cookie_valid(secret: bytes, addr: int, job: int, rank: int, nonce: bytes, value: bytes, now: float) -> bool:
    """Whether ``value`` is this core's cookie for the sender, of the current or the previous epoch."""
    e = epoch(now)
    return any(hmac.compare_digest(cookie(secret, addr, job, rank, nonce, k), value) for k in (e, e - 1))


def session_key(token_key_: bytes, job: int, rank: int, nonce: bytes, cookie_: bytes) -> bytes:
    return _mac(token_key_, b"intml-session", _ids(job, rank), nonce, cookie_)


def job_nonce(secret: bytes, nonce: bytes, cookie_: bytes, incarnation: int) -> bytes:
    return _mac(secret, b"intml-jobnonce", nonce, cookie_, incarnation.to_bytes(8, "big"))


def data_key(token_key_: bytes, job: int, job_nonce_: bytes) -> bytes:
    return _mac(token_key_, b"intml-data", job.to_bytes(4, "big"), job_nonce_)


def _zeroed(datagram: bytes, at: int) -> bytes:
    return datagram[:at] + bytes(MAC_SIZE) + datagram[at + MAC_SIZE:]


def seal(key: bytes, datagram: bytes, at: int) -> bytes:
    """``datagram`` with its MAC (the MAC_SIZE bytes at offset ``at``) set under ``key``."""
    body = _zeroed(datagram, at)
    return body[:at] + _mac(key, b"intml-control", body) + body[at + MAC_SIZE:]


def verify(key: bytes, datagram: bytes, at: int) -> bool:
    """Whether the MAC at offset ``at`` of ``datagram`` is right under ``key``."""
    if not 0 <= at <= len(datagram) - MAC_SIZE:
        return False
    return hmac.compare_digest(_mac(key, b"intml-control", _zeroed(datagram, at)), datagram[at:at + MAC_SIZE])
