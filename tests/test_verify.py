"""fxpar.verify compares what the program computes and reads, not memory nothing has written yet: Hugging Face's
mixture-of-experts layers invert their token sort into `torch.empty_like(order)` and fill it with `index_put_`, so
the empty tensor's value before the write is whatever the allocator left (passes/ir/aliasing.py `unwritten`). The
written values, and everything read from them, are still compared: a wrong shard on one rank fails on every rank."""
from __future__ import annotations

import operator

import pytest
import torch
import torch.fx as fx

import fxpar
from fxpar.passes.ir.aliasing import unwritten

aten = torch.ops.aten

MOE = ["qwen2_moe", "mixtral", "gpt_oss"]


def _tiny(arch: str):
    pytest.importorskip("transformers")
    from tests.hf_sweep import architectures, build

    return build(arch, architectures()[arch])


def test_unwritten_is_the_empty_result_and_its_views_until_a_write():
    g = fx.Graph()
    x = g.placeholder("x")
    empty = g.call_function(aten.empty_like.default, (x,))
    before = g.call_function(aten.view.default, (empty, [-1]))
    parts = g.call_function(aten.split.Tensor, (empty, 2))
    part = g.call_function(operator.getitem, (parts, 0))
    filled = g.call_function(aten.copy_.default, (before, x))  # writes the empty tensor through its view
    after = g.call_function(aten.view.default, (empty, [-1]))
    read = g.call_function(aten.add.Tensor, (after, filled))
    fresh = g.call_function(aten.new_empty.default, (x, [3]))
    functional = g.call_function(aten.index_put.default, (fresh, [x], x))  # a new value: fresh stays unwritten
    g.output((read, functional))
    assert unwritten(g) == {empty, before, parts, part, fresh}


@pytest.mark.parametrize("arch", MOE)
def test_verify_passes_on_hugging_face_experts(arch):
    """Every node the tp=2 program computes (the experts' gathered tokens, the inverse of their sort after
    index_put_, the combined output) equals the unmodified model's, on both threaded ranks."""
    from tests.threaded import on_tp_ranks

    model, args, kwargs = _tiny(arch)
    errors = on_tp_ranks(model, args, lambda pm, reference: fxpar.verify(reference, pm, args, kwargs), kwargs,
                         timeout_s=300)
    assert max(errors) <= 1e-5, errors


def test_verify_still_fails_on_a_wrong_expert_shard():
    """Rank 1's shard of the first layer's gate|up expert weights is off by 0.5 in one element: rank 1 names the
    experts' GEMM that reads it, rank 0 that another rank diverged, and both raise."""
    from tests.threaded import on_tp_ranks

    model, args, kwargs = _tiny("qwen2_moe")
    key = "model.layers.0.mlp.experts.gate_up_proj"

    def per_rank(pm, reference):
        if pm.rank.comm.rank == 1:
            with torch.no_grad():
                pm.get_parameter(key)[0, 0, 0] += 0.5
        try:
            fxpar.verify(reference, pm, args, kwargs)
        except fxpar.VerifyError as e:
            return str(e)
        return "passed"

    rank0, rank1 = on_tp_ranks(model, args, per_rank, kwargs, timeout_s=300)
    assert rank1.startswith("fxpar.verify: tp rank 1: node grouped_mm_fallback (fxpar.grouped_linear.default, "
                            "module model.layers.0.mlp.experts)") and "max relative error" in rank1, rank1
    assert rank0 == "fxpar.verify: tp rank 0: grouped_mm_fallback diverge(s) on another tp rank", rank0
