"""Forged data-plane datagrams: what an attacker who can spoof the aggregator's or a rank's address sends to a job
without the DATA/RESULT MAC. Used by the tests, ``intml-testbed audit`` and its fuzz campaign.

Every datagram here is syntactically valid (right magic, version, sizes, codes), so it reaches the receive
path's deepest checks: the point is what a forged round does to the state, not whether the parser rejects it.
"""

from __future__ import annotations

import random

import numpy as np

from intml.protocol import wire
from intml.protocol.wire import NO_EXP, Codec, MsgType


def _chunk_count(chunk: int, elements: int, packet_elements: int) -> int:
    return 0 if chunk < 0 else max(0, min(packet_elements, elements - chunk * packet_elements))


def _forged(typ: MsgType, codec: Codec, count: int, **fields: int) -> bytes:
    """A datagram of type ``typ`` with these header fields and an all-zero payload of ``count`` elements (zero is
    a valid code and value in either codec)."""
    width = np.dtype(wire.payload_dtype(codec)).itemsize
    return wire.pack({"type": typ, "count": count, "codec": int(codec), **fields}, bytes(width * count))


def forged_result(*, job: int, allreduce: int, chunk: int, slot: int, shadow: int, count: int, exp: int,
                  next_exp: int, codec: Codec = Codec.CNAT8, owners: int = 0) -> bytes:
    """A RESULT with these fields and an all-zero payload."""
    return _forged(MsgType.RESULT, codec, count, job=job, allreduce=allreduce, chunk=chunk, rank=owners << 8,
                   slot=slot, shadow=shadow, exp=exp, next_exp=next_exp)


def forged_rounds(*, job: int, elements: int, packet_elements: int, pool_size: int, rounds: int,
                  allreduce: int = 0, parity: int = 0, exp: int = 0, codec: Codec = Codec.CNAT8) -> list[bytes]:
    """RESULTs of ``rounds`` consecutive rounds of every slot of an allreduce of ``elements`` elements, in the
    order a worker would take them (every slot's round 0, then every slot's round 1, ...), as a fresh job's
    worker waits for them: round 0 is the slot's bootstrap chunk, parity ``parity``; each round names ``exp`` as
    the next chunk's agreed exponent, so every later round is valid for the state the one before leaves."""
    chunks = -(-elements // packet_elements)
    window = min(pool_size, chunks)
    out = []
    for k in range(rounds):
        for s in range(window):
            chunk = s - window + k * window
            if chunk >= chunks:
                continue
            count = _chunk_count(chunk, elements, packet_elements)
            out.append(forged_result(job=job, allreduce=allreduce, chunk=chunk, slot=s, shadow=(parity + k) % 2,
                                     count=count, exp=NO_EXP if chunk < 0 else exp, next_exp=exp, codec=codec))
    return out


def forged_data(*, job: int, rank: int, allreduce: int, chunk: int, slot: int, shadow: int, count: int, exp: int,
                next_exp: int, codec: Codec = Codec.CNAT8) -> bytes:
    """A DATA packet with these fields and an all-zero payload."""
    return _forged(MsgType.DATA, codec, count, job=job, allreduce=allreduce, chunk=chunk, rank=rank, slot=slot,
                   shadow=shadow, exp=exp, next_exp=next_exp)


def fuzzed(rng: random.Random, n: int, *, job: int, elements: int, packet_elements: int, pool_size: int,
           max_len: int, typ: MsgType = MsgType.RESULT) -> list[bytes]:
    """n datagrams of type ``typ`` (RESULT for a worker, DATA for an aggregator; one in 20 of another type) near a
    job's valid ones: header fields drawn around (and past) the values a receiver of that job accepts (allreduce
    0..2, every chunk of the allreduce and a few beyond each end, slots to past the pool, both parities,
    exponents at and off the agreed ones, counts and lengths that match or not), payload bytes random; some
    truncated or padded. Consecutive rounds of one slot come up often, the
    case a burst must survive."""
    chunks = -(-elements // packet_elements)
    window = min(pool_size, chunks)
    out = []
    for _ in range(n):
        chunk = rng.randint(-window - 2, chunks + 2)
        count = _chunk_count(chunk, elements, packet_elements) if rng.random() < 0.8 else rng.randint(0, 0xFFFF)
        fields = {"type": typ if rng.random() < 0.95 else rng.randint(0, 255), "job": job,
                  "allreduce": rng.choice((0, 0, 0, 1, 2, 0xFFFFFFFF)), "chunk": chunk,
                  "rank": rng.choice((0, 0, 1, 1 << 8, rng.randint(0, 0xFFFF))),
                  "slot": rng.randint(0, pool_size + 1), "count": count, "codec": rng.choice((0, 0, 0, 1, 255)),
                  "shadow": rng.choice((0, 1, 1, 2)), "exp": rng.choice((0, 0, NO_EXP, rng.randint(-128, 127))),
                  "next_exp": rng.choice((0, 0, NO_EXP, rng.randint(-128, 127)))}
        body = rng.randbytes(min(count, max_len)) if rng.random() < 0.5 else bytes(min(count, max_len))
        datagram = wire.pack(fields, body)
        r = rng.random()
        if r < 0.05:
            datagram = datagram[:rng.randint(0, len(datagram))]
        elif r < 0.1:
            datagram += rng.randbytes(rng.randint(1, 16))
        out.append(datagram[:max_len])
    return out
