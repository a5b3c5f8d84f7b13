"""Fewer collectives (passes/tensor_parallel/merge_comm.py): partial sums that meet through linear ops close with one g,
f's of one value become one; and what must not move stays put. Golden graphs on simulated ranks, numerics on threaded
gloo ranks, the alias facts (passes/ir/aliasing.py) on small graphs."""
import pytest
import torch
import torch.nn as nn
from expecttest import TestCase

from fxpar.api import build
from fxpar.passes.sharding.comm_audit import per_layer
from fxpar.passes.ir.meta import FXPAR_SCALE, comm_kind
from fxpar.passes.tensor_parallel.collectives import TPComm
from fxpar.passes.ir.aliasing import Storage, writes
from tests.golden import graph_text
from tests.models import Stack, sgd_gaps
from tests.threaded import on_tp_ranks

H, N_EXPERTS = 16, 3


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(H, 2 * H), nn.Linear(2 * H, H, bias=False)

    def forward(self, x):
        return self.down(torch.relu(self.up(x)))


class DenseMoE(nn.Module):
    """Every expert on every token, scaled by its routing weight, plus a shared expert: E + 1 partial sums that
    meet through a product by a per-token factor and sums, so one g closes them all."""

    def __init__(self):
        super().__init__()
        self.norm, self.router = nn.LayerNorm(H), nn.Linear(H, N_EXPERTS, bias=False)
        self.experts, self.shared = nn.ModuleList(MLP() for _ in range(N_EXPERTS)), MLP()

    def forward(self, x):
        h = self.norm(x)
        gates = self.router(h).softmax(-1)
        out = self.shared(h)
        for e, expert in enumerate(self.experts):
            out = out + expert(h) * gates[..., e:e + 1]
        return x + out


class BiasBetween(nn.Module):
    """g(a) + bias + g(b): the replicated bias sits between the two sums, so they stay two g's."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.bias = MLP(), MLP(), nn.Parameter(torch.randn(H))

    def forward(self, x):
        return x + (self.a(x) + self.bias) + self.b(x)


class WideGate(nn.Module):
    """A product by a full-width gate: linear in the partial sum, but its gradient would need an activation-sized
    f, so g stays before it."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.gate = MLP(), MLP(), nn.Linear(H, H)

    def forward(self, x):
        return x + self.a(x) * torch.sigmoid(self.gate(x)) + self.b(x)


class WrittenBetween(nn.Module):
    """Two MLPs read h, and an in-place op writes h (through a view) between them: each f, hoisted to h, stays its
    own ([Note: reads after mutation]). The first reads h through a product that saves nothing: the write is
    legal."""

    def __init__(self):
        super().__init__()
        self.norm, self.a, self.b = nn.LayerNorm(H), MLP(), MLP()

    def forward(self, x):
        h = self.norm(x)
        first = self.a(h * 0.5)
        h.narrow(1, 0, 1).mul_(2.0)  # through a view: the second reader reads h itself, written
        return x + first + self.b(h)


def _x():
    return torch.randn(2, 3, H, generator=torch.Generator().manual_seed(0))


def _built(model):
    return build(model, TPComm(rank=0, size=2), (_x(),), {})


def _comms(gm) -> list[str]:
    return [("f scale" if n.meta.get(FXPAR_SCALE) else comm_kind(n)) for n in gm.graph.nodes
            if comm_kind(n) in ("f", "g")]


def test_experts_and_shared_expert_close_with_one_g_and_open_with_one_f():
    pm = _built(Stack(DenseMoE))
    per = _comms(pm.compiled.gm)
    # each layer: one f of the normed input, one f per routing weight (a few values per token), one g
    layer = ["f"] + ["f scale"] * N_EXPERTS + ["g"]
    assert sorted(per) == sorted(layer * 2), per
    assert per_layer(pm.plan.comm) == (1.0, 1.0) and not pm.plan.above_bound
    assert [w.placement for w in pm.plan.weights if w.key == "layers.0.experts.1.down.weight"] == ["S(1)"]


def test_a_replicated_bias_between_two_sums_keeps_both_gs():
    assert _comms(_built(Stack(BiasBetween)).compiled.gm).count("g") == 4  # two per layer


def test_a_full_width_gate_keeps_g_before_it():
    gm = _built(Stack(WideGate)).compiled.gm
    assert _comms(gm).count("g") == 4 and "f scale" not in _comms(gm)


def test_a_write_between_two_readers_keeps_two_fs():
    assert _comms(_built(Stack(WrittenBetween)).compiled.gm).count("f") == 4


@pytest.mark.gloo
@pytest.mark.parametrize("cls", [DenseMoE, BiasBetween, WideGate, WrittenBetween], ids=lambda c: c.__name__)
def test_every_merge_and_every_refusal_is_exact_and_sharded(cls):
    torch.manual_seed(0)
    model, x = Stack(cls), _x()

    def measure(pm, reference):
        share = sum(p.numel() for p in pm.parameters()) / sum(p.numel() for p in reference.parameters())
        return (*sgd_gaps(pm, reference, (x,)), share)

    for fwd, params, share in on_tp_ranks(model, (x,), measure):
        assert fwd <= 1e-5 and params <= 1e-5, (fwd, params)
        assert share < 0.62, share  # every MLP split; norms, router, gate and bias whole



def test_storage_follows_views_and_fresh_results():
    def f(a, b):
        v = a.view(-1)
        m = torch.ops.aten.mul.Tensor(a, 2.0)
        mv = torch.ops.aten.view.default(m, [-1])
        torch.ops.aten.add_.Tensor(mv, 1.0)
        return v, torch.ops.aten.relu.default(b)

    gm = torch.fx.symbolic_trace(f)
    nodes = {n.name: n for n in gm.graph.nodes}
    # symbolic_trace keeps `a.view` as a method call: no schema, so it may alias a (and is its own root)
    view, m, mv, add_, relu = (nodes[k] for k in ("view", "mul_tensor", "view_default", "add__tensor", "relu_default"))
    s = Storage()
    assert s.may_alias(view, nodes["a"]) and s.may_alias(mv, m) and s.may_alias(add_, m)
    assert not s.may_alias(m, nodes["a"]) and not s.may_alias(relu, m)
    assert s.may_alias(nodes["a"], nodes["b"])  # a caller may pass one tensor twice
    assert writes(add_) == [mv] and writes(m) == [] and writes(view) is None


def test_golden_a_dense_moe_closes_its_partial_sums_with_one_g():
    """After merge_comm (the record's tp_graph): the shared and routed experts' partial sums meet through the
    routing products and sums, and one g closes them all; each gate enters through the f of a per-token factor."""
    gm = build(DenseMoE(), TPComm(rank=0, size=2), (torch.randn(2, 3, H),)).compiled.tp_graph
    TestCase().assertExpectedInline(graph_text(gm), """\
layer_norm = layer_norm.default(x, [16], p_norm_weight, p_norm_bias, 1e-05, False)  # R 2x3x16
linear = linear.default(layer_norm, p_router_weight)  # R 2x3x3
softmax = softmax.int(linear, -1)  # R 2x3x3
tp_f_0 = tp_f_0(layer_norm)  # R 2x3x16  [f]
linear_1 = linear.default(tp_f_0, p_shared_up_weight, p_shared_up_bias)  # S(2) 2x3x16
relu = relu.default(linear_1)  # S(2) 2x3x16
linear_2 = linear.default(relu, p_shared_down_weight)  # P 2x3x16
linear_3 = linear.default(tp_f_0, p_experts_0_up_weight, p_experts_0_up_bias)  # S(2) 2x3x16
relu_1 = relu.default(linear_3)  # S(2) 2x3x16
linear_4 = linear.default(relu_1, p_experts_0_down_weight)  # P 2x3x16
slice_1 = slice.Tensor(softmax, 2, 0, 1)  # R 2x3x1
tp_f_1 = tp_f_1(slice_1)  # R 2x3x1  [f]
mul = mul.Tensor(linear_4, tp_f_1)  # P 2x3x16
add = add.Tensor(linear_2, mul)  # P 2x3x16
linear_5 = linear.default(tp_f_0, p_experts_1_up_weight, p_experts_1_up_bias)  # S(2) 2x3x16
relu_2 = relu.default(linear_5)  # S(2) 2x3x16
linear_6 = linear.default(relu_2, p_experts_1_down_weight)  # P 2x3x16
slice_2 = slice.Tensor(softmax, 2, 1, 2)  # R 2x3x1
tp_f_2 = tp_f_2(slice_2)  # R 2x3x1  [f]
mul_1 = mul.Tensor(linear_6, tp_f_2)  # P 2x3x16
add_1 = add.Tensor(add, mul_1)  # P 2x3x16
linear_7 = linear.default(tp_f_0, p_experts_2_up_weight, p_experts_2_up_bias)  # S(2) 2x3x16
relu_3 = relu.default(linear_7)  # S(2) 2x3x16
linear_8 = linear.default(relu_3, p_experts_2_down_weight)  # P 2x3x16
slice_3 = slice.Tensor(softmax, 2, 2, 3)  # R 2x3x1
tp_f_3 = tp_f_3(slice_3)  # R 2x3x1  [f]
mul_2 = mul.Tensor(linear_8, tp_f_3)  # P 2x3x16
add_2 = add.Tensor(add_1, mul_2)  # P 2x3x16
tp_g_9 = tp_g_0(add_2)  # R 2x3x16  [g]
add_3 = add.Tensor(x, tp_g_9)  # R 2x3x16
""")
