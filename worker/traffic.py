"""Bytes on the wire per allreduce, per worker and each way: intml's from its packet format (a switch codec's) or
from the package bytes its engine measured (a host codec's, whose packages vary with the data), and the ring
allreduce's model that the benchmarks and the PyTorch accounting compare it with. Counted without loss
(retransmissions are counted apart, by the worker)."""

from __future__ import annotations

from intml.protocol.job import CODEC_NAMES
from intml.protocol.packet import HDR


def intml_packets(elements: int, packet_elements: int, pool_size: int) -> int:
    """Datagrams one worker sends (and receives): a data packet per chunk, ceil(N/P), and the min(pool, chunks)
    empty bootstrap packets that open the slots."""
    chunks = -(-elements // packet_elements)
    return chunks + min(pool_size, chunks)


def intml_bytes(elements: int, codec: str, packet_elements: int, pool_size: int, per_packet: int = HDR) -> int:
    """Bytes one worker sends (and receives) with switch codec `codec`: the payload plus `per_packet` bytes on each
    datagram (the intml header; add the IP, UDP and link headers for the bytes on a link). A host codec's bytes
    depend on the data: ``host_bytes`` of what its engine measured."""
    if codec not in CODEC_NAMES:
        raise ValueError(f"{codec!r} is not a switch codec ({', '.join(CODEC_NAMES)}); a host codec's bytes are "
                         f"measured (worker.host.HostStreamEngine.counters, host_bytes)")
    width = CODEC_NAMES[codec].bytes_per_element
    return elements * width + intml_packets(elements, packet_elements, pool_size) * per_packet


def ring_bytes(elements: int, world_size: int, element_size: int = 4) -> float:
    """Payload bytes one worker sends (and receives) in a ring allreduce: 2(n-1)/n of the tensor."""
    return 2 * (world_size - 1) / world_size * element_size * elements


def host_bytes(package_bytes: int, elements: int, packet_elements: int, per_packet: int = HDR) -> int:
    """Bytes one worker sent (or received) in a host-codec allreduce of `elements`: the packages' `package_bytes`
    as the engine measured them (``package_bytes`` sent, ``result_bytes`` received) plus `per_packet` bytes on
    each of the ceil(N/P) datagrams; host mode has no bootstrap round."""
    return package_bytes + -(-elements // packet_elements) * per_packet
