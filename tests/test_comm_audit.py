"""The plan's communication per layer (passes/sharding/comm_audit.py) against Megatron's 2 + 2, and low-rank pairs kept
to Megatron's layout ([Note: low-rank pairs] in passes/sharding/analysis.py): golden plans on simulated ranks, numerics
on threaded gloo ranks."""
import pytest
import torch
import torch.nn as nn

from fxpar.api import build
from fxpar.passes.sharding.comm_audit import per_layer
from fxpar.passes.tensor_parallel.collectives import TPComm
from tests import models
from tests.models import Stack, sgd_gaps
from tests.threaded import on_tp_ranks

H = 16


class MLP(nn.Module):
    def __init__(self, inner=4 * H):
        super().__init__()
        self.norm, self.up, self.down = nn.LayerNorm(H), nn.Linear(H, inner), nn.Linear(inner, H)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(self.norm(x))))


class ThreeMLPs(nn.Module):
    """Each layer three residual MLPs: three regions, above Megatron's two."""

    def __init__(self):
        super().__init__()
        self.first, self.second, self.third = MLP(), MLP(), MLP()

    def forward(self, x):
        return self.third(self.second(self.first(x)))


class SmallInner(nn.Module):
    """An MLP narrower inside than outside (most MoE experts): h -> h/2 -> h, a plain region, not a low-rank pair."""

    def __init__(self):
        super().__init__()
        self.mlp = MLP(inner=H // 2)

    def forward(self, x):
        return self.mlp(x)


class LowRank(nn.Module):
    """A low-rank factored up-projection (MLA's query, a low-rank gate): h -> r -> 4h -> h."""

    def __init__(self, r=4):
        super().__init__()
        self.norm, self.a = nn.LayerNorm(H), nn.Linear(H, r, bias=False)
        self.b, self.down = nn.Linear(r, 4 * H), nn.Linear(4 * H, H)

    def forward(self, x):
        return x + self.down(torch.relu(self.b(torch.tanh(self.a(self.norm(x))))))


def _plan(model, args, kwargs=None):
    return build(model, TPComm(rank=0, size=2), args, kwargs or {}).plan


def _x():
    return torch.randn(2, 3, H, generator=torch.Generator().manual_seed(0))


def test_every_gpt_layer_costs_megatrons_two_and_two():
    model, args, kwargs = models.build("gpt")
    plan = _plan(model, args, kwargs)
    inside = [c for c in plan.comm if c.layer != "outside the layers"]
    assert [c.layer for c in inside] == ["h.0", "h.1"]
    assert all(len(c.forward) == 2 and len(c.backward) == 2 and not c.above_bound for c in inside)
    assert per_layer(plan.comm) == (2.0, 2.0) and not plan.above_bound
    assert "activation all-reduces per layer" in str(plan) and "h.0..1" in plan.comm_table()


def test_a_layer_above_the_bound_names_its_regions():
    plan = _plan(Stack(ThreeMLPs), (_x(),))
    assert per_layer(plan.comm) == (3.0, 3.0)
    assert [c.layer for c in plan.above_bound] == ["layers.0", "layers.1"]
    note = plan.above_bound[0].note
    assert note.startswith("3 regions, each closed by its own collective")
    for part in ("first", "second", "third"):
        assert f"g of layers.0.{part}.down [2x3x16]" in note
    assert "3 regions" in plan.comm_table()


def test_one_process_and_replicated_models_have_no_audit():
    plan = build(Stack(MLP), TPComm(rank=0, size=1), (_x(),)).plan
    assert plan.comm == () and "activation all-reduces" not in str(plan)


def test_a_low_rank_pair_keeps_its_down_projection_replicated():
    plan = _plan(Stack(LowRank), (_x(),))
    weights = {w.key: w.placement for w in plan.weights}
    assert weights["layers.0.a.weight"] == "R"  # r*h redundant FLOPs, no all-reduce of 4h values
    assert weights["layers.0.b.weight"] == "S(0)" and weights["layers.0.down.weight"] == "S(1)"
    reasons = [r.reason for r in plan.regions if r.reason]
    wide = "64 values per token, more than the 16 the region reads and the 4 it contracts (a low-rank pair)"
    assert any(wide in r for r in reasons), reasons
    assert all(max(c.shape[-1] for c in layer.forward) == H for layer in plan.comm if layer.forward)


def test_an_mlp_narrower_inside_is_still_split():
    weights = {w.key: w.placement for w in _plan(Stack(SmallInner), (_x(),)).weights}
    assert weights["layers.0.mlp.up.weight"] == "S(0)" and weights["layers.0.mlp.down.weight"] == "S(1)"


@pytest.mark.gloo
def test_a_low_rank_pair_is_exact_and_sharded():
    torch.manual_seed(0)
    model, x = Stack(LowRank), _x()

    def measure(pm, reference):
        share = sum(p.numel() for p in pm.parameters()) / sum(p.numel() for p in reference.parameters())
        return (*sgd_gaps(pm, reference, (x,)), share)

    for fwd, params, share in on_tp_ranks(model, (x,), measure):
        assert fwd <= 1e-5 and params <= 1e-5, (fwd, params)
        assert share < 0.56, share  # b and down split; a and the norms whole
