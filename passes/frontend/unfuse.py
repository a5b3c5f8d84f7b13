"""Unfuse: a fused projection cut into one GEMM per part, on row blocks of its weight ([Note: whole parts] in
passes/ir/placements.py).

A fused Q|K|V GEMM shards only if every part does: multi-query attention's one K/V head ([q | k | v] of sizes
[H hd, hd, hd], Falcon's and StarCoder's) gives no rank a block of K. Cut apart, Q's GEMM is column-parallel and
K's and V's stay replicated, their heads scattered into the attention region, as separate K/V projections that t
does not divide are. The compiler cuts a fused GEMM only where the analysis left it replicated and the cut one
shards (fxpar/compiler.py, stage unfuse).

Pattern: y = linear(x, W[, b]), then layout ops that keep W's output rows in order (unsqueeze; at most one view
that splits the features into (n, ...) with n outermost), then a split of that n dim into the parts. Each part
becomes linear(x, W[a:b][, b[a:b]]) followed by the same layout ops at its own size, read where the split's piece
was. Why it is exact: each output column of the fused GEMM is the same dot product as the matching column of its
part's GEMM (the order of the summation inside a GEMM call may differ: a rounding difference, as any two GEMM
calls of different widths).
"""
from __future__ import annotations

import math
import operator

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx import GraphModule, Node

from fxpar.passes.ir.op_families import SPLITS, VIEWS

aten = torch.ops.aten
_META = ("nn_module_stack", "stack_trace")


def _shape(n: Node) -> tuple:
    return tuple(n.meta["val"].shape)


def _chain(gemm: Node):
    """(layout nodes, split) from the GEMM to the split of its parts, or None."""
    chain, n = [], gemm
    while len(n.users) == 1:
        (u,) = n.users
        if u.op != "call_function":
            return None
        if u.target in SPLITS:
            return chain, u
        if u.target is not aten.unsqueeze.default and (u.target not in VIEWS or any(c.target in VIEWS for c in chain)):
            return None
        chain.append(u)
        n = u
    return None


def _tracked(chain: list[Node], split: Node, gemm: Node) -> list[int] | None:
    """The dim of each chain node (then the GEMM's) that holds the parts, walking back from the split; None if the
    layout ops do not keep the parts outermost in the GEMM's output features."""
    src = split.args[0]
    d = (split.args[2] if len(split.args) > 2 else 0) % len(_shape(src))
    dims = []
    for node in reversed(chain):
        dims.append(d)
        inp = node.args[0]
        if node.target is aten.unsqueeze.default:
            u = node.args[1] % len(_shape(node))
            if u == d:
                return None
            d -= u < d
        else:  # a view splitting the input's features (its last dim) into (n, ...): n is d
            out, nin = _shape(node), _shape(inp)
            if math.prod(out[:d]) != math.prod(nin[:-1]) or math.prod(out[d:]) != nin[-1]:
                return None
            d = len(nin) - 1
    if d != len(_shape(gemm)) - 1:
        return None
    return dims[::-1]


def _pattern(gemm: Node):
    """(layout nodes, their tracked dims, split, part sizes in the split dim's units, the features per unit)."""
    if gemm.op != "call_function" or gemm.target is not aten.linear.default or gemm.kwargs:
        return None
    found = _chain(gemm)
    if found is None:
        return None
    chain, split = found
    dims = _tracked(chain, split, gemm)
    if dims is None or not all(p.target is operator.getitem for p in split.users):
        return None
    src = split.args[0]
    d = (split.args[2] if len(split.args) > 2 else 0) % len(_shape(src))
    sizes = [v.shape[d] for v in split.meta["val"]]
    return chain, dims, split, sizes, math.prod(_shape(src)[d + 1:])


def parts(gemm: Node) -> list[int] | None:
    """The output features of each part `unfuse` would cut `gemm` into, or None."""
    found = _pattern(gemm)
    return [n * found[4] for n in found[3]] if found is not None and len(found[3]) > 1 else None


def unfuse(gm: GraphModule, gemm: Node) -> list[Node] | None:
    """Cut `gemm` (aten.linear with a parameter weight) into one GEMM per part of the split that follows it; returns
    the new GEMMs, or None (gm unchanged) where the pattern does not match."""
    found = _pattern(gemm)
    if found is None:
        return None
    chain, dims, split, sizes, inner = found
    pieces = list(split.users)
    x, w = gemm.args[0], gemm.args[1]
    bias = gemm.args[2] if len(gemm.args) > 2 else None
    graph, out, start = gm.graph, [], 0
    mode = FakeTensorMode(allow_non_fake_inputs=True)  # this pass's own: another rank's thread may use the trace's
    by_index = {p.args[1]: p for p in pieces}
    with graph.inserting_before(split):
        for i, n in enumerate(sizes):
            rows = (start * inner, (start + n) * inner)
            start += n
            args = (x, _sliced(graph, w, rows, gemm, mode))
            if bias is not None:
                args += (_sliced(graph, bias, rows, gemm, mode),)
            y = _node(graph, aten.linear.default, args, gemm, _like(gemm, -1, rows[1] - rows[0], mode))
            out.append(y)
            for node, dim in zip(chain, dims):
                shape = list(_shape(node))
                shape[dim] = n
                args = (y, shape) if node.target in VIEWS else (y, *node.args[1:])
                y = _node(graph, node.target, args, node, _like(node, dim, n, mode))
            if i in by_index:
                by_index[i].replace_all_uses_with(y)
    for node in pieces + [split] + chain[::-1] + [gemm]:
        graph.erase_node(node)
    graph.lint()
    gm.recompile()
    return out


def _like(node: Node, dim: int, size: int, mode: FakeTensorMode):
    """node's value record with `dim` resized."""
    v = node.meta["val"]
    shape = list(v.shape)
    shape[dim] = size
    with mode:
        return torch.empty(shape, dtype=v.dtype, device=v.device)


def _sliced(graph, param: Node, rows: tuple[int, int], like: Node, mode: FakeTensorMode) -> Node:
    """param[rows] along its dim 0 (a weight's output rows, a bias)."""
    v = param.meta["val"]
    with mode:
        val = torch.empty((rows[1] - rows[0], *v.shape[1:]), dtype=v.dtype, device=v.device)
    return _node(graph, aten.slice.Tensor, (param, 0, *rows), like, val)


def _node(graph, target, args: tuple, like: Node, val) -> Node:
    node = graph.call_function(target, args)
    node.meta.update({k: like.meta[k] for k in _META if k in like.meta})
    node.meta["val"] = val
    return node
