"""Linear-attention token mixers as hybrid models write them (Qwen3-Next's gated delta net, Kimi's and OLMo's
linear attention), sharded by heads: Q, K and V projected apart and joined (`cat`) for one depthwise conv, or one
fused projection convolved before its split; a chunked scan that pads the sequence to whole chunks, masks with
`tril`, and writes each chunk's output into a `zeros_like` buffer (`copy_`); a decay gate from a low-rank pair whose
up-projection joins the region column-parallel with its own f."""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from fxpar.api import build
from fxpar.passes.sharding.comm_audit import per_layer
from fxpar.passes.tensor_parallel.collectives import TPComm
from tests.models import Stack, sgd_gaps
from tests.threaded import on_tp_ranks

D, SEQ, CHUNK, RANK = 32, 6, 4, 8
W = 2 * D  # the heads' width: the gate's up-projection (RANK -> W) outputs more than the layer reads (a low-rank pair)


class LinearAttention(nn.Module):
    """Pre-norm chunked linear attention with `heads` heads, then a pre-norm MLP. fused: one q|k|v projection."""

    def __init__(self, heads: int, fused: bool):
        super().__init__()
        self.heads, self.hd, self.fused = heads, W // heads, fused
        self.norm, self.norm2 = nn.LayerNorm(D), nn.LayerNorm(D)
        if fused:
            self.qkv = nn.Linear(D, 3 * W, bias=False)
        else:
            self.q, self.k, self.v = (nn.Linear(D, W, bias=False) for _ in range(3))
        self.conv = nn.Conv1d(3 * W, 3 * W, 3, groups=3 * W, padding=2)
        self.f_a, self.f_b = nn.Linear(D, RANK, bias=False), nn.Linear(RANK, W)
        self.o = nn.Linear(W, D)
        self.up, self.down = nn.Linear(D, 2 * D), nn.Linear(2 * D, D)

    def _scan(self, q, k, v, decay):
        """[b, h, s, hd] each: causal linear attention over chunks of CHUNK tokens, carrying a state between them."""
        b, h, s, hd = q.shape
        pad = (CHUNK - s % CHUNK) % CHUNK
        q, k, v, decay = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v, decay))
        n = (s + pad) // CHUNK
        q, k, v, decay = (x.reshape(b, h, n, CHUNK, hd) for x in (q, k, v, decay))
        mask = torch.ones(CHUNK, CHUNK, dtype=torch.bool).tril()
        out, state = torch.zeros_like(v), torch.zeros(b, h, hd, hd)
        for i in range(n):
            qi, ki, vi = q[:, :, i], k[:, :, i] * decay[:, :, i], v[:, :, i]
            scores = (qi @ ki.transpose(-1, -2)).masked_fill(~mask, 0.0).tril()
            out[:, :, i] = scores @ vi + qi @ state
            state = state + ki.transpose(-1, -2) @ vi
        return out.reshape(b, h, n * CHUNK, hd)[:, :, :s]

    def forward(self, x):
        b, s, _ = x.shape
        y = self.norm(x)
        qkv = self.qkv(y) if self.fused else torch.cat([self.q(y), self.k(y), self.v(y)], dim=-1)
        qkv = F.silu(self.conv(qkv.transpose(1, 2))[..., :s]).transpose(1, 2)
        q, k, v = qkv.split([W, W, W], dim=-1)
        decay = torch.sigmoid(self.f_b(self.f_a(y)))
        q, k, v, decay = (t.view(b, s, self.heads, self.hd).transpose(1, 2) for t in (q, k, v, decay))
        y = self._scan(q, k, v, decay)
        x = x + self.o(y.transpose(1, 2).reshape(b, s, W))
        return x + self.down(F.gelu(self.up(self.norm2(x))))


def _model(heads, fused):
    torch.manual_seed(0)
    return Stack(lambda: LinearAttention(heads, fused))


def _x():
    return torch.randn(2, SEQ, D, generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("fused", [False, True], ids=["cat", "fused"])
def test_sharded_by_heads_the_gate_with_its_own_f(fused):
    plan = build(_model(4, fused), TPComm(rank=0, size=2), (_x(),)).plan
    f_a = [[n] for n, m in plan.regions[0].modules.items() | plan.regions[2].modules.items() if m.endswith("f_a")]
    assert sorted(r.replicated for r in plan.regions if r.replicated) == sorted(f_a), plan.region_table()
    assert all("low-rank pair" in r.reason for r in plan.regions if r.replicated)  # f_a, as Megatron shards MLA
    weights = {w.key: w.local_shape for w in plan.weights}
    assert weights["layers.0.conv.weight"] == (3 * W // 2, 1, 3)  # each rank's q, k and v channels
    assert weights["layers.0.f_b.weight"] == (W // 2, RANK) and weights["layers.0.f_a.weight"] == (RANK, D)
    # f and g of the layer's two regions, and the f of the gate's low-rank input (b*s*RANK values), named
    assert per_layer(plan.comm) == (2.0, 3.0), plan.comm_table()
    assert "f_b" in plan.comm_table()


@pytest.mark.parametrize("fused,t", [(False, 2), (True, 2), (False, 4)])
def test_exact(fused, t):
    model, x = _model(8, fused), _x()

    def measure(pm, reference):
        share = sum(p.numel() for p in pm.parameters()) / sum(p.numel() for p in reference.parameters())
        return (*sgd_gaps(pm, reference, (x,)), share)

    for fwd, params, share in on_tp_ranks(model, (x,), measure, tp=t):
        assert fwd <= 1e-5 and params <= 1e-5, (fwd, params)
        assert share < 1 / t + 0.08, share  # f_a and the norms stay whole


def test_a_write_of_a_sharded_value_into_a_replicated_buffer_refuses_its_region():
    class Fill(nn.Module):
        def __init__(self):
            super().__init__()
            self.up, self.down = nn.Linear(D, D), nn.Linear(D, D)

        def forward(self, x):
            buf = torch.zeros(x.shape[0], x.shape[1], D)
            buf[:, :2] = self.up(x)[:, :2]
            return x + self.down(buf)

    plan = build(Fill(), TPComm(rank=0, size=2), (_x(),)).plan
    assert any("writes a sharded value into the replicated" in r.reason for r in plan.regions), plan.region_table()
