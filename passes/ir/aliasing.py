"""Which values may share storage, and which ops write into it: read from the ops' schemas, never guessed.

An aten op's schema says whether its result aliases an argument (`view(Tensor(a) self) -> Tensor(a)`) and which
arguments it writes (`index_put_(Tensor(a!) self, ...)`). A value's roots are the nodes whose storage it may live
in: an op with a fresh result is its own root; a view's roots are its source's; anything the schema cannot tell
(a call_module, a Python function, an op without a schema) is a root itself and may alias each of its inputs.
Graph inputs and attributes may alias one another (a caller can pass one tensor twice); fresh results alias
nothing made before them. `unwritten(graph)`: the values that are memory no op has written yet (`empty_like`).
"""
from __future__ import annotations

import operator

from torch.fx import Graph, Node

from fxpar.passes.ir.op_families import UNINITIALIZED, returns_view


def _schema(n: Node):
    return getattr(n.target, "_schema", None) if n.op == "call_function" else None


def _tensor_args(n: Node, schema, want) -> list[Node]:
    """The Node arguments of n whose schema argument satisfies `want(alias_info)`."""
    out = []
    for i, arg in enumerate(schema.arguments):
        if arg.alias_info is None or not want(arg.alias_info):
            continue
        v = n.args[i] if i < len(n.args) else n.kwargs.get(arg.name)
        out.extend(x for x in (v if isinstance(v, (list, tuple)) else [v]) if isinstance(x, Node))
    return out


class Storage:
    """Alias facts of one graph; `roots` is memoized, so build one per pass run."""

    def __init__(self):
        self._roots: dict[Node, frozenset[Node]] = {}

    def roots(self, n: Node) -> frozenset[Node]:
        if n in self._roots:
            return self._roots[n]
        schema = _schema(n)
        if n.op in ("placeholder", "get_attr"):
            out = frozenset({n})
        elif schema is not None and all(r.alias_info is None for r in schema.returns):
            out = frozenset({n})  # a fresh tensor
        elif schema is not None:
            out = frozenset().union(*(self.roots(a) for a in _tensor_args(n, schema, lambda info: True)))
        else:  # unknown: its own storage, or any of its inputs'
            out = frozenset({n}).union(*(self.roots(a) for a in n.all_input_nodes))
        self._roots[n] = out
        return out

    def may_alias(self, x: Node, y: Node) -> bool:
        rx, ry = self.roots(x), self.roots(y)
        if rx & ry:
            return True
        inputs = ("placeholder", "get_attr")
        return any(a.op in inputs for a in rx) and any(b.op in inputs for b in ry)


def _pure_python(target) -> bool:
    """An operator-module function that writes nothing (getitem, arithmetic on sizes): not setitem, not `iadd`."""
    name = getattr(target, "__name__", "")
    return getattr(target, "__module__", None) == "_operator" and not name.startswith(("i", "set", "del", "__i"))


def writes(n: Node) -> list[Node] | None:
    """The values n writes in place: [] where it writes nothing, None where it may write anything (a call_module,
    a function without a schema, a mutable op whose written arguments the schema does not name)."""
    if n.op in ("placeholder", "get_attr", "output"):
        return []
    schema = _schema(n)
    if schema is None:
        return [] if n.op == "call_function" and _pure_python(n.target) else None
    if not schema.is_mutable:
        return []
    written = _tensor_args(n, schema, lambda info: info.is_write)
    return written or None


def unwritten(graph: Graph) -> set[Node]:
    """The nodes whose value is memory nothing has written yet: the result of an UNINITIALIZED op (`empty_like`), and
    the views of it (and items of a split of it) taken before any op writes into its storage (an in-place op, an
    out= op, a copy_; an op whose writes the schema does not name counts as writing each of its inputs). Their
    values are whatever the allocator left there; what the program reads after the writes is a value like any
    other."""
    storage, blank, out = Storage(), set(), set()  # blank: the roots of UNINITIALIZED results not yet written
    for n in graph.nodes:
        schema = _schema(n)
        if schema is not None and n.target in UNINITIALIZED:
            blank.add(n)
            out.add(n)
        elif (schema is not None and not schema.is_mutable and returns_view(n.target)) \
                or (n.op == "call_function" and n.target is operator.getitem and isinstance(n.args[0], Node)):
            roots = storage.roots(n.args[0] if n.target is operator.getitem else n)
            if roots and roots <= blank:
                out.add(n)
        written = writes(n)
        for w in (n.all_input_nodes if written is None else written):
            blank -= storage.roots(w)
    return out


__all__ = ["Storage", "unwritten", "writes"]
