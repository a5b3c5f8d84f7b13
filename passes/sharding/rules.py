"""Sharding rules: one small function per ATen op family.

A rule sees a node at least one of whose inputs is sharded, and returns a Decision: the output placement, the
replicated inputs that must enter the sharded region (through f, or scattered to the local block), the node's new
shape arguments, and for GEMMs their role. A rule that cannot prove the sharding raises NoRule with the reason; the
analysis then leaves that whole region replicated. Never guess.

[Note: replicated means identical]
    A Replicate tensor has the same value on every rank. When one enters a sharded computation its gradient becomes
    a per-rank partial sum, so it goes through f (identity forward, all-reduce backward) if it can need a gradient, or
    is scattered (local block forward, all-gather backward) when the op needs only this rank's block of it.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Callable

import torch
from torch.fx import Node

from fxpar.passes.frontend.grouped_gemm import EXPERT_BMM, GROUPED_LINEAR
from fxpar.passes.ir.placements import Placement, Replicate, Shard, plain_shard
from fxpar.passes.sharding.view_rules import ReshapeError, reshape_shard

aten = torch.ops.aten
R = Replicate()


class NoRule(Exception):
    """The op cannot keep this sharding; the message says why."""


class Indivisible(NoRule):
    """The op could keep this sharding, but a size (heads, features) is not divisible by t."""


class Role(str, Enum):
    """What the tensor-parallel rewrite does at a decided node besides placing it (passes/tensor_parallel/rewrite.py
    REWRITES). A str: a role equals its name."""

    COLUMN = "column"  # a seed GEMM: its weight's output features sharded (nothing to insert after it)
    ROW = "row"  # a GEMM contracting a sharded dim: g after it, then its bias ([Note: row-parallel bias])
    REDUCE = "reduce"  # a sum or mean over the sharded dim: stat after it ([Note: partial statistics])
    VOCAB_EMBEDDING = "vocab_embedding"  # the lookup, replaced by the vocab-parallel embedding
    VOCAB_CROSS_ENTROPY = "vocab_cross_entropy"  # the loss over sharded logits, replaced by its vocab-parallel op
    VOCAB_LOGSUMEXP = "vocab_logsumexp"
    VOCAB_GATHER = "vocab_gather"
    VOCAB_HEAD = "vocab_head"  # the LM head: column-parallel over the vocabulary, then all-gathered
    VOCAB_HEAD_LOCAL = "vocab_head_local"  # the LM head whose sharded logits flow on into the loss ops

    __str__ = str.__str__
    __format__ = str.__format__


@dataclass
class Decision:
    out: Placement | tuple[Placement, ...]
    enter: dict[Node, Shard | None] = field(default_factory=dict)  # replicated input -> None (f) or Shard (scatter)
    args: tuple | None = None  # localized args, when shape constants change
    role: Role | None = None
    target: Callable | None = None  # a new op, when the local form needs one


class Ctx:
    """What rules may ask about the graph: global shapes, current placements, the tp degree."""

    def __init__(self, placements: dict, t: int, params: set):
        self.placements, self.t, self.params = placements, t, params

    def p(self, n) -> Placement:
        return self.placements.get(n, R) if isinstance(n, Node) else R

    @staticmethod
    def shape(n) -> tuple:
        v = n.meta.get("val") if isinstance(n, Node) else None
        return tuple(v.shape) if isinstance(v, torch.Tensor) else ()


def _norm(dim: int, ndim: int) -> int:
    return dim + ndim if dim < 0 else dim


def _need_divisible(s: Shard, t: int, node: Node):
    if not s.divisible(t):
        raise Indivisible(f"{node.name}: parts {s.parts} of dim {s.dim} are not divisible by t={t}")


def _tensor_args(node: Node):
    return [a for a in node.all_input_nodes if isinstance(a.meta.get("val"), torch.Tensor)]


_MISSING = object()


def arg(node: Node, name: str, default=None):
    """The argument `name` of an ATen call, positional or keyword, by the op's schema (default if not given).

    Rules read arguments by name, never by position: aten.var.dim's third argument is `unbiased`, not keepdim."""
    schema = getattr(node.target, "_schema", None)
    if name in node.kwargs:
        return node.kwargs[name]
    if schema is not None:
        for i, a in enumerate(schema.arguments):
            if a.name == name:
                if i < len(node.args) and not a.kwarg_only:
                    return node.args[i]
                return default
    return default


def _sharded_inputs(node: Node, ctx: "Ctx") -> list[Node]:
    return [a for a in _tensor_args(node) if isinstance(ctx.p(a), Shard)]


# --- elementwise: same shard on the broadcast output dim; replicated operands broadcast or get scattered
def elementwise(node: Node, ctx: Ctx) -> Decision:
    out_nd = len(ctx.shape(node))
    shards = {}
    for a in _tensor_args(node):
        pa = ctx.p(a)
        if isinstance(pa, Shard):
            shards[a] = pa.moved(pa.dim + out_nd - len(ctx.shape(a)))
        elif not isinstance(pa, Replicate):
            raise NoRule(f"{node.name}: input {a.name} is {pa}")
    first = next(iter(shards.values()))
    if any(s != first for s in shards.values()):
        raise NoRule(f"{node.name}: inputs sharded differently: {', '.join(map(str, shards.values()))}")
    enter = {}
    for a in _tensor_args(node):
        if a in shards:
            continue
        shape = ctx.shape(a)
        k = first.dim - (out_nd - len(shape))
        enter[a] = None if k < 0 or shape[k] == 1 else first.moved(k)
    return Decision(first, enter)


# --- type_as / to(other): the second tensor only gives a dtype (and device); no data of it enters
def like_input(node: Node, ctx: Ctx) -> Decision:
    x = node.args[0]
    if not isinstance(ctx.p(x), Shard):
        return Decision(R)  # only the dtype donor is sharded: the result is x, replicated
    return Decision(ctx.p(x))


# --- view / reshape / unflatten: see passes/sharding/view_rules.py; the shape argument is rewritten for the local shard
def view(node: Node, ctx: Ctx) -> Decision:
    src = node.args[0]
    try:
        out = reshape_shard(ctx.shape(src), ctx.shape(node), ctx.p(src), ctx.t)
    except ReshapeError as e:
        try:
            structural = reshape_shard(ctx.shape(src), ctx.shape(node), ctx.p(src), 1)
        except ReshapeError:
            raise NoRule(f"{node.name}: {e}") from None
        raise Indivisible(
            f"{node.name}: dim {structural.dim} of {tuple(ctx.shape(node))} has {structural.parts[0]} "
            f"(heads or features) to split over t={ctx.t}"
        ) from None
    _need_divisible(out, ctx.t, node)
    local = list(ctx.shape(node))
    local[out.dim] //= ctx.t
    if node.target is aten.flatten.using_ints:
        return Decision(out)  # flatten derives its shape from its input
    if node.target is aten.unflatten.int:
        d = _norm(node.args[1], len(ctx.shape(src)))
        sizes = local[d : d + len(node.args[2])]
        return Decision(out, args=(src, node.args[1], sizes))
    shape = list(node.args[1])
    if shape[out.dim] != -1:
        shape[out.dim] = local[out.dim]
    return Decision(out, args=(src, shape, *node.args[2:]))


# --- expand: the sharded dim is never the expanded one; its size becomes local
def expand(node: Node, ctx: Ctx) -> Decision:
    src, sizes = node.args[0], list(node.args[1])
    s = ctx.p(src)
    d = s.dim + len(sizes) - len(ctx.shape(src))
    if sizes[d] not in (-1, ctx.shape(src)[s.dim]):
        raise NoRule(f"{node.name}: expands the sharded dim {d}")
    if sizes[d] != -1:
        sizes[d] //= ctx.t
    return Decision(s.moved(d), args=(src, sizes, *node.args[2:]))


# --- transpose / permute / unsqueeze / squeeze: the shard follows its dim
def transpose(node: Node, ctx: Ctx) -> Decision:
    s, nd = ctx.p(node.args[0]), len(ctx.shape(node))
    a, b = _norm(node.args[1], nd), _norm(node.args[2], nd)
    return Decision(s.moved({a: b, b: a}.get(s.dim, s.dim)))


def permute(node: Node, ctx: Ctx) -> Decision:
    s, nd = ctx.p(node.args[0]), len(ctx.shape(node))
    order = [_norm(d, nd) for d in node.args[1]]
    return Decision(s.moved(order.index(s.dim)))


def unsqueeze(node: Node, ctx: Ctx) -> Decision:
    s = ctx.p(node.args[0])
    k = _norm(node.args[1], len(ctx.shape(node)))
    return Decision(s.moved(s.dim + (1 if k <= s.dim else 0)))


def squeeze(node: Node, ctx: Ctx) -> Decision:
    s, shape = ctx.p(node.args[0]), ctx.shape(node.args[0])
    dims = node.args[1] if len(node.args) > 1 else range(len(shape))
    dims = [dims] if isinstance(dims, int) else dims
    gone = {_norm(d, len(shape)) for d in dims if shape[_norm(d, len(shape))] == 1}
    return Decision(s.moved(s.dim - sum(1 for d in gone if d < s.dim)))


# --- view_as_complex / view_as_real (rotary embeddings as complex products): the trailing (real, imag) pair dim
# comes or goes; every other dim keeps its place and its shard
def complex_view(node: Node, ctx: Ctx) -> Decision:
    s, nd = ctx.p(node.args[0]), len(ctx.shape(node.args[0]))
    if node.target is aten.view_as_complex.default and s.dim == nd - 1:
        raise NoRule(f"{node.name}: view_as_complex over the sharded (real, imag) pair dim")
    return Decision(s)


# --- select / slice: fine on other dims; a slice on the sharded dim must take whole parts
def select(node: Node, ctx: Ctx) -> Decision:
    s = ctx.p(node.args[0])
    d = _norm(node.args[1], len(ctx.shape(node.args[0])))
    if d == s.dim:
        raise NoRule(f"{node.name}: selects an index of the sharded dim {d}")
    return Decision(s.moved(s.dim - (1 if d < s.dim else 0)))


def _part_bounds(s: Shard):
    """Global (start, end) of each part along the dim, for layouts without an inner factor."""
    bounds, offset = [], 0
    for _ in range(s.pre):
        for p in s.parts:
            bounds.append((offset, offset + p))
            offset += p
    return bounds


def slice_(node: Node, ctx: Ctx) -> Decision:
    x, s = node.args[0], ctx.p(node.args[0])
    dim, start, end, step = (list(node.args[1:]) + [0, None, None, 1][len(node.args) - 1 :])[:4]
    size = ctx.shape(x)[s.dim]
    dim = _norm(dim, len(ctx.shape(x)))
    if dim != s.dim:
        return Decision(s)
    start, end = start or 0, size if end is None else min(end, size)
    if step == 1 and (start, end) == (0, size):
        return Decision(s, args=(x, dim, 0, size // ctx.t))
    if step == 1 and s.post == 1 and (start, end) in _part_bounds(s):
        return Decision(plain_shard(dim, end - start), args=(x, dim, start // ctx.t, end // ctx.t))
    raise NoRule(f"{node.name}: slices [{start}:{end}:{step}] across the shards of dim {dim} ({s})")


# --- split / chunk / unbind: other dims pass through; on the sharded dim the pieces must be its parts
def split(node: Node, ctx: Ctx) -> Decision:
    x, s = node.args[0], ctx.p(node.args[0])
    nd, size = len(ctx.shape(x)), ctx.shape(x)
    pieces = [tuple(v.shape) for v in node.meta.get("val") or ()]
    if node.target is aten.unbind.int:
        d = _norm(node.args[1] if len(node.args) > 1 else 0, nd)
        if d == s.dim:
            raise NoRule(f"{node.name}: unbinds the sharded dim")
        return Decision(tuple(s.moved(s.dim - (1 if d < s.dim else 0)) for _ in pieces))
    d = _norm(node.args[2] if len(node.args) > 2 else 0, nd)
    sizes = [p[d] for p in pieces] if pieces else []
    if d != s.dim:
        return Decision(tuple(s for _ in sizes))
    bounds = _part_bounds(s) if s.post == 1 else []
    edges, offset = [], 0
    for n in sizes:
        edges.append((offset, offset + n))
        offset += n
    if edges != bounds:
        raise NoRule(f"{node.name}: splits dim {d} of size {size[d]} into {sizes}, across its shards ({s})")
    outs = tuple(plain_shard(d, n) for n in sizes)
    for o in outs:
        _need_divisible(o, ctx.t, node)
    local = [n // ctx.t for n in sizes]
    return Decision(outs, args=(x, local, d), target=aten.split_with_sizes.default)


def getitem(node: Node, ctx: Ctx) -> Decision:
    outs = ctx.p(node.args[0])
    if not isinstance(outs, tuple):
        raise NoRule(f"{node.name}: getitem of a non-sequence placement {outs}")
    return Decision(outs[node.args[1]])


# --- cat: along another dim, all inputs alike (replicated ones are scattered)
def cat(node: Node, ctx: Ctx) -> Decision:
    tensors = node.args[0]
    d = _norm(node.args[1] if len(node.args) > 1 else 0, len(ctx.shape(node)))
    shards = [ctx.p(a) for a in tensors if isinstance(ctx.p(a), Shard)]
    s = shards[0]
    if s.dim == d or any(o != s for o in shards):
        raise NoRule(f"{node.name}: concatenates along or across shards ({', '.join(map(str, shards))})")
    enter = {a: s for a in tensors if not isinstance(ctx.p(a), Shard)}
    return Decision(s, enter)


# --- stack: a new dim among the inputs' dims; all inputs alike (GPT-J's rotate_every_two)
def stack(node: Node, ctx: Ctx) -> Decision:
    tensors = node.args[0]
    k = _norm(node.args[1] if len(node.args) > 1 else 0, len(ctx.shape(node)))
    shards = [ctx.p(a) for a in tensors if isinstance(ctx.p(a), Shard)]
    s = shards[0]
    if any(o != s for o in shards):
        raise NoRule(f"{node.name}: stacks differently sharded inputs ({', '.join(map(str, shards))})")
    enter = {a: s for a in tensors if not isinstance(ctx.p(a), Shard)}
    return Decision(s.moved(s.dim + (1 if k <= s.dim else 0)), enter)


# --- softmax / log_softmax, and reductions over other dims
def softmax(node: Node, ctx: Ctx) -> Decision:
    s = ctx.p(node.args[0])
    if _norm(arg(node, "dim"), len(ctx.shape(node))) == s.dim:
        raise NoRule(f"{node.name}: softmax over the sharded dim")
    return Decision(s)


_PARTIAL_SUMS = {aten.sum.default, aten.sum.dim_IntList, aten.mean.default, aten.mean.dim}


def reduced(s: Shard, dims, keep: bool) -> Shard:
    """The shard of a reduction over `dims` (not the sharded dim): in place with keepdim, else moved left past the
    reduced dims before it."""
    return s if keep else s.moved(s.dim - sum(1 for d in dims if d < s.dim))


def reduction(node: Node, ctx: Ctx) -> Decision:
    """Over other dims the shard passes through. A sum or mean over the sharded dim is exact as this rank's partial
    sum, all-reduced ([Note: partial statistics] in passes/tensor_parallel/rewrite.py): role "reduce", the output
    Replicate."""
    s, nd = ctx.p(node.args[0]), len(ctx.shape(node.args[0]))
    dims = arg(node, "dim")
    dims = [dims] if isinstance(dims, int) else dims
    dims = {_norm(d, nd) for d in dims} if dims else set(range(nd))  # no dims (or []): every dim
    keep = bool(arg(node, "keepdim", False))
    if s.dim not in dims:
        return Decision(reduced(s, dims, keep))
    if node.target in _PARTIAL_SUMS:
        return Decision(R, role=Role.REDUCE)
    raise NoRule(f"{node.name}: {node.target.__name__} reduces over the sharded dim {s.dim}")


# --- max / min / argmax / argmin along a dim, topk, sort, cumsum: along another dim than the sharded one, each
# rank's slice is its own; values and indices (of the unsharded dim) alike
_KEEP_RANK = {aten.topk.default, aten.sort.default, aten.sort.stable, aten.cumsum.default}
_PAIRS = {aten.max.dim, aten.min.dim, aten.topk.default, aten.sort.default, aten.sort.stable}


def along_dim(node: Node, ctx: Ctx) -> Decision:
    s, nd = ctx.p(node.args[0]), len(ctx.shape(node.args[0]))
    dim = arg(node, "dim", -1 if node.target in _KEEP_RANK else None)
    if dim is None:
        raise NoRule(f"{node.name}: {node.target.__name__} over every element of a sharded tensor")
    d = _norm(dim, nd)
    if d == s.dim:
        raise NoRule(f"{node.name}: {node.target.__name__} along the sharded dim {d}")
    out = reduced(s, {d}, node.target in _KEEP_RANK or bool(arg(node, "keepdim", False)))
    return Decision((out, out) if node.target in _PAIRS else out)


def reshape_as(node: Node, ctx: Ctx) -> Decision:
    """x.reshape_as(other): as reshape(x, other.shape); exact locally when `other` is sharded as the result is."""
    x, other = node.args[0], node.args[1]
    try:
        out = reshape_shard(ctx.shape(x), ctx.shape(node), ctx.p(x), ctx.t)
    except ReshapeError as e:
        raise NoRule(f"{node.name}: {e}") from None
    if ctx.p(other) != out:
        raise NoRule(f"{node.name}: reshapes to {out} like {other.name}, which is {ctx.p(other)}")
    return Decision(out)


# --- layer_norm / rms_norm: normalized dims must be unsharded; the affine weights enter through f
def norm(node: Node, ctx: Ctx) -> Decision:
    x, s = node.args[0], ctx.p(node.args[0])
    if not isinstance(s, Shard):
        raise NoRule(f"{node.name}: the weights of a norm are sharded but its input is not")
    if s.dim >= len(ctx.shape(x)) - len(arg(node, "normalized_shape")):
        raise NoRule(f"{node.name}: normalizes over the sharded dim {s.dim}")
    return Decision(s, {a: None for a in _tensor_args(node) if a is not x})


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
    d = _norm(dim, len(ctx.shape(x)))
    if d != s.dim:
        return Decision(s)
    if not s.plain or arg(node, "output_size") is not None:
        raise NoRule(f"{node.name}: repeat_interleave of the sharded dim {d} laid out as {s}")
    _need_divisible(s, ctx.t, node)
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
    if s.dim != 1 or groups != channels or not s.plain:
        raise NoRule(f"{node.name}: conv1d over its sharded dim {s.dim} ({s}), or not depthwise (groups {groups} of "
                     f"{channels} channels): only a depthwise conv keeps channels apart")
    _need_divisible(s, ctx.t, node)
    block = plain_shard(0, out)
    enter = {a: block for a in (w, bias) if isinstance(a, Node)}
    stride, padding, dilation = arg(node, "stride", [1]), arg(node, "padding", [0]), arg(node, "dilation", [1])
    return Decision(plain_shard(1, out), enter, args=(x, w, bias, stride, padding, dilation, groups // ctx.t))


# --- matmul / bmm without a weight parameter (q @ k^T, probs @ v): batch dims pass through
def batched_matmul(node: Node, ctx: Ctx) -> Decision:
    a, b = node.args[:2]
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


# --- GEMMs with a weight parameter: row-parallel when the contraction dim is sharded
GEMM_WEIGHT_ARG = {aten.linear.default: (1, 0, 1), aten.addmm.default: (2, 1, 0), aten.mm.default: (1, 0, 0),
                   GROUPED_LINEAR: (1, 0, 2), EXPERT_BMM: (1, 0, 1)}
# op -> (weight arg index, input arg index, weight dim contracted with the input's last dim)
GEMM_WEIGHT_OUT = {aten.linear.default: 0, aten.addmm.default: 1, aten.mm.default: 1, GROUPED_LINEAR: 1,
                   EXPERT_BMM: 2}
# op -> the weight dim of the output features (a grouped GEMM's weight is [groups, out, in], a batched one's
# [groups, in, out])


DTYPE_ONLY = {aten.type_as.default: 1, aten.to.other: 1}  # op -> the argument read for its dtype and device only


def _dtype_only(user: Node, param: Node) -> bool:
    """`x.type_as(param)`: param gives a dtype, which its shard has too; no data of it is read."""
    i = DTYPE_ONLY.get(user.target)
    return i is not None and len(user.args) > i and user.args[i] is param and param not in user.args[:i]


def other_use(param: Node, gemm: Node) -> Node | None:
    """A user of `param` other than `gemm` ([Note: every use is proven] in analysis.py), or None. A use for its dtype
    alone does not count."""
    return next((u for u in param.users if u is not gemm and not _dtype_only(u, param)), None)


def gemm(node: Node, ctx: Ctx) -> Decision:
    w_idx, x_idx, w_in_dim = GEMM_WEIGHT_ARG[node.target]
    x, w = node.args[x_idx], node.args[w_idx]
    s, nx = ctx.p(x), len(ctx.shape(x))
    others = [a for a in _sharded_inputs(node, ctx) if a is not x]
    if others:
        raise NoRule(f"{node.name}: its weight or additive operand {others[0].name} is sharded "
                     f"({ctx.p(others[0])}); only a sharded input operand has a rule")
    if not isinstance(s, Shard):
        raise NoRule(f"{node.name}: input {getattr(x, 'name', x)} is {s}")
    if w in ctx.params and other_use(w, node) is None and s.dim == nx - 1:
        _need_divisible(s, ctx.t, node)
        return Decision(R, role=Role.ROW)  # g follows; the caller shards the weight on w_in_dim with s's layout
    if node.target is GROUPED_LINEAR and s.dim != nx - 1:
        raise NoRule(f"{node.name}: a grouped GEMM's rows belong to groups by its offsets; rows sharded as {s}")
    if node.target is EXPERT_BMM and s.dim == 0:
        raise NoRule(f"{node.name}: a batched expert GEMM with its experts sharded ({s}) needs expert parallelism")
    if s.dim == nx - 1:
        why = "is not a parameter" if w not in ctx.params else f"is also read by {other_use(w, node).name}"
        raise NoRule(f"{node.name}: contraction over a sharded dim with weight {getattr(w, 'name', w)}, which {why}")
    return Decision(s, {a: None for a in _tensor_args(node) if a is not x})
