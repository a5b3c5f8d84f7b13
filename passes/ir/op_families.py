"""Op families: the sets of ATen ops that passes and rules recognise by what they do, in one place (as tinygrad's
GroupOp), so a family fixed here is fixed for every pass that reads it.

    VIEWS        reinterpret the same elements under another shape: view, reshape
    ROW_VIEWS    VIEWS and flatten: fold leading dims into rows (or back)
    LAYOUT       move or copy elements without changing their values: ROW_VIEWS, transposes, (un)squeeze, expand,
                 repeat, clone, alias
    TRANSPOSES   swap two dims of a 2-D operand (t, .T, transpose, permute)
    SPLITS       cut one dim into pieces: split, split_with_sizes, chunk
    CASTS        change the dtype only
    SOFTMAX, LOG_SOFTMAX, SDPA
    GEMMS        every matrix product, with or without a weight (the analysis' seeds are rules.GEMM_WEIGHT_ARG)
    MODE_CALLS   enter or leave an autocast or grad-mode region (passes/frontend/context_regions.py): a value made
                 on one side of one is not the value made on the other (no gradient, another dtype)
    WAIT         a functional collective's wait (`collective_op` names the collective a node starts)
    UNINITIALIZED  allocate a tensor without writing it (empty, empty_like, new_empty, empty_strided, ...): its
                 values are whatever the allocator left until an in-place op, an out= op or a copy_ writes them
`returns_view(op)`: the op's result aliases an input (a view: its schema says so; `_unsafe_view` without saying).
"""
from __future__ import annotations

import torch

aten = torch.ops.aten

VIEWS = frozenset({aten.view.default, aten.reshape.default, aten._unsafe_view.default})
ROW_VIEWS = VIEWS | {aten.flatten.using_ints}
LAYOUT = ROW_VIEWS | {
    aten.transpose.int, aten.permute.default, aten.unsqueeze.default, aten.squeeze.dim, aten.squeeze.dims,
    aten.unflatten.int, aten.expand.default, aten.repeat.default, aten.clone.default, aten.alias.default,
}
TRANSPOSES = frozenset({aten.t.default, aten.numpy_T.default, aten.transpose.int, aten.permute.default})
SPLITS = frozenset({aten.split.Tensor, aten.split_with_sizes.default, aten.chunk.default})
CASTS = frozenset({aten.to.dtype, aten._to_copy.default})
MODE_CALLS = frozenset({torch._C._set_grad_enabled, torch.amp.autocast_mode._enter_autocast,
                        torch.amp.autocast_mode._exit_autocast})
WAIT = torch.ops._c10d_functional.wait_tensor.default
SOFTMAX = frozenset({aten.softmax.int, aten._softmax.default})
LOG_SOFTMAX = frozenset({aten.log_softmax.int, aten._log_softmax.default})
SDPA = frozenset({aten.scaled_dot_product_attention.default, aten._scaled_dot_product_flash_attention_for_cpu.default})
UNINITIALIZED = frozenset({aten.empty.memory_format, aten.empty_like.default, aten.new_empty.default,
                           aten.new_empty_strided.default, aten.empty_strided.default, aten.empty_permuted.default})
GEMMS = frozenset({aten.linear.default, aten.mm.default, aten.addmm.default, aten.bmm.default, aten.matmul.default,
                   aten.einsum.default})


def collective_op(n) -> str | None:
    """The c10d functional collective an FX node starts ("all_reduce", "all_gather", "reduce_scatter"), or None (its
    wait included)."""
    schema = getattr(n.target, "_schema", None)
    if n.op != "call_function" or schema is None or not schema.name.startswith("_c10d_functional::"):
        return None
    op = schema.name.split("::", 1)[1]
    return None if op == "wait_tensor" else op.removesuffix("_").removesuffix("_into_tensor").removesuffix("_tensor")


def returns_view(op) -> bool:
    """An ATen op whose result is a view of an input: its schema marks the alias, or it is `_unsafe_view`."""
    return op is aten._unsafe_view.default or any(r.alias_info is not None for r in op._schema.returns)
