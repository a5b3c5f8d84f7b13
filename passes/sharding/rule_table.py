"""The sharding rules by op: one table, built once from the rule families of passes/sharding/rules.py and the losses' of
passes/sharding/loss_rules.py (so neither module fills the other's registry, and neither imports the other back).

    rule_for(node)   the rule of the node's op family, or None (the analysis then refuses the sharding)
    register_rule    a user's declaration for an op fxpar cannot see into (a custom op with a fake), in one line:
                     fxpar.register_rule(torch.ops.mylib.swish, "pointwise")

An OpOverloadPacket in a row stands for all its overloads, an OpOverload for itself only.
"""
from __future__ import annotations

import operator
from types import MappingProxyType

import torch
from torch.fx import Node

from fxpar.passes.sharding.mixer_rules import baddbmm, batched_matmul, conv1d, einsum, repeat_interleave, sdpa
from fxpar.passes.sharding.rules import (GEMM_WEIGHT_ARG, along_dim, cat, complex_view, constant_like, copy_into,
                                         elementwise, expand, gemm, getitem, like_input, norm, pad, permute, reduction,
                                         reshape_as, select, slice_, softmax, split, squeeze, stack, tokenwise,
                                         transpose, triangular, unsqueeze, view)
from fxpar.passes.sharding.loss_rules import LOSS_RULES

aten = torch.ops.aten

FAMILIES = (  # (rule, ops it covers)
    (elementwise, (
        aten.add, aten.sub, aten.mul, aten.div, aten.neg, aten.pow, aten.masked_fill, aten.clamp,
        aten.exp, aten.log, aten.tanh, aten.sigmoid, aten.silu, aten.gelu, aten.relu, aten.erf, aten.rsqrt, aten.sqrt,
        aten.sin, aten.cos, aten.abs, aten.square, aten.reciprocal, aten._to_copy, aten.contiguous,
        aten.clone, aten.alias, aten.dropout, aten.eq, aten.ne, aten.lt, aten.le, aten.gt, aten.ge,
        aten.logical_not, aten.logical_and, aten.logical_or, aten.bitwise_and, aten.__and__, aten.__or__,
        aten.leaky_relu, aten.elu, aten.hardtanh, aten.softplus, aten.mish, aten.detach, aten.lift_fresh_copy,
        aten.maximum, aten.minimum, aten.rsub, aten.addcmul, aten.expm1, aten.log1p, aten.sign, aten.floor,
        aten.ceil, aten.round, aten.trunc, aten.hardsigmoid, aten.hardswish, aten.logical_xor, aten.fmod,
        aten.remainder,
        aten.min.other, aten.max.other,  # min(a, b) / max(a, b); not min.dim (indices)
        aten.where.self, aten.where.ScalarSelf, aten.where.ScalarOther, aten.where.Scalar,  # not where(cond)
        aten.to.dtype, aten.to.dtype_layout, aten.to.device,  # not to(other)
    )),
    (like_input, (aten.type_as.default, aten.to.other)),
    (view, (aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.unflatten.int,
            aten.flatten.using_ints)),  # not view(dtype): it reinterprets bits
    (expand, (aten.expand,)),
    (complex_view, (aten.view_as_complex, aten.view_as_real)),
    (transpose, (aten.transpose,)),
    (permute, (aten.permute,)),
    (unsqueeze, (aten.unsqueeze,)),
    (squeeze, (aten.squeeze,)),
    (select, (aten.select,)),
    (slice_, (aten.slice,)),
    (split, (aten.split, aten.split_with_sizes, aten.unbind, aten.chunk, aten.tensor_split)),
    (getitem, (operator.getitem,)),
    (cat, (aten.cat,)),
    (pad, (aten.pad.default, aten.constant_pad_nd.default)),
    (triangular, (aten.tril.default, aten.triu.default)),
    (copy_into, (aten.copy_.default,)),
    (constant_like, (aten.zeros_like.default, aten.ones_like.default, aten.empty_like.default,
                     aten.full_like.default)),
    (stack, (aten.stack,)),
    (softmax, (aten.softmax, aten._softmax, aten.log_softmax, aten._log_softmax)),
    (reduction, (aten.mean, aten.sum, aten.amax, aten.amin, aten.var, aten.linalg_vector_norm)),
    (along_dim, (aten.max.dim, aten.min.dim, aten.argmax.default, aten.argmin.default, aten.topk.default,
                 aten.sort.default, aten.sort.stable, aten.cumsum.default)),
    (reshape_as, (aten.reshape_as.default,)),
    (norm, (aten.layer_norm, aten.rms_norm)),
    (sdpa, (aten.scaled_dot_product_attention,)),
    (batched_matmul, (aten.matmul, aten.bmm)),
    (baddbmm, (aten.baddbmm.default,)),
    (einsum, (aten.einsum.default,)),
    (repeat_interleave, (aten.repeat_interleave,)),
    (conv1d, (aten.conv1d.default, aten.conv1d.padding)),
    (gemm, tuple(GEMM_WEIGHT_ARG)),
    *((rule, (op,)) for op, rule in LOSS_RULES.items()),
)


def _overloads(op) -> list:
    if isinstance(op, torch._ops.OpOverloadPacket):
        return [getattr(op, name) for name in op.overloads()]
    return [op]


RULES = MappingProxyType({overload: rule for rule, ops in FAMILIES for op in ops for overload in _overloads(op)})


DECLARED: dict = {}  # op overload -> the rule a user declared for it (register_rule)
KINDS = {"pointwise": elementwise, "tokenwise": tokenwise}


def register_rule(op, rule) -> None:
    """Declare how an op fxpar cannot see into (a torch.library custom op with a fake: a Triton or C++ kernel) acts
    on placements, for every graph fxpar compiles afterwards:

        "pointwise"   each output element from the same element of every input, broadcast as torch broadcasts
                      (an activation): sharded as its sharded inputs, all alike
        "tokenwise"   each output row from the same row of its first input over the last dim (a fused norm, a
                      per-head op): sharded on any dim but the last; its other inputs (weights) read whole
        a function    rule(node, ctx) -> Decision, in the form of fxpar's own (passes/sharding/rules.py)

    An op without a declaration keeps its region replicated, and the plan names it and this fix. A declaration is a
    promise about the kernel: fxpar checks each rewrite against the unmodified model only where you run
    `fxpar check` or `fxpar.verify`."""
    if isinstance(rule, str):
        if rule not in KINDS:
            raise ValueError(f"fxpar.register_rule: {rule!r} is not one of {sorted(KINDS)}; or pass a rule function "
                             "rule(node, ctx) -> Decision (passes/sharding/rules.py)")
        rule = KINDS[rule]
    elif not callable(rule):
        raise TypeError(f"fxpar.register_rule: the rule must be one of {sorted(KINDS)} or a function, got {rule!r}")
    if not isinstance(op, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        raise TypeError(f"fxpar.register_rule: {op!r} is not an op; pass it as torch.ops.<namespace>.<name>")
    for overload in _overloads(op):
        if overload in RULES:
            raise ValueError(f"fxpar.register_rule: {overload} has fxpar's own rule ({RULES[overload].__name__})")
        DECLARED[overload] = rule


def rule_for(node: Node):
    """The rule of this node's op family (or a user's declaration), or None (the analysis then refuses the
    sharding)."""
    if node.op != "call_function":
        return None
    return RULES.get(node.target) or DECLARED.get(node.target)


def undeclared(target) -> str:
    """The one-line fix for an op from outside aten with no rule, or ""."""
    if not isinstance(target, torch._ops.OpOverload) or target.namespace in ("aten", "prim", "fxpar"):
        return ""
    return (f"; declare what it does in one line: fxpar.register_rule(torch.ops.{target.namespace}."
            f"{target._opname}, \"pointwise\" or \"tokenwise\")")
