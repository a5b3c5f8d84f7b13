# Fuzz seed 99 (before the fix): a layer GEMM with V = H output features, left free by its refused region, was
# taken for the LM head; its all-gathered output then entered a sharded residual region scattered from the local shard.
# Fix: an untied LM head is a GEMM whose logits reach the output (passes/sharding/vocab_analysis.py).
import torch
import torch.nn as nn
import torch.nn.functional as F

CONFIG = {'H': 16, 'heads': 8, 'kv_heads': 1, 'F': 48, 'S': 4, 'layers': 2, 'vocab': 16, 'tied': False, 'p': 0.0, 'carry': False, 'regularize': False, 'head': True, 'side': False}


class Layer(nn.Module):
    def __init__(self):
        super().__init__()
        self.w2 = nn.Parameter(torch.randn(16) / 1.0000)
        self.w4 = nn.Parameter(torch.randn(16, 16) / 4.0000)
        self.w6 = nn.Parameter(torch.randn(16, 2) / 4.0000)
        self.w7 = nn.Parameter(torch.randn(2) / 1.0000)
        self.w9 = nn.Parameter(torch.randn(2, 16) / 1.4142)
        self.w10 = nn.Parameter(torch.randn(2) / 1.0000)
        self.w14 = nn.Parameter(torch.randn(16, 16) / 4.0000)
        self.ln16 = nn.LayerNorm(16)
        self.w18 = nn.Parameter(torch.randn(48, 16) / 6.9282)
        self.w19 = nn.Parameter(torch.randn(48) / 1.0000)
        self.lin22 = nn.Linear(48, 16, bias=False)

    def forward(self, x, prev):
        n1 = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.w2
        h3 = n1 @ self.w4
        h5 = torch.addmm(self.w7, n1.flatten(0, 1), self.w6).view(n1.shape[0], n1.shape[1], 2)
        h8 = n1 @ self.w9.t() + self.w10
        h3 = h3.view(n1.shape[0], 4, 8, 2).transpose(1, 2)
        h5 = h5.view(n1.shape[0], 4, 1, 2).transpose(1, 2)
        h8 = h8.view(n1.shape[0], 4, 1, 2).transpose(1, 2)
        h5 = h5.repeat_interleave(8, dim=1)
        h8 = h8.repeat_interleave(8, dim=1)
        y11 = F.scaled_dot_product_attention(h3, h5, h8, is_causal=True)
        m12 = y11.transpose(1, 2).reshape(n1.shape[0], 4, 16)
        h13 = F.linear(m12, self.w14)
        h13 = F.dropout(h13, 0.0, self.training)
        n15 = self.ln16(x)
        h17 = F.linear(n15, self.w18, self.w19)
        a20 = F.silu(h17)
        a20 = a20 / (1 + a20.std(1, keepdim=True))
        h21 = self.lin22(a20)
        x = x + h13 + h21
        return x, prev, None


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(Layer() for _ in range(2))
        self.wte = nn.Embedding(16, 16)
        self.head = nn.Linear(16, 16, bias=True)

    def forward(self, inp):
        x = self.wte(inp) if hasattr(self, 'wte') else inp
        prev = torch.zeros(x.shape[0], 8, 4, 4)
        side = []
        for layer in self.layers:
            x, prev, s = layer(x, prev)
            if s is not None:
                side.append(s)
        x = self.head(x)
        return (x, *side) if side else x


def example():
    g = torch.Generator().manual_seed(1)
    return (torch.randint(0, 16, (2, 4), generator=g),), {}


