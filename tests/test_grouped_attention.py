"""Grouped-query attention as real training code spells it, sharded by K/V group (each rank owns whole groups: its
query heads and the K/V heads they read) and exact: separate projections with K/V expanded by repeat_interleave, by
expand + reshape, or by SDPA(enable_gqa=True); one fused projection laid out per K/V group ([G, q_per_kv + 2, hd])
or as [q | k | v]; and attention written as two einsums between activations. Two of them also cut into a pipeline,
(p, t) = (2, 2)."""
import copy
import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from fxpar.api import build
from fxpar.passes.sharding.comm_audit import per_layer
from fxpar.passes.tensor_parallel.collectives import TPComm
from tests.harness import module_pool
from tests.models import Stack, sgd_gaps, step_gaps
from tests.threaded import on_tp_ranks

D, SEQ = 32, 8
KINDS = ["repeat_interleave", "expand", "enable_gqa", "einsum", "fused_per_group", "fused_flat"]


class GroupedAttention(nn.Module):
    """Pre-norm attention with `heads` query heads reading `groups` K/V heads, then a pre-norm MLP."""

    def __init__(self, kind: str, heads: int, groups: int):
        super().__init__()
        self.kind, self.heads, self.groups, self.hd = kind, heads, groups, D // heads
        self.norm, self.norm2 = nn.LayerNorm(D), nn.LayerNorm(D)
        if kind.startswith("fused"):
            self.qkv = nn.Linear(D, (heads + 2 * groups) * self.hd)
        else:
            self.q = nn.Linear(D, heads * self.hd)
            self.k, self.v = nn.Linear(D, groups * self.hd), nn.Linear(D, groups * self.hd)
        self.o = nn.Linear(heads * self.hd, D)
        self.up, self.down = nn.Linear(D, 2 * D), nn.Linear(2 * D, D)

    def _project(self, x):
        b, s, _ = x.shape
        h, g, hd = self.heads, self.groups, self.hd
        if self.kind == "fused_per_group":  # [b, s, g, h/g + 2, hd]: each group's queries, then its k and v
            q, k, v = self.qkv(x).view(b, s, g, h // g + 2, hd).split([h // g, 1, 1], dim=3)
            q, k, v = q.reshape(b, s, h, hd), k.reshape(b, s, g, hd), v.reshape(b, s, g, hd)
        elif self.kind == "fused_flat":  # [q | k | v] of sizes [h hd, g hd, g hd]
            q, k, v = self.qkv(x).split([h * hd, g * hd, g * hd], dim=-1)
            q, k, v = q.view(b, s, h, hd), k.view(b, s, g, hd), v.view(b, s, g, hd)
        else:
            q, k, v = self.q(x).view(b, s, h, hd), self.k(x).view(b, s, g, hd), self.v(x).view(b, s, g, hd)
        return q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)

    def _attend(self, q, k, v):
        r = self.heads // self.groups
        if self.kind == "enable_gqa":
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        if self.kind == "expand":
            b, g, s, hd = k.shape
            k = k[:, :, None].expand(b, g, r, s, hd).reshape(b, g * r, s, hd)
            v = v[:, :, None].expand(b, g, r, s, hd).reshape(b, g * r, s, hd)
        else:
            k, v = k.repeat_interleave(r, dim=1), v.repeat_interleave(r, dim=1)
        if self.kind == "einsum":
            scores = torch.einsum("bhid,bhjd->bhij", q, k) / math.sqrt(self.hd)
            causal = torch.ones(q.shape[2], q.shape[2], dtype=torch.bool).tril()
            return torch.einsum("bhij,bhjd->bhid", scores.masked_fill(~causal, float("-inf")).softmax(-1), v)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    def forward(self, x):
        y = self._attend(*self._project(self.norm(x)))
        x = x + self.o(y.transpose(1, 2).reshape(x.shape[0], x.shape[1], -1))
        return x + self.down(F.gelu(self.up(self.norm2(x))))


def _model(kind, heads, groups):
    torch.manual_seed(0)
    return Stack(lambda: GroupedAttention(kind, heads, groups))


def _x():
    return torch.randn(2, SEQ, D, generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("kind", KINDS)
def test_sharded_by_group_at_megatrons_two_and_two(kind):
    """Rank 0 of t=2 (4 query heads, 2 K/V groups): every projection column-parallel, K/V by whole groups."""
    plan = build(_model(kind, 4, 2), TPComm(rank=0, size=2), (_x(),)).plan
    assert not plan.replicated, plan.region_table()
    assert per_layer(plan.comm) == (2.0, 2.0) and not plan.above_bound, plan.comm_table()
    weights = {w.key: w.local_shape for w in plan.weights}
    if kind.startswith("fused"):
        assert weights["layers.0.qkv.weight"] == (32, D)  # (4 + 2 + 2) heads of 8, halved
    else:
        assert weights["layers.0.k.weight"] == (8, D) and weights["layers.0.q.weight"] == (16, D)  # heads of 8


@pytest.mark.parametrize("kind,t,heads,groups", [(k, 2, 4, 2) for k in KINDS] + [(k, 4, 8, 4) for k in KINDS])
def test_exact(kind, t, heads, groups):
    """Forward and every parameter after an SGD step within 1e-5, with the local share of the parameters near
    1/t (a replicated fallback would pass exactness and fail this)."""
    model, x = _model(kind, heads, groups), _x()

    def measure(pm, reference):
        share = sum(p.numel() for p in pm.parameters()) / sum(p.numel() for p in reference.parameters())
        return (*sgd_gaps(pm, reference, (x,)), share)

    for fwd, params, share in on_tp_ranks(model, (x,), measure, tp=t):
        assert fwd <= 1e-5 and params <= 1e-5, (fwd, params)
        assert share < 1 / t + 0.05, share  # the norms and the row-parallel biases stay whole


def test_an_einsum_that_contracts_the_sharded_letter_stays_replicated_and_says_why():
    class Contract(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(D, D), nn.Linear(D, D)

        def forward(self, x):
            return torch.einsum("bsh,bth->bst", self.a(x), self.b(x))

    plan = build(Contract(), TPComm(rank=0, size=2), (_x(),)).plan
    assert any("contracts the sharded letter 'h'" in r.reason for r in plan.regions), plan.region_table()


pool4 = module_pool(4)


def _pipeline_gaps(kind: str, steps: int = 3) -> tuple[float, float]:
    """(p, t) = (2, 2), 1F1B over 4 microbatches, `steps` SGD steps on a mean squared error: the largest loss and
    parameter differences from the single-process model trained on the whole batch."""
    import fxpar

    torch.manual_seed(0)
    model = Stack(lambda: GroupedAttention(kind, 4, 2), n=4)
    reference = copy.deepcopy(model)
    g = torch.Generator().manual_seed(3)
    x, target = torch.randn(8, SEQ, D, generator=g), torch.randn(8, SEQ, D, generator=g)
    pm = fxpar.parallelize(model, fxpar.init_mesh(tp=2, pp=2), example_args=(x[:2],), loss_fn=F.mse_loss,
                           config=fxpar.Config(microbatches=4, schedule="1f1b"))
    return step_gaps(pm, reference, x, target, F.mse_loss, steps)


@pytest.mark.parametrize("kind", ["fused_per_group", "repeat_interleave"])
def test_pipeline_of_grouped_attention_at_p2_t2(pool4, kind):
    for loss_gap, param_gap in pool4.run(_pipeline_gaps, kind):
        assert loss_gap <= 1e-5 and param_gap <= 1e-5, (loss_gap, param_gap)


# --- one K/V head inside a fused projection (multi-query attention): the GEMM is cut per part, Q's column-parallel,
# K's and V's replicated ([Note: whole parts] in passes/ir/placements.py)
@pytest.mark.parametrize("kind", ["fused_flat", "fused_per_group"])
def test_one_kv_head_in_a_fused_projection_shards_the_queries(kind):
    plan = build(_model(kind, 4, 1), TPComm(rank=0, size=2), (_x(),)).plan
    weights = {w.key: w for w in plan.weights}
    qkv = weights["layers.0.qkv.weight"]
    assert qkv.local_shape == (16 + 8 + 8, D), plan.weight_table()  # rank 0's 2 query heads, the K and V head whole
    assert "8*" in str(qkv.placement) and weights["layers.0.qkv.bias"].local_shape == (32,)
    attention = next(r for r in plan.regions if r.module == "layers.0" and r.columns)
    assert len(attention.replicated) == 2, plan.region_table()  # K's and V's GEMMs
    # f and g per region; in backward also the K and V heads scattered into the attention (all-gathered), named
    assert per_layer(plan.comm) == (2.0, 4.0), plan.comm_table()
    assert plan.comm_table().count("scatter") >= 2


@pytest.mark.parametrize("kind,t", [("fused_flat", 2), ("fused_per_group", 2), ("fused_flat", 4)])
def test_one_kv_head_in_a_fused_projection_is_exact(kind, t):
    model, x = _model(kind, 8, 1), _x()

    def measure(pm, reference):
        share = sum(p.numel() for p in pm.parameters()) / sum(p.numel() for p in reference.parameters())
        return (*sgd_gaps(pm, reference, (x,)), share)

    for fwd, params, share in on_tp_ranks(model, (x,), measure, tp=t):
        assert fwd <= 1e-5 and params <= 1e-5, (fwd, params)
        assert share < 1 / t + 0.12, share  # the K and V rows are whole on every rank
