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
    - Over several microbatches every such weight holds a gradient by its last microbatch's forward (the runtime
      gives it one before the step's first backward, unless a backward of the chunk runs before that forward), so
      the tensor it passes is the one autograd accumulates into, in place, whatever the schedule runs in between
      (1F1B runs a chunk's last forward before its earlier backwards). The bucket reads it when its backward runs,
      after those: the runtime calls the variant under identity saved-tensor hooks, so the program keeps the tensor
      itself and autograd does not refuse its newer version.
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

import operator

import torch
import torch.nn as nn
from torch.fx import GraphModule, Node

from fxpar.passes.ir.meta import PARAMETER, input_of
from fxpar.passes.ir.pieces import DPReduce, handle_dtype, handle_shape, piece_size, rank_major

DP_BUCKET = "dp_bucket_"  # the name of each bucket's module and call node: dp_bucket_0, ...
FXPAR_DP = "fxpar_dp"  # meta of a variant's added placeholders: "accumulated" or "handle"
_c10d = torch.ops._c10d_functional


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


def grad_order(gm: GraphModule) -> tuple[str, ...]:
    """The keys of the weights a chunk graph reads, in the order their gradients become final: the reverse of their
    first use forward (passes/ir/pieces.py buckets cuts it into buckets). A weight nothing reads is not in it."""
    first = {}
    for i, n in enumerate(gm.graph.nodes):
        for a in n.all_input_nodes:
            if a.op == "placeholder":
                first.setdefault(a, i)
    read = [p for p in gm.graph.find_nodes(op="placeholder") if p in first and input_of(p).kind == PARAMETER]
    return tuple(input_of(p).key for p in sorted(read, key=lambda p: -first[p]))


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
