"""A plainly written GPT with GPT-3 175B's dimensions, for planning on the meta device.

    .venv/bin/fxpar plan examples/gpt3_175b.py:factory --batch 1536 --gpus 1024 --cluster selene

`factory()` returns `(model, (ids,))`. Call it under `with torch.device("meta"):` (as `fxpar plan` does) and
no weights are allocated: the 175B model then costs a few hundred MB to trace instead of 700 GB.
`tiny()` builds the same architecture at toy size, for fast tests.

Glossary: l layers, h hidden, a heads, s sequence, V vocabulary.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class Block(nn.Module):
    """Pre-LN Transformer block: x + attn(ln1(x)), then x + mlp(ln2(x))."""

    def __init__(self, hidden: int, heads: int):
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(hidden)
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.proj = nn.Linear(hidden, hidden)
        self.ln2 = nn.LayerNorm(hidden)
        self.fc = nn.Linear(hidden, 4 * hidden)
        self.fc_proj = nn.Linear(4 * hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, hidden = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(hidden, dim=-1)  # 3 x (B, T, C)
        q = q.view(batch, seq, self.heads, hidden // self.heads).transpose(1, 2)  # (B, a, T, C/a)
        k = k.view(batch, seq, self.heads, hidden // self.heads).transpose(1, 2)  # (B, a, T, C/a)
        v = v.view(batch, seq, self.heads, hidden // self.heads).transpose(1, 2)  # (B, a, T, C/a)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, a, T, C/a)
        y = y.transpose(1, 2).reshape(batch, seq, hidden)  # (B, T, C)
        x = x + self.proj(y)
        return x + self.fc_proj(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    """Token + position embedding, `layers` pre-LN blocks, final LayerNorm, untied LM head."""

    def __init__(self, layers: int, hidden: int, heads: int, seq: int, vocab: int):
        super().__init__()
        self.wte = nn.Embedding(vocab, hidden)
        self.wpe = nn.Embedding(seq, hidden)
        self.blocks = nn.ModuleList(Block(hidden, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(hidden)
        self.lm_head = nn.Linear(hidden, vocab, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(ids.shape[1], device=ids.device)  # (T,)
        x = self.wte(ids) + self.wpe(positions)  # (B, T, C)
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))  # (B, T, V)


def build(layers: int, hidden: int, heads: int, seq: int, vocab: int):
    """Return `(model, (ids,))` for a GPT of the given shape; ids is a [1, seq] long tensor of zeros."""
    model = GPT(layers, hidden, heads, seq, vocab)
    ids = torch.zeros(1, seq, dtype=torch.long)
    return model, (ids,)


def factory():
    """GPT-3 175B: 96 layers, hidden 12288, 96 heads, sequence 2048, vocabulary 51200."""
    return build(layers=96, hidden=12288, heads=96, seq=2048, vocab=51200)


def tiny():
    """The same architecture at toy size (4 layers, hidden 64, 4 heads, sequence 32, vocabulary 128)."""
    return build(layers=4, hidden=64, heads=4, seq=32, vocab=128)
