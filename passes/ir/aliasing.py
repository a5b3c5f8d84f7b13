"""Which values may share storage, and which ops write into it: read from the ops' schemas, never guessed.

An aten op's schema says whether its result aliases an argument (`view(Tensor(a) self) -> Tensor(a)`) and which
arguments it writes (`index_put_(Tensor(a!) self, ...)`). A value's roots are the nodes whose storage it may live
in: an op with a fresh result is its own root; a view's roots are its source's; anything the schema cannot tell
(a call_module, a Python function, an op without a schema) is a root itself and may alias each of its inputs.
Graph inputs and attributes may alias one another (a caller can pass one tensor twice); fresh results alias
nothing made before them.
"""
from __future__ import annotations

from torch.fx import Node


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


__all__ = ["Storage", "writes"]
