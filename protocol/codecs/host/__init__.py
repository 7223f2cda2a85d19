"""Host-aggregated codecs (protocol.codecs.host.base): the papers' compressors beside the switch's C_nat, each one
module with its slow reference, selected by name.

``parse(name)`` gives the codec a name stands for; ``from_wire(wire_id, param)`` the one a JOIN names. Adding a
codec: its module (a ``HostCodec`` subclass), and its entry in ``FAMILIES``.
"""

from __future__ import annotations

from collections.abc import Callable

from intml.protocol.codecs.host import (adaptive, bitmask, lloyd, powersgd, qsgd, randomk, signsgd, terngrad, topk,
                                       uniform)
from intml.protocol.codecs.host.base import HostCodec, MalformedPackage, Memory

# family name -> (wire id, constructor from the text after the family name, constructor from the wire parameter)
FAMILIES: dict[str, tuple[int, Callable[[str], HostCodec], Callable[[int], HostCodec]]] = {}
for _module in (uniform, adaptive, lloyd, bitmask, qsgd, terngrad, signsgd, topk, randomk, powersgd):
    FAMILIES.update(_module.FAMILIES)


def parse(name: str) -> HostCodec:
    """The host codec called ``name`` (``uniform8``, ``adaptive``, ``topk0.01``...); ValueError naming the known
    families otherwise."""
    for family in sorted(FAMILIES, key=len, reverse=True):
        if name.startswith(family):
            return FAMILIES[family][1](name[len(family):])
    raise ValueError(f"unknown codec {name!r}: host codecs are {', '.join(sorted(FAMILIES))} (docs/codecs.md)")


def from_wire(wire_id: int, param: int) -> HostCodec:
    """The host codec a JOIN names by its codec field and parameter; MalformedPackage if none is."""
    for family_id, _, from_param in FAMILIES.values():
        if family_id == wire_id:
            return from_param(param)
    raise MalformedPackage(f"no host codec has wire id {wire_id}")


__all__ = ["FAMILIES", "HostCodec", "MalformedPackage", "Memory", "from_wire", "parse"]
