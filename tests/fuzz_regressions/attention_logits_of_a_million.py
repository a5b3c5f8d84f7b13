# Fuzz seed 9501460 (the long mode with --sequence-parallel; plain t=2 alike): an unnormalized three-layer stack whose
# SwiGLU reads the raw residual stream, so activations reach 5.6e6 and the last layer's attention logits 1e6. The fused
# attention (SDPA, fuse=True) recomputes the softmax in backward from the saved log-sum-exp, which at such logits
# loses the probabilities' low bits where the unmodified model keeps them: float32 parameter gap 44.9 after SGD,
# float64 9.2e-8, 2^-29 of it. Exact with fuse=False. A gap that shrinks with machine epsilon is rounding ([Note: a
# gap that scales with epsilon] in tests/fuzz.py), and docs/soundness.md says what the fusion changes.
FUZZ_OPTIONS = {'sequence_parallel': True}
FUZZ_LOSS = {}
import functools
import math
import torch
import torch.nn as nn
import torch.nn.functional as F

CONFIG = {'H': 24, 'heads': 2, 'kv_heads': 1, 'F': 72, 'S': 8, 'layers': 3, 'vocab': 17, 'tied': False, 'p': 0.0, 'carry': False, 'regularize': False, 'head': True, 'side': False, 'seq_first': False, 'function': None, 'loops': 1, 'no_grad': False}
SEED = 9501460  # the generator's (tests/fuzz.py --loss draws the targets from it)


class Layer(nn.Module):
    def __init__(self):
        super().__init__()
        self.w3 = nn.Parameter(torch.randn(24, 24) / 4.8990)
        self.w5 = nn.Parameter(torch.randn(24, 12) / 4.8990)
        self.w6 = nn.Parameter(torch.randn(12) / 1.0000)
        self.w8 = nn.Parameter(torch.randn(24, 12) / 4.8990)
        self.w9 = nn.Parameter(torch.randn(12) / 1.0000)
        self.w15 = nn.Parameter(torch.randn(24, 24) / 4.8990)
        self.w18 = nn.Parameter(torch.randn(24, 144) / 4.8990)
        self.w19 = nn.Parameter(torch.randn(24, 144) / 4.8990)
        self.w24 = nn.Parameter(torch.randn(24, 72) / 4.8990)
        self.w25 = nn.Parameter(torch.randn(24) / 1.0000)

    def forward(self, x, prev):
        h2 = torch.einsum('bsh,hf->bsf', x, self.w3)
        h4 = x @ self.w5 + self.w6
        h7 = torch.addmm(self.w9, x.flatten(0, 1), self.w8).view(x.shape[0], x.shape[1], 12)
        h2 = h2.view(x.shape[0], 8, 2, 12).transpose(1, 2)
        h4 = h4.view(x.shape[0], 8, 1, 12).transpose(1, 2)
        h7 = h7.view(x.shape[0], 8, 1, 12).transpose(1, 2)
        h4 = h4[:, :, None].expand(x.shape[0], 1, 2, 8, 12).reshape(x.shape[0], 2, 8, 12)
        h7 = h7.repeat_interleave(2, dim=1)
        s11 = (h2 @ h4.transpose(-2, -1)) * 0.28868
        p12 = (s11.masked_fill(torch.triu(torch.ones(8, 8, dtype=torch.bool), 1), float('-inf'))).softmax(-1)
        y10 = p12 @ h7
        m13 = y10.transpose(1, 2).reshape(x.shape[0], 8, 24)
        h14 = torch.addmm(m13.flatten(0, 1), m13.flatten(0, 1), self.w15, alpha=0.5).view(m13.shape[0], m13.shape[1], 24)
        x = x + h14
        h17 = torch.addmm((x.flatten(0, 1) @ self.w19), x.flatten(0, 1), self.w18).view(x.shape[0], x.shape[1], 144)
        g20, u21 = h17.chunk(2, dim=-1)
        h22 = F.silu(g20) * u21
        h22 = F.dropout(h22, 0.0, self.training)
        h23 = h22 @ self.w24.t() + self.w25
        h23 = F.dropout(h23, 0.0, self.training)
        x = x + h23
        return x, prev, None


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(Layer() for _ in range(3))
        self.wte = nn.Embedding(17, 24)
        self.head = nn.Linear(24, 17, bias=True)

    def forward(self, inp):
        x = self.wte(inp) if hasattr(self, 'wte') else inp
        prev = torch.zeros(x.shape[0], 2, 8, 8)
        side = []
        for layer in self.layers:
            x, prev, s = layer(x, prev)
            if s is not None:
                side.append(s)
        x = self.head(x)
        return (x, *side) if side else x


def example(rows=2):
    g = torch.Generator().manual_seed(1)
    return (torch.randint(0, 17, (rows, 8), generator=g),), {}
