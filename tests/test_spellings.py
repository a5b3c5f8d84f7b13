"""Spellings of attention and experts that real models write, sharded Megatron-style and exact at t=2: rotary
embeddings as complex products (view_as_complex / view_as_real, as torchtitan's Llama), a rotate-half through
reshape_as (RoFormer), a max over the keys for a stable softmax (attention sinks), and experts as batched GEMMs over
[E, in, out] weights (Llama 4's torch.bmm)."""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from fxpar.api import build
from fxpar.passes.sharding.comm_audit import per_layer
from fxpar.passes.tensor_parallel.collectives import TPComm
from tests.models import Stack, sgd_gaps
from tests.threaded import on_tp_ranks

H, HEADS, SEQ, E, INNER = 32, 4, 6, 4, 16
HD = H // HEADS


class ComplexRopeAttention(nn.Module):
    """torchtitan's Llama attention: rotary as a complex product, then explicit attention with a max-subtracted
    softmax and a RoFormer-style rotate-half on the values (reshape_as)."""

    def __init__(self):
        super().__init__()
        self.norm = nn.RMSNorm(H)
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(H, H, bias=False) for _ in range(4))
        freqs = 1.0 / (10000 ** (torch.arange(0, HD, 2).float() / HD))
        angles = torch.outer(torch.arange(SEQ).float(), freqs)
        self.register_buffer("freqs_cis", torch.polar(torch.ones_like(angles), angles))

    def _rope(self, x):  # x [b, s, heads, hd]
        xc = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
        return torch.view_as_real(xc * self.freqs_cis.view(1, SEQ, 1, HD // 2)).flatten(3).type_as(x)

    def forward(self, x):
        b, s, _ = x.shape
        h = self.norm(x)
        q, k, v = (w(h).view(b, s, HEADS, HD) for w in (self.wq, self.wk, self.wv))
        q, k = self._rope(q).transpose(1, 2), self._rope(k).transpose(1, 2)
        v = torch.stack([-v[..., 1::2], v[..., ::2]], dim=-1).reshape_as(v).transpose(1, 2)
        scores = q @ k.transpose(-2, -1) / HD ** 0.5
        scores = scores.masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), float("-inf"))
        scores = scores - scores.max(dim=-1, keepdim=True).values
        out = torch.softmax(scores, dim=-1) @ v
        return x + self.wo(out.transpose(1, 2).reshape(b, s, H))


class BmmExperts(nn.Module):
    """Llama 4's experts: every token through every expert, scaled by its router score; weights [E, in, out]."""

    def __init__(self):
        super().__init__()
        self.norm, self.router = nn.RMSNorm(H), nn.Linear(H, E, bias=False)
        self.gate_up = nn.Parameter(torch.randn(E, H, 2 * INNER) / H ** 0.5)
        self.down = nn.Parameter(torch.randn(E, INNER, H) / INNER ** 0.5)

    def forward(self, x):
        h = self.norm(x).reshape(-1, H)
        scores = torch.sigmoid(self.router(h)).t()  # [E, tokens]
        routed = (h.unsqueeze(0) * scores.unsqueeze(-1)).view(E, -1, H)
        gate, up = torch.bmm(routed, self.gate_up).chunk(2, dim=-1)
        out = torch.bmm(F.silu(gate) * up, self.down).view(E, -1, H).sum(0)
        return x + out.view_as(x)


class Layer(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn, self.moe = ComplexRopeAttention(), BmmExperts()

    def forward(self, x):
        return self.moe(self.attn(x))


def Model() -> Stack:
    return Stack(Layer)


def _x():
    return torch.randn(2, SEQ, H, generator=torch.Generator().manual_seed(0))


def test_every_spelling_is_sharded_at_megatrons_two_and_two():
    torch.manual_seed(0)
    plan = build(Model(), TPComm(rank=0, size=2), (_x(),)).plan
    weights = {w.key: w.placement for w in plan.weights}
    assert weights["layers.0.attn.wq.weight"] == "S(0)" and weights["layers.0.attn.wo.weight"] == "S(1)"
    assert weights["layers.0.moe.gate_up"].startswith("S(2") and weights["layers.0.moe.down"] == "S(1)"
    assert weights["layers.0.moe.router.weight"] == "R"
    assert per_layer(plan.comm) == (2.0, 2.0) and not plan.above_bound, plan.comm_table()


@pytest.mark.gloo
def test_every_spelling_is_exact():
    torch.manual_seed(0)
    model, x = Model(), _x()

    def measure(pm, reference):
        share = sum(p.numel() for p in pm.parameters()) / sum(p.numel() for p in reference.parameters())
        return (*sgd_gaps(pm, reference, (x,)), share)

    for fwd, params, share in on_tp_ranks(model, (x,), measure):
        assert fwd <= 1e-5 and params <= 1e-5, (fwd, params)
        assert share < 0.55, share  # attention and experts split; router and norms whole
