"""Fusion: GPT-2's GeLU written out as one aten.gelu, and bias + GeLU folded with the next GEMM (Megatron's
bias-GeLU with recomputation).

    gelu_pass (default)        NewGELU written out (8 elementwise ops, 6 saved tensors) -> aten.gelu(x, "tanh"):
                               one kernel each way with torch's own autograd, the activation saved as eager does
    bias_gelu_pass (with recompute="selective": it trades compute for memory, and without a fused kernel behind
    it that costs time, so it is not a default)
        gelu(y + b)            -> bias_gelu(y, b)
        linear(gelu(y + b), w) -> bias_gelu_linear(y, b, w)   when the GEMM is the activation's only user

GeLU is aten.gelu (erf or tanh) or GPT-2's NewGELU written out. See passes/fusion/match.py for "biased GEMM".
"""
from __future__ import annotations

import math

import torch
from torch.fx import GraphModule, Node

from fxpar.passes.ir import kernels
from fxpar.passes.fusion.match import (const_is, done, erase, is_call, keeps_last_dim, match_biased, ndim, new_node,
                                       only_user, scalar_operand, split_bias, users_of)
from fxpar.passes.ir.op_families import VIEWS

aten = torch.ops.aten
SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)


def _match_gelu(n: Node) -> tuple[Node, str, list[Node]] | None:
    """(x, approximate, pattern nodes) if n computes gelu(x): aten.gelu, or GPT-2's NewGELU written out."""
    if is_call(n, aten.gelu.default) and isinstance(n.args[0], Node):
        approximate = n.kwargs.get("approximate", n.args[1] if len(n.args) > 1 else "none")
        return n.args[0], approximate, [n]
    return _match_new_gelu(n)


def _match_new_gelu(n: Node) -> tuple[Node, str, list[Node]] | None:
    """0.5 * x * (1 + tanh(sqrt(2/pi) * (x + 0.044715 * x^3))), as torch.export writes GPT-2's NewGELU."""
    if not is_call(n, aten.mul.Tensor) or len(n.args) != 2 or not all(isinstance(a, Node) for a in n.args):
        return None
    for half, one_plus in (n.args, n.args[::-1]):
        found = _new_gelu_parts(half, one_plus)
        if found is None:
            continue
        x, nodes = found
        nodes.append(n)
        inside = set(nodes)
        if any(u not in inside for m in nodes[:-1] for u in users_of(m)) or set(users_of(x)) - inside:
            continue  # an intermediate is read elsewhere: fusing would drop it
        return x, "tanh", nodes
    return None


def _new_gelu_parts(half: Node, one_plus: Node) -> tuple[Node, list[Node]] | None:
    """(x, [0.5*x, x^3, 0.044715*x^3, x + ..., sqrt(2/pi)*(...), tanh, 1 + tanh]) or None."""
    h, t1 = scalar_operand(half, aten.mul.Tensor), scalar_operand(one_plus, aten.add.Tensor)
    if h is None or not const_is(h[1], 0.5) or t1 is None or not const_is(t1[1], 1.0):
        return None
    x, tanh = h[0], t1[0]
    if not is_call(tanh, aten.tanh.default):
        return None
    inner = scalar_operand(tanh.args[0], aten.mul.Tensor)
    if inner is None or not const_is(inner[1], SQRT_2_OVER_PI, 1e-6) or not is_call(inner[0], aten.add.Tensor):
        return None
    s = inner[0]
    if len(s.args) != 2 or s.kwargs or x not in s.args or s.args[0] is s.args[1]:
        return None
    w = s.args[1] if s.args[0] is x else s.args[0]
    cube = scalar_operand(w, aten.mul.Tensor) if isinstance(w, Node) else None
    if cube is None or not const_is(cube[1], 0.044715) or not is_call(cube[0], aten.pow.Tensor_Scalar):
        return None
    pow_ = cube[0]
    if pow_.args[0] is not x or not const_is(pow_.args[1], 3.0):
        return None
    return x, [half, pow_, w, s, tanh.args[0], tanh, one_plus]


def _second_gemm(h: Node) -> tuple[Node, Node | None, dict] | None:
    """(gemm, view, how) if the activation h's only consumer is a GEMM: linear(h, w[, b]) or view -> mm/addmm."""
    user = only_user(h)
    if is_call(user, aten.linear.default) and user.args[0] is h and len(users_of(h)) == len(h.users):
        bias = user.args[2] if len(user.args) > 2 else None
        return user, None, dict(weight=user.args[1], out_bias=bias, flat_shape=None, layout="linear")
    if is_call(user, *VIEWS) and keeps_last_dim(user, h) and ndim(user) == 2 and len(users_of(h)) == len(h.users):
        gemm = only_user(user)
        if is_call(gemm, aten.mm.default) and gemm.args[0] is user:
            return gemm, user, dict(weight=gemm.args[1], out_bias=None, flat_shape=list(user.args[1]), layout="mm")
        if is_call(gemm, aten.addmm.default) and not gemm.kwargs and gemm.args[1] is user:
            return gemm, user, dict(weight=gemm.args[2], out_bias=gemm.args[0], flat_shape=list(user.args[1]),
                                    layout="mm")
    return None


def gelu_pass(gm: GraphModule) -> GraphModule:
    """NewGELU written out -> aten.gelu(x, approximate="tanh"), the same formula to fp32 rounding. Returns gm."""
    changed = 0
    for node in list(gm.graph.nodes):
        found = _match_new_gelu(node)  # a match's nodes all precede `node`: nothing later is erased
        if found is None:
            continue
        x, approximate, nodes = found
        fused = new_node(gm, node, aten.gelu.default, (x,), dict(approximate=approximate), node, "gelu", "gelu")
        node.replace_all_uses_with(fused)
        erase(gm, nodes)
        changed += 1
    return done(gm, changed)


def bias_gelu_pass(gm: GraphModule) -> GraphModule:
    """gelu(biased GEMM) -> bias_gelu(y, b); folded with the next GEMM as bias_gelu_linear when that is its only user.

    Pattern: y + b (see the glossary) whose only user is gelu (erf, tanh, or NewGELU written out), optionally followed
    by a GEMM that is the activation's only user. Safe: y + b and gelu are the same ATen ops in the same order (NewGELU
    becomes aten.gelu(approximate="tanh"), the same formula to fp32 rounding), and the folded GEMM is the same kernel;
    only backward differs, recomputing gelu(y + b) from the saved y, which saves one [b, s, 4h/t] activation per MLP.
    """
    changed, gone = 0, set()
    for node in list(gm.graph.nodes):
        found = None if node in gone else _match_gelu(node)
        if found is None:
            continue
        x, approximate, gelu_nodes = found
        m = match_biased(x)
        if m is None or any(u not in gelu_nodes for u in users_of(x)):
            continue
        consumer = _second_gemm(node)
        y = split_bias(gm, m)
        dead = gelu_nodes + ([m.gemm] if m.kind == "add" else [])
        if consumer is None:
            fused = new_node(gm, node, kernels.bias_gelu, (y, m.bias, approximate), {}, node, "bias_gelu",
                         "bias_gelu")
            node.replace_all_uses_with(fused)
        else:
            gemm, view, how = consumer
            fused = new_node(gm, gemm, kernels.bias_gelu_linear, (y, m.bias),
                             dict(approximate=approximate, **how), gemm, "bias_gelu_linear", "bias_gelu_linear")
            gemm.replace_all_uses_with(fused)
            dead += [gemm] + ([view] if view is not None else [])
        erase(gm, dead)
        gone.update(dead)
        changed += 1
    return done(gm, changed)
