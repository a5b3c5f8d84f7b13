"""A small GPT, written plainly: the model fxpar's examples, tests and benchmarks parallelize.

Nothing in it knows about parallelism. Attention is explicit (matmul, scale, causal mask, softmax, matmul) by
default, with the mask held in a buffer; attention="in_graph" builds the mask in forward (`torch.triu(torch.ones(T,
T, dtype=torch.bool), 1)`, as much training code writes it); attention="sdpa" calls torch's
scaled_dot_product_attention.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass(frozen=True)
class GPTConfig:
    vocab: int = 256  # byte-level tokens
    seq: int = 64
    layers: int = 4
    hidden: int = 64
    heads: int = 4
    dropout: float = 0.0
    attention: str = "explicit"  # or "in_graph", "sdpa"
    tied: bool = True


class Attention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.heads, self.attention = cfg.heads, cfg.attention
        self.c_attn = nn.Linear(cfg.hidden, 3 * cfg.hidden)  # fused Q|K|V
        self.c_proj = nn.Linear(cfg.hidden, cfg.hidden)
        self.attn_drop = nn.Dropout(cfg.dropout)
        self.register_buffer("mask", torch.tril(torch.ones(cfg.seq, cfg.seq)).view(1, 1, cfg.seq, cfg.seq))

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)
        q = q.view(B, T, self.heads, C // self.heads).transpose(1, 2)  # (B, nh, T, hd)
        k = k.view(B, T, self.heads, C // self.heads).transpose(1, 2)
        v = v.view(B, T, self.heads, C // self.heads).transpose(1, 2)
        if self.attention == "sdpa":
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))  # (B, nh, T, T)
            if self.attention == "in_graph":
                att = att.masked_fill(torch.triu(torch.ones(T, T, dtype=torch.bool, device=x.device), 1),
                                      float("-inf"))
            else:
                att = att.masked_fill(self.mask[:, :, :T, :T] == 0, float("-inf"))
            att = self.attn_drop(F.softmax(att, dim=-1))
            y = att @ v  # (B, nh, T, hd)
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.c_proj(y)


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.c_fc = nn.Linear(cfg.hidden, 4 * cfg.hidden)
        self.c_proj = nn.Linear(4 * cfg.hidden, cfg.hidden)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x):
        return self.drop(self.c_proj(F.gelu(self.c_fc(x))))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln_1, self.attn = nn.LayerNorm(cfg.hidden), Attention(cfg)
        self.ln_2, self.mlp = nn.LayerNorm(cfg.hidden), MLP(cfg)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x):
        x = x + self.drop(self.attn(self.ln_1(x)))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig = GPTConfig()):
        super().__init__()
        self.cfg = cfg
        self.wte, self.wpe = nn.Embedding(cfg.vocab, cfg.hidden), nn.Embedding(cfg.seq, cfg.hidden)
        self.h = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.ln_f = nn.LayerNorm(cfg.hidden)
        self.lm_head = nn.Linear(cfg.hidden, cfg.vocab, bias=False)
        if cfg.tied:
            self.lm_head.weight = self.wte.weight
        for name, p in self.named_parameters():  # GPT-2's initialization
            if p.dim() == 2:
                std = 0.02 / math.sqrt(2 * cfg.layers) if name.endswith("c_proj.weight") else 0.02
                nn.init.normal_(p, std=std)
            elif name.endswith("bias"):
                nn.init.zeros_(p)

    def forward(self, ids):
        pos = torch.arange(ids.shape[1], device=ids.device)
        x = self.wte(ids) + self.wpe(pos)
        for block in self.h:
            x = block(x)
        return self.lm_head(self.ln_f(x))


def factory(batch: int = 2, **overrides):
    """(model, example_args) for `fxpar show examples/gpt.py:factory`."""
    torch.manual_seed(0)
    cfg = GPTConfig(**overrides)
    return GPT(cfg), (torch.randint(0, cfg.vocab, (batch, cfg.seq)),)


def loss_fn(logits, target):
    return F.cross_entropy(logits.flatten(0, 1), target.flatten())


def next_token_loss(logits, ids):
    """The language-modelling loss of a batch of token ids: position i predicts token i + 1."""
    return F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())


def lm(batch: int = 2, **overrides):
    """(model, example_args, example_kwargs, loss) for `fxpar check examples/gpt.py:lm`: the loss reads its targets
    from the input ids."""
    model, args = factory(batch, **overrides)
    return model, args, {}, next_token_loss
