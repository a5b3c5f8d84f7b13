"""`pm.check_replicas()`: replicas are checked, not hoped for.

[Note: replicated means identical] says a replicated weight has the same value on every rank that holds it: the
tp ranks of its stage (weights the analysis left whole), the dp ranks (every weight), and the pipeline stages that
share a tied weight. Nothing in the math re-synchronizes them, so a user's per-rank gradient clipping, a
non-deterministic kernel or a bug makes them drift silently. This check fingerprints every such weight (and
optionally its gradient) on each rank, compares the fingerprints across each group, and raises naming the first
weight that differs and by how much, as Megatron-Core's parameter-hash check across replicas does.

A fingerprint is two wrapping int64 sums over the tensor's bits (plain, and weighted by position): exact, computed
where the tensor lives, one all-gather of 2 numbers per weight per group.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


class ReplicaError(RuntimeError):
    """Replicas of a weight differ; the message names the weight, the group and the largest difference."""


def fingerprint(t: torch.Tensor) -> torch.Tensor:
    """(sum of bits, position-weighted sum of bits) of t as int64 (wrapping): equal iff equal, for practical ends."""
    bits = t.detach().contiguous().view(-1).view(_INT_OF_SIZE[t.element_size()]).to(torch.int64)
    weights = torch.arange(bits.numel(), device=bits.device, dtype=torch.int64) * 2654435761 + 1
    return torch.stack([bits.sum(), (bits * weights).sum()])


def _compare(named: list[tuple[str, torch.Tensor]], group, what: str) -> None:
    if not named or group is None or dist.get_world_size(group) == 1:
        return
    mine = torch.stack([fingerprint(t) for _, t in named])
    everyone = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(everyone, mine, group=group)
    stacked = torch.stack(everyone)
    differs = (stacked != stacked[:1]).any(dim=0).any(dim=-1)
    if not differs.any():
        return
    i = int(differs.nonzero()[0])
    key, t = named[i]
    first = t.detach().clone()
    dist.broadcast(first, src=dist.get_global_rank(group, 0), group=group)
    gap = (t.detach().double() - first.double()).abs().max().reshape(1)
    dist.all_reduce(gap, op=dist.ReduceOp.MAX, group=group)
    ranks = [dist.get_global_rank(group, r) for r in range(len(everyone)) if (stacked[r, i] != stacked[0, i]).any()]
    raise ReplicaError(
        f"fxpar: replicas of {what} {key} differ across its {_label(group)} group: global ranks {ranks} hold other "
        f"values than global rank {dist.get_global_rank(group, 0)} (max |difference| {gap.item():.3g}). Replicated "
        "weights must stay identical: clip gradients with pm.clip_grad_norm_ rather than per rank, and step the "
        "optimizer on every rank."
    )


def _label(group) -> str:
    return f"{dist.get_world_size(group)}-rank"


def check_replicas(pm, grads: bool = False) -> None:
    """Raise ReplicaError unless every replicated weight (and, with grads, its gradient) is bitwise identical on
    every rank that holds a replica of it. A collective over the tp and dp groups and the tied-weight groups."""
    held = pm.rank.weights.held()
    checks = [("weight", held)] + ([("gradient of", _grads(held, pm.rank.weights.grads))] if grads else [])
    for kind, tensors in checks:
        replicated = [(k, t) for k, t in tensors.items() if k not in pm.rank.specs]
        _compare(replicated, pm.rank.replica_groups.get("tp"), kind)
        experts = [(k, t) for k, t in tensors.items() if pm.rank.weights.expert(k)]  # the same on their edp ranks
        _compare([(k, t) for k, t in tensors.items() if not pm.rank.weights.expert(k)],
                 pm.rank.replica_groups.get("dp"), kind)
        _compare(experts, pm.rank.replica_groups.get("edp"), kind)
        for key, group in pm.rank.replica_groups.get("tied", {}).items():
            if key in tensors:
                _compare([(key, tensors[key])], group, kind)


def _grads(held: dict, grads) -> dict:
    """Every held parameter's gradient (zeros where there is none, so that every rank compares the same list);
    `grads` finds it (fxpar/runtime/precision.py Grads)."""
    return {k: grads.get(t) if grads.get(t) is not None else torch.zeros_like(t) for k, t in held.items()
            if t.requires_grad}
