"""Placements: how one logical tensor lives across the t ranks of a tensor-parallel group.

Glossary
    Replicate()   every tp rank holds the whole tensor, with the same value ([Note: replicated means identical]).
    Partial()     every rank holds a summand; the true value is the sum over ranks (a row-parallel GEMM's output).
    Shard(dim, pre, parts, post)
                  the tensor is split along `dim`. The dim's global size is pre * sum(parts) * post: `pre` outer
                  blocks, each holding the `parts` side by side, each part `post` wide on the inside. Every part is
                  split into t contiguous blocks, and rank r holds block r of every part, in every outer block.
                  A plain split is Shard(dim) with pre=1, parts=(size,), post=1. `whole` names parts that are not
                  split: every rank holds them whole (a weight's rows a replicated GEMM reads: [Note: whole parts]).

[Note: head-interleaved QKV]
    A fused projection such as GPT-2's c_attn computes Q|K|V in one GEMM. Splitting its output columns plainly would
    give rank 0 all of Q and part of K. With parts=(E, E, E) each rank's contiguous shard holds heads
    [r*n/t, (r+1)*n/t) of Q, of K and of V: the weight rows are reordered (interleaved) when sharded, so the local
    GEMM output is [q_r | k_r | v_r] and the model's own split(E) becomes a local split(E/t). `local_shard` applies
    the layout, `unshard` undoes it for full_state_dict.

[Note: whole parts]
    A fused projection with one K/V head (multi-query attention, [q | k | v] of sizes [H hd, hd, hd]) cannot give
    each rank a block of K. Its GEMM is split into one GEMM per part on the weight's row blocks
    (passes/frontend/unfuse.py): Q's is column-parallel, K's and V's stay replicated, outside the region. The weight
    is still one parameter: Shard(0, parts=(H hd, hd, hd), whole={1, 2}) stores rank r's block of Q and all of K and
    V, [q_r | k | v]. Only weights take this layout, never activations; its whole rows are counted once where every
    rank's gradients are summed (clipping).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # placements are plain data; torch is only needed to move tensors (the schedule tools skip it)
    import torch


@dataclass(frozen=True)
class Replicate:
    def __str__(self) -> str:
        return "R"


@dataclass(frozen=True)
class Partial:
    def __str__(self) -> str:
        return "P"


@dataclass(frozen=True)
class Shard:
    dim: int
    parts: tuple[int, ...]
    pre: int = 1
    post: int = 1
    whole: frozenset = frozenset()  # indices of parts every rank holds whole ([Note: whole parts])

    def __post_init__(self):
        if self.dim < 0:
            raise ValueError(f"Shard.dim must be normalized (non-negative), got {self.dim}")
        if not self.parts or min(self.parts) <= 0 or self.pre <= 0 or self.post <= 0 \
                or not set(self.whole) <= set(range(len(self.parts))):
            raise ValueError(f"bad Shard layout {self!r}")
        if self.whole:
            return  # parts of two kinds: no canonical folding
        if len(set(self.parts)) == 1 and len(self.parts) > 1:  # canonical form: equal parts fold into pre
            object.__setattr__(self, "pre", self.pre * len(self.parts))
            object.__setattr__(self, "parts", self.parts[:1])
        if len(self.parts) == 1 and self.post > 1:  # one part: its inner factor rides along in each block
            object.__setattr__(self, "parts", (self.parts[0] * self.post,))
            object.__setattr__(self, "post", 1)

    @property
    def size(self) -> int:
        """Global size of the sharded dim."""
        return self.pre * sum(self.parts) * self.post

    @property
    def plain(self) -> bool:
        return self.pre == 1 and len(self.parts) == 1

    def divisible(self, t: int) -> bool:
        return all(p % t == 0 for i, p in enumerate(self.parts) if i not in self.whole)

    def local_parts(self, t: int) -> tuple[int, ...]:
        """Each part's size on one rank: a block of a split part, all of a whole one."""
        return tuple(p if i in self.whole else p // t for i, p in enumerate(self.parts))

    def local_size(self, t: int) -> int:
        """The sharded dim's size on one rank."""
        return self.pre * sum(self.local_parts(t)) * self.post

    def moved(self, dim: int) -> "Shard":
        return Shard(dim, self.parts, self.pre, self.post, self.whole)

    def same_layout(self, other: "Shard") -> bool:
        return (self.parts, self.pre, self.post, self.whole) == (other.parts, other.pre, other.post, other.whole)

    def __str__(self) -> str:
        if self.plain and not self.whole:
            return f"S({self.dim})"
        parts = "|".join(f"{p}*" if i in self.whole else str(p) for i, p in enumerate(self.parts))
        return f"S({self.dim}, {self.pre}x[{parts}]x{self.post})"


def plain_shard(dim: int, size: int) -> Shard:
    return Shard(dim, (size,))


Placement = Replicate | Partial | Shard


def local_shard(tensor: torch.Tensor, spec: Shard, rank: int, t: int) -> torch.Tensor:
    """Rank `rank`'s block of every part of `tensor` along spec.dim (see [Note: head-interleaved QKV])."""
    import torch

    d = spec.dim
    assert tensor.shape[d] == spec.size, (tuple(tensor.shape), spec)
    x = tensor.unflatten(d, (spec.pre, sum(spec.parts), spec.post))
    pieces, offset = [], 0
    for i, (p, n) in enumerate(zip(spec.parts, spec.local_parts(t))):
        pieces.append(x.narrow(d + 1, offset + (0 if i in spec.whole else rank * n), n))
        offset += p
    return torch.cat(pieces, dim=d + 1).flatten(d, d + 2).contiguous()


def unshard(locals_: list[torch.Tensor], spec: Shard) -> torch.Tensor:
    """Inverse of local_shard: the full tensor from every rank's local block, in rank order."""
    import torch

    d, t = spec.dim, len(locals_)
    local = spec.local_parts(t)
    split = [x.unflatten(d, (spec.pre, sum(local), spec.post)) for x in locals_]
    full_parts = []
    for i, n in enumerate(local):
        start = sum(local[:i])
        held = split[:1] if i in spec.whole else split  # a whole part: rank 0's copy (every rank's is the same)
        full_parts.append(torch.cat([x.narrow(d + 1, start, n) for x in held], dim=d + 1))
    return torch.cat(full_parts, dim=d + 1).flatten(d, d + 2)
