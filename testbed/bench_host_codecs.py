"""`intml-testbed bench host-codecs`: per host codec (protocol.codecs.host), wire bits per parameter, RMS error
and one thread's encode and decode rates, on a fixed N(0, 1) float32 vector cut into packages; with
``--allreduce``, the time of a loopback allreduce of that vector through the aggregator's host mode, per codec,
beside C_nat's through its kernel in the same run."""

from __future__ import annotations

import platform
import statistics

import numpy as np

from intml.protocol.codecs.host import parse
from intml.protocol.job import CODEC_NAMES, HOST_DATAGRAM_ELEMENTS, host_aggregator_elements, host_max_packet
from intml.testbed import rank
from intml.testbed.bench_allreduce import aggregator, loopback_packet_elements
from intml.testbed.procs import run_ranks, slowest_per_round
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


BASELINE = "cnat8"  # the switch codec the host codecs' allreduces are timed beside
HOST_PACKET = host_max_packet(HOST_DATAGRAM_ELEMENTS)  # a host job's largest packet: the fewest per-packet costs


def allreduce(workers: int, elements: int, rounds: int, names: list[str], as_json: bool) -> list[dict]:
    """Per codec (C_nat first, then ``names``), the median over ``rounds`` of a loopback allreduce of ``elements``
    float32 at ``workers`` ranks through one aggregator core, each codec at its largest packet, and its time
    over C_nat's."""
    codecs = [BASELINE, *names]
    packet = {name: loopback_packet_elements(name) if name in CODEC_NAMES else HOST_PACKET for name in codecs}
    rows = []
    with aggregator(1, max(max(packet.values()), host_aggregator_elements(HOST_PACKET))) as port:
        for job, name in enumerate(codecs, start=1):
            reports = run_ranks([rank.command(f"127.0.0.1:{port}", r, workers, elements, codec=name,
                                              packet_elements=packet[name], rounds=rounds, job=job)
                                 for r in range(workers)], "intml", 600.0)
            rows.append({"codec": name, "packet_elements": packet[name],
                         "median_s": statistics.median(slowest_per_round(reports)),
                         "identical_across_ranks": all(r["hashes"] == reports[0]["hashes"] for r in reports)})
    for row in rows:
        row["vs_" + BASELINE] = row["median_s"] / rows[0]["median_s"]
    emit(rows, as_json, f"loopback allreduce through one aggregator core, host codecs beside {BASELINE}",
         [("codec", "codec", ""), ("packet_elements", "packet elements", "d"), ("median_s", "median s", ".4f"),
          ("vs_" + BASELINE, f"x {BASELINE}", ".2f"), ("identical_across_ranks", "identical", "")],
         {"workers": workers, "elements": elements, "rounds": rounds, "machine": platform.machine()})
    return rows
