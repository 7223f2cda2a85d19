"""A stand-in host codec for the host-mode tests (tests/aggregator/test_host_mode.py and others), so that they
test the data path, not the real codecs of protocol.codecs.host: ``hostq<N>``, a stochastic uniform quantizer to
N bits between each package's own min and max, keyed as C_nat's rounding is (protocol.rng). Its package varies in
length (a constant chunk is its 9-byte header alone), and its decode refuses what it could not have sent, so
malformed packages reach the aggregator's checks. ``registered()`` puts it in the registry for a test's duration.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import numpy as np

from intml.protocol.arith import worker_stream
from intml.protocol.codecs import host
from intml.protocol.codecs.host import HostCodec, MalformedPackage
from intml.protocol.rng import derive_key, fill_bits32

FAMILY = "hostq"
WIRE_ID = 250  # far from the real codecs' ids
HEAD = np.dtype([("lo", ">f4"), ("hi", ">f4"), ("bits", "u1")])


class HostQ(HostCodec):
    """N-bit stochastic uniform quantization: codes k in [0, 2**N - 1] stand for lo + k (hi - lo) / (2**N - 1)."""

    wire_id = WIRE_ID
    unbiased = True
    switch_reason = "its codes are relative to each package's own min and max, which a switch cannot add"

    def __init__(self, bits: int) -> None:
        if not 2 <= bits <= 16:
            raise MalformedPackage(f"{FAMILY} takes 2 to 16 bits, got {bits}")
        self.bits, self.name = bits, f"{FAMILY}{bits}"
        self.levels = (1 << bits) - 1

    def wire_param(self) -> int:
        return self.bits

    def encode(self, x: np.ndarray, key: int, offset: int) -> bytes:
        lo, hi = float(x.min()), float(x.max())
        head = np.array([(lo, hi, self.bits)], HEAD).tobytes()
        if lo == hi:
            return head
        u = np.empty(x.size, np.uint32)
        fill_bits32(u, np.uint64(key), np.uint64(offset))
        t = (x.astype(np.float64) - lo) / (hi - lo) * self.levels
        down = np.floor(t)
        codes = down + (u / 2.0 ** 32 < t - down)
        return head + np.minimum(codes, self.levels).astype(">u2").tobytes()

    def decode(self, package: bytes, count: int) -> np.ndarray:
        if len(package) < HEAD.itemsize:
            raise MalformedPackage(f"a {self.name} package has a {HEAD.itemsize}-byte header, got {len(package)} bytes")
        head = np.frombuffer(package, HEAD, count=1)[0]
        lo, hi = float(head["lo"]), float(head["hi"])
        if int(head["bits"]) != self.bits or not (np.isfinite(lo) and np.isfinite(hi) and lo <= hi):
            raise MalformedPackage(f"a {self.name} package's header is inconsistent: {head}")
        if lo == hi and len(package) == HEAD.itemsize:
            return np.full(count, lo, np.float32)
        if lo == hi or len(package) != HEAD.itemsize + 2 * count:
            raise MalformedPackage(f"a {self.name} package of {count} elements is {HEAD.itemsize + 2 * count} bytes, "
                                   f"got {len(package)}")
        codes = np.frombuffer(package, ">u2", offset=HEAD.itemsize).astype(np.float64)
        if codes.max() > self.levels:
            raise MalformedPackage(f"a {self.name} code above {self.levels}")
        return (lo + codes * ((hi - lo) / self.levels)).astype(np.float32)


@contextlib.contextmanager
def registered() -> Iterator[None]:
    """``hostq<N>`` is a host codec (protocol.codecs.host.FAMILIES) inside the block."""
    before = dict(host.FAMILIES)
    host.FAMILIES[FAMILY] = (WIRE_ID, lambda text: HostQ(int(text)), HostQ)
    try:
        yield
    finally:
        host.FAMILIES.clear()
        host.FAMILIES.update(before)


def rank_key(seed: int, allreduce: int, rank: int) -> int:
    """The key of rank ``rank``'s random words in allreduce ``allreduce`` of a job seeded ``seed``."""
    return int(derive_key(np.uint64(seed), worker_stream(allreduce, rank)))


def reference(codec: HostCodec, xs: list[np.ndarray], *, seed: int, allreduce: int, packet_elements: int,
              mean: bool = False) -> np.ndarray:
    """What every rank's host-mode allreduce of ``xs`` (rank order) must give, computed without the network: each
    rank's packages encoded with its key, decoded, combined in rank order, the result package decoded."""
    keys = [rank_key(seed, allreduce, r) for r in range(len(xs))]
    out = np.empty(xs[0].size, np.float32)
    for lo in range(0, out.size, packet_elements):
        parts = [x.reshape(-1)[lo:lo + packet_elements].astype(np.float32) for x in xs]
        decoded = [codec.decode(codec.encode(p, k, lo), p.size) for p, k in zip(parts, keys)]
        out[lo:lo + parts[0].size] = codec.decode_result(codec.encode_result(codec.combine(decoded)), parts[0].size)
    return out / np.float32(len(xs)) if mean else out
