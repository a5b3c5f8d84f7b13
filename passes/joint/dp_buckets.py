"""The data-parallel gradient reduction as nodes of the backward program: `dp_buckets` ([Note: dp buckets in the
program]).

Each weight's gradient is final when the last microbatch's backward of its chunk has computed it. The chunk graph
that last microbatch runs is a variant of the chunk's (`with_dp_buckets`): its weights pass through one
`dp_bucket_<i>` module per bucket, whose backward reduces the bucket over dp with a c10d functional collective
(an all-reduce; with the distributed optimizer, a reduce-scatter into this rank's pieces, [Note: pieces]). In the
joint program those collectives are nodes like tensor parallelism's, so the overlap passes (overlap.py) issue each
bucket as soon as its last gradient exists and wait for it at the end of the backward program, and the plan counts
them (comm_table.py).

[Note: dp buckets in the program]
    A bucket's backward must reduce the whole step's gradient, not this microbatch's. The sum over the earlier
    microbatches (the weight's .grad, or its fp32 main gradient under mixed precision) enters the variant as an
    input, and the bucket adds this microbatch's gradient to it as eager accumulation does.
    - Over several microbatches the runtime gives every such weight a gradient before the step's first backward,
      so the tensor it passes is the one autograd accumulates into, in place, whatever the schedule runs in between
      (1F1B runs a chunk's last forward before its earlier backwards).
    - With one microbatch only a gradient held from before the step is passed; the variant is traced for which
      weights have one.
    The reduced gradient leaves through autograd as the gradient of a *handle*: an input per weight that requires a
    gradient and whose value nothing reads. The bucket gives the weights themselves no gradient, so autograd leaves
    their accumulated .grad (and the mixed-precision hooks) alone, and the runtime moves each handle's gradient in
    after the step (fxpar/runtime/buckets.py). The ops are those of the runtime's buckets, in the same order and
    dtypes: the same values bit for bit. A weight whose gradient no output reaches gets none from the program (its
    handle's gradient stays None), and the runtime leaves it as eager would. Which weights share a bucket is the
    same on every dp rank (the same chunk, the same sizes), so the collectives match.
"""
from __future__ import annotations

import math
import operator
from dataclasses import dataclass

import torch
import torch.nn as nn
from torch.fx import GraphModule, Node

from fxpar.passes.ir.meta import input_of

DP_BUCKET = "dp_bucket_"  # the name of each bucket's module and call node: dp_bucket_0, ...
FXPAR_DP = "fxpar_dp"  # meta of a variant's added placeholders: "accumulated" or "handle"
_c10d = torch.ops._c10d_functional


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


class _Bucket(torch.autograd.Function):
    """Identity on the weights forward; backward reduces the bucket and returns it as the handles' gradients."""

    @staticmethod
    def forward(ctx, reduce: DPReduce, has_acc: tuple[bool, ...], *tensors):
        n = len(has_acc)
        accumulated = iter(tensors[n:n + sum(has_acc)])
        ctx.reduce, ctx.n_inputs = reduce, len(tensors)
        ctx.accumulated = [next(accumulated) if a else None for a in has_acc]
        ctx.set_materialize_grads(False)
        return tuple(w.view_as(w) for w in tensors[:n])

    @staticmethod
    def backward(ctx, *grads):
        r, totals = ctx.reduce, []
        for g, acc in zip(grads, ctx.accumulated):
            if g is not None and r.main_dtype is not None:
                g = g.to(r.main_dtype)
            # eager accumulation's order; no gradient: none, whatever the weight held (fxpar/runtime/buckets.py)
            totals.append(None if g is None else g if acc is None else acc + g)
        have = [i for i, t in enumerate(totals) if t is not None]
        out = [None] * len(grads)
        for i, reduced in zip(have, _reduce(r, [totals[i] for i in have]) if have else ()):
            out[i] = reduced
        return (None, None, *[None] * (ctx.n_inputs - len(grads)), *out)


def _reduce(r: DPReduce, totals: list[torch.Tensor]) -> list[torch.Tensor]:
    """The bucket's collective and what each weight's handle receives (fxpar/runtime/buckets.py runs the same)."""
    if r.scatter:
        flat = rank_major(totals, r.size)  # fp32 at least; float64 stays float64
        flat = flat.to(r.reduce_dtype or torch.promote_types(flat.dtype, torch.float32))
        mine = _c10d.wait_tensor(_c10d.reduce_scatter_tensor(flat, "sum", r.size, r.group_name))
        sizes = [piece_size(t.numel(), r.size) for t in totals]
        return list(mine.split(sizes))
    flat = torch.cat([t.reshape(-1) for t in totals])
    flat = flat.to(r.reduce_dtype or flat.dtype)
    mean = _c10d.wait_tensor(_c10d.all_reduce(flat, "sum", r.group_name)) / r.size
    return [part.view(t.shape).to(t.dtype) for part, t in zip(mean.split([t.numel() for t in totals]), totals)]


class DPBucket(nn.Module):
    """One bucket of a chunk's weights (call_module `dp_bucket_<i>` of a variant): see the module docstring."""

    def __init__(self, reduce: DPReduce, has_acc: tuple[bool, ...]):
        super().__init__()
        self.reduce, self.has_acc = reduce, has_acc

    def forward(self, *tensors):
        """tensors: the bucket's weights, the accumulated gradients of those has_acc marks, the weights' handles."""
        return _Bucket.apply(self.reduce, self.has_acc, *tensors)


def buckets_of(gm: GraphModule, keys: list[str], nbytes: dict[str, int], cap: float) -> list[list[str]]:
    """The weights `keys` (placeholders' keys) of a chunk graph in buckets of about `cap` bytes, in the order their
    gradients become final: the reverse of their first use forward. A bucket closes at the weight that fills it,
    as the runtime's do."""
    first = {}
    for i, n in enumerate(gm.graph.nodes):
        for a in n.all_input_nodes:
            if a.op == "placeholder":
                first.setdefault(a, i)
    wanted = set(keys)
    order = sorted((p for p in gm.graph.find_nodes(op="placeholder") if p in first and input_of(p).key in wanted),
                   key=lambda p: -first[p])  # a weight nothing reads gets no gradient: in no bucket
    out, size = [[]], 0
    for p in order:
        out[-1].append(input_of(p).key)
        size += nbytes[input_of(p).key]
        if size >= cap:
            out.append([])
            size = 0
    return [b for b in out if b]


def with_dp_buckets(gm: GraphModule, buckets: list[list[str]], reduce: DPReduce,
                    has_acc: dict[str, bool] | None = None) -> GraphModule:
    """A copy of chunk graph `gm` whose weights pass through one dp_bucket module per bucket (keys of its weight
    placeholders). After its placeholders come, bucket by bucket, the accumulated gradients of the weights has_acc
    marks (None: all), then the weights' handles: [Note: dp buckets in the program]."""
    has_acc = has_acc if has_acc is not None else {k: True for b in buckets for k in b}
    graph = torch.fx.Graph()
    graph.output(graph.graph_copy(gm.graph, {}))
    new = GraphModule(gm, graph)
    by_key = {input_of(p).key: p for p in graph.find_nodes(op="placeholder")}
    last = graph.find_nodes(op="placeholder")[-1]

    def placeholder(name: str, like: torch.Tensor, role: str) -> Node:
        nonlocal last
        with graph.inserting_after(last):
            last = graph.placeholder(name)
        last.meta.update(val=like, **{FXPAR_DP: role})
        return last

    extra = []
    for keys in buckets:
        weights = [by_key[k] for k in keys]
        accs = [placeholder(f"{w.name}_accumulated", _like(w, reduce.main_dtype, w.meta["val"].shape), "accumulated")
                for w, k in zip(weights, keys) if has_acc[k]]
        handles = [placeholder(f"{w.name}_handle", _like(w, handle_dtype(reduce, w.meta["val"].dtype),
                                                         handle_shape(reduce, w.meta["val"].shape)), "handle")
                   for w in weights]
        extra.append((keys, weights, accs, handles))
    position = {n: i for i, n in enumerate(graph.nodes)}
    for i, (keys, weights, accs, handles) in enumerate(extra):
        name = f"{DP_BUCKET}{i}"
        new.add_submodule(name, DPBucket(reduce, tuple(has_acc[k] for k in keys)))
        first_use = min((u for w in weights for u in w.users), key=position.__getitem__)
        with graph.inserting_before(first_use):  # a later bucket is applied later: its backward runs first
            call = graph.call_module(name, (*weights, *accs, *handles))
            views = [graph.call_function(operator.getitem, (call, j)) for j in range(len(weights))]
        call.meta["val"] = tuple(w.meta["val"] for w in weights)
        for w, view in zip(weights, views):
            view.meta["val"] = w.meta["val"]
            w.replace_all_uses_with(view, delete_user_cb=lambda u: u is not call)
    graph.lint()
    new.recompile()
    return new


def _like(weight: Node, dtype: torch.dtype | None, shape) -> torch.Tensor:
    v = weight.meta["val"]
    return v.new_empty(shape, dtype=dtype or v.dtype)
