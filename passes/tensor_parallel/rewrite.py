"""The tensor-parallel rewrite: apply an Analysis to the graph.

For every decided node: its shape constants become local (view(b, s, 12, 64) -> view(b, s, 12/t, 64)), replicated
inputs enter through f or scatter, a row-parallel GEMM is followed by g and only then by its bias
([Note: row-parallel bias]: added once, after the sum, never on every rank), the token embedding becomes the
vocab-parallel lookup, and the LM head's logits are gathered. The rewritten graph is the same on every rank; only the
weights differ, and the comm modules know the rank.

Every node leaves the pass with its placement in meta[FXPAR_PLACEMENT] (Replicate where no region reached it,
Partial for a row-parallel GEMM's output before g, the vocabulary Shard for the LM head's logits before the gather),
and every inserted collective with its kind in meta[FXPAR_COMM]. Shapes in meta["val"] are still global here: the
compiler's next stage (local_shapes) propagates this rank's local shapes through the rewritten graph.

[Note: row-parallel bias]
    Y = X W^T + b with X and W split along the contraction dim: each rank computes X_r W_r^T, g sums them, and b is
    added after g. Adding b on every rank before g would count it t times.

[Note: partial statistics]
    A sum or mean over the sharded dim (an RMSNorm's mean of squares over all heads, a regularizer's sum) closes the
    region without replicating it: each rank sums its block, `stat` all-reduces the b*s partial sums (identity in
    backward, like g), and a mean divides by the global count after. The replicated statistic re-enters the region
    through f where the sharded tensor is scaled by it, so its gradient is summed over the ranks' blocks.
"""
from __future__ import annotations

import bisect
import functools
import math

import torch
from torch.fx import GraphModule, Node

from fxpar.passes.sharding.analysis import Analysis
from fxpar.passes.ir.meta import FXPAR_COMM, FXPAR_ORIGIN, FXPAR_PLACEMENT, Comm
from fxpar.passes.ir.op_families import MODE_CALLS
from fxpar.passes.tensor_parallel.collectives import (CopyManyToTP, CopyToTP, GatherFromTP, GatherSequence,
                                                      GatherSequenceLinear, ReduceFromTP, ReduceScatterSequence,
                                                      ScatterToTP, TPComm, VocabParallelEmbedding,
                                                      VocabParallelEmbeddingSequence)
from fxpar.passes.ir.placements import Partial, Replicate, Shard
from fxpar.passes.sharding.rules import Role, arg
from fxpar.passes.tensor_parallel.vocab_kernels import (VocabParallelCrossEntropy, VocabParallelGather,
                                                        VocabParallelLogsumexp)

R = Replicate()
COMM_MODULES = {  # each collective's module (what it does: passes/ir/meta.py COMM_TABLE)
    Comm.F: CopyToTP, Comm.G: ReduceFromTP, Comm.STAT: ReduceFromTP, Comm.SCATTER: ScatterToTP,
    Comm.GATHER: GatherFromTP, Comm.VOCAB_EMBEDDING: VocabParallelEmbedding,
    Comm.VOCAB_CROSS_ENTROPY: VocabParallelCrossEntropy, Comm.VOCAB_LOGSUMEXP: VocabParallelLogsumexp,
    Comm.VOCAB_GATHER: VocabParallelGather, Comm.SEQ_GATHER: GatherSequence,
    Comm.SEQ_REDUCE_SCATTER: ReduceScatterSequence, Comm.VOCAB_EMBEDDING_SEQ: VocabParallelEmbeddingSequence,
    Comm.SEQ_GATHER_LINEAR: GatherSequenceLinear, Comm.SEQ_WEIGHTS: CopyManyToTP,
}

aten = torch.ops.aten


def call_comm(gm: GraphModule, kind: Comm | str, comm: TPComm, args: tuple, kwargs: dict | None = None,
              placement=R) -> Node:
    """A call_module node to a new comm module of `kind` (f, g, ...), one module `tp_<kind>_<i>` per call site,
    tagged with its kind and the placement of its output."""
    kind = Comm(kind)
    node = gm.graph.call_module(comm_module(gm, kind, comm), args, kwargs or {})
    node.meta[FXPAR_COMM] = kind
    node.meta[FXPAR_PLACEMENT] = placement
    return node


def spec_kwargs(how: Shard) -> dict:
    """A Shard as the keyword arguments of the collectives that take a layout."""
    return {"dim": how.dim, "parts": how.parts, "pre": how.pre, "post": how.post}


def comm_module(gm: GraphModule, kind: Comm, comm: TPComm) -> str:
    """A new module of `kind` on gm, `tp_<kind>_<i>`; returns its name."""
    i = 0
    while hasattr(gm, f"tp_{kind}_{i}"):
        i += 1
    gm.add_submodule(f"tp_{kind}_{i}", COMM_MODULES[kind](comm))
    return f"tp_{kind}_{i}"


class Inserter:
    """Creates the f / scatter node of an input right before the node that reads it, and reuses it for later readers
    when the graph mutates nothing.

    [Note: reads after mutation] Export keeps a forward's in-place ops (`states[:, t] = h` is copy_ into a view), so
    a node's value is what its storage holds when a reader runs, not when it was made. A collective placed right after
    the producer would read the tensor before the later writes (zeros, for a buffer filled in a loop). Placed before
    the reader, it reads what the reader would have read; a later reader reuses it unless an in-place op, or the
    entry or exit of a grad-mode or autocast region (a scatter made under no_grad carries no gradient), runs in
    between (then it gets its own)."""

    def __init__(self, gm: GraphModule, analysis: Analysis, comm: TPComm):
        self.gm, self.analysis, self.comm, self.cache = gm, analysis, comm, {}
        self.index = {n: i for i, n in enumerate(gm.graph.nodes)}  # the analysed nodes, in order
        self.writes = [i for n, i in self.index.items() if n.op == "call_function" and (
            n.target in MODE_CALLS or getattr(getattr(n.target, "_schema", None), "is_mutable", False))]

    def enter(self, inp: Node, how: Shard | None, user: Node, original: Node | None = None) -> Node:
        """`inp` entering a region at `user` (f, or scattered); `original` is the analysed node it replaced, if any."""
        if how is None and (original or inp) not in self.analysis.grad_nodes:
            return inp  # no gradient can flow into it: f would be a no-op
        if how is None:
            return self._insert((inp, how), user, Comm.F, (inp,), {}, R)
        return self._insert((inp, how), user, Comm.SCATTER, (inp,), spec_kwargs(how), how)

    def gather(self, inp: Node, how: Shard, user: Node) -> Node:
        """The whole of `inp`, sharded as `how`, gathered right before `user` reads it."""
        return self._insert((inp, "gather"), user, Comm.GATHER, (inp,), spec_kwargs(how), R)

    def _insert(self, key, user: Node, kind: Comm, args: tuple, kwargs: dict, placement) -> Node:
        at = self.index[user]
        cached = self.cache.get(key)
        if cached is None or bisect.bisect_left(self.writes, cached[1]) != bisect.bisect_left(self.writes, at):
            with self.gm.graph.inserting_before(user):
                node = call_comm(self.gm, kind, self.comm, args, kwargs, placement=placement)
            self.cache[key] = cached = (node, at)
        return cached[0]


def _reduce_then_bias(gm: GraphModule, node: Node, comm: TPComm) -> Node:
    """Row-parallel GEMM: drop the bias from the GEMM, then g, then add the bias ([Note: row-parallel bias]);
    returns the node that now holds the GEMM's (replicated) value."""
    graph = gm.graph
    if node.target is aten.linear.default:
        bias = node.args[2] if len(node.args) > 2 else None
        node.args = node.args[:2]
    elif node.target is aten.addmm.default:
        bias = node.args[0]
        node.target, node.args = aten.mm.default, (node.args[1], node.args[2])
    else:
        bias = None
    users = list(node.users)
    node.meta[FXPAR_PLACEMENT] = Partial()
    with graph.inserting_after(node):
        out = call_comm(gm, "g", comm, (node,))
    if bias is not None:
        with graph.inserting_after(out):
            out = graph.call_function(aten.add.Tensor, (out, bias))
            out.meta[FXPAR_PLACEMENT] = R
    for u in users:
        u.replace_input_with(node, out)
    return out


def _reduce_partial(gm: GraphModule, node: Node, comm: TPComm) -> Node:
    """A sum or mean over the sharded dim: this rank's partial sum, then `stat`, then / count for a mean
    ([Note: partial statistics]); returns the node that now holds the (replicated) statistic."""
    count = None
    if node.target in (aten.mean.dim, aten.mean.default):
        shape, dims = node.args[0].meta["val"].shape, arg(node, "dim")
        dims = range(len(shape)) if not dims else [d % len(shape) for d in dims]
        count = math.prod(int(shape[d]) for d in dims)
        node.target = aten.sum.dim_IntList if node.target is aten.mean.dim else aten.sum.default
    users = list(node.users)
    node.meta[FXPAR_PLACEMENT] = Partial()
    with gm.graph.inserting_after(node):
        out = call_comm(gm, "stat", comm, (node,))
    if count is not None:
        with gm.graph.inserting_after(out):
            out = gm.graph.call_function(aten.div.Tensor, (out, count))
            out.meta[FXPAR_PLACEMENT] = R
    for u in users:
        u.replace_input_with(node, out)
    return out


def _vocab_call(gm: GraphModule, node: Node, comm: TPComm, *, role: Role) -> Node:
    """The same call, to its vocab-parallel module (passes/tensor_parallel/vocab_kernels.py); returns the module's
    call."""
    with gm.graph.inserting_before(node):
        op = call_comm(gm, Comm(role), comm, node.args, node.kwargs)
    keep = ("nn_module_stack", "stack_trace", FXPAR_ORIGIN)  # the same value as the node it replaces
    op.meta.update({k: node.meta[k] for k in keep if k in node.meta})
    node.replace_all_uses_with(op)
    gm.graph.erase_node(node)
    return op


def _vocab_head(gm: GraphModule, node: Node, comm: TPComm) -> Node:
    """Column-parallel over the vocabulary, then all-gathered; returns the gathered (replicated) logits."""
    users = list(node.users)
    vocab = node.meta["val"].shape[-1]
    node.meta[FXPAR_PLACEMENT] = Shard(node.meta["val"].dim() - 1, (vocab,))
    with gm.graph.inserting_after(node):
        out = call_comm(gm, "gather", comm, (node,), {"dim": -1})
    for u in users:
        u.replace_input_with(node, out)
    return out


# what the rewrite inserts at a node of each role (a column GEMM needs nothing after it); each returns the node that
# now holds the node's value
REWRITES = {
    Role.ROW: _reduce_then_bias,
    Role.REDUCE: _reduce_partial,
    Role.VOCAB_HEAD: _vocab_head,
    **{role: functools.partial(_vocab_call, role=role)  # each a call of the vocab-parallel module of its name
       for role in (Role.VOCAB_EMBEDDING, Role.VOCAB_CROSS_ENTROPY, Role.VOCAB_LOGSUMEXP, Role.VOCAB_GATHER)},
}


def tensor_parallel_pass(gm: GraphModule, analysis: Analysis, comm: TPComm) -> GraphModule:
    """Rewrite `gm` in place for tensor parallelism as `analysis` decided; returns gm (unchanged when t == 1).

    Every node is tagged with its placement, Replicate included, so what `fxpar show` prints is what was decided."""
    if not analysis.decisions:
        for node in gm.graph.nodes:  # nothing sharded: every value is replicated (a metadata-only change)
            node.meta[FXPAR_PLACEMENT] = R
        return gm
    ins, replaced = Inserter(gm, analysis, comm), {}
    for node in list(gm.graph.nodes):
        if FXPAR_COMM not in node.meta:
            node.meta[FXPAR_PLACEMENT] = analysis.placements.get(node, R)
        d = analysis.decisions.get(node)
        if d is None:
            continue
        if d.args is not None:
            node.args = d.args
        if d.target is not None:
            node.target = d.target
        for inp, how in d.enter.items():
            now = replaced.get(inp, inp)  # replaced already: a vocab lookup, gathered logits, a row GEMM's g (+bias)
            node.replace_input_with(now, ins.enter(now, how, node, inp))
        rewrite = REWRITES.get(d.role)
        if rewrite is not None:
            replaced[node] = rewrite(gm, node, comm)
    gm.graph.lint()
    gm.recompile()
    return gm
