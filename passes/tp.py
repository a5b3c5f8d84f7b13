"""The tensor-parallel rewrite: apply an Analysis to the graph.

For every decided node: its shape constants become local (view(b, s, 12, 64) -> view(b, s, 12/t, 64)), replicated
inputs enter through f or scatter, a row-parallel GEMM is followed by g and only then by its bias
([Note: row-parallel bias]: added once, after the sum, never on every rank), the token embedding becomes the
vocab-parallel lookup, and the LM head's logits are gathered. The rewritten graph is the same on every rank; only the
weights differ, and the comm modules know the rank.

[Note: row-parallel bias]
    Y = X W^T + b with X and W split along the contraction dim: each rank computes X_r W_r^T, g sums them, and b is
    added after g. Adding b on every rank before g would count it t times.
"""
from __future__ import annotations

import torch
from torch.fx import GraphModule, Node

from .analysis import Analysis
from .ops import COMM_MODULES, TPComm
from .placements import Shard

aten = torch.ops.aten


def call_comm(gm: GraphModule, kind: str, comm: TPComm, args: tuple, kwargs: dict | None = None) -> Node:
    """A call_module node to a new comm module of `kind` (tp_f, tp_g, ...), one module per call site."""
    i = sum(1 for name, _ in gm.named_children() if name.startswith(kind + "_"))
    name = f"{kind}_{i}"
    gm.add_submodule(name, COMM_MODULES[kind](comm))
    return gm.graph.call_module(name, args, kwargs or {})


class _Inserter:
    """Creates the f / scatter nodes once per (input, kind) and reuses them."""

    def __init__(self, gm: GraphModule, analysis: Analysis, comm: TPComm):
        self.gm, self.analysis, self.comm, self.cache = gm, analysis, comm, {}

    def enter(self, inp: Node, how: Shard | None) -> Node:
        if how is None and inp not in self.analysis.grad_nodes:
            return inp  # no gradient can flow into it: f would be a no-op
        key = (inp, how)
        if key not in self.cache:
            with self.gm.graph.inserting_after(inp):
                if how is None:
                    self.cache[key] = call_comm(self.gm, "tp_f", self.comm, (inp,))
                else:
                    kwargs = {"dim": how.dim, "parts": how.parts, "pre": how.pre, "post": how.post}
                    self.cache[key] = call_comm(self.gm, "tp_scatter", self.comm, (inp,), kwargs)
        return self.cache[key]


def _reduce_then_bias(gm: GraphModule, node: Node, comm: TPComm) -> None:
    """Row-parallel GEMM: drop the bias from the GEMM, then g, then add the bias ([Note: row-parallel bias])."""
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
    with graph.inserting_after(node):
        out = call_comm(gm, "tp_g", comm, (node,))
    if bias is not None:
        with graph.inserting_after(out):
            out = graph.call_function(aten.add.Tensor, (out, bias))
    for u in users:
        u.replace_input_with(node, out)


def _vocab_head(gm: GraphModule, node: Node, comm: TPComm) -> None:
    users = list(node.users)
    with gm.graph.inserting_after(node):
        out = call_comm(gm, "tp_gather", comm, (node,), {"dim": -1})
    for u in users:
        u.replace_input_with(node, out)


def tensor_parallel_pass(gm: GraphModule, analysis: Analysis, comm: TPComm) -> GraphModule:
    """Rewrite `gm` in place for tensor parallelism as `analysis` decided; returns gm (unchanged when t == 1)."""
    if not analysis.decisions:
        return gm
    ins = _Inserter(gm, analysis, comm)
    for node in list(gm.graph.nodes):
        d = analysis.decisions.get(node)
        if d is None:
            continue
        if d.args is not None:
            node.args = d.args
        if d.target is not None:
            node.target = d.target
        for inp, how in d.enter.items():
            node.replace_input_with(inp, ins.enter(inp, how))
        if d.role == "row":
            _reduce_then_bias(gm, node, comm)
        elif d.role == "vocab_embedding":
            with gm.graph.inserting_before(node):
                node.replace_all_uses_with(call_comm(gm, "tp_vocab_embedding", comm, node.args, node.kwargs))
            gm.graph.erase_node(node)
        elif d.role == "vocab_head":
            _vocab_head(gm, node, comm)
    gm.graph.lint()
    gm.recompile()
    return gm
