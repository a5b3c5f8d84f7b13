"""passes/frontend/gemm_forms.py: every spelling of an activation times a weight parameter becomes linear or mm."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
from expecttest import TestCase
from torch.fx import GraphModule

from fxpar.passes.frontend.gemm_forms import gemm_forms_pass
from fxpar.trace import trace
from tests.models import sgd_gaps
from tests.threaded import on_tp_ranks

aten = torch.ops.aten
H, F = 8, 16


class Spellings(nn.Module):
    """Six spellings of a GEMM with a weight, and three contractions that are not GEMMs with a 2-D weight."""

    def __init__(self):
        super().__init__()
        self.out_in = nn.Parameter(torch.randn(F, H) / H ** 0.5)  # [out, in], as nn.Linear stores it
        self.in_out = nn.Parameter(torch.randn(H, F) / H ** 0.5)  # [in, out]
        self.bias = nn.Parameter(torch.randn(F))
        self.cube = nn.Parameter(torch.randn(2, H, H))

    def forward(self, x):
        flat = x.flatten(0, 1)
        return (x @ self.out_in.T, x @ self.out_in.t(), torch.matmul(x, self.out_in.transpose(0, 1)),
                x @ self.in_out, torch.einsum("bsh,hf->bsf", x, self.in_out),
                torch.einsum("bsh,fh->bsf", x, self.out_in), torch.addmm(self.bias, flat, self.out_in.t()),
                flat @ self.in_out, x.permute(0, 2, 1).permute(0, 2, 1) @ self.in_out,
                # not rewritten: an activation times an activation, a 3-D weight, an einsum that reorders
                x @ x.transpose(1, 2), x @ self.cube[0], torch.einsum("bsh,hf->bfs", x, self.in_out))


def _rewritten(model, x):
    traced = trace(model, (x,))
    gm = GraphModule(traced.gm, copy.deepcopy(traced.gm.graph))
    state = dict(model.named_parameters())
    flat = [state[gi.key] if gi.kind == "parameter" else x for gi in traced.inputs]
    return traced, gemm_forms_pass(gm), flat


def test_every_spelling_becomes_a_gemm_form_and_computes_the_same():
    torch.manual_seed(0)
    model, x = Spellings(), torch.randn(2, 3, H)
    traced, gm, flat = _rewritten(model, x)
    targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert targets.count(aten.linear.default) == 5  # .T, .t(), transpose, einsum [out, in], addmm
    assert targets.count(aten.mm.default) == 4  # x @ W [in, out] (3-D and 2-D), einsum [in, out], permuted x
    assert targets.count(aten.einsum.default) == 1 and targets.count(aten.matmul.default) == 2  # left alone
    assert aten.numpy_T.default not in targets and aten.t.default not in targets
    for got, want in zip(gm(*flat), traced.gm(*flat)):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-6)


def test_every_rewritten_node_keeps_the_origin_of_the_value_it_computes():
    from fxpar.passes.ir.meta import FXPAR_ORIGIN

    traced, gm, _ = _rewritten(Spellings(), torch.randn(2, 3, H))
    out = next(n for n in gm.graph.nodes if n.op == "output")
    traced_names = {n.name for n in traced.gm.graph.nodes}
    for value in out.args[0]:
        assert value.meta.get(FXPAR_ORIGIN) in traced_names, value


@pytest.mark.parametrize("shape", [(5, H), (2, 3, H), (2, 2, 3, H)])
def test_matmul_on_any_rank_folds_to_mm(shape):
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.randn(H, F))

        def forward(self, x):
            return x @ self.w

    model, x = M(), torch.randn(*shape)
    traced, gm, flat = _rewritten(model, x)
    assert [n.target for n in gm.graph.nodes if n.op == "call_function"].count(aten.mm.default) == 1
    assert torch.equal(gm(*flat)[0], traced.gm(*flat)[0])


class SpelledMLP(nn.Module):
    """An MLP with no nn.Linear: weights stored [in, out] and [out, in], read through @, .T and einsum."""

    def __init__(self):
        super().__init__()
        self.up = nn.Parameter(torch.randn(H, F) / H ** 0.5)
        self.gate = nn.Parameter(torch.randn(F, H) / H ** 0.5)
        self.down = nn.Parameter(torch.randn(H, F) / F ** 0.5)

    def forward(self, x):
        h = torch.nn.functional.silu(x @ self.gate.T) * torch.einsum("bsh,hf->bsf", x, self.up)
        return x + h @ self.down.T


def test_a_spelled_mlp_is_sharded_at_t2():
    torch.manual_seed(0)
    x = torch.randn(2, 3, H)

    def measure(pm, reference):
        fwd, params = sgd_gaps(pm, reference, (x,))
        share = sum(p.numel() for p in pm.parameters()) / sum(p.numel() for p in reference.parameters())
        return fwd, params, share, [r.kind for r in pm.plan.sharded_regions]

    for fwd, params, share, kinds in on_tp_ranks(SpelledMLP(), (x,), measure):
        assert fwd <= 1e-5 and params <= 1e-5 and kinds == ["tp"] and share == pytest.approx(0.5), (fwd, params)


def test_a_non_contiguous_activation_folds_like_matmul_does():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.randn(H, F))

        def forward(self, x):
            return x.transpose(0, 1) @ self.w  # view(-1, H) of this would fail; matmul reshapes

    model, x = M(), torch.randn(3, 2, H)
    traced, gm, flat = _rewritten(model, x)
    assert torch.equal(gm(*flat)[0], traced.gm(*flat)[0])


class AdditiveTerms(nn.Module):
    """addmm whose additive term is not a bias of shape [out]: an activation (column and row GEMMs), a broadcast
    column, and beta/alpha. Each once crashed a later stage (local_shapes: a 2-D term scattered like a bias)."""

    def __init__(self):
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(H, F) / H ** 0.5)
        self.w2 = nn.Parameter(torch.randn(F, H) / F ** 0.5)
        self.w3 = nn.Parameter(torch.randn(H, F) / H ** 0.5)
        self.w4 = nn.Parameter(torch.randn(H, F) / H ** 0.5)

    def forward(self, x):
        h = x.flatten(0, 1)  # (b*s, H)
        a = torch.relu(torch.addmm(h @ self.w3, h, self.w1))  # an activation added to a column GEMM
        a = a + torch.addmm(h[:, :1], h, self.w4, beta=0.5, alpha=2.0)  # a broadcast column, beta and alpha
        y = torch.addmm(h * 2, a, self.w2)  # an activation added to a row GEMM
        return x + y.view_as(x)


def _gemm_lines(gm: GraphModule) -> str:
    """The graph's GEMMs, products and sums, one per line, as `name = op(args)`."""
    keep = (aten.mm.default, aten.addmm.default, aten.mul.Tensor, aten.add.Tensor, aten.linear.default)
    return "".join(f"{n.name} = {n.target.__name__}({', '.join(map(str, n.args))})\n" for n in gm.graph.nodes
                   if n.op == "call_function" and n.target in keep)


def test_an_additive_term_that_is_not_a_bias_becomes_an_add():
    torch.manual_seed(0)
    model, x = AdditiveTerms(), torch.randn(2, 3, H)
    traced, gm, flat = _rewritten(model, x)
    targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert aten.addmm.default not in targets and targets.count(aten.mm.default) == 4
    torch.testing.assert_close(gm(*flat)[0], traced.gm(*flat)[0], rtol=0, atol=1e-6)
    TestCase().assertExpectedInline(_gemm_lines(gm), """\
mm_default_3 = mm.default(flatten, p_w3)
mm_default = mm.default(flatten, p_w1)
addmm = add.Tensor(mm_default, mm_default_3)
mm_default_1 = mm.default(flatten, p_w4)
mul_tensor = mul.Tensor(mm_default_1, 2.0)
mul_tensor_1 = mul.Tensor(slice_1, 0.5)
addmm_1 = add.Tensor(mul_tensor, mul_tensor_1)
add = add.Tensor(relu, addmm_1)
mul = mul.Tensor(flatten, 2)
mm_default_2 = mm.default(add, p_w2)
addmm_2 = add.Tensor(mm_default_2, mul)
add_1 = add.Tensor(x, view_as)
""")


def test_a_plain_bias_stays_addmm():
    class Conv1D(nn.Module):  # Hugging Face's GPT-2 projection: addmm(b, x, W[in, out])
        def __init__(self):
            super().__init__()
            self.w, self.b = nn.Parameter(torch.randn(H, F)), nn.Parameter(torch.randn(F))

        def forward(self, x):
            return torch.addmm(self.b, x.flatten(0, 1), self.w)

    traced, gm, flat = _rewritten(Conv1D(), torch.randn(2, 3, H))
    assert [n.target for n in gm.graph.nodes if n.op == "call_function"].count(aten.addmm.default) == 1


def test_additive_terms_are_exact_at_t2():
    torch.manual_seed(0)
    x = torch.randn(2, 3, H)

    def measure(pm, reference):
        return (*sgd_gaps(pm, reference, (x,)), len(pm.plan.sharded_regions))

    for fwd, params, regions in on_tp_ranks(AdditiveTerms(), (x,), measure):
        assert fwd <= 1e-5 and params <= 1e-5 and regions >= 1, (fwd, params, regions)
