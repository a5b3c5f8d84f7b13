"""All-reduces in place where nothing else can read the tensor: f's and g's copies removed (Megatron's f and g
all-reduce in place).

g all-reduces a row-parallel GEMM's partial output, f the gradient of a region's input; torch.distributed's
all-reduce writes into its tensor, so by default each clones first: the tensor may be read again (a residual's
gradient handed to two branches, a value an op saved for its backward). The copy is dropped only where the graph
proves it is the sole reader:

    g   its input is a GEMM's output (linear, mm, addmm, bmm, fxpar's expert GEMMs), or a sum, difference or product
        (two partial sums merged into one g, passes/tensor_parallel/merge_comm.py), read by nothing but g: a fresh
        tensor that no backward saves (each of these ops' backward saves its inputs, if anything, not its output).
    f   every reader of its output is a GEMM taking it as the activation: each one's input gradient is a fresh
        tensor (the GEMM's backward computes it), and autograd sums several into a fresh buffer.

Anything else (a fused op, a norm, a view with other readers) keeps the copy. Why it is exact: the all-reduce's
result is the same; only which buffer holds it changes, and no other reader of that buffer exists.
"""
from __future__ import annotations

import copy

import torch
from torch.fx import GraphModule, Node

from fxpar.passes.ir.meta import comm_kind
from fxpar.passes.sharding.rules import GEMM_WEIGHT_ARG

aten = torch.ops.aten
_FRESH = set(GEMM_WEIGHT_ARG) | {aten.bmm.default, aten.matmul.default, aten.add.Tensor, aten.sub.Tensor,
                                 aten.sum.dim_IntList, aten.mul.Tensor}


def _activation_of_gemm(user: Node, value: Node) -> bool:
    """user is a GEMM that reads `value` as its activation (not as its weight)."""
    if user.op != "call_function" or user.target not in GEMM_WEIGHT_ARG:
        return False
    w_idx, x_idx, _ = GEMM_WEIGHT_ARG[user.target]
    return user.args[x_idx] is value and user.args[w_idx] is not value


def in_place_pass(gm: GraphModule) -> GraphModule:
    """Mark every f and g whose tensor no one else can read as in place (see the module docstring); returns gm."""
    for n in gm.graph.nodes:
        kind = comm_kind(n)
        if n.op != "call_module" or kind not in ("f", "g"):
            continue
        src = n.args[0]
        if kind == "g":
            safe = isinstance(src, Node) and src.op == "call_function" and src.target in _FRESH \
                and len(src.users) == 1
        else:
            safe = bool(n.users) and all(_activation_of_gemm(u, n) for u in n.users)
        if safe:  # a copy of the module: the graph kept for verify (which reads every value) still clones
            module = copy.copy(gm.get_submodule(n.target))
            module.in_place = True
            gm.add_submodule(n.target, module)
    return gm
