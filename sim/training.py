"""Training time per iteration: DDP's overlap of the backward pass with bucket allreduces, for intml cnat8 and
Gloo's ring, from the analytic models.

DDP (torch.nn.parallel.DistributedDataParallel) groups gradients into buckets of ``bucket_cap_mb`` = 25 MB (the
first 1 MB), in reverse layer order; a bucket's allreduce starts once its gradients are ready and the previous
allreduce is done. The model here: backward produces gradient bytes at a constant rate over its duration
(backward = 2/3 of the compute, forward 1/3), buckets go one at a time, the iteration ends when both the backward
pass and the last allreduce are done. intml's host side (encode and decode on one core, ``sim.costs``) bounds
its allreduce too: ``cpu`` columns include it, ``net`` columns are the network alone.

Profiles: parameter counts are the models' published ones (ResNet-50 25.6M, He et al. 2016; VGG-16 138M, Simonyan
and Zisserman 2015; BERT-base 110M, Devlin et al. 2019; GPT-2 medium 355M, Radford et al. 2019; ResNet-110 1.7M,
He et al. 2016; AlexNet 61M, Krizhevsky et al. 2012). Compute times per iteration are ASSUMPTIONS of this model, of
the order of published single-V100 mixed-precision throughputs (ResNet-50 at about 1,000 images/s, batch 64;
others scaled by their FLOPs per sample): they were not measured here, and the speedups scale with them.
"""

from __future__ import annotations

from intml.sim.costs import IO_PER_DATAGRAM
from intml.sim.models import Net, in_network, largest_packet, pool_for, ring
from intml.sim.output import plot_lines
from intml.worker.costs import MIN_POOL, tuner_costs
from intml.worker.tuner import Costs, Network, switch_seconds

PROFILES = {  # name: (parameters, compute seconds per iteration, forward + backward, assumed)
    "ResNet-50": (25_557_032, 0.064),
    "VGG-16": (138_357_544, 0.240),
    "BERT-base": (110_000_000, 0.110),
    "GPT-2 medium": (355_000_000, 0.350),
    "ResNet-110": (1_730_000, 0.030),
    "AlexNet": (61_100_840, 0.020),
}
SOURCES = "parameters: the models' papers; compute: assumed (see sim/training.py)"
BUCKET = 25 * 2 ** 20 // 4  # elements of float32 in a 25 MB bucket
FIRST_BUCKET = 2 ** 20 // 4
COLUMNS = ("model", "rate_gbit", "workers", "ring_s", "intml_net_s", "intml_cpu_s", "less_time_net",
           "less_time_cpu")


def buckets(parameters: int) -> list[int]:
    sizes = [min(FIRST_BUCKET, parameters)]
    left = parameters - sizes[0]
    while left > 0:
        sizes.append(min(BUCKET, left))
        left -= sizes[-1]
    return sizes


def iteration(parameters: int, compute: float, allreduce) -> float:
    """One DDP iteration: ``allreduce(elements)`` per bucket, overlapped with backward."""
    forward, backward = compute / 3, 2 * compute / 3
    done_bytes, end = 0, 0.0
    for size in buckets(parameters):
        done_bytes += size
        ready = forward + backward * done_bytes / parameters
        end = max(ready, end) + allreduce(size)
    return max(forward + backward, end)


# The tuner's costs (worker.costs' table and network models, the DDP hook's too): a datagram through GSO/GRO, or
# sendmmsg's
COSTS = tuner_costs()
SENDMMSG_COSTS = tuner_costs(IO_PER_DATAGRAM)


def in_network_cpu(net: Net, elements: int, codec: str = "cnat8", costs: Costs = SENDMMSG_COSTS) -> float:
    """One in-network allreduce of a switch codec (cnat8, int32): the tuner's model (worker.tuner.switch_seconds)
    with the simulator's network, the largest packets the MTU and the aggregator allow, bounded by the worker's
    CPU as well (encode and decode on one core, a datagram out and one in per packet)."""
    return switch_seconds(costs, Network(rtt=net.rtt, mtu=net.mtu), codec, net.workers, net.rate, elements)


def predict(model: str, workers: int, rate: float, mtu: int = 9000) -> dict:
    parameters, compute = PROFILES[model]
    net = Net(workers, rate, mtu=mtu)
    pe = largest_packet(1, mtu)
    pool = max(MIN_POOL, pool_for(net, pe))
    ring_t = iteration(parameters, compute, lambda n: ring(net, n))
    t_net = iteration(parameters, compute, lambda n: in_network(net, n, pe, pool))
    t_cpu = iteration(parameters, compute, lambda n: in_network_cpu(net, n))
    return {"model": model, "rate_gbit": rate / 1e9, "workers": workers, "ring_s": ring_t, "intml_net_s": t_net,
            "intml_cpu_s": t_cpu, "less_time_net": 1 - t_net / ring_t, "less_time_cpu": 1 - t_cpu / ring_t}


def table(workers: int, rates: list[float]) -> list[dict]:
    return [predict(m, workers, r) for m in PROFILES for r in rates]


def plot(rows: list[dict], path: str) -> None:
    """Speedup over the ring (ring time / intml time, network only) against bandwidth, one line per model."""
    series: dict[str, list[tuple[float, float]]] = {}
    for r in rows:
        series.setdefault(r["model"], []).append((r["rate_gbit"], r["ring_s"] / r["intml_net_s"]))
    plot_lines(path, series, xlabel="link Gbit/s", ylabel="iteration speedup over the ring",
               title=f"DDP iteration, {rows[0]['workers']} workers (intml network-bound)", logx=True)
