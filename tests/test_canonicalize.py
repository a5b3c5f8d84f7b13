"""passes/frontend/canonicalize.py: view_as spelled as a view; and models whose activations use it and binary min/max."""
from __future__ import annotations

import copy

import torch
import torch.nn as nn

from expecttest import TestCase

from fxpar.passes.frontend.canonicalize import merge_aliases_pass, view_as_pass
from fxpar.trace import trace
from tests.models import sgd_gaps
from tests.golden import graph_text
from tests.threaded import on_tp_ranks

aten = torch.ops.aten
H, F = 8, 16


class Clipped(nn.Module):
    """Apertus's xIELU-like activation (a binary min) and a view_as back to the input's shape (Beam's attention)."""

    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(H, F), nn.Linear(F, H)
        self.cap = nn.Parameter(torch.tensor(0.5))

    def forward(self, x):
        h = self.up(x)
        h = torch.min(h, self.cap) + torch.max(h, -self.cap).sigmoid()
        h = h.view(-1, F).view_as(h)
        return x + self.down(h)


def test_view_as_becomes_a_view_of_the_traced_shape():
    model, x = Clipped(), torch.randn(2, 3, H)
    traced = trace(model, (x,))
    gm = torch.fx.GraphModule(traced.gm, copy.deepcopy(traced.gm.graph))
    view_as_pass(gm)
    targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert aten.view_as.default not in targets
    views = [n for n in gm.graph.nodes if n.target is aten.view.default]
    assert [2, 3, F] in [list(n.args[1]) for n in views]
    flat = [dict(model.named_parameters())[gi.key] if gi.kind == "parameter" else x for gi in traced.inputs]
    assert torch.equal(gm(*flat)[0], traced.gm(*flat)[0])


def test_binary_min_max_and_view_as_keep_the_mlp_sharded():
    torch.manual_seed(0)
    x = torch.randn(2, 3, H)

    def measure(pm, reference):
        share = sum(p.numel() for p in pm.parameters()) / sum(p.numel() for p in reference.parameters())
        return (*sgd_gaps(pm, reference, (x,)), share)

    for fwd, params, share in on_tp_ranks(Clipped(), (x,), measure):
        assert fwd <= 1e-5 and params <= 1e-5 and share == (8 * 8 + 8 + 8 * 8 + 8 + 1) / (2 * 128 + 16 + 8 + 1)


class Tied(nn.Module):
    """One weight under two names: the LM head tied to the embedding."""

    def __init__(self):
        super().__init__()
        self.wte, self.head = nn.Embedding(8, H), nn.Linear(H, 8, bias=False)
        self.head.weight = self.wte.weight

    def forward(self, ids):
        return self.head(self.wte(ids))


def test_golden_view_as_and_tied_weights():
    """Before -> after: view_as becomes a view of the traced shape; a tied weight read under both names becomes one
    placeholder (the first name), the other erased."""
    from fxpar.compiler import canonical_keys

    model, x = Clipped(), torch.randn(2, 3, H)
    traced = trace(model, (x,))
    gm = view_as_pass(torch.fx.GraphModule(traced.gm, copy.deepcopy(traced.gm.graph)))
    TestCase().assertExpectedInline(graph_text(gm, placements=False), """\
linear = linear.default(x, p_up_weight, p_up_bias)
min_1 = min.other(linear, p_cap)
neg = neg.default(p_cap)
max_1 = max.other(linear, neg)
sigmoid = sigmoid.default(max_1)
add = add.Tensor(min_1, sigmoid)
view = view.default(add, [-1, 16])
view_as = view.default(view, [2, 3, 16])
linear_1 = linear.default(view_as, p_down_weight, p_down_bias)
add_1 = add.Tensor(x, linear_1)
""")
    tied = Tied()
    traced = trace(tied, (torch.randint(0, 8, (2, 3)),))
    gm = merge_aliases_pass(torch.fx.GraphModule(traced.gm, copy.deepcopy(traced.gm.graph)), canonical_keys(tied))
    TestCase().assertExpectedInline(str([n.name for n in gm.graph.nodes if n.op == "placeholder"]) + "\n" +
                                    graph_text(gm, placements=False), """\
['p_wte_weight', 'ids']
embedding = embedding.default(p_wte_weight, ids)
linear = linear.default(embedding, p_wte_weight)
""")


class InPlace(nn.Module):
    """An MLP that adds a bias and scales in place on fresh GEMM outputs (as Hugging Face's experts add theirs), and
    in-place writes the pass must leave alone: into a view, into a value read again, and one that keeps a narrower
    dtype than its operand."""

    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(H, F, bias=False), nn.Linear(F, H)
        self.b = nn.Parameter(torch.randn(F))

    def forward(self, x):
        h = self.up(x).add_(self.b).mul_(2.0)
        y = self.down(torch.relu(h))
        z = x * 3
        z[:, 0].add_(1.0)  # into a view: writes z
        w = x + 1
        u = w * 3  # w read before it is written
        w.mul_(2.0)
        half = torch.zeros_like(x, dtype=torch.bfloat16).add_(x)  # bf16 += fp32 stays bf16; add would give fp32
        return y + z + u + w + half.float()


def test_fresh_in_place_ops_become_out_of_place_and_nothing_else():
    from fxpar.passes.frontend.canonicalize import fresh_in_place_pass

    model, x = InPlace(), torch.randn(2, 3, H)
    traced = trace(model, (x,))
    gm = fresh_in_place_pass(torch.fx.GraphModule(traced.gm, copy.deepcopy(traced.gm.graph)))
    TestCase().assertExpectedInline(graph_text(gm, placements=False), """\
linear = linear.default(x, p_up_weight)
add_ = add.Tensor(linear, p_b)
mul_ = mul.Tensor(add_, 2.0)
relu = relu.default(mul_)
linear_1 = linear.default(relu, p_down_weight, p_down_bias)
mul = mul.Tensor(x, 3)
select = select.int(mul, 1, 0)
add__1 = add_.Tensor(select, 1.0)
add = add.Tensor(x, 1)
mul_1 = mul.Tensor(add, 3)
mul__1 = mul_.Tensor(add, 2.0)
zeros_like = zeros_like.default(x)
add__2 = add_.Tensor(zeros_like, x)
add_1 = add.Tensor(linear_1, mul)
add_2 = add.Tensor(add_1, mul_1)
add_3 = add.Tensor(add_2, mul__1)
_assert_tensor_metadata_default = _assert_tensor_metadata.default(add__2)
to = to.dtype(add__2, torch.float32)
add_4 = add.Tensor(add_3, to)
""")
    flat = [dict(model.named_parameters())[gi.key] if gi.kind == "parameter" else x for gi in traced.inputs]
    assert torch.equal(gm(*flat)[0], traced.gm(*flat)[0])


def test_a_bias_added_in_place_keeps_the_mlp_sharded_and_exact():
    torch.manual_seed(0)
    x = torch.randn(2, 3, H)

    class Mlp(nn.Module):
        def __init__(self):
            super().__init__()
            self.up, self.down = nn.Linear(H, F, bias=False), nn.Linear(F, H)
            self.b = nn.Parameter(torch.randn(F))

        def forward(self, x):
            return x + self.down(torch.relu(self.up(x).add_(self.b)))

    def measure(pm, reference):
        share = sum(p.numel() for p in pm.parameters()) / sum(p.numel() for p in reference.parameters())
        return (*sgd_gaps(pm, reference, (x,)), share)

    for fwd, params, share in on_tp_ranks(Mlp(), (x,), measure):
        assert fwd <= 1e-5 and params <= 1e-5 and share == (8 * 8 + 8 + 8 * 8 + 8) / (2 * 128 + 16 + 8), share
