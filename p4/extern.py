"""The random extern of the pipeline model: the 32-bit words the re-encode of a completed round draws, one per
lane. The P4 program calls v1model's ``random()``, which is not keyed; the model takes the source as an object:

* ``KeyedRandom``: exactly the emulator's keyed words (protocol.rng: the job seed, ``switch_stream(allreduce)``,
  element index ``chunk * packet_elements + lane``), so that the model is bit-equal to the aggregator core.
* ``ExternRandom(seed)``: an unkeyed generator, as a real switch has. Results then differ from run to run, but
  stay loss-invariant within a run (each round is encoded once, on completion, and re-sends read the stored
  codes) and unbiased.
* ``CarriedRandom``: the words of the program's test build (``-DINTML_TEST_RANDOM``), which takes lane i's word
  from word i of a header the packet carries, in every pass: the model's ``carried`` is set to the words of the
  packet it receives next, so that BMv2 and the model round alike.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np

from intml.p4.layout import LANES_PER_PASS
from intml.protocol.arith import switch_stream
from intml.protocol.rng import random_bits


class RandomSource(Protocol):
    def words(self, seed: int, allreduce: int, index: int, n: int) -> np.ndarray:
        """``n`` uint32 words for the lanes of elements index, index + 1, ... (mod 2**64) of a round of
        ``allreduce`` of a job with ``seed``."""


class KeyedRandom:
    def words(self, seed: int, allreduce: int, index: int, n: int) -> np.ndarray:
        return random_bits(seed, int(switch_stream(allreduce)), index, n)


class ExternRandom:
    def __init__(self, seed: int) -> None:
        self.rng = np.random.default_rng(seed)

    def words(self, seed: int, allreduce: int, index: int, n: int) -> np.ndarray:
        return self.rng.integers(0, 1 << 32, n, dtype=np.uint32)


class CarriedRandom:
    def __init__(self) -> None:
        self.carried = np.zeros(LANES_PER_PASS, np.uint32)

    def words(self, seed: int, allreduce: int, index: int, n: int) -> np.ndarray:
        return self.carried[:n]
