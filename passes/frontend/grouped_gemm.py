"""Grouped GEMMs: mixture-of-experts layers that multiply each expert's rows by its own 3-D weight slice.

Hugging Face's experts (Mixtral, Qwen-MoE, OLMoE, DeepSeek, ... through `use_experts_implementation`) store the
weights as parameters [E, out, in] and, with tokens sorted by expert, call

    transformers::grouped_mm_fallback(x_sorted, W.transpose(-2, -1), offs)     offs: cumulative rows per expert

which computes `out[offs[e-1]:offs[e]] = x[offs[e-1]:offs[e]] @ W[e].T`, with the backward of the same loop (its
source in transformers/integrations/moe.py). GEMM forms (passes/frontend/gemm_forms.py) rewrite that call, and only that
spelling, as `fxpar::grouped_linear(x, W, offs)`: F.linear per expert, weight [E, out, in] read directly. Experts that
store their weights [E, in, out] (GPT-OSS, Aria) pass W itself: that call becomes `fxpar::grouped_mm(x, W, offs)`,
the same loop with W's `out` dim (2) the output features. The rules
then treat it as any GEMM with a weight parameter (rules.GEMM_WEIGHT_ARG): column-parallel over `out` (gate|up
parts found from the chunk that follows), row-parallel over `in`, g after the second: each expert's MLP is split
as Megatron splits a dense one, the router and the token sorting replicated. Expert parallelism is not done.

Experts written with batched GEMMs over weights stored [E, in, out] (Llama 4's `torch.bmm(x.view(E, -1, h), W)`)
become `fxpar::expert_bmm(x, W)`, the same bmm, with W's `out` dim (2) the output features and its `in` dim (1) the
contracted one: the same column- then row-parallel split.

Why it is exact: the same torch.mm calls on the same strided views as the call it replaces (W[e].t() is
W.transpose(-2, -1)[e]), forward and backward; expert_bmm's backward is autograd's of bmm, op for op.
"""
from __future__ import annotations

import torch
from torch.fx import Node

aten = torch.ops.aten


def _grouped_forward(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """out[rows of e] = x[rows of e] @ w[e]; w [E, in, out] (maybe a transposed view): transformers' loop."""
    out = torch.zeros(x.size(0), w.size(2), device=x.device, dtype=x.dtype)
    start = 0
    for e, end in enumerate(offs.tolist()):
        if end > start:
            torch.mm(x[start:end], w[e], out=out[start:end])
        start = end
    return out


def _grouped_backward(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor, grad: torch.Tensor):
    """(grad_x, grad_w) of _grouped_forward, grad_w laid out as w is: transformers' backward loop."""
    grad_x, grad_w = torch.zeros_like(x), torch.zeros_like(w)
    start = 0
    for e, end in enumerate(offs.tolist()):
        if end > start:
            torch.mm(grad[start:end], w[e].t(), out=grad_x[start:end])
            torch.mm(x[start:end].t(), grad[start:end], out=grad_w[e])
        start = end
    return grad_x, grad_w


@torch.library.custom_op("fxpar::grouped_linear", mutates_args=())
def grouped_linear(x: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """out[rows of e] = x[rows of e] @ weight[e].T; x [S, in] sorted by group, weight [E, out, in], offs [E]."""
    return _grouped_forward(x, weight.transpose(-2, -1), offs)


@grouped_linear.register_fake
def _(x, weight, offs):
    if x.dim() != 2 or weight.dim() != 3 or x.size(1) != weight.size(2) or offs.size(0) != weight.size(0):
        raise ValueError(f"fxpar::grouped_linear: x {tuple(x.shape)}, weight {tuple(weight.shape)} [E, out, in], "
                         f"offs {tuple(offs.shape)} do not fit")
    return x.new_empty(x.size(0), weight.size(1))


@torch.library.custom_op("fxpar::grouped_linear_backward", mutates_args=())
def grouped_linear_backward(x: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor,
                            grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    grad_x, grad_wt = _grouped_backward(x, weight.transpose(-2, -1), offs, grad)
    return grad_x, grad_wt.transpose(-2, -1).contiguous()


@grouped_linear_backward.register_fake
def _(x, weight, offs, grad):
    return torch.empty_like(x), torch.empty_like(weight)


def _setup(ctx, inputs, output):
    ctx.save_for_backward(inputs[0], inputs[1])
    ctx.offs = inputs[2]


def _backward(ctx, grad):
    x, weight = ctx.saved_tensors
    grad_x, grad_w = torch.ops.fxpar.grouped_linear_backward(x, weight, ctx.offs, grad)
    return grad_x, grad_w, None


grouped_linear.register_autograd(_backward, setup_context=_setup)

GROUPED_LINEAR = torch.ops.fxpar.grouped_linear.default


@torch.library.custom_op("fxpar::grouped_mm", mutates_args=())
def grouped_mm(x: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """out[rows of e] = x[rows of e] @ weight[e]; x [S, in] sorted by group, weight [E, in, out], offs [E]."""
    return _grouped_forward(x, weight, offs)


@grouped_mm.register_fake
def _(x, weight, offs):
    if x.dim() != 2 or weight.dim() != 3 or x.size(1) != weight.size(1) or offs.size(0) != weight.size(0):
        raise ValueError(f"fxpar::grouped_mm: x {tuple(x.shape)}, weight {tuple(weight.shape)} [E, in, out], "
                         f"offs {tuple(offs.shape)} do not fit")
    return x.new_empty(x.size(0), weight.size(2))


@torch.library.custom_op("fxpar::grouped_mm_backward", mutates_args=())
def grouped_mm_backward(x: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor,
                        grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return _grouped_backward(x, weight, offs, grad)


@grouped_mm_backward.register_fake
def _(x, weight, offs, grad):
    return torch.empty_like(x), torch.empty_like(weight)


def _backward_mm(ctx, grad):
    x, weight = ctx.saved_tensors
    grad_x, grad_w = torch.ops.fxpar.grouped_mm_backward(x, weight, ctx.offs, grad)
    return grad_x, grad_w, None


grouped_mm.register_autograd(_backward_mm, setup_context=_setup)

GROUPED_MM = torch.ops.fxpar.grouped_mm.default


@torch.library.custom_op("fxpar::expert_bmm", mutates_args=())
def expert_bmm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """torch.bmm(x, weight): x [E, rows, in], weight [E, in, out] (a parameter, one slice per expert)."""
    return torch.bmm(x, weight)


@expert_bmm.register_fake
def _(x, weight):
    if x.dim() != 3 or weight.dim() != 3 or x.size(0) != weight.size(0) or x.size(2) != weight.size(1):
        raise ValueError(f"fxpar::expert_bmm: x {tuple(x.shape)}, weight {tuple(weight.shape)} [E, in, out] do not fit")
    return x.new_empty(x.size(0), x.size(1), weight.size(2))


def _setup_bmm(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _backward_bmm(ctx, grad):
    x, weight = ctx.saved_tensors  # as autograd differentiates bmm (tools/autograd/derivatives.yaml)
    return grad.bmm(weight.transpose(1, 2)), x.transpose(1, 2).bmm(grad)


expert_bmm.register_autograd(_backward_bmm, setup_context=_setup_bmm)

EXPERT_BMM = torch.ops.fxpar.expert_bmm.default


def expert_bmm_form(n: Node, params: set[Node]) -> tuple[Node, Node] | None:
    """(x, W) when n is aten.bmm(x, W) with W a 3-D parameter [E, in, out]."""
    if n.op != "call_function" or n.target is not aten.bmm.default or n.args[1] not in params:
        return None
    return n.args[0], n.args[1]


_HF_GROUPED_MM = "transformers.grouped_mm_fallback.default"  # str() of the OpOverload, present once transformers is


def grouped_form(n: Node, params: set[Node]):
    """(GROUPED_LINEAR, (x, W, offs)) when n is transformers' grouped_mm_fallback(x, W.transpose(-2, -1), offs), W a
    3-D parameter [E, out, in]; (GROUPED_MM, (x, W, offs)) when it passes W [E, in, out] itself; else None."""
    if n.op != "call_function" or str(n.target) != _HF_GROUPED_MM or len(n.args) != 3 or n.kwargs:
        return None
    x, wt, offs = n.args
    if wt in params and wt.meta["val"].dim() == 3:
        return GROUPED_MM, (x, wt, offs)
    if not (isinstance(wt, Node) and wt.op == "call_function" and wt.target is aten.transpose.int):
        return None
    w = wt.args[0]
    if w not in params or w.meta["val"].dim() != 3 or sorted(d % 3 for d in wt.args[1:3]) != [1, 2]:
        return None
    return GROUPED_LINEAR, (x, w, offs)
