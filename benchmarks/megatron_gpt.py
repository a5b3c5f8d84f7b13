"""A hand-written Megatron-style tensor-parallel version of examples/gpt.py: the baseline fxpar is measured against.

Everything fxpar derives from the graph is written out here by hand, as in Megatron-LM's `tensor_parallel/layers.py`
and `mappings.py`:

    f   (_CopyToTP)      identity forward, all-reduce backward     enters a column-parallel GEMM
    g   (_ReduceFromTP)  all-reduce forward, identity backward     leaves a row-parallel GEMM
    gather               all-gather forward, local block backward  the LM head's logits
    ColumnParallelLinear  f, then a GEMM on this rank's rows of the weight (output features / t)
    RowParallelLinear     a GEMM on this rank's columns of the weight, then g, then the bias (added once, after g)
    VocabParallelEmbedding  this rank's rows of the vocabulary; ids outside them give 0; then g
    Attention             c_attn is column-parallel with the head-interleaved layout: rank r's rows of the weight are
                          [Q heads of r | K heads of r | V heads of r], so the local output splits into q, k, v of
                          heads/t heads each (fxpar's [Note: head-interleaved QKV], done here by `shard`).

The collectives are done in place, as Megatron does (no defensive clone): the tensors they reduce are fresh outputs of
a GEMM (forward) or the gradient of a GEMM's input (backward), used by nothing else.

`MegatronGPT.from_full(model, rank, t, group)` builds one rank's model from the full single-process GPT, so outputs
and gradients can be compared with it: `shard(name, tensor, rank, t)` maps any full parameter (or gradient) to this
rank's block under the same name.
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F


class _CopyToTP(torch.autograd.Function):
    """f: identity forward, all-reduce of the input's gradient backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _ReduceFromTP(torch.autograd.Function):
    """g: all-reduce forward (in place, on a fresh GEMM output), identity backward."""

    @staticmethod
    def forward(ctx, x, group):
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _GatherFromTP(torch.autograd.Function):
    """All-gather along the last dim forward; this rank's block of the gradient backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.rank, ctx.width = dist.get_rank(group), x.shape[-1]
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim=-1)

    @staticmethod
    def backward(ctx, grad):
        return grad.narrow(-1, ctx.rank * ctx.width, ctx.width).contiguous(), None


class ColumnParallelLinear(nn.Module):
    """Y_r = f(X) W_r^T + b_r: this rank's out_features/t output features."""

    def __init__(self, in_features: int, out_features: int, t: int, group, bias: bool = True, gather: bool = False):
        super().__init__()
        self.group, self.gather = group, gather
        self.weight = nn.Parameter(torch.empty(out_features // t, in_features))  # (out/t, in)
        self.bias = nn.Parameter(torch.empty(out_features // t)) if bias else None

    def forward(self, x):
        y = F.linear(_CopyToTP.apply(x, self.group), self.weight, self.bias)  # (B, T, out/t)
        return _GatherFromTP.apply(y, self.group) if self.gather else y


class RowParallelLinear(nn.Module):
    """Y = g(X_r W_r^T) + b: the input is already split along its features; the bias is added once, after g."""

    def __init__(self, in_features: int, out_features: int, t: int, group):
        super().__init__()
        self.group = group
        self.weight = nn.Parameter(torch.empty(out_features, in_features // t))  # (out, in/t)
        self.bias = nn.Parameter(torch.empty(out_features))

    def forward(self, x):
        return _ReduceFromTP.apply(F.linear(x, self.weight), self.group) + self.bias  # (B, T, out)


class VocabParallelEmbedding(nn.Module):
    """Rows [r*V/t, (r+1)*V/t) of the token embedding; ids outside them look up zeros; g sums the ranks."""

    def __init__(self, vocab: int, hidden: int, rank: int, t: int, group):
        super().__init__()
        self.group, self.start, self.rows = group, rank * (vocab // t), vocab // t
        self.weight = nn.Parameter(torch.empty(vocab // t, hidden))  # (V/t, C)

    def forward(self, ids):
        outside = (ids < self.start) | (ids >= self.start + self.rows)
        local = (ids - self.start).masked_fill(outside, 0)
        out = F.embedding(local, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)  # (B, T, C) partial
        return _ReduceFromTP.apply(out, self.group)


class Attention(nn.Module):
    def __init__(self, cfg, t: int, group):
        super().__init__()
        self.heads, self.hd, self.attention = cfg.heads // t, cfg.hidden // cfg.heads, cfg.attention  # local heads
        self.c_attn = ColumnParallelLinear(cfg.hidden, 3 * cfg.hidden, t, group)  # head-interleaved Q|K|V
        self.c_proj = RowParallelLinear(cfg.hidden, cfg.hidden, t, group)
        self.attn_drop = nn.Dropout(cfg.dropout)
        self.register_buffer("mask", torch.tril(torch.ones(cfg.seq, cfg.seq)).view(1, 1, cfg.seq, cfg.seq))

    def forward(self, x):
        B, T, _ = x.shape
        local = self.heads * self.hd  # C/t
        q, k, v = self.c_attn(x).split(local, dim=2)  # each (B, T, C/t)
        q = q.view(B, T, self.heads, self.hd).transpose(1, 2)  # (B, nh/t, T, hd)
        k = k.view(B, T, self.heads, self.hd).transpose(1, 2)
        v = v.view(B, T, self.heads, self.hd).transpose(1, 2)
        if self.attention == "sdpa":
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(self.hd))  # (B, nh/t, T, T)
            att = att.masked_fill(self.mask[:, :, :T, :T] == 0, float("-inf"))
            y = self.attn_drop(F.softmax(att, dim=-1)) @ v
        y = y.transpose(1, 2).contiguous().view(B, T, local)  # (B, T, C/t)
        return self.c_proj(y)


class MLP(nn.Module):
    def __init__(self, cfg, t: int, group):
        super().__init__()
        self.c_fc = ColumnParallelLinear(cfg.hidden, 4 * cfg.hidden, t, group)
        self.c_proj = RowParallelLinear(4 * cfg.hidden, cfg.hidden, t, group)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x):
        return self.drop(self.c_proj(F.gelu(self.c_fc(x))))  # c_fc output (B, T, 4C/t)


class Block(nn.Module):
    def __init__(self, cfg, t: int, group):
        super().__init__()
        self.ln_1, self.attn = nn.LayerNorm(cfg.hidden), Attention(cfg, t, group)
        self.ln_2, self.mlp = nn.LayerNorm(cfg.hidden), MLP(cfg, t, group)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x):
        x = x + self.drop(self.attn(self.ln_1(x)))
        return x + self.mlp(self.ln_2(x))


class MegatronGPT(nn.Module):
    """One tensor-parallel rank of examples/gpt.py's GPT; parameter names match the full model's."""

    def __init__(self, cfg, rank: int, t: int, group=None):
        super().__init__()
        for what, n in (("heads", cfg.heads), ("hidden", cfg.hidden), ("vocab", cfg.vocab)):
            if n % t:
                raise ValueError(f"MegatronGPT: {what}={n} is not divisible by t={t}; choose t dividing it")
        self.cfg, self.rank, self.t = cfg, rank, t
        self.wte = VocabParallelEmbedding(cfg.vocab, cfg.hidden, rank, t, group)
        self.wpe = nn.Embedding(cfg.seq, cfg.hidden)
        self.h = nn.ModuleList(Block(cfg, t, group) for _ in range(cfg.layers))
        self.ln_f = nn.LayerNorm(cfg.hidden)
        self.lm_head = ColumnParallelLinear(cfg.hidden, cfg.vocab, t, group, bias=False, gather=True)
        if cfg.tied:
            self.lm_head.weight = self.wte.weight  # the same vocab rows: their gradients meet in one tensor

    def forward(self, ids):
        pos = torch.arange(ids.shape[1], device=ids.device)
        x = self.wte(ids) + self.wpe(pos)  # (B, T, C)
        for block in self.h:
            x = block(x)
        return self.lm_head(self.ln_f(x))  # (B, T, V), gathered

    def shard(self, name: str, full: torch.Tensor) -> torch.Tensor:
        """This rank's block of the full model's parameter (or gradient) `name`."""
        return shard(name, full, self.cfg, self.rank, self.t)

    @classmethod
    def from_full(cls, model: nn.Module, rank: int, t: int, group=None) -> "MegatronGPT":
        """Rank `rank` of t, holding its blocks of `model`'s weights."""
        tp = cls(model.cfg, rank, t, group)
        full = model.state_dict()
        with torch.no_grad():
            for name, tensor in tp.state_dict(keep_vars=True).items():
                tensor.copy_(tp.shard(name, full[name]))
        return tp


def shard(name: str, full: torch.Tensor, cfg, rank: int, t: int) -> torch.Tensor:
    """Rank `rank`'s block of the full parameter `name` of examples/gpt.py's GPT, laid out as MegatronGPT holds it."""
    parts = name.split(".")
    module, kind = (parts[-2] if len(parts) > 1 else ""), parts[-1]  # "h.0.attn.c_attn.weight" -> c_attn, weight
    if module == "c_attn":  # (3C, ...) -> [Q_r | K_r | V_r], each C/t rows ([Note: head-interleaved QKV])
        return torch.cat([part.chunk(t, dim=0)[rank] for part in full.chunk(3, dim=0)], dim=0)
    if module in ("c_fc", "wte", "lm_head"):  # column-parallel, or this rank's rows of the vocabulary
        return full.chunk(t, dim=0)[rank]
    if module == "c_proj" and kind == "weight":  # row-parallel: this rank's columns of the contraction dim
        return full.chunk(t, dim=1)[rank]
    return full  # replicated: layer norms, wpe, row-parallel biases, the mask buffer
