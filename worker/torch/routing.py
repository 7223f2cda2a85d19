"""Which allreduces go through the aggregator and which go exactly through Gloo, and why.

The aggregator sums 8-bit C_nat codes (or int32 fixed point): right for gradients, wrong for a loss, a counter or
a metric, which a user expects exact. So the backend sends through intml only float32, bfloat16 and float16 SUM/AVG
allreduces of at least ``INTML_MIN_ELEMENTS`` elements (``config`` says why 64 Ki), and the hook every DDP bucket it
can encode: CPU tensors, and CUDA tensors where ``intml.worker.gpu`` is usable (``gpu``: encoded on their device).
Everything else goes to Gloo, counted under its reason in ``Traffic.gloo_reasons``. The reasons a user chose
(warm-up, start-up fallback) pass silently, and below the threshold gets one ``IntmlRoutingWarning`` per group (a
user who swapped in intml should know that it moved nothing); the others warn once per reason and group with an
``IntmlUncompressedWarning``, since that user may have expected the tensor to be compressed. A group that sent
anything to Gloo says its totals when it is destroyed. The warnings point at the user's line.

Every rank routes a collective the same way: the rule reads only what all ranks share (size, dtype, op, layout).

A reduce-scatter (``reduce_scatter_tensor``: FSDP's and ZeRO's gradient reduction) routes by the same rule, its CUDA
tensors through the CUDA path as an allreduce's (``scatter_route``).

A host codec (``INTML_CODEC=uniform8``...) routes by the same rule, with one difference: its CUDA tensors need no
CUDA path (``link.AggregatorLinked._cuda_problem``), since it encodes on the CPU and they are staged through host
memory, as Gloo stages them.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Sequence

import torch
import typing_extensions

FALLBACK = "fallback"  # start-up could not reach the aggregator (IntmlFallbackWarning said so then)
WARMUP = "warmup"  # hook: one of the first INTML_WARMUP_STEPS steps
TUNED = "tuned"  # hook, INTML_CODEC=auto: the tuner chose Gloo's exact ring for the bucket this step
SMALL = "small"  # backend: fewer than INTML_MIN_ELEMENTS elements, kept exact
OP = "op"  # a reduce op other than SUM and AVG
DTYPE = "dtype"  # not float32, bfloat16 or float16
DEVICE = "device"  # neither on the CPU nor on a CUDA device
CUDA = "cuda"  # on a CUDA device, and intml's CUDA path (intml.worker.gpu) cannot run here
LAYOUT = "layout"  # not contiguous
COALESCED = "coalesced"  # several tensors in one call that differ in dtype or device
SHAPE = "shape"  # reduce-scatter: the input is not world size times the output, or of another dtype or device

# float32, and the 16-bit floats of mixed-precision training (bfloat16 has float32's exponent range; float16
# sums beyond its range come back +-Inf, as torch's own conversion gives)
DTYPES = frozenset({torch.float32, torch.bfloat16, torch.float16})

CHOSEN = frozenset({FALLBACK, WARMUP, SMALL, TUNED})  # configured by the user: no warning

WHY = {
    OP: "intml sums; only ReduceOp.SUM and AVG go through it",
    DTYPE: "intml encodes float32, bfloat16 and float16 only",
    DEVICE: "intml takes CPU and CUDA tensors only",
    CUDA: "it is on a CUDA device and intml's CUDA path cannot run here (install intml[cuda] where numba sees "
          "the GPU and its driver)",
    LAYOUT: "the tensor is not contiguous",
    COALESCED: "the coalesced tensors differ in dtype or device, so they cannot go as one concatenation",
    SHAPE: "a reduce-scatter's input must hold world size times its output's elements, of its dtype and device",
}


class IntmlUncompressedWarning(UserWarning):
    """An allreduce a user may have expected intml to compress went uncompressed through Gloo."""


def unsupported(tensor: torch.Tensor, cuda_problem: Callable[[], str | None]) -> str | None:
    """Why intml cannot allreduce `tensor` (a reason), or None when it can. `cuda_problem()`: why intml's CUDA path
    cannot run here, or None (asked for CUDA tensors only: it may import the path)."""
    if tensor.dtype not in DTYPES:
        return DTYPE
    if tensor.device.type == "cuda":
        if cuda_problem() is not None:
            return CUDA
    elif tensor.device.type != "cpu":
        return DEVICE
    if not tensor.is_contiguous():
        return LAYOUT
    return None


def backend_route(tensors: Sequence[torch.Tensor], op: str | None, min_elements: int,
                  cuda_problem: Callable[[], str | None]) -> str | None:
    """The reason the backend sends this allreduce to Gloo, or None to send it through intml (several tensors, a
    coalesced allreduce, as one allreduce of their concatenation). `op` is "sum", "mean", or None for any other
    reduce op."""
    if sum(t.numel() for t in tensors) < min_elements:
        return SMALL
    if op is None:
        return OP
    if len({(t.dtype, t.device) for t in tensors}) != 1:
        return COALESCED
    return next((reason for t in tensors if (reason := unsupported(t, cuda_problem)) is not None), None)


def scatter_route(output: torch.Tensor, input: torch.Tensor, op: str | None, min_elements: int,  # noqa: A002
                  world_size: int, cuda_problem: Callable[[], str | None]) -> str | None:
    """As backend_route, for a reduce-scatter of `input` into `output` (``reduce_scatter_tensor``): both tensors
    must be tensors intml can take, of one dtype and device, the input world_size times the output."""
    reason = backend_route([input], op, min_elements, cuda_problem) or unsupported(output, cuda_problem)
    if reason is None and ((output.dtype, output.device) != (input.dtype, input.device)
                           or input.numel() != world_size * output.numel()):
        return SHAPE
    return reason


class IntmlRoutingWarning(UserWarning):
    """What the intml swap did with a group's collectives: once a group sends one to Gloo for its size, and the
    totals of each path when the group is destroyed (once per group each)."""


def _collective(reduce_scatter: bool) -> str:
    return "a reduce-scatter" if reduce_scatter else "an allreduce"


def warning_text(reason: str, elements: int, reduce_scatter: bool = False) -> str:
    return (f"intml: {_collective(reduce_scatter)} of {elements} elements goes uncompressed through Gloo: "
            f"{WHY[reason]}. Further ones for this reason are counted in .traffic.gloo_reasons[{reason!r}] without a "
            f"warning")


def small_text(elements: int, min_elements: int, reduce_scatter: bool = False) -> str:
    """The one line at a group's first collective that goes to Gloo for its size."""
    return (f"intml: {_collective(reduce_scatter)} of {elements} elements goes exactly through Gloo, uncompressed: "
            f"intml takes collectives of at least INTML_MIN_ELEMENTS={min_elements} elements (set it lower to "
            f"compress smaller ones). This group's totals are given when it is destroyed, and .traffic counts them")


def totals_text(intml_collectives: int, intml_elements: int, gloo_collectives: int, gloo_elements: int,
                reasons: dict[str, int]) -> str:
    """The one line of a group's totals, when it is destroyed."""
    share = 100.0 * intml_elements / max(1, intml_elements + gloo_elements)
    why = ", ".join(f"{reason}: {count}" for reason, count in sorted(reasons.items()))
    return (f"intml: this group sent {share:.1f}% of its collectives' elements through intml ({intml_collectives} "
            f"collectives, {intml_elements} elements) and the rest through Gloo ({gloo_collectives} collectives, "
            f"{gloo_elements} elements; by reason: {why})")


# torch's files, the deprecation wrapper torch puts around some of its functions, and intml's worker package
_OWN_FILES = (os.path.dirname(torch.__file__) + os.sep, typing_extensions.__file__,
              os.path.dirname(os.path.dirname(__file__)) + os.sep)


def user_stacklevel() -> int:
    """The ``stacklevel`` that makes a warning issued by this function's caller point at the first frame outside
    torch and intml's worker: the user's line (``dist.all_reduce``, ``loss.backward()``,
    ``destroy_process_group()``), however many of torch's wrappers lie between."""
    frame, level = sys._getframe(1), 1  # stacklevel 1 is the caller of warnings.warn
    while frame is not None and frame.f_code.co_filename.startswith(_OWN_FILES):
        frame, level = frame.f_back, level + 1
    return level
