"""The fused ops that passes/fusion/driver.py inserts: plain functions over autograd Functions, called from the graph.

Each function computes exactly what the ATen ops it replaces compute in the forward (the same kernels, in the same
order, consuming the random stream the same way), and differs only in what it saves for backward:

    bias_gelu(y, b)                   gelu(y + b)              saves y and b; backward recomputes y + b
    bias_gelu_linear(y, b, w, ...)    linear(gelu(y + b), w)   saves y, b, w; backward recomputes gelu(y + b), so the
                                                               activation gelu(y + b) ([b, s, 4h/t]) is never stored
    bias_dropout_add(y, b, r, p, tr)  r + dropout(y + b)       saves a bool keep-mask (1 byte) instead of the float
                                                               noise tensor (4 bytes in fp32)

Glossary: *pre-activation* y is the GEMM output before its bias; *keep-mask* marks the elements dropout kept.
[Note: same random stream] On CPU aten.dropout draws `empty_like(x).bernoulli_(1 - p)` and divides it by 1 - p;
bias_dropout_add draws the same way at the same point of the graph, so a fused step equals the unfused step bit for
bit even with p > 0. On CUDA aten.dropout is native_dropout, which bias_dropout_add calls there too.
"""
from __future__ import annotations

import torch

aten = torch.ops.aten


def _autocast_of(x: torch.Tensor) -> dict:
    """The autocast state a forward ran under, for its backward (autograd runs backward outside autocast; eager
    autocast's own backward sees the dtypes the forward's casts made, and so must a fused backward)."""
    device = x.device.type
    return dict(device_type=device, dtype=torch.get_autocast_dtype(device), enabled=torch.is_autocast_enabled(device))


def _sum_to_bias(grad: torch.Tensor) -> torch.Tensor:
    """The gradient of a bias broadcast along the last dim: sum over every leading dim."""
    return grad.reshape(-1, grad.shape[-1]).sum(0)


class _BiasGeLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y, bias, approximate):
        ctx.approximate, ctx.autocast = approximate, _autocast_of(y)
        ctx.save_for_backward(y, bias)
        return aten.gelu(y + bias, approximate=approximate)

    @staticmethod
    def backward(ctx, grad):
        y, bias = ctx.saved_tensors
        with torch.autocast(**ctx.autocast):
            grad_x = aten.gelu_backward(grad, y + bias, approximate=ctx.approximate)
        return grad_x, _sum_to_bias(grad_x) if ctx.needs_input_grad[1] else None, None


def bias_gelu(y: torch.Tensor, bias: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    """gelu(y + bias), recomputing y + bias in backward."""
    return _BiasGeLU.apply(y, bias, approximate)


def _second_gemm(h, weight, out_bias, flat_shape, layout):
    """The GEMM that consumed the activation: linear(h, w, b) or [view ->] mm / addmm (Conv1D-style weights)."""
    if flat_shape is not None:
        h = h.view(flat_shape)
    if layout == "linear":
        return aten.linear(h, weight, out_bias) if out_bias is not None else aten.linear(h, weight)
    return aten.addmm(out_bias, h, weight) if out_bias is not None else aten.mm(h, weight)


class _BiasGeLULinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y, bias, weight, out_bias, approximate, flat_shape, layout):
        ctx.approximate, ctx.flat_shape, ctx.layout = approximate, flat_shape, layout
        ctx.autocast = _autocast_of(y)
        ctx.save_for_backward(y, bias, weight)
        h = aten.gelu(y + bias, approximate=approximate)  # not saved: backward recomputes it
        return _second_gemm(h, weight, out_bias, flat_shape, layout)

    @staticmethod
    def backward(ctx, grad):
        with torch.autocast(**ctx.autocast):
            return _BiasGeLULinear._backward(ctx, grad)

    @staticmethod
    def _backward(ctx, grad):
        y, bias, weight = ctx.saved_tensors
        x = y + bias
        h = aten.gelu(x, approximate=ctx.approximate)
        h2 = h.reshape(-1, h.shape[-1])  # (tokens, 4h/t)
        g2 = grad.reshape(-1, grad.shape[-1])  # (tokens, h)
        need = ctx.needs_input_grad
        if ctx.layout == "linear":  # out = h w^T (+ b2)
            grad_h = g2.mm(weight)
            grad_w = g2.t().mm(h2) if need[2] else None
        else:  # out = h w (+ b2)
            grad_h = g2.mm(weight.t())
            grad_w = h2.t().mm(g2) if need[2] else None
        grad_out_bias = g2.sum(0) if need[3] else None
        grad_x = aten.gelu_backward(grad_h.view(x.shape).to(x.dtype), x, approximate=ctx.approximate)
        grad_b = _sum_to_bias(grad_x) if need[1] else None
        return grad_x, grad_b, grad_w, grad_out_bias, None, None, None


def bias_gelu_linear(y, bias, weight, out_bias=None, approximate="none", flat_shape=None, layout="linear"):
    """second_gemm(gelu(y + bias)); backward recomputes the activation instead of storing it.

    layout "linear": aten.linear(h, weight[, out_bias]) with weight (out, in); layout "mm": h.view(flat_shape) then
    aten.mm(h, weight) or aten.addmm(out_bias, h, weight) with weight (in, out) (Hugging Face Conv1D).
    """
    return _BiasGeLULinear.apply(y, bias, weight, out_bias, approximate, flat_shape, layout)


def _noise(x: torch.Tensor, p: float) -> torch.Tensor:
    """aten.dropout's CPU noise, drawn the same way ([Note: same random stream])."""
    return torch.empty_like(x).bernoulli_(1 - p).div_(1 - p)


class _BiasDropoutAdd(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y, bias, residual, p, residual_first):
        x = y + bias
        ctx.p = p
        if p == 1.0:
            dropped, keep = x * x.new_zeros(()), torch.zeros_like(x, dtype=torch.bool)
        elif x.device.type != "cpu":  # aten.dropout is native_dropout there
            dropped, keep = aten.native_dropout(x, p, True)
        else:
            noise = _noise(x, p)
            dropped, keep = x * noise, noise != 0
        ctx.save_for_backward(keep)
        return residual + dropped if residual_first else dropped + residual

    @staticmethod
    def backward(ctx, grad):
        (keep,) = ctx.saved_tensors
        if ctx.p == 1.0:
            grad_x = grad * grad.new_zeros(())
        elif keep.device.type != "cpu":
            grad_x = aten.native_dropout_backward(grad, keep, 1.0 / (1.0 - ctx.p))
        else:  # the same float noise the forward multiplied by, rebuilt from the 1-byte mask
            grad_x = grad * keep.to(grad.dtype).div_(1 - ctx.p)
        need = ctx.needs_input_grad
        return grad_x, _sum_to_bias(grad_x) if need[1] else None, grad if need[2] else None, None, None


def bias_dropout_add(y, bias, residual, p: float, train: bool, residual_first: bool = True):
    """residual + dropout(y + bias, p, train), keeping a 1-byte keep-mask for backward.

    With p == 0 or train False, aten.dropout is the identity (and draws no random numbers); so is this.
    `residual_first` keeps the operand order of the add it replaces (IEEE addition commutes, so it is cosmetic).
    """
    if p == 0.0 or not train:
        x = y + bias
        return residual + x if residual_first else x + residual
    return _BiasDropoutAdd.apply(y, bias, residual, float(p), residual_first)
