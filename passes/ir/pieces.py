"""How data-parallel gradients are laid out: DPReduce, Megatron's pieces ([Note: pieces] in fxpar/runtime/zero.py),
the handles of a reduction in the program ([Note: dp buckets in the program] in passes/joint/dp_buckets.py) and the
buckets of a chunk's weights. Shared by the pass that puts the reduction in the program and the runtime that runs
it otherwise; no graph is read here.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class DPReduce:
    """How a bucket is reduced over dp."""

    size: int  # d
    group_name: str  # the dp group's (what a functional collective names)
    scatter: bool = False  # the distributed optimizer: reduce-scatter this rank's pieces (the sums, not the mean)
    main_dtype: torch.dtype | None = None  # the accumulated gradients' (fp32 main gradients); None: the weight's
    reduce_dtype: torch.dtype | None = None  # of the collective; None: the gradient's (fp32 with `scatter`)


def piece_size(n: int, d: int) -> int:
    return math.ceil(n / d) if n else 0


def pieces(flat: torch.Tensor, d: int) -> list[torch.Tensor]:
    """The d pieces of a flat tensor ([Note: pieces] in fxpar/runtime/zero.py), the last padded with zeros."""
    size = piece_size(flat.numel(), d)
    padded = torch.nn.functional.pad(flat, (0, size * d - flat.numel()))
    return list(padded.view(d, size).unbind(0)) if size else [flat.new_zeros(0)] * d


def rank_major(grads: list[torch.Tensor], d: int) -> torch.Tensor:
    """A bucket's gradients laid out to be reduce-scattered: piece 0 of each, then piece 1, ... ([Note: pieces])."""
    cut = [pieces(g.reshape(-1), d) for g in grads]
    return torch.cat([c[q] for q in range(d) for c in cut])


def handle_shape(reduce: DPReduce, shape: torch.Size) -> tuple[int, ...]:
    """The shape of a weight's handle: its gradient's, or (scatter) this rank's piece of it."""
    return (piece_size(math.prod(shape), reduce.size),) if reduce.scatter else tuple(shape)


def handle_dtype(reduce: DPReduce, dtype: torch.dtype) -> torch.dtype:
    """The dtype of a weight's handle: its gradient's (main gradient's), or (scatter) the collective's."""
    if reduce.scatter:
        return reduce.reduce_dtype or torch.promote_types(dtype, torch.float32)
    return reduce.main_dtype or dtype


def buckets(order: tuple[str, ...], keys, nbytes: dict[str, int], cap: float) -> list[list[str]]:
    """The weights `keys` of a chunk in buckets of about `cap` bytes, in `order` (the order their gradients become
    final: passes/joint/dp_buckets.py grad_order). A bucket closes at the weight that fills it, as the runtime's
    do; a weight not in `order` (nothing reads it, so it gets no gradient) is in no bucket."""
    wanted = set(keys)
    out, size = [[]], 0
    for key in order:
        if key not in wanted:
            continue
        out[-1].append(key)
        size += nbytes[key]
        if size >= cap:
            out.append([])
            size = 0
    return [b for b in out if b]
