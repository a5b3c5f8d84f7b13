"""The cost model's expert dimension (cost/): a mixture-of-experts layer's parameters and FLOPs, its expert weights
and optimizer state split over ep, the dispatch bytes, and `fxpar plan` choosing ep for a Mixtral-shaped model."""
from __future__ import annotations

import json

import pytest

from fxpar.cost.cluster import get_cluster
from fxpar.cost.comm import ep_dispatch_elements
from fxpar.cost.flops import expert_parameters, layer_forward_flops, layer_parameters, parameters
from fxpar.cost.memory import stage_parameters
from fxpar.cost.planner import SearchSpace, plan
from fxpar.cost.shape import ModelShape
from fxpar.cost.step import ParallelConfig, estimate

# Mixtral 8x7B's sizes (Jiang et al. 2024): 32 layers, h 4096, 32 heads, 8 experts of f_e 14336, top-2, V 32000
MIXTRAL = ModelShape(layers=32, hidden=4096, heads=32, seq=4096, vocab=32000, batch=512, ffn_hidden=14336, experts=8,
                     top_k=2)


def test_a_moe_layer_holds_the_router_and_every_gated_expert():
    h, e, fe = 4096, 8, 14336
    assert expert_parameters(MIXTRAL) == e * 3 * h * fe
    assert layer_parameters(MIXTRAL) == 4 * h * h + 8 * h + h * e + e * 3 * h * fe
    # 47.4B with full multi-head attention and a tied head; Mixtral's grouped K/V (8 heads: 0.8B fewer) and its
    # untied head (0.13B more) make the published 46.7B
    assert parameters(MIXTRAL) / 1e9 == pytest.approx(46.7 + 0.8 - 0.13, abs=0.05)


def test_a_token_pays_for_its_k_experts_not_for_all_of_them():
    wide = ModelShape(layers=32, hidden=4096, heads=32, seq=4096, vocab=32000, ffn_hidden=14336, experts=64, top_k=2)
    router = 2.0 * 4096 * (64 - 8) * 4096  # the only difference: 2 h E per token, over s = 4096 tokens
    assert layer_forward_flops(wide, 1) - layer_forward_flops(MIXTRAL, 1) == pytest.approx(router)
    dense = ModelShape(layers=32, hidden=4096, heads=32, seq=4096, vocab=32000, ffn_hidden=2 * 14336 * 3 // 2)
    assert layer_forward_flops(MIXTRAL, 1) - layer_forward_flops(dense, 1) == pytest.approx(2.0 * 4096 * 8 * 4096)


def test_expert_parallelism_divides_the_experts_and_only_them():
    stages = (32,)
    one = stage_parameters(MIXTRAL, stages, 0, 1, ep=1)
    eight = stage_parameters(MIXTRAL, stages, 0, 1, ep=8)
    assert one - eight == pytest.approx(32 * expert_parameters(MIXTRAL) * 7 / 8)
    cluster = get_cluster("h100")
    at = {ep: estimate(MIXTRAL, ParallelConfig(tp=1, pp=4, dp=16, ep=ep, recompute="selective", vpp=4), cluster)
          for ep in (1, 8)}
    assert at[8].memory.states < at[1].memory.states / 4
    assert at[1].parts["tp_comm"] == 0 < at[8].parts["tp_comm"]  # the dispatch's all-to-alls


def test_the_dispatch_sends_k_rows_per_token_out_and_back_forward_and_backward():
    assert ep_dispatch_elements(b=2, s=8, h=16, k=2, ep=4) == 4 * 2 * 2 * 8 * 16 * 3 / 4
    assert ep_dispatch_elements(b=2, s=8, h=16, k=2, ep=1) == 0


@pytest.mark.parametrize("config, message", [
    (dict(tp=1, dp=4, ep=3), "ep=3 must divide dp=4"),
])
def test_bad_expert_configurations_are_refused(config, message):
    with pytest.raises(ValueError, match=message):
        estimate(MIXTRAL, ParallelConfig(**config), get_cluster("h100"))


def test_ep_on_a_dense_model_is_refused():
    dense = ModelShape(layers=4, hidden=64, heads=4, seq=32, vocab=64, batch=8)
    with pytest.raises(ValueError, match="the model has no experts"):
        estimate(dense, ParallelConfig(tp=1, dp=2, ep=2), get_cluster("h100"))
    with pytest.raises(ValueError, match="top_k must be 1..experts=8"):
        ModelShape(layers=4, hidden=64, heads=4, seq=32, vocab=64, experts=8, top_k=9)


def test_the_planner_chooses_expert_parallelism_for_mixtral():
    cluster = get_cluster("h100")
    best = plan(MIXTRAL, 64, cluster).best
    assert best.config.ep > 1 and best.config.tp == 1, best.config.describe()
    without = plan(MIXTRAL, 64, cluster, SearchSpace(ep=1)).best
    assert without.seconds > best.seconds, (without.config.describe(), best.config.describe())


def test_fxpar_plan_prints_ep_and_its_mesh(capsys):
    from fxpar.cli.main import main

    flags = ["plan", "--layers", "32", "--hidden", "4096", "--heads", "32", "--ffn", "14336", "--experts", "8",
             "--top-k", "2", "--seq", "4096", "--vocab", "32000", "--batch", "512", "--gpus", "64", "--cluster", "h100"]
    assert main(flags + ["--top", "3"]) == 0
    out = capsys.readouterr().out
    assert "E=8 k=2 f_e=14336" in out and " ep " in out.splitlines()[1], out
    assert main(flags + ["--json"]) == 0
    best = json.loads(capsys.readouterr().out)
    assert best["fxpar"]["mesh"]["ep"] == best["ep"] > 1 and best["experts"] == 8
