"""Sharding rules of the token mixers: attention (SDPA, grouped K/V heads expanded by repeat_interleave), einsum
and batched matmuls between activations, baddbmm, and depthwise convolutions. The same contract as rules.py: a
Decision for the placements given, or NoRule with the reason.
"""
from __future__ import annotations

import torch
from torch.fx import Node

from fxpar.passes.ir.placements import Replicate, Shard, plain_shard
from fxpar.passes.sharding.rules import Ctx, Decision, NoRule, arg, need_divisible, norm_dim

aten = torch.ops.aten


# --- scaled_dot_product_attention: q, k, v sharded alike on a batch dim (the heads), masks scattered or broadcast
def sdpa(node: Node, ctx: Ctx) -> Decision:
    q, k, v = node.args[:3]
    shards = [ctx.p(a) for a in (q, k, v) if isinstance(ctx.p(a), Shard)]
    if not shards:
        raise NoRule(f"{node.name}: only the attention mask is sharded")
    s = ctx.p(q) if isinstance(ctx.p(q), Shard) else shards[0]
    nd = len(ctx.shape(q))
    if arg(node, "enable_gqa", False) and _grouped_alike(ctx, q, (k, v), s):
        enter = {}  # each rank's K/V groups are those of its query heads, as for repeat_interleave
    elif s.dim >= nd - 2 or any(o != s for o in shards):
        raise NoRule(f"{node.name}: q/k/v must be sharded alike on a batch or heads dim, got {shards}")
    elif any(ctx.shape(a)[s.dim] != ctx.shape(q)[s.dim] for a in (k, v)):
        raise NoRule(f"{node.name}: grouped k/v heads {ctx.shape(k)[s.dim]} vs query heads {ctx.shape(q)[s.dim]}")
    else:
        enter = {a: s for a in (q, k, v) if not isinstance(ctx.p(a), Shard)}
    mask = arg(node, "attn_mask")
    if isinstance(mask, Node):
        shape = ctx.shape(mask)
        kdim = s.dim - (nd - len(shape))
        want = None if kdim < 0 or shape[kdim] == 1 else s.moved(kdim)
        have = ctx.p(mask)
        if isinstance(have, Shard):
            if have != want:
                raise NoRule(f"{node.name}: the mask is sharded as {have}, the heads as {s}")
        elif not isinstance(have, Replicate):
            raise NoRule(f"{node.name}: the mask is {have}")
        else:
            enter[mask] = want
    return Decision(s, enter)


# --- repeat_interleave(x, r, dim): grouped K/V heads expanded to the query heads. On the sharded heads dim each
# rank's groups expand to exactly its query heads (rank r: groups [rG/t, (r+1)G/t) -> heads [rH/t, (r+1)H/t))
def repeat_interleave(node: Node, ctx: Ctx) -> Decision:
    x, s = node.args[0], ctx.p(node.args[0])
    dim, reps = arg(node, "dim"), arg(node, "repeats")
    if node.target is not aten.repeat_interleave.self_int or dim is None:
        raise NoRule(f"{node.name}: repeat_interleave with a tensor of repeats or without a dim")
    d = norm_dim(dim, len(ctx.shape(x)))
    if d != s.dim:
        return Decision(s)
    if not s.plain or arg(node, "output_size") is not None:
        raise NoRule(f"{node.name}: repeat_interleave of the sharded dim {d} laid out as {s}")
    need_divisible(s, ctx.t, node)
    return Decision(plain_shard(d, s.size * reps))


# --- einsum between activations (a weight's einsum is a GEMM form already): the sharded letter must be one that
# every sharded operand shards alike and the output keeps (a batch or free letter); contracting it would need a sum
def einsum(node: Node, ctx: Ctx) -> Decision:
    equation, operands = node.args[0].replace(" ", ""), list(node.args[1])
    if "->" not in equation or "." in equation:
        raise NoRule(f"{node.name}: einsum {equation!r} without an explicit output, or with an ellipsis")
    inputs, output = equation.split("->")
    inputs = inputs.split(",")
    letters = {}
    for sub, op in zip(inputs, operands):
        p = ctx.p(op)
        if isinstance(p, Shard):
            letters[sub[p.dim]] = letters.get(sub[p.dim], []) + [p]
        elif not isinstance(p, Replicate):
            raise NoRule(f"{node.name}: operand {op.name} is {p}")
    shards = next(iter(letters.values()))
    letter, s = next(iter(letters)), shards[0]
    if len(letters) > 1 or any(not o.same_layout(s) for o in shards):
        raise NoRule(f"{node.name}: einsum {equation!r} with operands sharded on different letters or layouts")
    if letter not in output:
        raise NoRule(f"{node.name}: einsum {equation!r} contracts the sharded letter {letter!r}")
    if any(sub.count(letter) > 1 for sub in inputs) or output.count(letter) > 1:
        raise NoRule(f"{node.name}: einsum {equation!r} repeats the sharded letter {letter!r}")
    enter = {}
    for sub, op in zip(inputs, operands):
        if not isinstance(ctx.p(op), Shard):
            k = sub.find(letter)
            enter[op] = None if k < 0 or ctx.shape(op)[k] == 1 else s.moved(k)
    return Decision(s.moved(output.index(letter)), enter)


def _grouped_alike(ctx: Ctx, q: Node, kv: tuple, s: Shard) -> bool:
    """SDPA(enable_gqa=True) with q's heads and K/V's groups plainly sharded on the heads dim, t dividing both."""
    groups = [ctx.p(a) for a in kv]
    return (isinstance(ctx.p(q), Shard) and s.plain and s.dim == len(ctx.shape(q)) - 3 and s.divisible(ctx.t)
            and all(isinstance(g, Shard) and g.plain and g.dim == s.dim and g.divisible(ctx.t)
                    and s.size % g.size == 0 for g in groups))


# --- conv1d: a depthwise conv (groups = channels: a hybrid layer's causal token mixer) is channel-wise, so it keeps
# the channels sharded, each rank convolving its channels with its rows of the weight; over the batch it is per
# sample. Over the length (the tokens it mixes) it refuses.
def conv1d(node: Node, ctx: Ctx) -> Decision:
    x, w = node.args[0], node.args[1]
    bias = arg(node, "bias")
    s, shape = ctx.p(x), ctx.shape(x)
    others = [a for a in (w, bias) if isinstance(ctx.p(a), Shard)]
    if others or len(shape) != 3 or not isinstance(s, Shard):
        raise NoRule(f"{node.name}: conv1d with its weight or bias sharded, or an unbatched input")
    if s.dim == 0:
        return Decision(s, {a: None for a in (w, bias) if isinstance(a, Node)})
    groups, channels, out = arg(node, "groups", 1), shape[1], ctx.shape(w)[0]
    if s.dim != 1 or groups != channels or not (s.plain or out == channels):
        raise NoRule(f"{node.name}: conv1d over its sharded dim {s.dim} ({s}), or not depthwise (groups {groups} of "
                     f"{channels} channels): only a depthwise conv keeps channels apart")
    need_divisible(s, ctx.t, node)
    block = plain_shard(0, out) if s.plain else s.moved(0)  # a fused layout (q|k|v channels) stays as it is
    enter = {a: block for a in (w, bias) if isinstance(a, Node)}
    stride, padding, dilation = arg(node, "stride", [1]), arg(node, "padding", [0]), arg(node, "dilation", [1])
    return Decision(block.moved(1), enter, args=(x, w, bias, stride, padding, dilation, groups // ctx.t))


# --- matmul / bmm without a weight parameter (q @ k^T, probs @ v): batch dims pass through
def batched_matmul(node: Node, ctx: Ctx) -> Decision:
    return _batched(node, *node.args[:2], ctx)


# --- baddbmm(input, a, b): a batched matmul as above; the additive input sharded as its result, or scattered
def baddbmm(node: Node, ctx: Ctx) -> Decision:
    add, a, b = node.args[:3]
    d, pc = _batched(node, a, b, ctx), ctx.p(add)
    k = d.out.dim - (len(ctx.shape(node)) - len(ctx.shape(add)))
    if isinstance(pc, Shard):
        if pc != d.out.moved(k):
            raise NoRule(f"{node.name}: its additive input is sharded as {pc}, its product as {d.out}")
        return d
    return Decision(d.out, d.enter | {add: d.out.moved(k) if k >= 0 and ctx.shape(add)[k] != 1 else None})


def _batched(node: Node, a: Node, b: Node, ctx: Ctx) -> Decision:
    pa, pb = ctx.p(a), ctx.p(b)
    na, nb, no = len(ctx.shape(a)), len(ctx.shape(b)), len(ctx.shape(node))
    if na < 2 or nb < 2:
        raise NoRule(f"{node.name}: vector matmul of a sharded tensor")
    outs, enter = [], {}
    for x, px, nx, m_or_n in ((a, pa, na, na - 2), (b, pb, nb, nb - 1)):
        if isinstance(px, Shard):
            if px.dim == (nx - 1 if x is a else nx - 2):
                raise NoRule(f"{node.name}: contraction over a sharded dim")
            outs.append(px.moved(px.dim + no - nx) if px.dim < nx - 2 else px.moved(no - 2 if x is a else no - 1))
    if len(outs) == 2 and (outs[0] != outs[1] or outs[0].dim >= no - 2):
        raise NoRule(f"{node.name}: operands sharded on different dims ({pa}, {pb})")
    s = outs[0]
    for x, px, nx in ((a, pa, na), (b, pb, nb)):
        if not isinstance(px, Shard):
            k = s.dim - (no - nx)
            enter[x] = s.moved(k) if s.dim < no - 2 and k >= 0 and ctx.shape(x)[k] != 1 else None
    return Decision(s, enter)
