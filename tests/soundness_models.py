"""Small models, one per class of soundness hazard (tests/test_soundness.py): each must come out exact or be refused
with a clear message. Every builder returns (model, example_args, example_kwargs)."""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

H, HEADS, SEQ, BATCH, VOCAB = 16, 4, 8, 2, 32


def _x():
    return torch.randn(BATCH, SEQ, H, generator=torch.Generator().manual_seed(1))


class ScoresLayer(nn.Module):
    """Attention whose scores carry over to the next layer (residual attention): a sharded value crosses layers."""

    def __init__(self):
        super().__init__()
        self.qkv, self.proj, self.norm = nn.Linear(H, 3 * H), nn.Linear(H, H), nn.LayerNorm(H)

    def forward(self, x, prev):
        b, s, _ = x.shape
        q, k, v = self.qkv(self.norm(x)).view(b, s, 3, HEADS, H // HEADS).permute(2, 0, 3, 1, 4).unbind(0)
        scores = q @ k.transpose(-1, -2) * (H // HEADS) ** -0.5 + prev
        y = (scores.softmax(-1) @ v).transpose(1, 2).reshape(b, s, H)
        return x + self.proj(y), scores


class ResidualScores(nn.Module):
    def __init__(self, layers: int = 4):
        super().__init__()
        self.layers = nn.ModuleList(ScoresLayer() for _ in range(layers))
        self.head = nn.Linear(H, VOCAB)

    def forward(self, x):
        prev = torch.zeros(x.shape[0], HEADS, x.shape[1], x.shape[1])
        for layer in self.layers:
            x, prev = layer(x, prev)
        return self.head(x)


def residual_scores():
    torch.manual_seed(0)
    return ResidualScores(), (_x(),), {}


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(H, 4 * H), nn.Linear(4 * H, H)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x)))


class BiasRegularized(MLP):
    """A column-parallel GEMM's bias read again outside the GEMM (a regularizer)."""

    def forward(self, x):
        return x + super().forward(x) + self.fc1.bias.pow(2).sum()


class SharedBias(MLP):
    """A bias shared by the column-parallel fc1 and a GEMM that stays replicated."""

    def __init__(self):
        super().__init__()
        self.side = nn.Linear(H, 4 * H, bias=False)

    def forward(self, x):
        return super().forward(x) + (self.side(x) + self.fc1.bias).sum(-1, keepdim=True)


class WeightReadTwice(MLP):
    """A column-parallel GEMM's weight also read by another op."""

    def forward(self, x):
        return super().forward(x) * self.fc1.weight.mean()


class PerHeadLinear(nn.Module):
    """nn.Linear applied per head on [b, heads, s, hd] before the heads are merged."""

    def __init__(self):
        super().__init__()
        self.q, self.out = nn.Linear(H, H), nn.Linear(H, H)
        self.per_head = nn.Linear(H // HEADS, H // HEADS)

    def forward(self, x):
        b, s, _ = x.shape
        q = self.q(x).view(b, s, HEADS, H // HEADS).transpose(1, 2)
        q = self.per_head(q)
        return x + self.out(q.transpose(1, 2).reshape(b, s, H))


class AddmmActivation(nn.Module):
    """addmm whose additive term is an activation, and a weight on the left: (W @ h^T)^T."""

    def __init__(self):
        super().__init__()
        self.fc1, self.w2 = nn.Linear(H, 4 * H), nn.Parameter(torch.randn(H, 4 * H) / 8)
        self.w3 = nn.Parameter(torch.randn(4 * H, H) / 8)

    def forward(self, x):
        h = F.relu(self.fc1(x)).flatten(0, 1)  # (b*s, 4h)
        y = torch.addmm(h @ self.w3, h, self.w3)  # the additive term is an activation
        return x + ((self.w2 @ h.t()).t() + y).view_as(x)


class VarStatistics(nn.Module):
    """var over a dim other than the sharded one, with keepdim=True and unbiased=False (an argument read by name)."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(H, 4 * H), nn.Linear(4 * H, H)

    def forward(self, x):
        h = self.fc1(x)
        h = h / (h.var(1, keepdim=True, unbiased=False) + 1).sqrt()
        return self.fc2(h)


class Branchy(nn.Module):
    """Dropout, and non-tensor arguments: a float scale and a flag that picks a branch."""

    def __init__(self, p: float = 0.0):
        super().__init__()
        self.mlp, self.drop = MLP(), nn.Dropout(p)

    def forward(self, x, scale: float = 2.0, double: bool = False):
        y = self.drop(self.mlp(x)) * scale
        return y * 2 if double else y


class CausalBuffer(nn.Module):
    """Explicit attention with a causal mask buffer that the fusion proves causal from its value."""

    def __init__(self):
        super().__init__()
        self.qkv, self.proj = nn.Linear(H, 3 * H), nn.Linear(H, H)
        self.register_buffer("mask", torch.tril(torch.ones(SEQ, SEQ)).view(1, 1, SEQ, SEQ))

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = self.qkv(x).split(H, dim=2)
        q, k, v = (t.view(b, s, HEADS, H // HEADS).transpose(1, 2) for t in (q, k, v))
        att = (q @ k.transpose(-2, -1)) * 0.5
        att = att.masked_fill(self.mask[:, :, :s, :s] == 0, float("-inf"))
        return x + self.proj((att.softmax(-1) @ v).transpose(1, 2).reshape(b, s, H))


class TinyLM(nn.Module):
    """Token embedding, one MLP, LM head: for vocabulary bounds and state loading."""

    def __init__(self):
        super().__init__()
        self.wte, self.mlp, self.lm_head = nn.Embedding(VOCAB, H), MLP(), nn.Linear(H, VOCAB, bias=False)

    def forward(self, ids):
        x = self.wte(ids)
        return self.lm_head(x + self.mlp(x))


class InPlaceScan(nn.Module):
    """A gated recurrence written the way recurrent_gemma's RG-LRU is: a zeros_like buffer filled step by step in
    place, then multiplied into a column-parallel branch ([Note: reads after mutation] in
    passes/tensor_parallel/rewrite.py)."""

    def __init__(self):
        super().__init__()
        self.gate, self.inp, self.out = nn.Linear(H, 2 * H), nn.Linear(H, 2 * H), nn.Linear(2 * H, H)

    def forward(self, x):
        y = F.gelu(self.gate(x))
        xs = torch.tanh(self.inp(x))
        states = torch.zeros_like(xs)
        for t in range(xs.shape[1]):
            states[:, t] = xs[:, t] + (0.5 * states[:, t - 1] if t else 0.0)
        return x + self.out(states * y)


class HiddenIsVocab(nn.Module):
    """Hidden size equal to the vocabulary: fc2 has V output features, yet it is no LM head (its output feeds the
    head, it is not logits). fc1's region is refused (no rule for a statistic over the sequence), so fc2 is free."""

    def __init__(self):
        super().__init__()
        self.wte, self.fc1, self.fc2 = nn.Embedding(H, H), nn.Linear(H, 3 * H), nn.Linear(3 * H, H, bias=False)
        self.proj, self.head = nn.Linear(H, H), nn.Linear(H, H)

    def forward(self, ids):
        x = self.wte(ids)
        a = F.silu(self.fc1(x))
        a = a / (1 + a.std(1, keepdim=True))
        x = x + self.fc2(a) + self.proj(F.relu(x))
        return self.head(x)


def hidden_is_vocab():
    torch.manual_seed(0)
    return HiddenIsVocab(), (torch.randint(0, H, (BATCH, SEQ), generator=torch.Generator().manual_seed(2)),), {}


def _plain(cls):
    def build():
        torch.manual_seed(0)
        return cls(), (_x(),), {}
    return build


def tiny_lm():
    torch.manual_seed(0)
    return TinyLM(), (torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(2)),), {}


BUILDERS = {
    "residual_scores": residual_scores,
    "bias_regularized": _plain(BiasRegularized),
    "shared_bias": _plain(SharedBias),
    "weight_read_twice": _plain(WeightReadTwice),
    "per_head_linear": _plain(PerHeadLinear),
    "addmm_activation": _plain(AddmmActivation),
    "var_statistics": _plain(VarStatistics),
    "branchy": _plain(Branchy),
    "causal_buffer": _plain(CausalBuffer),
    "tiny_lm": tiny_lm,
    "hidden_is_vocab": hidden_is_vocab,
    "in_place_scan": _plain(InPlaceScan),
}
