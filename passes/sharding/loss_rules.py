"""Sharding rules of the losses over a vocabulary-sharded dim: cross-entropy, logsumexp, and the target's gather.

Each is exact as a vocab-parallel op (passes/tensor_parallel/vocab_kernels.py): this rank's block of the classes plus an
all-reduce of one or two values per token, never the logits (Shoeybi et al. 2019, Sec. 3). The dim must be sharded as
one plain block per rank (the LM head's vocabulary), so that rank r holds the classes [r*V/t, (r+1)*V/t).
"""
from __future__ import annotations

import torch
from torch.fx import Node

from fxpar.passes.ir.placements import Replicate
from fxpar.passes.sharding.rules import R, Ctx, Decision, NoRule, Role, arg, reduced

aten = torch.ops.aten


def _class_block(node: Node, ctx: Ctx, dim: int):
    """The Shard of node's input if it is one plain block per rank on `dim`, else NoRule."""
    s, nd = ctx.p(node.args[0]), len(ctx.shape(node.args[0]))
    if s.dim != dim % nd:
        return None
    if len(s.parts) != 1 or s.pre != 1 or s.post != 1:
        raise NoRule(f"{node.name}: the class dim is sharded as {s}, not one block of classes per rank")
    return s


def cross_entropy(node: Node, ctx: Ctx) -> Decision:
    """aten.cross_entropy_loss over logits sharded on the class dim (dim 1, or 0 for one sample)."""
    x, target = node.args[0], node.args[1]
    nd = len(ctx.shape(x))
    if _class_block(node, ctx, 1 if nd >= 2 else 0) is None:
        raise NoRule(f"{node.name}: cross-entropy over logits sharded on dim {ctx.p(x).dim}, not the classes")
    if arg(node, "weight") is not None:
        raise NoRule(f"{node.name}: cross-entropy with class weights")
    if target.meta["val"].is_floating_point():
        raise NoRule(f"{node.name}: cross-entropy against class probabilities (a float target)")
    return Decision(R, role=Role.VOCAB_CROSS_ENTROPY)


def logsumexp(node: Node, ctx: Ctx) -> Decision:
    """Over the sharded dim alone: the vocab-parallel logsumexp; over other dims the shard passes through."""
    s, nd = ctx.p(node.args[0]), len(ctx.shape(node.args[0]))
    dims = {d % nd for d in arg(node, "dim")}
    keep = bool(arg(node, "keepdim", False))
    if s.dim not in dims:
        return Decision(reduced(s, dims, keep))
    if dims != {s.dim}:
        raise NoRule(f"{node.name}: logsumexp over the sharded dim {s.dim} and others {sorted(dims - {s.dim})}")
    _class_block(node, ctx, s.dim)
    return Decision(R, role=Role.VOCAB_LOGSUMEXP)


def gather(node: Node, ctx: Ctx) -> Decision:
    """x.gather(dim, index) along the sharded dim with a replicated index (the target's logit): each rank picks the
    indices in its block, and the sum over the ranks is the gathered value."""
    x, index = node.args[0], arg(node, "index")
    if not isinstance(ctx.p(index), Replicate):
        raise NoRule(f"{node.name}: the gather's index is sharded")
    if _class_block(node, ctx, arg(node, "dim")) is None:
        raise NoRule(f"{node.name}: gathers along dim {arg(node, 'dim')}, not the sharded dim {ctx.p(x).dim}")
    if arg(node, "sparse_grad", False):
        raise NoRule(f"{node.name}: gather with sparse gradients")
    return Decision(R, role=Role.VOCAB_GATHER)


LOSS_RULES = {
    aten.cross_entropy_loss.default: cross_entropy,
    aten.logsumexp.default: logsumexp,
    aten.gather.default: gather,
}
