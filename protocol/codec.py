"""The wire's codec ids: the ``codec`` field of the header and of the JOIN, and the type of one payload element
each id puts on the wire. The codecs themselves (encode, check, add, decode) are the modules of protocol.codecs,
one per id; this module imports none of them, so that the wire format (protocol.wire) and the codecs both build
on it without importing each other.
"""

from __future__ import annotations

from enum import IntEnum

import numpy as np


class Codec(IntEnum):
    """Encoding of DATA / RESULT payload elements: the ids of the modules of protocol.codecs."""

    CNAT8 = 0
    INT32 = 1

    @property
    def payload_dtype(self) -> np.dtype:
        """The numpy dtype of one payload element on the wire (network byte order)."""
        return PAYLOAD_DTYPES[self]

    @property
    def bytes_per_element(self) -> int:
        """Size of one payload element on the wire."""
        return self.payload_dtype.itemsize


PAYLOAD_DTYPES: dict[Codec, np.dtype] = {Codec.CNAT8: np.dtype(np.uint8), Codec.INT32: np.dtype(">i4")}
