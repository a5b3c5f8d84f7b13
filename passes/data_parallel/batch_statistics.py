"""Statistics over the batch's rows inside a loss: what makes a router's load-balancing loss the whole batch's.

[Note: batch statistics]
A data-parallel rank computes its loss on its own rows of the global batch, and the mean of the d ranks' gradients
is the whole batch's where the loss is linear in each rank's share of it: a token mean ([Note: whole-batch
semantics] in token_count.py), a sum. A loss that multiplies statistics over the rows is not. Mixtral's
load-balancing loss is E * sum_e f_e * P_e: f_e the share of the (token, k) pairs routed to expert e, P_e the mean
router probability of e, both over every token of the batch. A rank's product of its own f and P is neither the
whole batch's product nor, averaged over the ranks, equal to it.

Found by comparing two traces of the program with its loss (passes get both; fxpar/compiler.py makes the second):
at the example's rows, one rank's microbatch, and at d times them, the d ranks' microbatches together, as one
process computes them. Node for node the two are the same program, or nothing is changed.

- A node whose output has the same shape in both while one of its inputs grew is a **reduction over the rows**.
- One that reaches the loss only linearly (adds, casts, views, sums, products with or divisions by values that
  depend on no row) is already the whole batch's after the dp mean: the cross-entropy, a sum.
- One that reaches a nonlinear op (a product of two statistics, a square, a division by one) must be the whole
  batch's value there. A sum or a count (aten.sum, aten.histc) is all-reduced over the dp ranks, a mean all-reduced
  and divided by d. The constants after it that differ between the traces (the token count a mean divides by,
  which Python read from a shape) take the d-rank trace's values. The all-reduce's backward all-reduces the
  gradient too: each rank's rows then receive the whole loss's gradient, and the dp mean of the gradients is the
  whole batch's.
- A floating statistic read back on the rows (x - mean(x), as BatchNorm reads it) keeps each rank's own, and the
  plan says so. An integer one is the rows' own layout, as one process computes it on those rows: the offsets of
  a rank's rows sorted by expert (passes/experts/find.py).
- Anything else (a maximum over the rows, a product with the rank's own cross-entropy, a constant that differs
  beside row-shaped values) keeps each rank's own statistics, and the plan says why.

With m > 1 microbatches per rank the statistics span microbatch i of every dp rank: the whole batch's only at m = 1
(a pipeline computes microbatch i's loss before it runs the others), and step() says so.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn as nn
import torch.utils._pytree as pytree
from torch.fx import GraphModule, Node

from fxpar.passes.ir.meta import module_path
from fxpar.passes.ir.op_families import ADDS, CASTS, LAYOUT, PRODUCTS, QUOTIENTS
from fxpar.passes.tensor_parallel.collectives import TPComm

aten = torch.ops.aten

ADDITIVE = {aten.sum.dim_IntList: "sum", aten.sum.default: "sum", aten.histc.default: "sum",
            aten.mean.dim: "mean", aten.mean.default: "mean"}
_LINEAR = CASTS | LAYOUT | ADDS | {aten.neg.default, aten.sum.dim_IntList, aten.sum.default, aten.cumsum.default}


@dataclass
class BatchStatistics:
    """The loss's reductions over the batch's rows that reach it nonlinearly (`reduce`: node name -> "sum" or
    "mean"), the constants after them that become the whole batch's (`constants`: node name -> its args and
    kwargs), and `why` nothing changes where it cannot be proven."""

    reduce: dict[str, str] = field(default_factory=dict)
    modules: dict[str, str] = field(default_factory=dict)  # node name -> its module path, for the plan
    constants: dict[str, tuple] = field(default_factory=dict)
    why: str = ""

    def line(self, dp: int) -> str:
        if self.why:
            return f"each dp rank's own: {self.why}"
        where = ", ".join(f"{n} ({self.modules[n] or '<root>'})" for n in self.reduce)
        return (f"{len(self.reduce)} reduction(s) over the batch's rows all-reduced over dp={dp}, as one process on "
                f"the whole batch computes them (at m=1; with m>1, over microbatch i of every dp rank): {where}")


def _scales(a, b) -> bool:
    """Whether a node's value changed shape between the two traces (it holds rows)."""
    va, vb = a.meta.get("val"), b.meta.get("val")
    if isinstance(va, torch.Tensor) and isinstance(vb, torch.Tensor):
        return va.shape != vb.shape
    if isinstance(va, (tuple, list)) and isinstance(vb, (tuple, list)):
        return any(isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor) and x.shape != y.shape
                   for x, y in zip(va, vb))
    return False


def _leaves(n: Node) -> list:
    return [x for x in pytree.tree_leaves((n.args, n.kwargs)) if not isinstance(x, Node)]


def find_batch_statistics(local: GraphModule, whole: GraphModule) -> BatchStatistics | None:
    """The reductions over rows to make the whole batch's (see the module docstring): `local` traced at one
    microbatch's rows, `whole` at d times them. None: the loss reads no statistic nonlinearly."""
    pairs = list(zip(local.graph.nodes, whole.graph.nodes))
    bad = next((a for a, b in pairs if a.op != b.op or a.target != b.target), None)
    if bad is not None or len(local.graph.nodes) != len(whole.graph.nodes):
        return BatchStatistics(why="the program traced at d times the rows is not the same program"
                                   + (f" (from node {bad.name})" if bad is not None else ""))
    twin = {a: b for a, b in pairs}
    scales = {a for a, b in pairs if _scales(a, b)}
    reductions, after = [], {}  # after: a statistic-level node -> the reductions over rows upstream of it
    for a in local.graph.nodes:
        ins = a.all_input_nodes
        if a in scales or a.op != "call_function":
            continue  # rows: a statistic read here is read per row (as the rank's own offsets of its rows)
        up = set().union(*(after[i] for i in ins if i in after))
        if any(i in scales for i in ins):
            reductions.append(a)
            up = up | {a}
        if up:
            after[a] = up
    nonlinear: set[Node] = set()  # the reductions some nonlinear op reads
    for a in after:
        read = [i for i in a.all_input_nodes if i in after]
        if read and not _linear(a, after):
            nonlinear |= set().union(*(after[i] for i in read))
    # a statistic read on rows: a floating one (x - mean(x)) stays the rank's own; an integer one is the rows' own
    # layout (the offsets of a rank's rows sorted by expert), as one process computes it on those rows, unless it
    # is also to become the whole batch's
    for a in scales:
        for i in (i for i in a.all_input_nodes if i in after):
            v = i.meta.get("val")
            if isinstance(v, torch.Tensor) and v.is_floating_point():
                return BatchStatistics(why=f"{a.name} ({a.target}, {module_path(a) or '<root>'}) reads the statistic "
                                           f"{i.name} over the batch's rows on the rank's own rows")
            if after[i] & nonlinear:
                return BatchStatistics(why=f"{a.name} ({a.target}) reads the statistic {i.name} on the rank's own "
                                           "rows as well")
    if not nonlinear:
        return None
    out = BatchStatistics()
    for r in sorted(nonlinear, key=reductions.index):
        kind = ADDITIVE.get(r.target)
        if kind is None:
            return BatchStatistics(why=f"the loss reads {r.name} ({r.target}, {module_path(r) or '<root>'}) over the "
                                       "batch's rows nonlinearly, and it is not a sum, a count or a mean")
        out.reduce[r.name], out.modules[r.name] = kind, module_path(r)
    for a, up in after.items():
        if not up & nonlinear or _leaves(a) == _leaves(twin[a]):
            continue
        if up - nonlinear:
            return BatchStatistics(why=f"{a.name} ({a.target}) has constants that change with the rows, after both the "
                                       f"whole batch's statistics and the rank's own ({sorted(n.name for n in up)})")
        out.constants[a.name] = (twin[a].args, twin[a].kwargs)
    return out


def _linear(n: Node, after: dict) -> bool:
    """Whether n passes the statistics it reads on linearly (so the dp mean of the loss is the whole batch's)."""
    if n.target in _LINEAR:
        return True
    tensors = [a for a in n.args if isinstance(a, Node)]
    if n.target in PRODUCTS:
        return sum(a in after for a in tensors) <= 1
    if n.target in QUOTIENTS:
        return len(n.args) < 2 or not isinstance(n.args[1], Node) or n.args[1] not in after
    return False


class _AllReduce(torch.autograd.Function):
    """The sum over the dp ranks; its backward the sum of the ranks' gradients (each holds the whole loss's)."""

    @staticmethod
    def forward(ctx, x, comm: TPComm, scale: float):
        ctx.comm, ctx.scale = comm, scale
        out = comm.all_reduce(x.clone())
        return out / scale if scale != 1 else out

    @staticmethod
    def backward(ctx, grad):
        out = ctx.comm.all_reduce(grad.clone())
        return (out / ctx.scale if ctx.scale != 1 else out), None, None


class BatchStatistic(nn.Module):
    """A reduction over the rows, made the whole batch's: all-reduced over dp (a mean: then divided by dp)."""

    def __init__(self, comm: TPComm, kind: str, node: str):
        super().__init__()
        self.comm, self.kind, self.node = comm, kind, node

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _AllReduce.apply(x, self.comm, self.comm.size if self.kind == "mean" else 1)

    def extra_repr(self) -> str:
        return f"{self.kind} of {self.node} over dp={self.comm.size}"


def batch_statistics_pass(gm: GraphModule, stats: BatchStatistics | None, comm: TPComm) -> GraphModule:
    """Each reduction of `stats` all-reduced over dp (`comm`), the constants after them the whole batch's."""
    if stats is None or stats.why or comm.size == 1:
        return gm
    nodes = {n.name: n for n in gm.graph.nodes}
    missing = [name for name in [*stats.reduce, *stats.constants] if name not in nodes]
    if missing:
        stats.why = f"an earlier stage rewrote {missing[0]}, which the statistics read"
        return gm
    for i, (name, kind) in enumerate(stats.reduce.items()):
        n, target = nodes[name], f"dp_statistic_{i}"
        gm.add_submodule(target, BatchStatistic(comm, kind, name))
        with gm.graph.inserting_after(n):
            s = gm.graph.call_module(target, (n,))
        s.meta = dict(n.meta)
        n.replace_all_uses_with(s, delete_user_cb=lambda u: u is not s)
    for name, (args, kwargs) in stats.constants.items():
        n = nodes[name]
        n.args = pytree.tree_map(lambda x, y: x if isinstance(x, Node) else y, n.args, args)
        n.kwargs = pytree.tree_map(lambda x, y: x if isinstance(x, Node) else y, dict(n.kwargs), dict(kwargs))
    gm.recompile()
    return gm
