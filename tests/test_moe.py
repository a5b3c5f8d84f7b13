"""Mixture-of-experts (passes/frontend/grouped_gemm.py): Hugging Face's grouped expert GEMM becomes
fxpar::grouped_linear (weights [E, out, in]) or fxpar::grouped_mm (weights [E, in, out]), bit for bit the same, and
each expert's MLP is split column- then row-wise, the router replicated: behind a softmax (Mixtral) or a top-k over
the router's logits (GPT-OSS, Aria), with per-expert biases gathered per token and interleaved gate|up columns."""
from __future__ import annotations

import copy

import pytest
import torch

from fxpar.passes.frontend.gemm_forms import gemm_forms_pass
from fxpar.passes.frontend.grouped_gemm import GROUPED_LINEAR, GROUPED_MM
from fxpar.trace import trace

moe = pytest.importorskip("transformers.integrations.moe")


@pytest.mark.parametrize("counts", [(3, 0, 5, 2), (0, 0, 0, 4), (1, 1, 1, 1)], ids=["uneven", "one-expert", "even"])
def test_grouped_linear_is_transformers_grouped_gemm_bit_for_bit(counts):
    torch.manual_seed(0)
    x = torch.randn(sum(counts), 6, requires_grad=True)
    w = torch.randn(len(counts), 10, 6, requires_grad=True)  # [E, out, in], as the experts store it
    offs = torch.tensor(counts).cumsum(0)
    got = GROUPED_LINEAR(x, w, offs)
    want = torch.ops.transformers.grouped_mm_fallback(x, w.transpose(-2, -1), offs)
    assert torch.equal(got, want)
    dy = torch.randn_like(got)
    assert all(torch.equal(a, b) for a, b in zip(torch.autograd.grad(got, (x, w), dy),
                                                 torch.autograd.grad(want, (x, w), dy)))


@pytest.mark.parametrize("counts", [(3, 0, 5, 2), (0, 0, 0, 4)], ids=["uneven", "one-expert"])
def test_grouped_mm_is_transformers_grouped_gemm_on_in_out_weights_bit_for_bit(counts):
    torch.manual_seed(0)
    x = torch.randn(sum(counts), 6, requires_grad=True)
    w = torch.randn(len(counts), 6, 10, requires_grad=True)  # [E, in, out], as GPT-OSS and Aria store it
    offs = torch.tensor(counts).cumsum(0)
    got = GROUPED_MM(x, w, offs)
    want = torch.ops.transformers.grouped_mm_fallback(x, w, offs)
    assert torch.equal(got, want)
    dy = torch.randn_like(got)
    assert all(torch.equal(a, b) for a, b in zip(torch.autograd.grad(got, (x, w), dy),
                                                 torch.autograd.grad(want, (x, w), dy)))


def test_gemm_forms_rewrites_the_experts_call_and_nothing_else():
    from tests.hf_sweep import build

    model, args, kwargs = build("mixtral", "MixtralForCausalLM")
    traced = trace(model, args, kwargs)
    gm = gemm_forms_pass(torch.fx.GraphModule(traced.gm, copy.deepcopy(traced.gm.graph)))
    targets = [str(n.target) for n in gm.graph.nodes if n.op == "call_function"]
    assert targets.count(str(GROUPED_LINEAR)) == 2 * model.config.num_hidden_layers  # gate|up and down
    assert "transformers.grouped_mm_fallback.default" not in targets
    grouped = [n for n in gm.graph.nodes if n.target is GROUPED_LINEAR]
    assert all(n.args[1].op == "placeholder" and n.args[1].meta["val"].dim() == 3 for n in grouped)


def test_mixtral_experts_are_split_column_then_row():
    from tests.hf_sweep import architectures, sweep_one
    from tests.threaded import Threaded

    with Threaded():
        row = sweep_one("mixtral", architectures()["mixtral"])
    assert row["status"] == "sharded" and row["gap"] <= 1e-5, row
    assert row["share"] <= 0.51, row  # experts, attention and vocabulary all split (the router is replicated)
    assert row["fwd"] == 2 and row["bwd"] == 2, row  # one g after attention, one after the experts


@pytest.mark.parametrize("arch", ["gpt_oss", "aria_text"])
def test_experts_behind_a_top_k_router_are_split_column_then_row(arch):
    """The router's top-k over its logits keeps the router replicated (the plan says so); the experts' grouped GEMMs
    are split as a dense MLP is. GPT-OSS also adds a per-expert bias gathered per token (stored sharded, gathered
    locally) and reads gate|up interleaved ([::2], [1::2]); Aria adds shared experts."""
    from tests.hf_sweep import architectures, build, sweep_one
    from tests.threaded import Threaded

    with Threaded():
        row = sweep_one(arch, architectures()[arch])
    assert row["status"] == "sharded" and row["gap"] <= 1e-5, row
    assert row["share"] <= 0.51, row
    assert row["fwd"] == 2 and row["bwd"] == 2, row
    model, args, kwargs = build(arch, architectures()[arch])
    from fxpar.api import build as fxbuild
    from fxpar.passes.tensor_parallel.collectives import TPComm

    plan = fxbuild(model, TPComm(rank=0, size=2), args, kwargs).plan
    router = [r for r in plan.regions if r.module.endswith("mlp.router")]
    assert router and all(not r.columns and "topk" in r.reason for r in router), plan.region_table()
    experts = model.model.layers[0].mlp.experts
    local = {w.key: w.local_shape for w in plan.weights}
    e, h, two_i = experts.gate_up_proj.shape
    assert local["model.layers.0.mlp.experts.gate_up_proj"] == (e, h, two_i // 2)
    assert local["model.layers.0.mlp.experts.down_proj"] == (e, two_i // 4, h)
    if arch == "gpt_oss":
        assert local["model.layers.0.mlp.experts.gate_up_proj_bias"] == (e, two_i // 2)
