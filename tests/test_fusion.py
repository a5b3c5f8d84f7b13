"""Fusion passes: golden graphs, numerics (fused vs unfused loss and every gradient, one process and t=2 over gloo),
memory (bias+GeLU saves one [b, s, 4h/t] activation per MLP), near misses left alone, torch.compile.

The fused pipeline-parallel case runs in tests/test_pipeline_exact.py (fusion is on by default there).
"""
from __future__ import annotations

import copy
import functools
import math

import pytest
import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F
from expecttest import TestCase

from fxpar.compiler import compile_graph
from fxpar.runtime.measure import saved_activation_bytes
from fxpar.passes.fusion.driver import (FXPAR_FUSED, attention_to_sdpa_pass, bias_dropout_add_pass, bias_gelu_pass,
                                        fusion_pass, gelu_pass)
from fxpar.passes.ir.meta import resolve_inputs
from fxpar.trace import trace
from tests import models
from tests.harness import module_pool

pool2 = module_pool(2)
LOSS_REL, GRAD_ABS = 1e-5, 1e-5


# ---------------------------------------------------------------------------------------------- small models
class MLPBlock(nn.Module):
    """x + dropout(fc2(gelu(fc1(x)))): bias+GeLU folded with fc2, and bias+dropout+add."""

    def __init__(self, approximate="none", p=0.0):
        super().__init__()
        self.fc1, self.fc2, self.drop, self.approximate = nn.Linear(8, 32), nn.Linear(32, 8), nn.Dropout(p), approximate

    def forward(self, x):
        return x + self.drop(self.fc2(F.gelu(self.fc1(x), approximate=self.approximate)))


class NewGELU(nn.Module):
    """GPT-2's NewGELU written out, on a Linear, read by a non-GEMM (so bias_gelu is not folded)."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 16)

    def forward(self, x):
        y = self.fc(x)
        return (0.5 * y * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (y + 0.044715 * torch.pow(y, 3.0))))).sum(-1)


class Attn(nn.Module):
    """Explicit causal attention on given q, k, v, in the example GPT's spelling; knobs make near misses."""

    def __init__(self, T=4, mask=None, dim=-1, learned_scale=False, p=0.0):
        super().__init__()
        self.register_buffer("mask", torch.tril(torch.ones(T, T)).view(1, 1, T, T) if mask is None else mask)
        self.dim, self.drop = dim, nn.Dropout(p)
        self.scale = nn.Parameter(torch.tensor(0.5)) if learned_scale else 0.5

    def forward(self, q, k, v):
        T = q.shape[-2]
        att = (q @ k.transpose(-2, -1)) * self.scale
        att = att.masked_fill(self.mask[:, :, :T, :T] == 0, float("-inf"))
        return self.drop(F.softmax(att, dim=self.dim)) @ v


def _qkv(T=4):
    g = torch.Generator().manual_seed(0)
    return tuple(torch.randn(2, 2, T, 8, generator=g, requires_grad=True) for _ in range(3))


def _traced(model, args):
    torch.manual_seed(0)
    traced = trace(model, args)
    return traced, traced.values(dict(model.named_buffers()))


def _run_traced(traced, model, gm, args):
    """Call a traced graph with the model's parameters and buffers; return (output, grads of params and args)."""
    state = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    inputs = resolve_inputs(traced.inputs, state, traced.constants, args)
    for t in list(state.values()) + list(args):
        t.grad = None
    out = gm(*inputs)[0]
    out.float().sin().sum().backward()
    grads = [t.grad for t in list(model.parameters()) + [a for a in args if a.requires_grad]]
    return out.detach(), grads


def _same_math(model, args, pass_fn, exact=False):
    traced, values = _traced(model, args)
    ref = traced.gm
    new = fx.GraphModule(ref, copy.deepcopy(ref.graph))
    assert pass_fn(new, values) is new
    torch.manual_seed(1)
    out0, g0 = _run_traced(traced, model, ref, args)
    torch.manual_seed(1)
    out1, g1 = _run_traced(traced, model, new, args)
    if exact:
        assert torch.equal(out0, out1) and all(torch.equal(a, b) for a, b in zip(g0, g1))
    else:
        torch.testing.assert_close(out1, out0, rtol=1e-5, atol=1e-6)
        for a, b in zip(g0, g1):
            torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)
    return new


def _body(gm) -> str:
    """The graph's code without the signature line (placeholders), for short goldens."""
    return "\n".join(gm.code.strip().splitlines()[1:])


# --------------------------------------------------------------------------------------------- golden graphs
class TestGolden(TestCase):
    def test_mlp_block(self):
        """The default: the dropout (p = 0) removed, the GEMMs keep their biases, the GeLU is torch's (its activation
        saved, as eager)."""
        model, x = MLPBlock(), torch.randn(2, 3, 8)
        traced, values = _traced(model, (x,))
        gm = fusion_pass(traced.gm, values)
        self.assertExpectedInline(_body(gm), """\
    linear = torch.ops.aten.linear.default(x, p_fc1_weight, p_fc1_bias);  p_fc1_weight = p_fc1_bias = None
    gelu = torch.ops.aten.gelu.default(linear);  linear = None
    linear_1 = torch.ops.aten.linear.default(gelu, p_fc2_weight, p_fc2_bias);  gelu = p_fc2_weight = p_fc2_bias = None
    add = torch.ops.aten.add.Tensor(x, linear_1);  x = linear_1 = None
    return (add,)""")

    def test_mlp_block_with_gelu_recompute(self):
        """recompute="selective": bias+GeLU folded with the next GEMM, the activation recomputed in backward."""
        model, x = MLPBlock(), torch.randn(2, 3, 8)
        traced, values = _traced(model, (x,))
        gm = fusion_pass(traced.gm, values, recompute_gelu=True)
        self.assertExpectedInline(_body(gm), """\
    linear = torch.ops.aten.linear.default(x, p_fc1_weight);  p_fc1_weight = None
    bias_gelu_linear = fxpar_passes_ir_kernels_bias_gelu_linear(linear, p_fc1_bias, approximate = 'none', weight = p_fc2_weight, out_bias = p_fc2_bias, flat_shape = None, layout = 'linear');  linear = p_fc1_bias = p_fc2_weight = p_fc2_bias = None
    add = torch.ops.aten.add.Tensor(x, bias_gelu_linear);  x = bias_gelu_linear = None
    return (add,)""")

    def test_new_gelu_becomes_aten_gelu(self):
        model, x = NewGELU(), torch.randn(2, 3, 8)
        traced, values = _traced(model, (x,))
        gm = gelu_pass(traced.gm)
        self.assertExpectedInline(_body(gm), """\
    linear = torch.ops.aten.linear.default(x, p_fc_weight, p_fc_bias);  x = p_fc_weight = p_fc_bias = None
    gelu = torch.ops.aten.gelu.default(linear, approximate = 'tanh');  linear = None
    sum_1 = torch.ops.aten.sum.dim_IntList(gelu, [-1]);  gelu = None
    return (sum_1,)""")

    def test_new_gelu(self):
        model, x = NewGELU(), torch.randn(2, 3, 8)
        traced, values = _traced(model, (x,))
        gm = bias_gelu_pass(traced.gm)
        self.assertExpectedInline(_body(gm), """\
    linear = torch.ops.aten.linear.default(x, p_fc_weight);  x = p_fc_weight = None
    bias_gelu = fxpar_passes_ir_kernels_bias_gelu(linear, p_fc_bias, 'tanh');  linear = p_fc_bias = None
    sum_1 = torch.ops.aten.sum.dim_IntList(bias_gelu, [-1]);  bias_gelu = None
    return (sum_1,)""")

    def test_causal_attention(self):
        model = Attn()
        traced, values = _traced(model, _qkv())
        gm = attention_to_sdpa_pass(traced.gm, values)
        self.assertExpectedInline(_body(gm), """\
    sdpa = torch.ops.aten.scaled_dot_product_attention.default(q, k, v, is_causal = True, scale = 0.5);  q = k = v = None
    return (sdpa,)""")


# ------------------------------------------------------------------------------------ numerics, one process
@pytest.mark.parametrize("approximate", ["none", "tanh"])
@pytest.mark.parametrize("recompute_gelu", [False, True])
def test_mlp_block_numerics(approximate, recompute_gelu):
    gm = _same_math(MLPBlock(approximate), (torch.randn(2, 3, 8, requires_grad=True),),
                    functools.partial(fusion_pass, recompute_gelu=recompute_gelu))
    fused = {n.meta.get(FXPAR_FUSED) for n in gm.graph.nodes}
    assert "bias_dropout_add" not in fused and ("bias_gelu_linear" in fused) == recompute_gelu, fused  # p = 0


@pytest.mark.parametrize("fuse", [gelu_pass, bias_gelu_pass])
def test_new_gelu_numerics(fuse):
    _same_math(NewGELU(), (torch.randn(2, 3, 8, requires_grad=True),), lambda gm, v: fuse(gm))


def test_bias_dropout_add_draws_the_same_mask():
    """p > 0 in training: the fused op draws aten.dropout's noise, so the step is bit-identical."""
    gm = _same_math(MLPBlock(p=0.3), (torch.randn(2, 3, 8, requires_grad=True),), fusion_pass, exact=True)
    assert any(n.meta.get(FXPAR_FUSED) == "bias_dropout_add" for n in gm.graph.nodes)


@pytest.mark.parametrize("T", [4, 3])
def test_causal_attention_numerics(T):
    """T < buffer size: the buffer is sliced to [:T, :T] in the graph and still proven causal."""
    gm = _same_math(Attn(T=4), _qkv(T), attention_to_sdpa_pass)
    assert [n.meta[FXPAR_FUSED] for n in gm.graph.nodes if FXPAR_FUSED in n.meta] == ["sdpa"]


def loss_grads_saved(pm, args, kwargs):
    """(loss, grads by name, saved activation bytes of the forward) of one step of `pm` on (args, kwargs)."""
    for p in pm.parameters():
        p.grad = None

    def forward():
        y = models.first_tensor(pm(*args, **kwargs))
        return F.cross_entropy(y.flatten(0, 1).float(), args[0].flatten())

    loss, saved = saved_activation_bytes(forward, list(pm.parameters()) + list(pm.buffers()))
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in pm.named_parameters()}, saved


def fused_vs_unfused(name: str, t: int, eager_attention: bool = False) -> dict:
    """Build `name` for this rank (t=1 in-process, else over the gloo group) and run one step of the unfused graph,
    of the graph with the default fusions ("default"), with every fusion ("all": the GeLU recomputed) and with
    bias+GeLU only ("bias_gelu"); for each fused one:
    the errors against unfused, the fusions made, and the saved activation bytes (also "saved_unfused")."""
    import fxpar
    from fxpar.api import build
    from fxpar.passes.tensor_parallel.collectives import TPComm

    model, args, kwargs = models.build(name)
    if eager_attention:
        model.config._attn_implementation = "eager"
    buffers = dict(model.named_buffers(remove_duplicate=False))
    unfused = fxpar.Config(fuse=False)  # this test applies the passes itself
    pm = build(model, TPComm(0, 1), args, kwargs, config=unfused) if t == 1 else \
        fxpar.parallelize(model, fxpar.init_mesh(tp=t), example_args=args, example_kwargs=kwargs, config=unfused)
    ref = pm.compiled.callables[0]
    values = pm.compiled.traced.values(buffers)
    l0, g0, saved0 = loss_grads_saved(pm, args, kwargs)
    result = {"saved_unfused": saved0}
    for label, fn in (("default", functools.partial(fusion_pass, values=values)),
                      ("all", functools.partial(fusion_pass, values=values, recompute_gelu=True)),
                      ("bias_gelu", bias_gelu_pass)):
        fused = fn(fx.GraphModule(ref, copy.deepcopy(ref.graph)))
        pm.compiled.callables[0] = fused
        l1, g1, saved1 = loss_grads_saved(pm, args, kwargs)
        result[label] = {
            "fusions": sorted(n.meta[FXPAR_FUSED] for n in fused.graph.nodes if FXPAR_FUSED in n.meta),
            "loss_rel": ((l1 - l0).abs() / l0.abs()).item(),
            "grad_abs": max((g1[k] - g0[k]).abs().max().item() for k in g0),
            "saved": saved1,
        }
    pm.compiled.callables[0] = ref
    return result


# which fusions each model gets (dropout is 0 in all three: no bias_dropout_add): the example GPT SDPA and, with the
# GeLU recomputed, bias_gelu_linear; GPT-2 (already SDPA) its written-out GeLU as one op; Llama (SDPA, SwiGLU, no
# biases) none
EXPECTED = {"gpt": {"sdpa", "bias_gelu_linear"}, "gpt2": {"bias_gelu_linear"}, "llama": set()}
EXPECTED_DEFAULT = {"gpt": {"sdpa"}, "gpt2": {"gelu"}, "llama": set()}
HIDDEN = 32  # of the example GPT and GPT-2 in tests/models.py, both with 2 layers


def _check(name: str, r: dict, t: int) -> None:
    for label in ("default", "all", "bias_gelu"):
        assert r[label]["loss_rel"] <= LOSS_REL and r[label]["grad_abs"] <= GRAD_ABS, (name, label, r[label])
    assert EXPECTED[name] <= set(r["all"]["fusions"]), (name, r["all"]["fusions"])
    assert set(r["default"]["fusions"]) == EXPECTED_DEFAULT[name], (name, r["default"]["fusions"])
    if name != "llama":  # bias+GeLU alone saves at least one [b, s, 4h/t] fp32 activation per MLP
        one_activation = models.BATCH * models.SEQ * 4 * HIDDEN // t * 4
        assert r["saved_unfused"] - r["bias_gelu"]["saved"] >= 2 * one_activation, (name, r)


def test_fused_equals_unfused_t1():
    """One process; GPT-2 and Llama run in the t=2 test below (each model build costs seconds)."""
    _check("gpt", fused_vs_unfused("gpt", 1), 1)


def test_fused_equals_unfused_hf_eager_attention():
    """GPT-2 with explicit ("eager") attention: an additive float mask becomes SDPA's attn_mask."""
    r = fused_vs_unfused("gpt2", 1, eager_attention=True)["all"]
    assert r["loss_rel"] <= LOSS_REL and r["grad_abs"] <= GRAD_ABS, r
    assert r["fusions"].count("sdpa") == 2, r["fusions"]


def _tp_cases(names):
    return [fused_vs_unfused(name, 2) for name in names]


def test_fused_equals_unfused_t2(pool2):
    """t=2 over gloo: every rank's loss and local gradients, fused vs unfused; bias+GeLU's saved activation."""
    names = ("gpt", "gpt2", "llama")
    for per_rank in pool2.run(_tp_cases, names):
        for name, r in zip(names, per_rank):
            _check(name, r, 2)


# ------------------------------------------------------------------------------- near misses: left alone
def _untouched(model, args, pass_fn):
    traced, values = _traced(model, args)
    before = traced.gm.code
    assert pass_fn(traced.gm, values) is traced.gm
    assert traced.gm.code == before, "a near miss was rewritten"


NEAR_MISS_ATTENTION = {
    "mask of another shape": dict(mask=torch.tril(torch.ones(4, 4)).expand(1, 2, 4, 4).clone()),  # per-head dim 2
    "mask that is not causal": dict(mask=torch.triu(torch.ones(4, 4)).view(1, 1, 4, 4)),
    "mask shifted by one": dict(mask=torch.tril(torch.ones(4, 4), diagonal=-1).view(1, 1, 4, 4)),
    "softmax over another dim": dict(dim=-2),
    "scale that is a tensor": dict(learned_scale=True),
}


@pytest.mark.parametrize("case", list(NEAR_MISS_ATTENTION))
def test_attention_near_miss_is_left_alone(case):
    _untouched(Attn(**NEAR_MISS_ATTENTION[case]), _qkv(), attention_to_sdpa_pass)


def test_attention_without_buffer_values_is_left_alone():
    """Causality is proven from the buffer's value: with no values given, nothing is proven."""
    _untouched(Attn(), _qkv(), lambda gm, values: attention_to_sdpa_pass(gm, None))


class ReusedPreActivation(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 16)

    def forward(self, x):
        y = self.fc(x)
        return F.gelu(y) + y  # y + b is read again: fusing would have to keep it anyway


class NoBias(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc, self.proj = nn.Linear(8, 16, bias=False), nn.Linear(16, 8, bias=False)

    def forward(self, x):
        return x + F.dropout(self.proj(F.gelu(self.fc(x))), 0.1)


class RandomBetween(nn.Module):
    """A second dropout runs between the fused dropout and its add: moving the draw would reorder the stream."""

    def __init__(self):
        super().__init__()
        self.fc, self.d1, self.d2 = nn.Linear(8, 8), nn.Dropout(0.5), nn.Dropout(0.5)

    def forward(self, x):
        a = self.d1(self.fc(x))
        b = self.d2(x)
        return (x + a) * b


@pytest.mark.parametrize("model", [ReusedPreActivation(), NoBias(), RandomBetween()], ids=lambda m: type(m).__name__)
def test_bias_patterns_near_miss_are_left_alone(model):
    _untouched(model, (torch.randn(2, 3, 8),), fusion_pass)


def test_passes_on_a_graph_without_patterns_return_it_untouched():
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU())
    for pass_fn in (fusion_pass, attention_to_sdpa_pass, lambda gm, v: bias_gelu_pass(gm),
                    lambda gm, v: bias_dropout_add_pass(gm)):
        _untouched(model, (torch.randn(2, 8),), pass_fn)


# ----------------------------------------------------------------------------------- compile, show
def test_compile_graph_runs_the_fused_graph():
    model, x = MLPBlock(), torch.randn(2, 3, 8, requires_grad=True)
    traced, values = _traced(model, (x,))
    ref = traced.gm
    fused = fusion_pass(fx.GraphModule(ref, copy.deepcopy(ref.graph)), values)
    compiled = compile_graph(fused, backend="aot_eager")
    out0, g0 = _run_traced(traced, model, ref, (x,))
    out1, g1 = _run_traced(traced, model, compiled, (x,))
    torch.testing.assert_close(out1, out0)
    for a, b in zip(g0, g1):
        torch.testing.assert_close(b, a)


def test_fake_tensor_prop_runs_on_the_fused_graph():
    """`fxpar show` propagates fake tensors through the rewritten graph: the fused ops must allow it."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.passes.fake_tensor_prop import FakeTensorProp

    model, x = MLPBlock(p=0.1), torch.randn(2, 3, 8)
    traced, values = _traced(model, (x,))
    gm = fusion_pass(traced.gm, values)
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    state = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    inputs = [mode.from_tensor(v) for v in resolve_inputs(traced.inputs, state, traced.constants, (x,))]
    FakeTensorProp(gm, mode).propagate(*inputs)
    assert tuple(list(gm.graph.nodes)[-2].meta["val"].shape) == (2, 3, 8)


# ------------------------------------------------------------------ masks built in the graph, folded and proven
class InGraphMask(nn.Module):
    """Causal attention whose mask the forward builds from sizes, as much real code writes it."""

    def __init__(self, how: str):
        super().__init__()
        self.how = how

    def forward(self, q, k, v):
        T = q.shape[-2]
        att = (q @ k.transpose(-2, -1)) * 0.5
        if self.how == "triu_bool":
            att = att.masked_fill(torch.triu(torch.ones(T, T, dtype=torch.bool), 1), float("-inf"))
        elif self.how == "tril_eq_0":
            att = att.masked_fill(torch.tril(torch.ones(T, T)) == 0, float("-inf"))
        elif self.how == "arange":
            i = torch.arange(T)
            att = att.masked_fill(i[None, :] > i[:, None], float("-inf"))
        elif self.how == "full_inf_triu":
            att = att + torch.full((T, T), float("-inf")).triu(1)
        elif self.how == "hf_lowest":  # Hugging Face's additive mask: the dtype's lowest value above the diagonal
            i = torch.arange(T)
            att = att + torch.zeros(T, T).masked_fill(i[None, :] > i[:, None], torch.finfo(torch.float32).min)
        elif self.how == "not_causal":  # the diagonal masked too
            att = att.masked_fill(torch.triu(torch.ones(T, T, dtype=torch.bool), 0), -1e9).masked_fill(
                torch.triu(torch.ones(T, T, dtype=torch.bool), 1), float("-inf"))
        elif self.how == "finite_fill":  # -1e4 is not -inf: an additive mask, not causality
            att = att + torch.full((T, T), -1e4).triu(1)
        elif self.how == "random":
            att = att.masked_fill(torch.rand(T, T) > 2.0, float("-inf"))  # all False, but drawn: never folded
        return F.softmax(att, dim=-1) @ v


@pytest.mark.parametrize("how", ["triu_bool", "tril_eq_0", "arange", "full_inf_triu", "hf_lowest"])
def test_a_causal_mask_built_in_the_graph_is_folded_and_fused(how):
    gm = _same_math(InGraphMask(how), _qkv(), attention_to_sdpa_pass)
    sdpa = [n for n in gm.graph.nodes if n.meta.get(FXPAR_FUSED) == "sdpa"]
    assert len(sdpa) == 1 and sdpa[0].kwargs.get("is_causal") and len(sdpa[0].args) == 3, gm.code
    assert not [n for n in gm.graph.nodes if n.op == "call_function" and n.target in (
        torch.ops.aten.ones.default, torch.ops.aten.full.default, torch.ops.aten.arange.default)], gm.code


@pytest.mark.parametrize("how", ["not_causal", "random"])
def test_a_mask_built_in_the_graph_that_is_not_causal_or_not_constant_is_left_alone(how):
    _untouched(InGraphMask(how), _qkv(), attention_to_sdpa_pass)


def test_a_finite_additive_mask_built_in_the_graph_stays_a_mask():
    gm = _same_math(InGraphMask("finite_fill"), _qkv(), attention_to_sdpa_pass)
    sdpa = [n for n in gm.graph.nodes if n.meta.get(FXPAR_FUSED) == "sdpa"]
    assert len(sdpa) == 1 and not sdpa[0].kwargs.get("is_causal") and len(sdpa[0].args) == 4, gm.code
