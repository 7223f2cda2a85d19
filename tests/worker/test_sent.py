"""The engine's ``sent`` output (error feedback's compressed gradient): per element, the value this rank put on
the wire, checked bit for bit against an independent computation from ``protocol.reference``'s primitives, for
both codecs, through the in-process harness (tests/support/harness.py) and through a real ``Worker``.
"""

from __future__ import annotations

import asyncio
import functools

import numpy as np
import pytest
from support.cluster import aggregator
from support.harness import Network, make_inputs

from intml.protocol import reference
from intml.protocol.wire import NO_EXP
from intml.worker import Worker

SEED = 77


def reference_sent(xs: list[np.ndarray], rank: int, codec: str, *, seed: int, allreduce_seq: int,
                   packet_elements: int) -> np.ndarray:
    """What rank `rank` sends, decoded: per chunk, the exponent agreed over all ranks, then its own C_nat codes at
    that floor (cnat8) or its values rounded to the chunk's fixed-point unit (int32)."""
    n = len(xs)
    s = 31 - n.bit_length()
    x = xs[rank].reshape(-1)
    out = np.empty(x.size, np.float32)
    for lo in range(0, x.size, packet_elements):
        parts = [y.reshape(-1)[lo:lo + packet_elements] for y in xs]
        mine = parts[rank]
        if codec == "cnat8":
            floor, encoded = reference.worker_codes(parts, seed=seed, allreduce_seq=allreduce_seq, offset=lo)
            out[lo:lo + mine.size] = reference.decode(encoded[rank][0], floor)
        else:
            e = max(reference.chunk_exponent(p, -126, 127) for p in parts)
            scale = s - (-126 if e == NO_EXP else e)
            # the integer on the wire (a rounded -0.0 is the integer 0)
            fixed = np.clip(np.rint(mine.astype(np.float64) * 2.0**scale), -(2.0**s), 2.0**s).astype(np.int64)
            out[lo:lo + mine.size] = (fixed * 2.0**-scale).astype(np.float32)
    return out


def assert_bits_equal(got: np.ndarray, want: np.ndarray, what: str) -> None:
    bad = np.flatnonzero(got.view(np.uint32) != want.view(np.uint32))
    assert bad.size == 0, f"{what}: {bad.size} elements differ, first {bad[:5]}: {got[bad[:5]]} != {want[bad[:5]]}"


@pytest.mark.parametrize("codec", ["cnat8", "int32"])
@pytest.mark.parametrize(("n", "size", "pool", "kind"), [(1, 300, 2, "normal"), (3, 64 * 5 + 17, 2, "mixed"),
                                                          (4, 64 * 9, 16, "zero_chunks"), (2, 200, 3, "tiny"),
                                                          (3, 130, 4, "huge"), (2, 0, 2, "normal")])
@pytest.mark.parametrize("drop", [0.0, 0.2])
def test_sent_equals_reference(codec: str, n: int, size: int, pool: int, kind: str, drop: float) -> None:
    """Two consecutive allreduces (the second one's random stream differs), with and without loss: the
    retransmissions resend the stored datagrams, so what was sent stays what was encoded once."""
    P = 64
    net = Network(n, codec=codec, packet_elements=P, pool_size=pool, seed=SEED, drop=drop, duplicate=drop,
                  reorder=drop, fault_seed=size)
    for seq in range(2):
        xs = make_inputs(n, size, P, kind, seed=1000 * seq + size + n)
        sents = [np.full(size, np.nan, np.float32) for _ in range(n)]
        for engine, sent in zip(net.engines, sents):  # the harness starts the engines; bind sent= to each
            engine.start = functools.partial(type(engine).start, engine, sent=sent)
        results = net.allreduce(xs)
        for rank, sent in enumerate(sents):
            want = reference_sent(xs, rank, codec, seed=SEED, allreduce_seq=seq, packet_elements=P)
            assert_bits_equal(sent, want, f"{codec} n={n} allreduce {seq} rank {rank}")
        if codec == "int32":  # the switch adds exactly what the ranks sent
            total = np.sum([s.astype(np.float64) for s in sents], axis=0).astype(np.float32)
            assert_bits_equal(results[0], total, f"int32 n={n} allreduce {seq}: result vs sum of sent")
        if n == 1 and codec == "cnat8":  # one rank: the switch re-encodes a power of two to itself
            assert_bits_equal(results[0], sents[0], f"cnat8 n=1 allreduce {seq}: result vs sent")


def test_without_sent_the_result_is_unchanged() -> None:
    """Asking for `sent` changes nothing else: the same datagrams and results as without it."""
    xs = make_inputs(3, 64 * 6 + 5, 64, "mixed", seed=5)
    plain = Network(3, codec="cnat8", packet_elements=64, pool_size=3, seed=SEED, record=True)
    asked = Network(3, codec="cnat8", packet_elements=64, pool_size=3, seed=SEED, record=True)
    for engine in asked.engines:
        engine.start = functools.partial(type(engine).start, engine, sent=np.empty(xs[0].size, np.float32))
    for a, b in zip(plain.allreduce(xs), asked.allreduce(xs)):
        assert_bits_equal(a, b, "result")
    assert plain.sent_up == asked.sent_up


@pytest.mark.parametrize("sent", [np.zeros(10, np.float32), np.zeros(11, np.float64),
                                  np.zeros((11, 2), np.float32)[:, 0]])
def test_engine_rejects_bad_sent(sent: np.ndarray) -> None:
    engine = Network(1, join=False).engines[0]
    with pytest.raises(ValueError, match="sent must be a C-contiguous float32 array of 11 elements"):
        engine.start(np.ones(11, np.float32), 0.0, sent=sent)


@pytest.mark.process
@pytest.mark.parametrize("codec", ["cnat8", "int32"])
def test_worker_allreduce_sent(codec: str) -> None:
    """Worker.allreduce and allreduce_async pass `sent` through: at world size 1, against the reference."""
    x = make_inputs(1, 5000, 512, "normal", seed=3)[0].reshape(50, 100)
    with aggregator() as agg, Worker(agg.address, job=3, rank=0, world_size=1, token="t", codec=codec,
                                     packet_elements=512, pool_size=4, seed=SEED) as w:
        sent = np.empty_like(x)
        w.allreduce(x, "mean", sent=sent)
        want = reference_sent([x], 0, codec, seed=SEED, allreduce_seq=0, packet_elements=512)
        assert_bits_equal(sent.reshape(-1), want, f"{codec} allreduce")
        asyncio.run(w.allreduce_async(x, sent=sent))
        want = reference_sent([x], 0, codec, seed=SEED, allreduce_seq=1, packet_elements=512)
        assert_bits_equal(sent.reshape(-1), want, f"{codec} allreduce_async")
