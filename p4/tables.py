"""The match-action tables and registers of the pipeline model, as a switch holds them: tables filled from
p4.entries' Entry data and looked up by key (a miss runs the table's default action), registers as numpy arrays
of the widths p4.layout declares, so that every write wraps around as the hardware's bits do."""

from __future__ import annotations

import numpy as np

from intml.p4.entries import Entry
from intml.p4.layout import REGISTERS, TABLE, TABLES

Hit = tuple[str, tuple[int, ...]]  # (action, params)


def _dtype(width: int) -> type:
    """The narrowest numpy type holding ``width`` bits (a 48-bit register lives in 64 and is masked on write)."""
    return next(t for bits, t in ((8, np.uint8), (16, np.uint16), (32, np.uint32), (64, np.uint64)) if width <= bits)


class Registers:
    """Every register array of the layout: ``cells[name]`` is (entries,) or, for a per-lane register, (lanes,
    entries); ``write`` masks a value to the register's width."""

    def __init__(self) -> None:
        self.cells = {r.name: np.zeros((r.lanes, r.entries) if r.lanes else r.entries, _dtype(r.width))
                      for r in REGISTERS}
        self.mask = {r.name: (1 << r.width) - 1 for r in REGISTERS}

    def read(self, name: str, index: int) -> int:
        return int(self.cells[name][index])

    def write(self, name: str, index: int, value: int) -> None:
        self.cells[name][index] = value & self.mask[name]


class Tables:
    """Exact tables as dicts, the ternary leading-one table as (value, mask) arrays matched in one step over a
    pass's lanes, the 256-entry decode table as arrays indexed by the code (an exact table on an 8-bit key)."""

    def __init__(self) -> None:
        self.exact: dict[str, dict[tuple, Hit]] = {t.name: {} for t in TABLES}
        self.groups: dict[int, tuple[int, ...]] = {}  # v1model multicast group -> replica ids

    def install(self, entries: list[Entry]) -> None:
        for e in entries:
            if e.table == "multicast_group":
                self.groups[e.key[0]] = e.params
            else:
                self.exact[e.table][e.key] = (e.action, e.params)
        self._compile_lane_tables()

    def clear(self, tables: tuple[str, ...]) -> None:
        """Remove every entry of these tables (``multicast_group`` included by name)."""
        for name in tables:
            if name == "multicast_group":
                self.groups.clear()
            else:
                self.exact[name].clear()

    def lookup(self, table: str, key: tuple) -> Hit:
        return self.exact[table].get(key, (TABLE[table].default, ()))

    def _compile_lane_tables(self) -> None:
        decode = self.exact["cnat_decode"]
        self.decode_hit = np.array([(c,) in decode for c in range(256)])
        self.decode_value = np.array([decode[(c,)][1][0] if (c,) in decode else 0 for c in range(256)], np.uint32)
        ternary = list(self.exact["leading_one"].items())
        self.one_value = np.array([k[0][0] for k, _ in ternary], np.uint32)
        self.one_mask = np.array([k[0][1] for k, _ in ternary], np.uint32)
        self.one_action = [action for _, (action, _) in ternary]

    def decode(self, codes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(hit, value) of each lane's cnat_decode lookup."""
        return self.decode_hit[codes], self.decode_value[codes]

    def leading_one(self, magnitudes: np.ndarray) -> list[str]:
        """The action each lane's leading_one lookup runs (the first matching entry, else the default)."""
        match = (magnitudes[:, None] & self.one_mask[None, :]) == self.one_value[None, :]
        first = match.argmax(axis=1)
        default = TABLE["leading_one"].default
        return [self.one_action[f] if match[i, f] else default for i, f in enumerate(first.tolist())]
