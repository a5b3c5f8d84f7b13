"""Statistics over the sharded dim ([Note: partial statistics] in passes/tensor_parallel/rewrite.py): a mean or sum over
all heads or all intermediate features keeps its region sharded, as each rank's partial sum all-reduced (`stat`),
exactly."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from tests.models import sgd_gaps
from tests.threaded import on_tp_ranks

H, FF, HEADS = 16, 32, 4


def rms(x, weight, eps=1e-6):
    """Hugging Face's RMSNorm, written out: the mean of squares over the last dim."""
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


class SubNormMLP(nn.Module):
    """BitNet's MLP: an RMSNorm over the whole (sharded) intermediate before the down projection."""

    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(H, FF), nn.Linear(FF, H)
        self.sub_norm = nn.Parameter(1 + 0.1 * torch.randn(FF))

    def forward(self, x):
        return x + self.down(rms(F.silu(self.up(x)), self.sub_norm))


class QKNormAttention(nn.Module):
    """OLMo-2's attention: q and k normalized over all heads (the whole projection) before the head split."""

    def __init__(self):
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(H, H, bias=False) for _ in range(4))
        self.q_norm, self.k_norm = nn.Parameter(1 + 0.1 * torch.randn(H)), nn.Parameter(1 + 0.1 * torch.randn(H))

    def forward(self, x):
        b, s, _ = x.shape
        q, k = rms(self.q(x), self.q_norm), rms(self.k(x), self.k_norm)
        q, k, v = (t.view(b, s, HEADS, H // HEADS).transpose(1, 2) for t in (q, k, self.v(x)))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return x + self.o(y.transpose(1, 2).reshape(b, s, H))


class Regularized(nn.Module):
    """A loss term over a sharded activation: the sum and the mean of every element, beside the output."""

    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(H, FF), nn.Linear(FF, H)

    def forward(self, x):
        h = torch.tanh(self.up(x))
        return x + self.down(h) + 1e-2 * h.pow(2).mean() + 1e-3 * h.sum(dim=(0, 2), keepdim=True).mean(-1, True)


class Stacked(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn, self.mlp = QKNormAttention(), SubNormMLP()

    def forward(self, x):
        return self.mlp(self.attn(x))


def _measure(pm, reference, x):
    from fxpar.passes.ir.meta import FXPAR_COMM

    fwd, params = sgd_gaps(pm, reference, (x,))
    share = sum(p.numel() for p in pm.parameters()) / sum(p.numel() for p in reference.parameters())
    kinds = [n.meta.get(FXPAR_COMM) for n in pm.compiled.callables[0].graph.nodes]
    return fwd, params, share, {k: kinds.count(k) for k in ("f", "g", "stat")}


@pytest.mark.parametrize("cls, stats, share", [(SubNormMLP, 1, 560 / 1104), (QKNormAttention, 2, 0.5),
                                               (Regularized, 2, 544 / 1072), (Stacked, 3, 1088 / 2160)])
def test_a_statistic_over_the_sharded_dim_keeps_the_region_sharded_and_exact(cls, stats, share):
    torch.manual_seed(0)
    x = torch.randn(2, 6, H)
    for fwd, params, got_share, comm in on_tp_ranks(cls(), (x,), lambda pm, ref: _measure(pm, ref, x)):
        assert fwd <= 1e-5 and params <= 1e-5, (cls.__name__, fwd, params)
        assert got_share == pytest.approx(share, abs=1e-4), (cls.__name__, got_share)  # norm weights sharded too
        assert comm["stat"] == stats, comm  # one b*s all-reduce per statistic, none of the activations added


def test_a_max_over_the_sharded_dim_still_refuses_its_region():
    """amax has no partial form that keeps ties' gradients exact: the region stays replicated, with the reason."""
    class Maxed(SubNormMLP):
        def forward(self, x):
            h = F.silu(self.up(x))
            return x + self.down(h / h.amax(-1, keepdim=True))

    reasons = on_tp_ranks(Maxed(), (torch.randn(2, 3, H),), lambda pm, ref: [r.reason for r in pm.plan.regions])
    assert "amax" in reasons[0][0] and "reduces over the sharded dim" in reasons[0][0], reasons[0]
