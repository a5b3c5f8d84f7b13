"""Gradient clipping by the global norm of the whole (p, t, d) model, with torch.nn.utils.clip_grad_norm_'s
semantics: the norm of all gradients as if the model were one module, every gradient scaled by
max_norm / (norm + 1e-6) when that is below 1; returns the total norm.

[Note: count every gradient once]
    A rank's local gradients are not the model's: a tensor-parallel shard is a part of one (summed over the tp group), a
    replicated weight is the same on every tp rank ([Note: replicated means identical]: counted on tp rank 0 only, as
    are a weight's whole parts), a weight tied across pipeline stages has one owner of record (counted there only), and
    the data-parallel replicas hold equal gradients after step()'s all-reduce (counted once: no reduction over dp; with
    the distributed optimizer each dp rank holds its own pieces, and their sums are all-reduced over dp too). With
    expert parallelism each ep rank holds other experts (counted on every ep rank) and the same everything else
    (counted on ep rank 0; with the distributed optimizer every dp rank's pieces differ, and the dp sum counts
    each once). So each rank sums |g|^p over what it counts, the sum is all-reduced over tp, ep and pp,
    and every rank scales all the gradients it holds by the same coefficient, which keeps the replicas identical.
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist


def _counted_here(pm, key: str) -> bool:
    if key not in pm.rank.specs and pm.rank.comm.rank != 0:
        return False  # replicated over tp: tp rank 0 counts it
    w = pm.rank.weights
    if pm.rank.zero is None and w.ep is not None and w.ep.size > 1 and not w.expert(key) and w.ep.rank != 0:
        return False  # the same on every ep rank: ep rank 0 counts it (each rank counts its own experts)
    tied = pm.rank.replica_groups.get("tied", {}).get(key)
    return tied is None or dist.get_rank() == min(dist.get_process_group_ranks(tied))


def _without_whole_copies(pm, key: str, g: torch.Tensor, zero) -> torch.Tensor:
    """g, with the rows of a weight's whole parts zeroed off tp rank 0 ([Note: whole parts] in
    passes/ir/placements.py: every tp rank holds them, so rank 0 counts them); g is a distributed optimizer's piece
    of the flattened tensor when `zero` is one."""
    spec = pm.rank.specs.get(key)
    if spec is None or not spec.whole or pm.rank.comm.rank == 0:
        return g

    shape, local = tuple(pm.rank.weights.live[key].shape), spec.local_parts(pm.rank.comm.size)
    blocks = shape[:spec.dim] + (spec.pre, sum(local), spec.post) + shape[spec.dim + 1:]
    keep = torch.ones(blocks, dtype=g.dtype, device=g.device)
    start = 0
    for i, n in enumerate(local):
        if i in spec.whole:
            keep.narrow(spec.dim + 1, start, n).zero_()
        start += n
    keep = keep.reshape(shape)
    return g * (zero.piece(pm.rank.weights.live[key], keep) if zero is not None else keep)


@torch.no_grad()
def clip_grad_norm_(pm, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False) -> torch.Tensor:
    """Clip the gradients of a ParallelModule by their global norm; returns that norm (see the module docstring)."""
    norm_type = float(norm_type)
    if norm_type <= 0 or math.isnan(norm_type):
        raise ValueError(f"fxpar clip_grad_norm_: norm_type must be positive or inf, got {norm_type}")
    zero = pm.rank.zero  # the distributed optimizer: this rank's reduce-scattered pieces
    w = pm.rank.weights
    grads = zero.grads() if zero is not None else \
        {k: g for k, t in w.held().items() if t.requires_grad and (g := w.grads.get(t)) is not None}
    if not grads:
        raise RuntimeError("fxpar clip_grad_norm_: no gradients to clip on this rank. Fix: call it after pm.step() "
                           "(or a backward of pm(x)), before the optimizer's step")
    counted = [_without_whole_copies(pm, k, g.detach().to(torch.float64), zero) for k, g in grads.items()
               if _counted_here(pm, k)]
    nothing = torch.zeros((), dtype=torch.float64, device=next(iter(grads.values())).device)
    if norm_type == math.inf:
        local = max((g.abs().max() for g in counted if g.numel()), default=nothing)
        op = dist.ReduceOp.MAX
    else:
        local = sum((g.abs().pow(norm_type).sum() for g in counted), nothing)
        op = dist.ReduceOp.SUM
    total = local.reshape(1).clone()
    groups = [pm.rank.replica_groups.get("tp")] + ([pm.rank.groups.dp_group] if zero is not None else [])
    layout = pm.rank.groups
    if layout is not None and layout.ep > 1 and zero is None:  # with zero, the dp sum counts every piece once
        groups.append(layout.ep_group)
    if layout is not None and layout.pp > 1:
        groups.append(layout.pp_group)
    for group in groups:
        if group is not None and dist.get_world_size(group) > 1:
            dist.all_reduce(total, op=op, group=group)
    norm = total[0] if norm_type == math.inf else total[0].pow(1.0 / norm_type)
    if error_if_nonfinite and not torch.isfinite(norm):
        raise RuntimeError(f"fxpar clip_grad_norm_: the total norm of order {norm_type} of the gradients is "
                           f"{norm.item()}. Fix: find the non-finite gradient, or pass error_if_nonfinite=False")
    coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    for g in grads.values():
        g.mul_(coef.to(g.dtype))
    dtype = next(iter(grads.values())).dtype if grads else torch.float32
    return norm.to(dtype)
