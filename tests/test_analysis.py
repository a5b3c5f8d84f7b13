"""The sharding analysis and the tensor-parallel pass in one process, on simulated ranks: golden graphs, decisions,
and refusals (never guess)."""
import expecttest
import pytest
import torch
import torch.nn as nn

from fxpar.api import build
from fxpar.compiler import Target, compile_model
from fxpar.passes.sharding.fused_projections import fused_parts
from fxpar.passes.tensor_parallel.collectives import TPComm
from fxpar.passes.tensor_parallel.rewrite import tensor_parallel_pass
from fxpar.trace import trace
from tests import models


class MLP(nn.Module):
    def __init__(self, norm_inside=False):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, 16), nn.Linear(16, 8)
        self.norm = nn.LayerNorm(16) if norm_inside else nn.Identity()

    def forward(self, x):
        return x + self.fc2(torch.relu(self.norm(self.fc1(x))))


def _code(gm) -> str:
    return "\n".join(line.strip() for line in gm.code.strip().splitlines() if line.strip())


class TestGolden(expecttest.TestCase):
    def test_mlp_column_then_row(self):
        pm = build(MLP(), TPComm(rank=0, size=2), (torch.randn(2, 8),))
        self.assertExpectedInline(_code(pm.compiled.callables[0]), """\
def forward(self, p_fc1_weight, p_fc1_bias, p_fc2_weight, p_fc2_bias, x):
tp_f_0 = self.tp_f_0(x)
linear = torch.ops.aten.linear.default(tp_f_0, p_fc1_weight, p_fc1_bias);  tp_f_0 = p_fc1_weight = p_fc1_bias = None
relu = torch.ops.aten.relu.default(linear);  linear = None
linear_1 = torch.ops.aten.linear.default(relu, p_fc2_weight);  relu = p_fc2_weight = None
tp_g_0 = self.tp_g_0(linear_1);  linear_1 = None
add_tensor = torch.ops.aten.add.Tensor(tp_g_0, p_fc2_bias);  tp_g_0 = p_fc2_bias = None
add = torch.ops.aten.add.Tensor(x, add_tensor);  x = add_tensor = None
return (add,)""")

    def test_gpt2_heads_view_is_localized(self):
        model, args, kwargs = models.build("gpt2")
        code = build(model, TPComm(rank=1, size=2), args, kwargs).compiled.callables[0].code
        assert "aten.split_with_sizes.default(view_2, [16, 16, 16], 2)" in code  # Q|K|V, 2 of 4 heads each
        assert "aten.view.default(getitem, [2, 8, -1, 8])" in code  # GPT-2 leaves the heads to -1


def test_plan_and_weights():
    pm = build(MLP(), TPComm(rank=1, size=2), (torch.randn(2, 8),))
    weights = {w.key: (w.placement, w.local_shape) for w in pm.plan.weights}
    assert weights == {"fc1.weight": ("S(0)", (8, 8)), "fc1.bias": ("S(0)", (8,)),
                       "fc2.weight": ("S(1)", (8, 8)), "fc2.bias": ("R", (8,))}
    assert [(r.columns, r.rows) for r in pm.plan.regions] == [(["linear"], ["linear_1"])]


def test_refuses_norm_over_the_sharded_dim():
    with pytest.warns(UserWarning, match="found nothing to shard"):
        pm = build(MLP(norm_inside=True), TPComm(rank=0, size=2), (torch.randn(2, 8),))
    fc1, fc2 = pm.plan.regions
    assert fc1.columns == [] and fc1.replicated == ["linear"]
    assert "normalizes over the sharded dim" in fc1.reason
    assert fc2.replicated == ["linear_1"] and "residual stream" in fc2.reason  # x + fc2(...): x would be scattered
    assert "tp_" not in pm.compiled.callables[0].code  # replicated: no collective at all


def test_fused_parts_found_per_model():
    def gemm_parts(name):
        model, args, kwargs = models.build(name)
        gm = trace(model, args, kwargs).gm
        return [fused_parts(n) for n in gm.graph.nodes if n.target in (torch.ops.aten.linear.default,
                                                                      torch.ops.aten.addmm.default)][:2]
    assert gemm_parts("gpt2")[0] == (32, 32, 32)  # c_attn: split(32)
    assert gemm_parts("encoder_pre_ln")[0] == (32, 32, 32)  # in_proj: unflatten(3, E) then select
    assert gemm_parts("gpt_neox")[0] is None  # view (heads, 3*hd): already head-major
    assert gemm_parts("phi3")[0] == (32, 32, 32)  # qkv_proj: slices


def test_gqa_kv_heads_stay_replicated_when_t_does_not_divide():
    model, args, kwargs = models.build("llama_gqa")  # 4 query heads, 2 kv heads
    pm = build(model, TPComm(rank=0, size=4), args, kwargs)
    attn = pm.plan.regions[0]
    assert attn.columns == ["linear"] and attn.replicated == ["linear_1", "linear_2"]
    assert "has 2 (heads or features) to split over t=4" in attn.reason
    assert "tp_scatter" in pm.compiled.callables[0].code  # k and v enter the region as this rank's heads


def test_t1_pass_returns_same_graph():
    compiled = compile_model(MLP(), (torch.randn(2, 8),), {}, Target(TPComm(0, 1)))
    assert not compiled.analysis.decisions
    code = compiled.gm.code
    assert tensor_parallel_pass(compiled.gm, compiled.analysis, TPComm(0, 1)) is compiled.gm
    assert compiled.gm.code == code


class ResidualThenNorm(nn.Module):
    """An output projection of a replicated value, added to the residual, then a norm and an MLP (DiffLlama after
    its attention stayed replicated)."""

    def __init__(self):
        super().__init__()
        self.o, self.up, self.down = nn.Linear(8, 8), nn.Linear(8, 16), nn.Linear(16, 8)

    def forward(self, x):
        h = x + self.o(torch.tanh(x))
        n = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
        return h + self.down(torch.relu(self.up(n)))


def test_the_residual_stream_does_not_join_a_region():
    pm = build(ResidualThenNorm(), TPComm(rank=0, size=2), (torch.randn(2, 3, 8),))
    o, mlp = pm.plan.regions
    assert o.columns == [] and "residual stream" in o.reason, o  # else: h sharded, an all-reduce per GEMM
    assert mlp.columns == ["linear_1"] and mlp.rows == ["linear_2"], mlp
    assert pm.compiled.callables[0].code.count("self.tp_g_") == 1


class Routed(nn.Module):
    """A router over 5 experts (t=2 does not divide 5) chosen by top-k, and an MLP t=2 does divide."""

    def __init__(self):
        super().__init__()
        self.router, self.up, self.down = nn.Linear(8, 5), nn.Linear(8, 16), nn.Linear(16, 8)

    def forward(self, x):
        weight = self.router(torch.tanh(x)).softmax(-1).topk(2).values.sum(-1, keepdim=True)  # a group of its own
        return x + weight * self.down(torch.relu(self.up(x)))


def test_a_size_t_does_not_divide_refuses_the_model_only_if_it_is_the_only_obstacle():
    pm = build(Routed(), TPComm(rank=0, size=2), (torch.randn(2, 3, 8),))  # not "cannot split ... over t=2"
    router, mlp = sorted(pm.plan.regions, key=lambda r: r.columns)
    assert router.replicated == ["linear"] and not router.indivisible, router
    assert "softmax over the sharded dim" in router.reason, router  # what blocks it at any t
    assert mlp.columns == ["linear_1"] and mlp.rows == ["linear_2"], mlp
