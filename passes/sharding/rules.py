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

from fxpar.passes.ir.op_families import ORDERINGS, REDUCTIONS, VALUES_AND_INDICES
from fxpar.passes.frontend.grouped_gemm import EXPERT_BMM, GROUPED_LINEAR, GROUPED_MM
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

    def __init__(self, placements: dict, t: int, params: set, refused: dict | None = None):
        self.placements, self.t, self.params = placements, t, params
        self.refused = refused or {}  # GEMM -> why its weight may not be sharded ([Note: shared weights])

    def p(self, n) -> Placement:
        return self.placements.get(n, R) if isinstance(n, Node) else R

    @staticmethod
    def shape(n) -> tuple:
        v = n.meta.get("val") if isinstance(n, Node) else None
        return tuple(v.shape) if isinstance(v, torch.Tensor) else ()


def norm_dim(dim: int, ndim: int) -> int:
    return dim + ndim if dim < 0 else dim


def need_divisible(s: Shard, t: int, node: Node):
    if not s.divisible(t):
        raise Indivisible(f"{node.name}: parts {s.parts} of dim {s.dim} are not divisible by t={t}")


def tensor_args(node: Node):
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
    return [a for a in tensor_args(node) if isinstance(ctx.p(a), Shard)]


# --- elementwise: same shard on the broadcast output dim; replicated operands broadcast or get scattered
def elementwise(node: Node, ctx: Ctx) -> Decision:
    out_nd = len(ctx.shape(node))
    shards = {}
    for a in tensor_args(node):
        pa = ctx.p(a)
        if isinstance(pa, Shard):
            shards[a] = pa.moved(pa.dim + out_nd - len(ctx.shape(a)))
        elif not isinstance(pa, Replicate):
            raise NoRule(f"{node.name}: input {a.name} is {pa}")
    first = next(iter(shards.values()))
    if any(s != first for s in shards.values()):
        raise NoRule(f"{node.name}: inputs sharded differently: {', '.join(map(str, shards.values()))}")
    enter = {}
    for a in tensor_args(node):
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
    need_divisible(out, ctx.t, node)
    local = list(ctx.shape(node))
    local[out.dim] //= ctx.t
    if node.target is aten.flatten.using_ints:
        return Decision(out)  # flatten derives its shape from its input
    if node.target is aten.unflatten.int:
        d = norm_dim(node.args[1], len(ctx.shape(src)))
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
    a, b = norm_dim(node.args[1], nd), norm_dim(node.args[2], nd)
    return Decision(s.moved({a: b, b: a}.get(s.dim, s.dim)))


def permute(node: Node, ctx: Ctx) -> Decision:
    s, nd = ctx.p(node.args[0]), len(ctx.shape(node))
    order = [norm_dim(d, nd) for d in node.args[1]]
    return Decision(s.moved(order.index(s.dim)))


def unsqueeze(node: Node, ctx: Ctx) -> Decision:
    s = ctx.p(node.args[0])
    k = norm_dim(node.args[1], len(ctx.shape(node)))
    return Decision(s.moved(s.dim + (1 if k <= s.dim else 0)))


def squeeze(node: Node, ctx: Ctx) -> Decision:
    s, shape = ctx.p(node.args[0]), ctx.shape(node.args[0])
    dims = node.args[1] if len(node.args) > 1 else range(len(shape))
    dims = [dims] if isinstance(dims, int) else dims
    gone = {norm_dim(d, len(shape)) for d in dims if shape[norm_dim(d, len(shape))] == 1}
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
    d = norm_dim(node.args[1], len(ctx.shape(node.args[0])))
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
    dim = norm_dim(dim, len(ctx.shape(x)))
    if dim != s.dim:
        return Decision(s)
    start, end = start or 0, size if end is None else min(end, size)
    if step == 1 and (start, end) == (0, size):
        return Decision(s, args=(x, dim, 0, size // ctx.t))
    if step == 1 and s.post == 1 and (start, end) in _part_bounds(s):
        return Decision(plain_shard(dim, end - start), args=(x, dim, start // ctx.t, end // ctx.t))
    if 0 <= start < step and end == size and s.post == 1 and all(p % (ctx.t * step) == 0 for p in s.parts):
        # every step-th element (GPT-OSS's interleaved gate|up: [::2], [1::2]): each shard's blocks start at a
        # multiple of step, so a shard's every step-th element from `start` is the result's matching block
        return Decision(Shard(dim, tuple(p // step for p in s.parts), s.pre), args=(x, dim, start, size // ctx.t, step))
    raise NoRule(f"{node.name}: slices [{start}:{end}:{step}] across the shards of dim {dim} ({s})")


# --- split / chunk / unbind: other dims pass through; on the sharded dim the pieces must be its parts
def split(node: Node, ctx: Ctx) -> Decision:
    x, s = node.args[0], ctx.p(node.args[0])
    nd, size = len(ctx.shape(x)), ctx.shape(x)
    pieces = [tuple(v.shape) for v in node.meta.get("val") or ()]
    if node.target is aten.unbind.int:
        d = norm_dim(node.args[1] if len(node.args) > 1 else 0, nd)
        if d == s.dim:
            raise NoRule(f"{node.name}: unbinds the sharded dim")
        return Decision(tuple(s.moved(s.dim - (1 if d < s.dim else 0)) for _ in pieces))
    d = norm_dim(node.args[2] if len(node.args) > 2 else 0, nd)
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
        need_divisible(o, ctx.t, node)
    local = [n // ctx.t for n in sizes]
    return Decision(outs, args=(x, local, d), target=aten.split_with_sizes.default)


def getitem(node: Node, ctx: Ctx) -> Decision:
    outs = ctx.p(node.args[0])
    if not isinstance(outs, tuple):
        raise NoRule(f"{node.name}: getitem of a non-sequence placement {outs}")
    return Decision(outs[node.args[1]])


# --- cat: along another dim, all inputs alike (replicated ones are scattered); along the sharded dim, every input
# sharded there, each becoming parts of a fused layout (q|k|v projected apart, joined for one conv: each rank's
# local cat is [q_r | k_r | v_r], the parts layout of [Note: head-interleaved QKV])
def cat(node: Node, ctx: Ctx) -> Decision:
    tensors = node.args[0]
    d = norm_dim(node.args[1] if len(node.args) > 1 else 0, len(ctx.shape(node)))
    shards = [ctx.p(a) for a in tensors if isinstance(ctx.p(a), Shard)]
    s = shards[0]
    if s.dim == d and len(shards) == len(tensors) and all(o.dim == d and o.post == 1 for o in shards):
        return Decision(Shard(d, tuple(p for o in shards for p in o.parts * o.pre)))
    if s.dim == d or any(o != s for o in shards):
        raise NoRule(f"{node.name}: concatenates along or across shards ({', '.join(map(str, shards))})")
    enter = {a: s for a in tensors if not isinstance(ctx.p(a), Shard)}
    return Decision(s, enter)


# --- pad: dims other than the sharded one padded (a chunked scan padding its sequence to whole chunks)
def pad(node: Node, ctx: Ctx) -> Decision:
    s, nd = ctx.p(node.args[0]), len(ctx.shape(node))
    widths = list(node.args[1])
    padded = {nd - 1 - i // 2 for i, w in enumerate(widths) if w}  # pairs from the last dim backward
    if s.dim in padded:
        raise NoRule(f"{node.name}: pads the sharded dim {s.dim} ({widths})")
    return Decision(s)


# --- zeros_like / ones_like / empty_like / full_like: a constant shaped as the sharded input, sharded as it is
def constant_like(node: Node, ctx: Ctx) -> Decision:
    return Decision(ctx.p(node.args[0]))


# --- tril / triu: the last two dims masked; another dim sharded passes through
def triangular(node: Node, ctx: Ctx) -> Decision:
    s, nd = ctx.p(node.args[0]), len(ctx.shape(node))
    if s.dim >= nd - 2:
        raise NoRule(f"{node.name}: masks the sharded dim {s.dim} ({s})")
    return Decision(s)


# --- copy_(dst, src): a write into a sharded dst (a chunked scan filling its slices); src sharded alike, or
# replicated and scattered. A write into a replicated dst of a sharded src would make dst half sharded: refused.
def copy_into(node: Node, ctx: Ctx) -> Decision:
    dst = node.args[0]
    if not isinstance(ctx.p(dst), Shard):
        raise NoRule(f"{node.name}: writes a sharded value into the replicated {dst.name}")
    d = elementwise(node, ctx)
    if d.out != ctx.p(dst):
        raise NoRule(f"{node.name}: writes into {dst.name} ({ctx.p(dst)}) a value sharded as {d.out}")
    return d


# --- stack: a new dim among the inputs' dims; all inputs alike (GPT-J's rotate_every_two)
def stack(node: Node, ctx: Ctx) -> Decision:
    tensors = node.args[0]
    k = norm_dim(node.args[1] if len(node.args) > 1 else 0, len(ctx.shape(node)))
    shards = [ctx.p(a) for a in tensors if isinstance(ctx.p(a), Shard)]
    s = shards[0]
    if any(o != s for o in shards):
        raise NoRule(f"{node.name}: stacks differently sharded inputs ({', '.join(map(str, shards))})")
    enter = {a: s for a in tensors if not isinstance(ctx.p(a), Shard)}
    return Decision(s.moved(s.dim + (1 if k <= s.dim else 0)), enter)


# --- softmax / log_softmax, and reductions over other dims
def softmax(node: Node, ctx: Ctx) -> Decision:
    s = ctx.p(node.args[0])
    if norm_dim(arg(node, "dim"), len(ctx.shape(node))) == s.dim:
        raise NoRule(f"{node.name}: softmax over the sharded dim")
    return Decision(s)




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
    dims = {norm_dim(d, nd) for d in dims} if dims else set(range(nd))  # no dims (or []): every dim
    keep = bool(arg(node, "keepdim", False))
    if s.dim not in dims:
        return Decision(reduced(s, dims, keep))
    if node.target in REDUCTIONS:
        return Decision(R, role=Role.REDUCE)
    raise NoRule(f"{node.name}: {node.target.__name__} reduces over the sharded dim {s.dim}")


# --- max / min / argmax / argmin along a dim, topk, sort, cumsum: along another dim than the sharded one, each
# rank's slice is its own; values and indices (of the unsharded dim) alike


def along_dim(node: Node, ctx: Ctx) -> Decision:
    s, nd = ctx.p(node.args[0]), len(ctx.shape(node.args[0]))
    dim = arg(node, "dim", -1 if node.target in ORDERINGS else None)
    if dim is None:
        raise NoRule(f"{node.name}: {node.target.__name__} over every element of a sharded tensor")
    d = norm_dim(dim, nd)
    if d == s.dim:
        raise NoRule(f"{node.name}: {node.target.__name__} along the sharded dim {d}")
    out = reduced(s, {d}, node.target in ORDERINGS or bool(arg(node, "keepdim", False)))
    return Decision((out, out) if node.target in VALUES_AND_INDICES else out)


def tokenwise(node: Node, ctx: Ctx) -> Decision:
    """A declared token-wise op (fxpar.register_rule(op, "tokenwise")): each output row from the same row of its first
    input over the last dim (a fused norm, a per-head op): sharded as that input on any dim but the last; its other
    tensor inputs (weights over the last dim) read whole."""
    x = tensor_args(node)[0]
    s = ctx.p(x)
    if not isinstance(s, Shard):
        raise NoRule(f"{node.name}: {node.target} reads a sharded tensor beside its replicated first input {x.name}")
    if s.dim == len(ctx.shape(x)) - 1:
        raise NoRule(f"{node.name}: {node.target} is token-wise over the last dim, which is sharded")
    return Decision(s, {a: None for a in tensor_args(node) if a is not x})


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
    return Decision(s, {a: None for a in tensor_args(node) if a is not x})


# --- GEMMs with a weight parameter: row-parallel when the contraction dim is sharded
GEMM_WEIGHT_ARG = {aten.linear.default: (1, 0, 1), aten.addmm.default: (2, 1, 0), aten.mm.default: (1, 0, 0),
                   GROUPED_LINEAR: (1, 0, 2), GROUPED_MM: (1, 0, 1), EXPERT_BMM: (1, 0, 1)}
# op -> (weight arg index, input arg index, weight dim contracted with the input's last dim)
GEMM_WEIGHT_OUT = {aten.linear.default: 0, aten.addmm.default: 1, aten.mm.default: 1, GROUPED_LINEAR: 1,
                   GROUPED_MM: 2, EXPERT_BMM: 2}
# op -> the weight dim of the output features (grouped_linear's weight is [groups, out, in], grouped_mm's and a
# batched one's [groups, in, out])


DTYPE_ONLY = {aten.type_as.default: 1, aten.to.other: 1}  # op -> the argument read for its dtype and device only


def _dtype_only(user: Node, param: Node) -> bool:
    """`x.type_as(param)`: param gives a dtype, which its shard has too; no data of it is read."""
    i = DTYPE_ONLY.get(user.target)
    return i is not None and len(user.args) > i and user.args[i] is param and param not in user.args[:i]


def other_use(param: Node, gemm: Node) -> Node | None:
    """A user of `param` other than `gemm` ([Note: every use is proven] in analysis.py), or None. A use for its dtype
    alone does not count."""
    return next((u for u in param.users if u is not gemm and not _dtype_only(u, param)), None)


def gemm_uses(param: Node) -> list[Node] | None:
    """The GEMMs that read `param` as their weight, if that is its every use (a use for its dtype aside), else None.
    A block applied twice (a looped layer) reads its weights in two GEMMs ([Note: shared weights] in analysis.py)."""
    uses = []
    for u in param.users:
        if _dtype_only(u, param):
            continue
        w_idx = GEMM_WEIGHT_ARG.get(u.target, (None,))[0]
        if w_idx is None or len(u.args) <= w_idx or u.args[w_idx] is not param \
                or param in u.args[:w_idx] + u.args[w_idx + 1:]:
            return None
        uses.append(u)
    return uses


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
    if w in ctx.params and gemm_uses(w) is not None and s.dim == nx - 1:
        if node in ctx.refused:
            raise NoRule(ctx.refused[node])
        need_divisible(s, ctx.t, node)
        return Decision(R, role=Role.ROW)  # g follows; the caller shards the weight on w_in_dim with s's layout
    if node.target in (GROUPED_LINEAR, GROUPED_MM) and s.dim != nx - 1:
        raise NoRule(f"{node.name}: a grouped GEMM's rows belong to groups by its offsets; rows sharded as {s}")
    if node.target is EXPERT_BMM and s.dim == 0:
        raise NoRule(f"{node.name}: a batched expert GEMM with its experts sharded ({s}) needs expert parallelism")
    if s.dim == nx - 1:
        why = "is not a parameter" if w not in ctx.params else f"is also read by {other_use(w, node).name}"
        raise NoRule(f"{node.name}: contraction over a sharded dim with weight {getattr(w, 'name', w)}, which {why}")
    return Decision(s, {a: None for a in tensor_args(node) if a is not x})
