"""Fusion: residual + dropout(y + b) -> bias_dropout_add(y, b, residual, p, train), Megatron's bias-dropout-add, where
the dropout draws; a dropout that is an identity (p = 0, or eval) is removed.

See passes/fusion/match.py for "biased GEMM", and [Note: same random stream] in passes/ir/kernels.py for why the
fused op draws the same mask as the ops it replaces.
"""
from __future__ import annotations

import torch
from torch.fx import GraphModule, Node

from fxpar.passes.fusion.match import done, erase, is_call, match_biased, new_node, only_user, split_bias, val
from fxpar.passes.ir import kernels
from fxpar.passes.ir.meta import comm_kind
from fxpar.passes.ir.op_families import RANDOM

aten = torch.ops.aten


def _draws_random(n: Node) -> bool:
    if n.op == "call_module":
        return comm_kind(n) is None  # a collective draws nothing; any other module might
    if is_call(n, aten.dropout.default, kernels.bias_dropout_add):
        p, train = (n.args[1], n.args[2]) if n.target is aten.dropout.default else (n.args[3], n.args[4])
        return bool(train) and p > 0
    if is_call(n, aten.scaled_dot_product_attention.default):
        return n.kwargs.get("dropout_p", n.args[4] if len(n.args) > 4 else 0.0) > 0
    return is_call(n, *RANDOM)


def _random_between(a: Node, b: Node) -> bool:
    n = a.next
    while n is not b:
        if _draws_random(n):
            return True
        n = n.next
    return False


def identity_dropout_pass(gm: GraphModule) -> GraphModule:
    """aten.dropout(x, p, train) with p == 0 or train False is x: the node is removed (exact; it draws nothing).
    Returns gm."""
    changed = 0
    for drop in list(gm.graph.nodes):
        if is_call(drop, aten.dropout.default) and isinstance(drop.args[0], Node) and \
                (drop.args[1] == 0 or not drop.args[2]):
            drop.replace_all_uses_with(drop.args[0])
            erase(gm, [drop])
            changed += 1
    return done(gm, changed)


def bias_dropout_add_pass(gm: GraphModule) -> GraphModule:
    """residual + dropout(biased GEMM) -> bias_dropout_add(y, b, residual, p, train), where the dropout draws (p > 0
    in training: the fused op keeps a 1-byte mask instead of the float noise; a dropout that is an identity is
    removed by identity_dropout_pass instead, since fusing it only moves the bias out of the GEMM).

    Pattern: aten.dropout(y + b, p, train) whose only user is an add with a residual. Safe: the fused op adds the bias,
    draws its noise exactly as aten.dropout does at the add's position ([Note: same random stream] in
    passes/ir/kernels.py; the pass refuses when another random op runs between the dropout and the add), and adds the
    residual; backward keeps a 1-byte mask instead of the float noise.
    """
    changed = 0
    for drop in list(gm.graph.nodes):
        if not is_call(drop, aten.dropout.default) or not isinstance(drop.args[0], Node):
            continue
        add = only_user(drop)
        if not is_call(add, aten.add.Tensor) or add.kwargs or len(add.args) != 2 or add.args[0] is add.args[1]:
            continue
        residual = add.args[1] if add.args[0] is drop else add.args[0]
        m = match_biased(drop.args[0])
        p, train = drop.args[1], drop.args[2]
        if not (train and p > 0) or not isinstance(residual, Node) or m is None or only_user(m.out) is not drop:
            continue
        shapes = [val(x) for x in (residual, m.out, add)]
        if any(v is None for v in shapes) or len({tuple(v.shape) for v in shapes}) != 1:
            continue  # the add would broadcast: its gradients would need summing
        if _random_between(drop, add):
            continue
        y = split_bias(gm, m)
        fused = new_node(gm, add, kernels.bias_dropout_add, (y, m.bias, residual, p, train),
                         {"residual_first": add.args[0] is residual}, add, "bias_dropout_add", "bias_dropout_add")
        add.replace_all_uses_with(fused)
        erase(gm, [add, drop] + ([m.gemm] if m.kind == "add" else []))
        changed += 1
    return done(gm, changed)
