"""Fewer collectives: g moves down past linear ops until two partial sums meet and share one all-reduce; f moves up
past linear ops until two regions' f's read one value and become one.

g all-reduces a partial sum, and an all-reduce commutes with every op linear in it: L(g(a)) = g(L(a)), and
g(a) + g(b) = g(a + b). So where a row-parallel GEMM's output reaches another region's through linear ops only (an
MoE layer's routed experts, scaled by the routing weights, combined per token and added to its shared expert's
output), the two regions close with one g. In the same way f(L(y)) = L(f(y)) for f, identity forward and
all-reduce of the gradient backward: the experts read the layer's input through a token gather, the shared expert
reads it directly, and one f serves both.

[Note: moving a collective]
    g(a) moves past its reader L only where
      - L is its only reader, and the partial sum a is read by g alone;
      - L is linear in it: a layout op, a sum, an index by integers, a cast to a dtype as wide, a product or quotient
        by a scalar or by a replicated per-token factor (a routing weight: its last dim is 1), or a sum of values that
        are each such a g. The factor goes through f: its gradient, read from this rank's summand, is partial;
      - L's output is no larger than its input (a moved all-reduce never moves more values).
    A sum written in place (`out.add_(routed)`, Llama 4) is one too: its first operand is a chain's end, read by
    nothing else, so the write changes no value another op reads.
    f(x) moves above x = L(y) only where L is a layout op, a cast that keeps the dtype or a product by a per-token
    factor (its f marked as above; x's other readers keep x, f's get a copy of L), or an index by integers that f
    alone reads, and y is no larger than x. Two f's of one value become one where no op writes in place
    between them ([Note: reads after mutation], passes/tensor_parallel/rewrite.py).
    Why it is exact: each step is an identity of linear algebra; only where the sum is taken changes (the
    summation order, as any all-reduce's).
"""
from __future__ import annotations

import torch
from torch.fx import GraphModule, Node

from fxpar.passes.ir.meta import FXPAR_PLACEMENT, FXPAR_SCALE, comm_kind
from fxpar.passes.ir.op_families import ADDS, CASTS, INDEXING, LAYOUT, SCALINGS, SUMS
from fxpar.passes.tensor_parallel.collectives import TPComm
from fxpar.passes.ir.placements import Partial, Replicate
from fxpar.passes.ir.aliasing import Storage, writes
from fxpar.passes.tensor_parallel.rewrite import call_comm

aten = torch.ops.aten
R = Replicate()


def _val(n) -> torch.Tensor | None:
    """n's traced value; a collective's is its input's (the tp pass gives it none)."""
    if isinstance(n, Node) and "val" not in n.meta and comm_kind(n) is not None and n.args:
        return _val(n.args[0])
    v = n.meta.get("val") if isinstance(n, Node) else None
    return v if isinstance(v, torch.Tensor) else None


def _numel(n: Node) -> int:
    v = _val(n)
    return v.numel() if v is not None else -1


def _tensor_inputs(n: Node) -> list[Node]:
    return [a for a in n.all_input_nodes if _val(a) is not None]


def _integer_only(n: Node, x: Node) -> bool:
    """Every tensor n reads besides x is an integer or boolean index."""
    return all(a is x or not (a.meta["val"].is_floating_point() or a.meta["val"].is_complex())
               for a in _tensor_inputs(n))


def _cast_ok(n: Node, x: Node, widen: bool) -> bool:
    """n casts x to a dtype as wide (widen) or the same dtype, changing nothing else."""
    out, inp = _val(n), _val(x)
    if out is None or inp is None or out.shape != inp.shape or out.device != inp.device or \
            not inp.is_floating_point():
        return False
    if out.dtype == inp.dtype:
        return True
    return widen and out.is_floating_point() and torch.finfo(out.dtype).bits >= torch.finfo(inp.dtype).bits \
        and torch.finfo(out.dtype).eps <= torch.finfo(inp.dtype).eps


def _replicated(n) -> bool:
    return not isinstance(n, Node) or isinstance(n.meta.get(FXPAR_PLACEMENT, R), Replicate)


def _factor(n: Node, g: Node):
    """The factor n scales g by: a product's other operand (either side), a quotient's denominator."""
    if n.args[0] is g:
        return n.args[1]
    return n.args[0] if n.target in (aten.mul.Tensor, aten.mul.Scalar) else None


def _per_token_factor(n: Node, g: Node) -> bool:
    """n multiplies (or divides) g by a scalar or a replicated factor of last dim 1 (a routing weight)."""
    if len(n.args) != 2 or n.kwargs or g not in n.args:
        return False
    other = _factor(n, g)
    if not isinstance(other, Node):
        return isinstance(other, (int, float))
    v = _val(other)
    return other is not g and v is not None and _replicated(other) and comm_kind(other) is None \
        and (v.dim() == 0 or v.shape[-1] == 1) and v.numel() * 2 <= _numel(n)


def _linear_in(n: Node, g: Node) -> bool:
    """n is linear in g's value, reads it once, and outputs no more values ([Note: moving a collective])."""
    if n.op != "call_function" or _numel(n) < 0 or _numel(n) > _numel(g):
        return False
    if n.target in LAYOUT | SUMS:
        return n.args[0] is g and all(a is g for a in _tensor_inputs(n)) and _val(n).dtype == _val(g).dtype
    if n.target in INDEXING:
        return n.args[0] is g and g not in n.args[1:] and _integer_only(n, g) and not _in(g, n.args[1:])
    if n.target in CASTS:
        return n.args[0] is g and _cast_ok(n, g, widen=True)
    if n.target in SCALINGS:
        return _per_token_factor(n, g)
    return False


def _in(g: Node, args) -> bool:
    """g appears inside a list argument (an index list)."""
    return any(a is g or (isinstance(a, (list, tuple)) and _in(g, a)) for a in args)


def _movable_g(n: Node) -> bool:
    src = n.args[0] if n.args else None
    return comm_kind(n) == "g" and len(n.users) == 1 and isinstance(src, Node) and len(src.users) == 1


def _chain(g: Node) -> list[Node]:
    """The readers g can move past, in order: each the only reader of the one before and linear in it."""
    out, cur = [], g
    while len(cur.users) == 1 and _linear_in(n := next(iter(cur.users)), cur):
        out.append(cur := n)
    return out


def _erase_comm(gm: GraphModule, n: Node) -> None:
    target = n.target
    gm.graph.erase_node(n)
    gm.delete_submodule(target)


def _move_g(gm: GraphModule, g: Node, path: list[Node], comm: TPComm) -> Node:
    """g moved to after the last node of `path` (its chain's first nodes); a factor enters through f."""
    prev = g
    for n in path:
        factor = _factor(n, prev) if n.target in SCALINGS else None
        prev = n
        if isinstance(factor, Node) and factor.meta["val"].is_floating_point():
            with gm.graph.inserting_before(n):
                f = call_comm(gm, "f", comm, (factor,))
            f.meta["val"], f.meta[FXPAR_SCALE] = factor.meta["val"], True
            n.replace_input_with(factor, f)
        n.meta[FXPAR_PLACEMENT] = Partial()
    if not path:
        return g
    path[0].replace_input_with(g, g.args[0])
    _erase_comm(gm, g)
    return _new_g(gm, path[-1], comm)


def _new_g(gm: GraphModule, after: Node, comm: TPComm) -> Node:
    users = list(after.users)
    with gm.graph.inserting_after(after):
        g = call_comm(gm, "g", comm, (after,))
    g.meta["val"] = after.meta.get("val")
    for u in users:
        u.replace_input_with(after, g)
    after.meta[FXPAR_PLACEMENT] = Partial()
    return g


def _adds_partials(n: Node, ends: dict) -> bool:
    """n adds (or subtracts) two same-shaped values that are each the end of a g's chain."""
    # in place too: into a value g alone read
    return n.op == "call_function" and n.target in ADDS and len(n.args) == 2 and \
        all(isinstance(a, Node) and a in ends and _val(a) is not None and _val(n) is not None
            and _val(a).shape == _val(n).shape for a in n.args) and n.args[0] is not n.args[1] and \
        set(n.kwargs) <= {"alpha"} and n.kwargs.get("alpha", 1) in (1, -1)


def _sink_step(gm: GraphModule, comm: TPComm) -> bool:
    """One move ([Note: moving a collective]): two g's that meet at an add become one; else a g moves to where its
    chain carries the fewest values, if fewer than it all-reduces now. True if the graph changed."""
    ends = {}
    for g in [n for n in gm.graph.nodes if _movable_g(n)]:
        chain = _chain(g)
        ends[chain[-1] if chain else g] = (g, chain)
    for end in ends:
        add = next(iter(end.users)) if len(end.users) == 1 else None
        if add is not None and _adds_partials(add, ends):
            for a in add.args:
                g, chain = ends[a]
                moved = _move_g(gm, g, chain, comm)
                add.replace_input_with(moved, moved.args[0])
                _erase_comm(gm, moved)
            _new_g(gm, add, comm)
            return True
    for g, chain in ends.values():
        if chain:
            best = min(range(len(chain)), key=lambda i: (_numel(chain[i]), i))
            if _numel(chain[best]) < _numel(g):
                _move_g(gm, g, chain[:best + 1], comm)
                return True
    return False


def _hoist_source(x: Node) -> tuple[Node, Node | None] | None:
    """(y, factor) where f(x) may move above x = L(y) (factor: the per-token factor L scales y by, or None)."""
    if x.op != "call_function" or not x.args:
        return None
    if x.target in SCALINGS:
        y = next((a for a in x.args[:2] if isinstance(a, Node) and _per_token_factor(x, a)), None)
        return (y, _factor(x, y)) if y is not None else None
    y = x.args[0]
    if not isinstance(y, Node):
        return None
    if x.target in LAYOUT:
        ok = all(a is y for a in _tensor_inputs(x))
    elif x.target in INDEXING:
        ok = _integer_only(x, y) and not _in(y, x.args[1:]) and len(x.users) == 1
    else:
        ok = x.target in CASTS and _cast_ok(x, y, widen=False)
    return (y, None) if ok else None


def _hoist_one(gm: GraphModule, f: Node, comm: TPComm) -> Node | None:
    """Move f above the op that made its input; the new f, or None. Where x = L(y) has other readers, they keep
    x (their gradient is not partial) and f's readers get a copy of L reading f(y): L is a view, a cast or a
    per-token scaling, cheap. A factor's gradient read from f(y)'s summand is partial: it enters through f too."""
    x = f.args[0] if f.args else None
    found = _hoist_source(x) if comm_kind(f) == "f" and isinstance(x, Node) else None
    if found is None:
        return None
    y, factor = found
    if _val(y) is None or not _val(y).is_floating_point() or _numel(y) > _numel(x) or not _replicated(y):
        return None
    new_args = {}
    with gm.graph.inserting_before(x.next):  # where x reads y: an op writing y later changes neither
        for value, scale in ((y, False), (factor, True)):
            if isinstance(value, Node) and _val(value).is_floating_point():
                new_args[value] = call_comm(gm, "f", comm, (value,))
                new_args[value].meta["val"] = _val(value)
                if scale or f.meta.get(FXPAR_SCALE):
                    new_args[value].meta[FXPAR_SCALE] = True
        copy = gm.graph.node_copy(x, lambda a: new_args.get(a, a))
    f.replace_all_uses_with(copy)
    _erase_comm(gm, f)
    if not x.users:
        gm.graph.erase_node(x)
    return new_args[y]


def _merge_fs(gm: GraphModule) -> None:
    """Two f's of one value become the first, unless an op between them may write that value's storage ([Note:
    reads after mutation], passes/tensor_parallel/rewrite.py; passes/ir/aliasing.py says which ops write what)."""
    first: dict[Node, Node] = {}
    storage = Storage()
    for n in list(gm.graph.nodes):
        if comm_kind(n) == "f":
            earlier = first.setdefault(n.args[0], n)
            if earlier is not n:
                if not n.meta.get(FXPAR_SCALE):
                    earlier.meta.pop(FXPAR_SCALE, None)  # it now moves an activation's gradient too
                n.replace_all_uses_with(earlier)
                _erase_comm(gm, n)
            continue
        if comm_kind(n) is not None:
            continue  # g all-reduces its own input, read by nothing else; a scatter or gather writes a new tensor
        written = writes(n)
        if written is None:
            first.clear()
        elif written:
            first = {x: f for x, f in first.items() if not any(storage.may_alias(x, w) for w in written)}


def merge_comm_pass(gm: GraphModule, comm: TPComm) -> GraphModule:
    """Sink every g and hoist every f as far as [Note: moving a collective] allows, then merge f's; returns gm."""
    if comm.size == 1:
        return gm
    while _sink_step(gm, comm):
        pass
    todo = [n for n in gm.graph.nodes if comm_kind(n) == "f"]
    while todo:
        new = _hoist_one(gm, todo.pop(), comm)
        if new is not None:
            todo.append(new)
    _merge_fs(gm)
    gm.graph.lint()
    gm.recompile()
    return gm


__all__ = ["merge_comm_pass"]
