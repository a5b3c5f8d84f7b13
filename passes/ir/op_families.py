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
    METADATA_ASSERTS  assert a tensor's metadata (export's guards; dropped by canonicalize)
    MASK_BUILDERS what an attention mask is built with from ids, sizes and constants (a mask proven causal)
    RANDOM       draw random numbers (dropout, bernoulli, rand*, SDPA, the fused bias_dropout_add)
    SAME_VALUES  pass each element's value through unchanged (views, copies, slices): token ids stay ids
    SAME_DIMS    keep every dim where it is (copies, casts, dropout, detach)
    PICKS        take pieces out of one dim: select, unbind
    REDUCTIONS   sum or mean over dims (a partial sum stays partial)
    ORDERINGS    order or rank along a dim (topk, sort, cumsum)
    VALUES_AND_INDICES  return (values, indices): max/min over a dim, topk, sort
    INDEXING     take elements by index or range (index, index_select, select, slice, narrow)
    SUMS         sums and negation (linear in their input)
    SCALINGS     multiply or divide
    ADDS         add or subtract (in place too)
    TOKEN_MEANS  the losses that may average over valid targets (cross_entropy, nll_loss)
    DECOMPOSED_GEMMS  the GEMMs of a decomposed (joint) program: mm, addmm, bmm
    FILLS_LIKE   a tensor shaped like another, from no value of it (zeros_like, new_full, ...): no gradient flows
`returns_view(op)`: the op's result aliases an input (a view: its schema says so; `_unsafe_view` without saying).
"""
from __future__ import annotations

import torch
from torch.fx import Node

from fxpar.passes.ir import kernels

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
SQUEEZES = frozenset({aten.unsqueeze.default, aten.squeeze.dim})  # one dim added or dropped
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
METADATA_ASSERTS = frozenset({aten._assert_tensor_metadata.default})
MASK_BUILDERS = frozenset({
    aten.alias.default, aten.slice.Tensor, aten.view.default, aten.reshape.default, aten.unsqueeze.default,
    aten.squeeze.dim, aten.expand.default, aten.eq.Scalar, aten.ne.Scalar, aten.logical_not.default,
    aten.bitwise_not.default, aten.to.dtype, aten._to_copy.default, aten.detach.default, aten.clone.default,
    aten.select.int, aten.lt.Scalar, aten.le.Scalar, aten.gt.Scalar, aten.ge.Scalar,
    # constants built in the graph: deterministic functions of sizes and numbers
    aten.ones.default, aten.zeros.default, aten.full.default, aten.arange.default, aten.arange.start,
    aten.arange.start_step, aten.triu.default, aten.tril.default, aten.lt.Tensor, aten.le.Tensor,
    aten.gt.Tensor, aten.ge.Tensor, aten.eq.Tensor, aten.ne.Tensor, aten.masked_fill.Scalar,
    aten.mul.Tensor, aten.add.Tensor, aten.sub.Tensor, aten.logical_and.default, aten.logical_or.default,
})
RANDOM = frozenset({
    aten.dropout.default, aten.native_dropout.default, aten.bernoulli.default, aten.bernoulli.p,
    aten.bernoulli_.float, aten.rand_like.default, aten.randn_like.default, aten.rand.default,
    aten.randn.default, aten.scaled_dot_product_attention.default, kernels.bias_dropout_add,
})
SAME_VALUES = frozenset({
    aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.clone.default,
    aten.contiguous.default, aten.alias.default, aten._to_copy.default, aten.flatten.using_ints,
    aten.unsqueeze.default, aten.squeeze.dim, aten.slice.Tensor, aten.select.int, aten.detach.default,
    aten.lift_fresh_copy.default,
})
SAME_DIMS = frozenset({
    aten.clone.default, aten.contiguous.default, aten.alias.default, aten.dropout.default, aten._to_copy.default,
    aten.to.dtype, aten.to.dtype_layout, aten.to.device, aten.detach.default,
})
PICKS = frozenset({aten.select.int, aten.unbind.int})
REDUCTIONS = frozenset({aten.sum.default, aten.sum.dim_IntList, aten.mean.default, aten.mean.dim})
ORDERINGS = frozenset({aten.topk.default, aten.sort.default, aten.sort.stable, aten.cumsum.default})
VALUES_AND_INDICES = frozenset({aten.max.dim, aten.min.dim, aten.topk.default, aten.sort.default, aten.sort.stable})
INDEXING = frozenset({aten.index.Tensor, aten.index_select.default, aten.select.int, aten.slice.Tensor,
                      aten.narrow.default})
SUMS = frozenset({aten.sum.dim_IntList, aten.sum.default, aten.neg.default})
PRODUCTS = frozenset({aten.mul.Tensor, aten.mul.Scalar})
QUOTIENTS = frozenset({aten.div.Tensor, aten.div.Scalar})
SCALINGS = PRODUCTS | QUOTIENTS
ADDS = frozenset({aten.add.Tensor, aten.sub.Tensor, aten.add_.Tensor, aten.sub_.Tensor})
TOKEN_MEANS = frozenset({aten.cross_entropy_loss.default, aten.nll_loss_nd.default, aten.nll_loss.default})
DECOMPOSED_GEMMS = frozenset({aten.mm.default, aten.addmm.default, aten.bmm.default})
FILLS_LIKE = frozenset({aten.zeros_like.default, aten.ones_like.default, aten.empty_like.default, aten.full_like.default,
                        aten.new_zeros.default, aten.new_ones.default, aten.new_empty.default, aten.new_full.default})

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


def rows_as_2d(node: Node) -> Node | None:
    """The only reader of node, when it is a view of its rows as 2-D (`x.view(-1, h)`), else None."""
    if len(node.users) != 1:
        return None
    view = next(iter(node.users))
    shape, full = view.meta.get("val"), node.meta.get("val")
    if view.op != "call_function" or view.target not in ROW_VIEWS or shape is None or full is None:
        return None
    return view if shape.dim() == 2 and shape.shape[-1] == full.shape[-1] and full.dim() > 2 else None


def gemm_reading(user: Node, node: Node) -> tuple | None:
    """("linear" or "mm", weight, bias or None) of a GEMM reading node as its input and only there, else None."""
    if user.op != "call_function" or user.kwargs:
        return None
    args = user.args
    if user.target is aten.linear.default and args[0] is node and node not in args[1:]:
        return "linear", args[1], args[2] if len(args) > 2 else None
    if user.target is aten.mm.default and args[0] is node and args[1] is not node:
        return "mm", args[1], None
    if user.target is aten.addmm.default and len(args) == 3 and args[1] is node and node not in (args[0], args[2]):
        return "mm", args[2], args[0]
    return None
