"""Recompute pass: golden graphs, bit-exactness (torch.equal on the loss and every gradient, one process and t=2 over
gloo), collectives never recomputed (all-reduce counts unchanged), saved activation bytes none > selective > full
with and without fusion, printed next to Korthikanti et al.'s per-layer formula, and edge cases.

Recomputation inside pipeline chunks runs in tests/test_pipeline_exact.py.
"""
from __future__ import annotations

import contextlib
import copy

import pytest
import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F
from expecttest import TestCase

from fxpar.cost.memory import activation_bytes_per_layer
from fxpar.cost.shape import ModelShape
from fxpar.runtime.measure import saved_activation_bytes
from fxpar.passes.fusion.driver import fusion_pass
from fxpar.passes.ir.meta import FXPAR_RECOMPUTE, resolve_inputs
from fxpar.passes.fusion.recompute import Checkpointed, recompute_pass
from fxpar.trace import trace
from tests import models
from tests.harness import module_pool

pool2 = module_pool(2)
MODES = ("none", "selective", "full")


class Layer(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        return x + torch.relu(self.fc(x))


class Tiny(nn.Module):
    """Two repeated layers (layers.0, layers.1) and a head outside them."""

    def __init__(self):
        super().__init__()
        self.layers, self.head = nn.ModuleList([Layer(), Layer()]), nn.Linear(8, 2)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


class Attn(nn.Module):
    """Explicit causal attention over q, k, v, as in examples/gpt.py."""

    def __init__(self, T=4):
        super().__init__()
        self.register_buffer("mask", torch.tril(torch.ones(T, T)).view(1, 1, T, T))

    def forward(self, q, k, v):
        att = (q @ k.transpose(-2, -1)) * 0.5
        att = att.masked_fill(self.mask == 0, float("-inf"))
        return F.softmax(att, dim=-1) @ v


def _body(gm) -> str:
    return "\n".join(gm.code.strip().splitlines()[1:])


class TestGolden(TestCase):
    def test_full(self):
        gm = recompute_pass(trace(Tiny(), (torch.randn(2, 8),)).gm, "full")
        self.assertExpectedInline(_body(gm), """\
    recompute_0 = self.recompute_0(x, p_layers_0_fc_weight, p_layers_0_fc_bias);  x = p_layers_0_fc_weight = p_layers_0_fc_bias = None
    getitem = recompute_0[0];  recompute_0 = None
    recompute_1 = self.recompute_1(getitem, p_layers_1_fc_weight, p_layers_1_fc_bias);  getitem = p_layers_1_fc_weight = p_layers_1_fc_bias = None
    getitem_1 = recompute_1[0];  recompute_1 = None
    linear_2 = torch.ops.aten.linear.default(getitem_1, p_head_weight, p_head_bias);  getitem_1 = p_head_weight = p_head_bias = None
    return (linear_2,)""")
        self.assertExpectedInline(_body(gm.recompute_0.body), """\
    linear = torch.ops.aten.linear.default(x, p_layers_0_fc_weight, p_layers_0_fc_bias);  p_layers_0_fc_weight = p_layers_0_fc_bias = None
    relu = torch.ops.aten.relu.default(linear);  linear = None
    add = torch.ops.aten.add.Tensor(x, relu);  x = relu = None
    return (add,)""")

    def test_selective(self):
        g = torch.Generator().manual_seed(0)
        gm = recompute_pass(trace(Attn(), tuple(torch.randn(2, 2, 4, 8, generator=g) for _ in range(3))).gm,
                            "selective")
        self.assertExpectedInline(_body(gm), """\
    transpose = torch.ops.aten.transpose.int(k, -2, -1);  k = None
    eq = torch.ops.aten.eq.Scalar(b_mask, 0);  b_mask = None
    recompute_0 = self.recompute_0(q, transpose, eq, v);  q = transpose = eq = v = None
    getitem = recompute_0[0];  recompute_0 = None
    return (getitem,)""")
        self.assertExpectedInline(_body(gm.recompute_0.body), """\
    matmul = torch.ops.aten.matmul.default(q, transpose);  q = transpose = None
    mul = torch.ops.aten.mul.Tensor(matmul, 0.5);  matmul = None
    masked_fill = torch.ops.aten.masked_fill.Scalar(mul, eq, -inf);  mul = eq = None
    softmax = torch.ops.aten.softmax.int(masked_fill, -1);  masked_fill = None
    matmul_1 = torch.ops.aten.matmul.default(softmax, v);  softmax = v = None
    return (matmul_1,)""")


# ------------------------------------------------------------------------------- exactness and memory
@contextlib.contextmanager
def count_collectives(comm):
    """Counts this rank's all-reduces and all-gathers: every f, g, gather and vocab lookup goes through `comm`."""
    calls = [0]

    def counted(method):
        def call(x):
            calls[0] += 1
            return method(x)
        return call

    comm.all_reduce, comm.all_gather = counted(comm.all_reduce), counted(comm.all_gather)
    try:
        yield calls
    finally:
        del comm.all_reduce, comm.all_gather  # back to the class's methods


def _step(pm, args, kwargs):
    """(loss, grads by name, saved activation bytes of the forward, collectives run forward/backward)."""
    for p in pm.parameters():
        p.grad = None

    def forward():
        y = models.first_tensor(pm(*args, **kwargs))
        return F.cross_entropy(y.flatten(0, 1), args[0].flatten())

    with count_collectives(pm.rank.comm) as fwd_comm:
        loss, saved = saved_activation_bytes(forward, list(pm.parameters()) + list(pm.buffers()))
    with count_collectives(pm.rank.comm) as bwd_comm:
        loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in pm.named_parameters()}, saved, (fwd_comm[0], bwd_comm[0])


def recompute_matrix(name: str, t: int, **gpt_overrides) -> dict:
    """For fusion off/on and every mode: loss and grads bit-equal to mode "none"?, saved bytes, comm counts, and the
    number of checkpointed regions. `gpt_overrides` builds the example GPT with those GPTConfig fields instead."""
    import fxpar
    from fxpar.api import build
    from fxpar.passes.tensor_parallel.collectives import TPComm

    if gpt_overrides:
        from gpt import factory

        model, args = factory(batch=models.BATCH, **gpt_overrides)
        kwargs = {}
    else:
        model, args, kwargs = models.build(name)
    buffers = dict(model.named_buffers(remove_duplicate=False))
    unfused = fxpar.Config(fuse=False)  # this test applies the passes itself
    pm = build(model, TPComm(0, 1), args, kwargs, config=unfused) if t == 1 else \
        fxpar.parallelize(model, fxpar.init_mesh(tp=t), example_args=args, example_kwargs=kwargs, config=unfused)
    ref = pm.compiled.callables[0]
    values = pm.compiled.traced.values(buffers)
    out = {}
    for fuse in (False, True):
        base = fusion_pass(fx.GraphModule(ref, copy.deepcopy(ref.graph)), values) if fuse else ref
        runs = {}
        for mode in MODES:
            gm = recompute_pass(fx.GraphModule(base, copy.deepcopy(base.graph)), mode)
            pm.compiled.callables[0] = gm
            torch.manual_seed(3)
            pm.manual_seed(3)  # the random streams dropout draws from (passes/tensor_parallel/rng.py)
            runs[mode] = _step(pm, args, kwargs)
            regions = sum(1 for n in gm.graph.nodes if FXPAR_RECOMPUTE in n.meta)
            loss, grads, saved, counts = runs[mode]
            l0, g0 = runs["none"][:2]
            equal = torch.equal(loss, l0) and all(torch.equal(grads[k], g0[k]) for k in g0)
            out[fuse, mode] = {"equal": equal, "saved": saved, "comm": counts, "regions": regions}
    pm.compiled.callables[0] = ref
    return out


def _check(name, matrix):
    for (fuse, mode), r in matrix.items():
        assert r["equal"], f"{name} fuse={fuse} recompute={mode}: loss or gradients differ from no recompute"
        assert r["comm"] == matrix[fuse, "none"]["comm"], (name, fuse, mode, r["comm"])  # g never runs twice
        assert (r["regions"] > 0) == (mode != "none"), (name, fuse, mode, r)
    for fuse in (False, True):
        s = [matrix[fuse, mode]["saved"] for mode in MODES]
        assert s[0] > s[1] > s[2], f"{name} fuse={fuse}: saved bytes none/selective/full = {s}"


def test_recompute_is_bit_exact_t1():
    """One process; GPT-2 and Llama run in the t=2 test below (each model build costs seconds)."""
    _check("gpt", recompute_matrix("gpt", 1))


def test_recompute_is_bit_exact_with_dropout():
    """Dropout p > 0 everywhere: checkpoint replays the forward's random state, so the masks are the same."""
    _check("gpt dropout", recompute_matrix("gpt", 1, seq=8, layers=2, hidden=32, heads=4, vocab=64, dropout=0.1))


def _tp_matrices(names):
    return [recompute_matrix(name, 2) for name in names]


def test_recompute_is_bit_exact_t2(pool2):
    """t=2 over gloo: bit-exact on every rank, and the same number of all-reduces (no g inside a region)."""
    names = ("gpt", "gpt2", "llama")
    for per_rank in pool2.run(_tp_matrices, names):
        for name, matrix in zip(names, per_rank):
            _check(name, matrix)
            assert matrix[False, "none"]["comm"][0] > 0  # collectives did run


def test_saved_bytes_per_layer_vs_korthikanti(capsys):
    """Per layer = saved(L=3) - saved(L=2), so embedding, head and loss cancel (L=1 has no repeated block to find).
    Printed next to the formula; the assert is the order none > selective > full."""
    s, b, h, a = 32, models.BATCH, 64, 4
    per = {}
    for layers in (2, 3):
        per[layers] = recompute_matrix("gpt", 1, seq=s, layers=layers, hidden=h, heads=a, vocab=64)
    rows = []
    for fuse in (False, True):
        for mode in MODES:
            measured = per[3][fuse, mode]["saved"] - per[2][fuse, mode]["saved"]
            formula = activation_bytes_per_layer(ModelShape(layers=2, hidden=h, heads=a, seq=s, vocab=64), b, 1, mode)
            rows.append((fuse, mode, measured, formula))
    with capsys.disabled():
        print(f"\nsaved activation bytes per layer, example GPT s={s} b={b} h={h} a={a} t=1, fp32")
        print(f"{'fuse':>5} {'recompute':>10} {'measured':>10} {'formula fp16':>13} {'x2 fp32':>10} {'ratio':>6}")
        for fuse, mode, measured, formula in rows:
            print(f"{fuse!s:>5} {mode:>10} {measured:>10} {formula:>13.0f} {2 * formula:>10.0f} "
                  f"{measured / (2 * formula):>6.2f}")
    for fuse in (False, True):
        got = [m for f, _, m, _ in rows if f == fuse]
        assert got[0] > got[1] > got[2], got


# ----------------------------------------------------------------------------------------- edge cases
def test_none_returns_the_graph_untouched():
    gm = trace(Tiny(), (torch.randn(2, 8),)).gm
    code = gm.code
    assert recompute_pass(gm, "none") is gm and gm.code == code


def test_no_layers_no_attention_selective_returns_the_graph_untouched_and_full_says_why():
    gm = trace(nn.Sequential(nn.Linear(8, 8), nn.ReLU()), (torch.randn(2, 8),)).gm
    code = gm.code
    assert recompute_pass(gm, "selective") is gm and gm.code == code
    with pytest.raises(ValueError, match=r"recompute='full' .* no layer list .*\n.*Fix: Config\(recompute='sel"):
        recompute_pass(gm, "full")
    assert gm.code == code


def test_twice_is_once():
    gm = recompute_pass(trace(Tiny(), (torch.randn(2, 8),)).gm, "full")
    code = gm.code
    assert recompute_pass(gm, "full") is gm and gm.code == code


def test_bad_mode_raises():
    with pytest.raises(ValueError, match=r"mode must be one of \('none', 'selective', 'full'\), got 'all'"):
        recompute_pass(trace(Tiny(), (torch.randn(2, 8),)).gm, "all")


def test_regions_are_checkpointed_modules():
    gm = recompute_pass(trace(Tiny(), (torch.randn(2, 8),)).gm, "full")
    calls = [n for n in gm.graph.nodes if n.op == "call_module"]
    assert [n.meta[FXPAR_RECOMPUTE] for n in calls] == ["full:layers.0", "full:layers.1"]
    assert all(isinstance(gm.get_submodule(n.target), Checkpointed) for n in calls)


def test_fake_tensor_prop_runs_on_the_recomputed_graph():
    """`fxpar show` propagates fake tensors through the rewritten graph: Checkpointed regions must allow it."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.passes.fake_tensor_prop import FakeTensorProp

    model, x = Tiny(), torch.randn(2, 8)
    traced = trace(model, (x,))
    gm = recompute_pass(traced.gm, "full")
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    state = dict(model.named_parameters())
    inputs = [mode.from_tensor(v) for v in resolve_inputs(traced.inputs, state, traced.constants, (x,))]
    FakeTensorProp(gm, mode).propagate(*inputs)
    assert tuple(list(gm.graph.nodes)[-2].meta["val"].shape) == (2, 2)
