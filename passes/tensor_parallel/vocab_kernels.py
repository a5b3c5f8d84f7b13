"""The vocab-parallel losses: cross-entropy, logsumexp and the target's gather over logits sharded on the classes.

Rank r holds the logits of classes [r*V/t, (r+1)*V/t) (the LM head's block, passes/sharding/vocab_analysis.py). Each op
works on its block and all-reduces per-token values only, b*s numbers instead of the b*s*V logits (Shoeybi et al. 2019,
Sec. 3):

    cross-entropy  max all-reduce, then one sum all-reduce of (sum of exp, target logit, sum of logits) per token;
                   backward is local: softmax - (1 - eps) * onehot - eps / V, times the token's gradient
    logsumexp      max all-reduce, sum-of-exp all-reduce; backward local: softmax times the gradient
    gather         each rank picks the indices in its block (zero elsewhere), sum all-reduce; backward local

Half-precision logits are computed in fp32 and the results cast back (as ATen's kernels accumulate). Targets
outside [0, V) that are not ignore_index raise, as the unparallelized loss would (each rank would otherwise see
another rank's class). On fake or meta tensors they compute shapes only (passes/tensor_parallel/collectives.py).
"""
from __future__ import annotations

import torch

from fxpar.passes.tensor_parallel.collectives import TPComm, _check_ids, _TPModule

_MEAN, _SUM, _NONE = 1, 2, 0  # ATen's reduction enum (at::Reduction)


def _block(comm: TPComm, x: torch.Tensor, index: torch.Tensor):
    """(local index, inside) of global class indices for this rank's block of x's last dim."""
    rows = x.shape[-1]
    start = comm.rank * rows
    inside = (index >= start) & (index < start + rows)
    return (index - start).masked_fill(~inside, 0), inside


def _wide(x: torch.Tensor) -> torch.Tensor:
    """x in at least fp32 (Megatron's cross-entropy upcasts bf16/fp16 logits); fp64 stays fp64."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


def _global_max(x: torch.Tensor, comm: TPComm) -> torch.Tensor:
    return comm.all_reduce(x.amax(-1), "max")


class _CrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, comm, reduction, ignore_index, smoothing):
        x = _wide(logits)
        vocab = x.shape[-1] * comm.size
        ignored = target == ignore_index
        _check_ids(target.masked_fill(ignored, 0), vocab, "target")
        local, inside = _block(comm, x, target)
        top = _global_max(x, comm).unsqueeze(-1)
        shifted = x - top
        exp = shifted.exp()
        picked = shifted.gather(-1, local.unsqueeze(-1)).squeeze(-1).masked_fill(~inside, 0.0)
        stats = torch.stack([exp.sum(-1), picked, shifted.sum(-1)])
        sum_exp, picked, sum_shifted = comm.all_reduce(stats).unbind(0)
        lse = sum_exp.log()
        loss = (lse - picked) * (1.0 - smoothing) + (lse - sum_shifted / vocab) * smoothing
        loss = loss.masked_fill(ignored, 0.0)
        count = (~ignored).sum()
        ctx.save_for_backward(exp / sum_exp.unsqueeze(-1), local, inside, ignored, count)
        ctx.comm, ctx.reduction, ctx.smoothing, ctx.vocab, ctx.dtype = comm, reduction, smoothing, vocab, logits.dtype
        if reduction == _MEAN:
            loss = loss.sum() / count
        elif reduction == _SUM:
            loss = loss.sum()
        return loss.to(logits.dtype)

    @staticmethod
    def backward(ctx, grad):
        softmax, local, inside, ignored, count = ctx.saved_tensors
        grad = _wide(grad)
        if ctx.reduction == _MEAN:
            grad = (grad / count).expand(ignored.shape)
        elif ctx.reduction == _SUM:
            grad = grad.expand(ignored.shape)
        onehot = torch.zeros_like(softmax).scatter_(-1, local.unsqueeze(-1), inside.unsqueeze(-1).to(softmax.dtype))
        d = softmax - onehot * (1.0 - ctx.smoothing) - ctx.smoothing / ctx.vocab
        d = d * grad.masked_fill(ignored, 0.0).unsqueeze(-1)
        return d.to(ctx.dtype), None, None, None, None, None


class VocabParallelCrossEntropy(_TPModule):
    """aten.cross_entropy_loss(logits, target, weight=None, reduction, ignore_index, label_smoothing) with the
    logits' class dim (1, or 0 for one sample) sharded: this rank's block of the classes."""

    def forward(self, logits, target, weight=None, reduction: int = _MEAN, ignore_index: int = -100,
                label_smoothing: float = 0.0):
        assert weight is None, "class weights are refused by the rule (passes/sharding/loss_rules.py)"
        class_dim = 1 if logits.dim() >= 2 else 0
        x = logits.movedim(class_dim, -1)
        return _CrossEntropy.apply(x, target, self.comm, reduction, ignore_index, float(label_smoothing))


class _Logsumexp(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, comm):
        xf = _wide(x)
        top = _global_max(xf, comm).unsqueeze(-1)
        top = torch.where(torch.isinf(top), torch.zeros_like(top), top)  # all -inf: log(0) = -inf, as torch gives
        out = comm.all_reduce((xf - top).exp().sum(-1)).log() + top.squeeze(-1)
        ctx.save_for_backward(x, out)
        return out.to(x.dtype)

    @staticmethod
    def backward(ctx, grad):
        x, out = ctx.saved_tensors
        return ((_wide(x) - out.unsqueeze(-1)).exp() * _wide(grad).unsqueeze(-1)).to(x.dtype), None


class VocabParallelLogsumexp(_TPModule):
    """aten.logsumexp(x, dim, keepdim) over the sharded dim."""

    def forward(self, x, dim, keepdim: bool = False):
        d = dim[0] % x.dim()
        out = _Logsumexp.apply(x.movedim(d, -1), self.comm)
        return out.unsqueeze(d) if keepdim else out


class _Gather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, index, comm):
        local, inside = _block(comm, x, index)
        picked = x.gather(-1, local).masked_fill(~inside, 0)
        ctx.save_for_backward(local, inside)
        ctx.shape = x.shape
        return comm.all_reduce(picked)

    @staticmethod
    def backward(ctx, grad):
        local, inside = ctx.saved_tensors
        out = grad.new_zeros(ctx.shape).scatter_add_(-1, local, grad.masked_fill(~inside, 0))
        return out, None, None


class VocabParallelGather(_TPModule):
    """aten.gather(x, dim, index) along the sharded dim, the index replicated (global positions)."""

    def forward(self, x, dim: int, index, sparse_grad: bool = False):
        d = dim % x.dim()
        _check_ids(index, x.shape[d] * self.comm.size, "index")
        out = _Gather.apply(x.movedim(d, -1), index.movedim(d, -1), self.comm)
        return out.movedim(-1, d)
