"""`intml-testbed bench host-codecs`: per host codec (protocol.codecs.host), wire bits per parameter, RMS error
and one thread's encode and decode rates, on a fixed N(0, 1) float32 vector cut into packages."""

from __future__ import annotations

import platform

import numpy as np

from intml.protocol.codecs.host import parse
from intml.testbed.timing import emit, median_seconds

CODECS = ["uniform4", "uniform8", "adaptive", "adaptive-c6", "adaptive-huffman", "adaptive-huffman-c6", "lloyd3",
          "bitmask", "qsgd4", "qsgd127", "terngrad", "signsgd", "topk0.01", "randomk0.01", "powersgd4"]


def run(elements: int, package: int, repeats: int, names: list[str], as_json: bool) -> list[dict]:
    x = np.random.default_rng(0).standard_normal(elements).astype(np.float32)
    starts = range(0, elements, package)
    rows = []
    for name in names:
        codec = parse(name)
        packages = [codec.encode(x[start:start + package], 1, start) for start in starts]
        decoded = np.concatenate([codec.decode(p, min(package, elements - s)) for p, s in zip(packages, starts)])
        encode = median_seconds(lambda: [codec.encode(x[s:s + package], 1, s) for s in starts], repeats)
        decode = median_seconds(lambda: [codec.decode(p, min(package, elements - s)) for p, s in zip(packages, starts)],
                                repeats)
        rows.append({"codec": name, "bits_per_parameter": 8 * sum(map(len, packages)) / elements,
                     "rms_error": float(np.sqrt(np.mean((decoded.astype(np.float64) - x) ** 2))),
                     "encode_m_per_s": elements / encode / 1e6, "decode_m_per_s": elements / decode / 1e6,
                     "unbiased": codec.unbiased})
    emit(rows, as_json, "host codecs on N(0, 1) float32, one thread",
         [("codec", "codec", ""), ("bits_per_parameter", "bits/param", ".3f"), ("rms_error", "RMS error", ".4g"),
          ("encode_m_per_s", "encode M/s", ".1f"), ("decode_m_per_s", "decode M/s", ".1f"),
          ("unbiased", "unbiased", "")],
         {"elements": elements, "package elements": package, "repeats": repeats, "machine": platform.machine()})
    return rows
