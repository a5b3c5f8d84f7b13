"""GEMM and elementwise kernel times: the roofline plus a fixed per-kernel overhead."""
import dataclasses

import pytest

from fxpar.cost.cluster import builtin_clusters
from fxpar.cost.compute import Gemm, gemm_seconds, layer_elementwise_bytes, layer_gemms, layer_seconds
from fxpar.cost.flops import attention_core_flops, layer_forward_flops
from fxpar.cost.shape import ModelShape

SELENE = builtin_clusters()["selene"]
SHAPE = ModelShape(layers=40, hidden=6144, heads=48, seq=2048, vocab=51200)


def test_layer_gemms_add_up_to_the_eq3_layer_flops():
    for t in (1, 2, 8):
        projections, core = layer_gemms(SHAPE, 2, t)
        assert sum(g.flops for g in projections + core) == pytest.approx(layer_forward_flops(SHAPE, 2) / t)
        assert sum(g.flops for g in core) == pytest.approx(attention_core_flops(SHAPE, 2) / t)


def test_backward_gemms_have_twice_the_forward_flops():
    g = Gemm("fc1", 4096, 3072, 6144)
    assert sum(bg.flops for bg in g.backward()) == 2 * g.flops


def test_large_gemm_runs_at_the_sustained_rate():
    g = Gemm("big", 8192, 8192, 8192)
    assert g.flops / gemm_seconds(g, SELENE) == pytest.approx(SELENE.gemm_flops, rel=0.01)


def test_attention_gemm_is_bandwidth_bound_below_the_ridge_point():
    scores = Gemm("scores", 2048, 2048, 64, batch=32)  # arithmetic intensity ~ 60 FLOP/byte < ridge ~ 134
    rate = scores.flops / gemm_seconds(scores, SELENE)
    assert rate < 0.6 * SELENE.gemm_flops


def test_small_gemm_pays_the_kernel_overhead():
    tiny = Gemm("tiny", 8, 8, 8)
    assert gemm_seconds(tiny, SELENE) == pytest.approx(SELENE.kernel_overhead, rel=0.01)


def test_elementwise_bytes_follow_the_fused_kernel_list():
    b, e = 1, 2
    dense, attention = layer_elementwise_bytes(SHAPE, b, 1, e)
    bsh = b * SHAPE.seq * SHAPE.hidden
    assert dense == pytest.approx(22 * bsh + (16 + 16) * bsh)  # (10e + 2) bsh + (8e bsh + 2e bsf)
    assert attention == pytest.approx(9 * b * SHAPE.heads * SHAPE.seq ** 2)


def test_faster_memory_makes_layers_faster():
    fast = dataclasses.replace(SELENE, memory_bandwidth=2 * SELENE.memory_bandwidth)
    assert layer_seconds(SHAPE, 1, 8, fast).forward < layer_seconds(SHAPE, 1, 8, SELENE).forward
