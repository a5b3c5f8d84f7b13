"""Pattern-matching helpers shared by the fusion passes (attention.py, dropout.py, gelu.py).

Glossary:
    biased GEMM   y + b where y is a GEMM output and b a 1-D bias along the last dim, in one of three spellings:
                  aten.linear(x, w, b) | aten.addmm(b, x, w) (Hugging Face Conv1D) | aten.add(gemm_out, b)
                  (the row-parallel bias that the tensor-parallel pass adds after g), optionally seen through a
                  view that keeps the last dim (GPT-2 flattens to 2-D around addmm).
    split         the biased GEMM becomes its bias-free GEMM (linear without b, or mm) and the fused op adds b.
Every node a fusion creates carries the metadata of the node whose value it computes (copy_meta: its value, module
stack and placement) and meta[FXPAR_FUSED] = the fusion's name.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.fx import GraphModule, Node

from fxpar.passes.ir.meta import FXPAR_FUSED, copy_meta
from fxpar.passes.ir.op_families import VIEWS

aten = torch.ops.aten
ASSERT = aten._assert_tensor_metadata.default


def is_call(n, *targets) -> bool:
    """n is a call_function node of one of `targets`."""
    return isinstance(n, Node) and n.op == "call_function" and n.target in targets


def val(n):
    """n's value as the graph's metadata has it (a FakeTensor of this rank's shape), or None."""
    v = n.meta.get("val") if isinstance(n, Node) else None
    return v if isinstance(v, torch.Tensor) else None


def ndim(n) -> int | None:
    v = val(n)
    return v.dim() if v is not None else None


def users_of(n: Node) -> list[Node]:
    """Users that consume the value (shape/dtype asserts only watch it)."""
    return [u for u in n.users if not is_call(u, ASSERT)]


def only_user(n: Node) -> Node | None:
    users = users_of(n)
    return users[0] if len(users) == 1 else None


def const_is(x, want: float, rel: float = 0.0) -> bool:
    """x is a Python number within rel of want."""
    return isinstance(x, (int, float)) and not isinstance(x, bool) and abs(x - want) <= rel * abs(want)


def scalar_operand(n: Node, target) -> tuple[Node, float] | None:
    """(tensor, c) if n is target(tensor, c) or target(c, tensor) with c a Python number."""
    if not is_call(n, target) or len(n.args) != 2 or n.kwargs:
        return None
    a, b = n.args
    if isinstance(a, Node) and isinstance(b, (int, float)):
        return a, b
    if isinstance(b, Node) and isinstance(a, (int, float)):
        return b, a
    return None


def erase(gm: GraphModule, nodes) -> None:
    """Erase `nodes` (now unused, with their assert users) in reverse graph order."""
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    for n in sorted(set(nodes), key=order.__getitem__, reverse=True):
        for u in list(n.users):
            if is_call(u, ASSERT):
                gm.graph.erase_node(u)
        assert not n.users, f"fxpar fusion: {n.name} still has users {list(n.users)}"
        gm.graph.erase_node(n)


def new_node(gm: GraphModule, before: Node, fn, args: tuple, kwargs: dict, like: Node, fusion: str,
             name: str) -> Node:
    """A call_function node before `before`, with `like`'s value metadata and the fusion's mark."""
    with gm.graph.inserting_before(before):
        node = gm.graph.create_node("call_function", fn, args, kwargs, name=name)
    copy_meta(like, node)
    node.meta[FXPAR_FUSED] = fusion
    return node


def done(gm: GraphModule, changed: int) -> GraphModule:
    """Lint and recompile only when something changed; return gm."""
    if changed:
        gm.graph.lint()
        gm.recompile()
    return gm


# ------------------------------------------------------------------------------------------------------ biased GEMM
@dataclass
class Biased:
    out: Node  # the node whose value is y + b (what the activation / dropout reads)
    gemm: Node  # linear / addmm / the add of the bias
    bias: Node
    kind: str  # "linear" | "addmm" | "add"
    view: Node | None = None


def keeps_last_dim(view: Node, src: Node) -> bool:
    a, b = val(view), val(src)
    return a is not None and b is not None and a.dim() >= 1 and a.shape[-1] == b.shape[-1]


def match_biased(n: Node) -> Biased | None:
    """n = y + b for a GEMM output y and a 1-D bias b (see the glossary)."""
    view = None
    if is_call(n, *VIEWS) and isinstance(n.args[0], Node) and only_user(n.args[0]) is n:
        if not keeps_last_dim(n, n.args[0]):
            return None
        view, n = n, n.args[0]
    if is_call(n, aten.linear.default) and len(n.args) == 3 and isinstance(n.args[2], Node):
        bias, kind = n.args[2], "linear"
    elif is_call(n, aten.addmm.default) and not n.kwargs and isinstance(n.args[0], Node):
        bias, kind = n.args[0], "addmm"
    elif is_call(n, aten.add.Tensor) and not n.kwargs and all(isinstance(a, Node) for a in n.args):
        ys = [a for a in n.args if ndim(a) not in (None, 1)]
        bs = [a for a in n.args if ndim(a) == 1]
        if len(ys) != 1 or len(bs) != 1 or val(n) is not None and val(ys[0]).shape != val(n).shape:
            return None  # the bias must not broadcast y to a bigger shape
        bias, kind = bs[0], "add"
    else:
        return None
    if ndim(bias) != 1:
        return None
    return Biased(view or n, n, bias, kind, view)


def split_bias(gm: GraphModule, m: Biased) -> Node:
    """Drop the bias from the GEMM; returns the node holding y (the pre-activation, bias-free)."""
    if m.kind == "linear":
        m.gemm.args = m.gemm.args[:2]
        m.gemm.meta[FXPAR_FUSED] = "bias_split"
    elif m.kind == "addmm":
        mm = new_node(gm, m.gemm, aten.mm.default, m.gemm.args[1:], {}, m.gemm, "bias_split", "mm")
        m.gemm.replace_all_uses_with(mm)
        gm.graph.erase_node(m.gemm)
        return m.view or mm
    else:  # y + b: y itself, read through the view if there is one
        y = next(a for a in m.gemm.args if a is not m.bias)
        if m.view is None:
            return y
        m.view.replace_input_with(m.gemm, y)
    return m.view or m.gemm
