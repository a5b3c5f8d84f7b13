"""Unit tests of the sharding rules of passes/sharding/rules.py and mixer_rules.py that compute over dims: softmax,
reductions, norms, SDPA, batched matmul, baddbmm and GEMMs with a weight parameter. Placement in, Decision (or a
refusal) out; see tests/test_rules.py for how the graphs are made.

The tests at the end pin corners that once went wrong (an argument read by position, a dtype donor scattered, a
sharded weight operand, a mask scattered twice).
"""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from fxpar.passes.sharding import mixer_rules, rules
from fxpar.passes.sharding.rule_table import rule_for
from fxpar.passes.sharding.rules import Decision, Indivisible, NoRule, Role
from tests.rule_helpers import R, S, aten, ctx, export


# --- softmax / log_softmax: over another dim only
@pytest.mark.parametrize("fn,target", [
    (lambda x: x.softmax(-1), aten.softmax.int), (lambda x: x.log_softmax(-1), aten.log_softmax.int),
    (lambda x: aten._softmax(x, -1, False), aten._softmax.default),
    (lambda x: aten._log_softmax(x, -1, False), aten._log_softmax.default),
])
def test_softmax_over_another_dim(fn, target):
    g = export(fn, (2, 4, 8, 8))
    (x,) = g.inputs
    assert rules.softmax(g.node(target), ctx({x: S(1, 4)})) == Decision(S(1, 4))


def test_softmax_refuses_the_sharded_dim():
    g = export(lambda x: x.softmax(-1), (2, 8, 32))
    (x,) = g.inputs
    with pytest.raises(NoRule, match="softmax over the sharded dim"):
        rules.softmax(g.node(aten.softmax.int), ctx({x: S(2, 32)}))


# --- reductions: over other dims; the shard moves down past the reduced dims unless keepdim
@pytest.mark.parametrize("fn,target,shard,out", [
    (lambda x: x.sum(-1), aten.sum.dim_IntList, S(1, 8), S(1, 8)),
    (lambda x: x.sum((0, 1)), aten.sum.dim_IntList, S(2, 32), S(0, 32)),
    (lambda x: x.mean(0), aten.mean.dim, S(2, 32), S(1, 32)),
    (lambda x: x.mean(1, keepdim=True), aten.mean.dim, S(2, 32), S(2, 32)),
    (lambda x: x.amax(-1), aten.amax.default, S(1, 8), S(1, 8)),
    (lambda x: x.amin(0, keepdim=True), aten.amin.default, S(2, 32), S(2, 32)),
    (lambda x: x.var(1), aten.var.dim, S(2, 32), S(1, 32)),
], ids=["sum-last", "sum-two", "mean-first", "mean-keepdim", "amax", "amin-keepdim", "var"])
def test_reduction_over_other_dims(fn, target, shard, out):
    g = export(fn, (2, 8, 32))
    (x,) = g.inputs
    assert rules.reduction(g.node(target), ctx({x: shard})) == Decision(out)


@pytest.mark.parametrize("fn,target", [
    (lambda x: x.sum(2), aten.sum.dim_IntList), (lambda x: x.mean((0, -1)), aten.mean.dim),
    (lambda x: x.sum(), aten.sum.default), (lambda x: x.mean(), aten.mean.default),
    (lambda x: x.pow(2).mean(-1, keepdim=True), aten.mean.dim),
], ids=["sum", "mean-two", "sum-all", "mean-all", "mean-of-squares"])
def test_a_sum_or_mean_over_the_sharded_dim_is_a_partial_sum(fn, target):
    g = export(fn, (2, 8, 32))
    node = g.node(target)
    assert rules.reduction(node, ctx({node.args[0]: S(2, 32)})) == Decision(R, role=Role.REDUCE)


@pytest.mark.parametrize("fn,target", [
    (lambda x: x.amax(2), aten.amax.default), (lambda x: x.amin(-1, keepdim=True), aten.amin.default),
    (lambda x: x.var(2), aten.var.dim),
], ids=["amax", "amin", "var"])
def test_other_reductions_refuse_the_sharded_dim(fn, target):
    g = export(fn, (2, 8, 32))
    (x,) = g.inputs
    with pytest.raises(NoRule, match="reduces over the sharded dim 2"):
        rules.reduction(g.node(target), ctx({x: S(2, 32)}))


# --- layer_norm / rms_norm: normalized dims unsharded; the affine weights enter through f
def test_layer_norm_weights_enter_through_f():
    g = export(nn.LayerNorm(32), (2, 8, 32))
    (x,) = g.inputs
    w, b = g.params["weight"], g.params["bias"]
    got = rules.norm(g.node(aten.layer_norm.default), ctx({x: S(1, 8)}, params=(w, b)))
    assert got == Decision(S(1, 8), {w: None, b: None})


def test_rms_norm_weight_enters_through_f():
    g = export(nn.RMSNorm(32), (2, 8, 32))
    (x,) = g.inputs
    w = g.params["weight"]
    assert rules.norm(g.node(aten.rms_norm.default), ctx({x: S(0, 2)}, params=(w,))) == Decision(S(0, 2), {w: None})


def test_norm_without_affine_weights():
    g = export(lambda x: F.layer_norm(x, (32,)), (2, 8, 32))
    (x,) = g.inputs
    assert rules.norm(g.node(aten.layer_norm.default), ctx({x: S(1, 8)})) == Decision(S(1, 8))


@pytest.mark.parametrize("fn,target,shard", [
    (lambda x: F.layer_norm(x, (32,)), aten.layer_norm.default, S(2, 32)),
    (lambda x: F.layer_norm(x, (8, 32)), aten.layer_norm.default, S(1, 8)),
    (lambda x: F.rms_norm(x, (32,)), aten.rms_norm.default, S(2, 32)),
])
def test_norm_refuses_normalizing_the_sharded_dim(fn, target, shard):
    g = export(fn, (2, 8, 32))
    (x,) = g.inputs
    with pytest.raises(NoRule, match=f"normalizes over the sharded dim {shard.dim}"):
        rules.norm(g.node(target), ctx({x: shard}))


# --- scaled_dot_product_attention: q, k, v sharded alike on the heads (or batch); a mask scattered or broadcast
def _sdpa(mask_shape=None):
    if mask_shape is None:
        return export(F.scaled_dot_product_attention, *[(2, 4, 8, 8)] * 3)
    return export(lambda q, k, v, m: F.scaled_dot_product_attention(q, k, v, attn_mask=m), *[(2, 4, 8, 8)] * 3,
                  mask_shape)


@pytest.mark.parametrize("shard", [S(1, 4), S(0, 2)])
def test_sdpa_sharded_heads_or_batch(shard):
    g = _sdpa()
    q, k, v = g.inputs
    node = g.node(aten.scaled_dot_product_attention.default)
    assert mixer_rules.sdpa(node, ctx({q: shard, k: shard, v: shard})) == Decision(shard)


def test_sdpa_scatters_a_replicated_value():
    g = _sdpa()
    q, k, v = g.inputs
    node = g.node(aten.scaled_dot_product_attention.default)
    assert mixer_rules.sdpa(node, ctx({q: S(1, 4), k: S(1, 4)})) == Decision(S(1, 4), {v: S(1, 4)})


@pytest.mark.parametrize("mask_shape,how", [
    ((2, 4, 8, 8), S(1, 4)),  # one mask per head: scattered with the heads
    ((4, 8, 8), S(0, 4)),
    ((2, 1, 8, 8), None),  # broadcast over the heads: whole, through f
    ((8, 8), None),
])
def test_sdpa_attn_mask_scattered_or_broadcast(mask_shape, how):
    g = _sdpa(mask_shape)
    q, k, v, m = g.inputs
    node = g.node(aten.scaled_dot_product_attention.default)
    assert mixer_rules.sdpa(node, ctx({q: S(1, 4), k: S(1, 4), v: S(1, 4)})) == Decision(S(1, 4), {m: how})


def test_sdpa_refuses_grouped_kv_heads():
    g = export(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, enable_gqa=True),
               (2, 4, 8, 8), (2, 2, 8, 8), (2, 2, 8, 8))
    q, k, v = g.inputs
    with pytest.raises(NoRule, match="grouped k/v heads 2 vs query heads 4"):
        mixer_rules.sdpa(g.node(aten.scaled_dot_product_attention.default), ctx({q: S(1, 4)}))


@pytest.mark.parametrize("pq,pk", [(S(2, 8), S(2, 8)), (S(3, 8), S(3, 8)), (S(1, 4), S(0, 2))])
def test_sdpa_refuses_sequence_head_dim_or_unlike_shards(pq, pk):
    g = _sdpa()
    q, k, v = g.inputs
    with pytest.raises(NoRule, match="q/k/v must be sharded alike on a batch or heads dim"):
        mixer_rules.sdpa(g.node(aten.scaled_dot_product_attention.default), ctx({q: pq, k: pk, v: pk}))


# --- matmul / bmm without a weight: batch dims (and the free m / n dims) pass through; never the contraction
@pytest.mark.parametrize("a_shape,b_shape,pa,pb,out,enter", [
    ((2, 4, 8, 16), (2, 4, 16, 8), S(1, 4), S(1, 4), S(1, 4), {}),  # q @ k^T per head
    ((2, 4, 8, 16), (2, 4, 16, 8), S(1, 4), R, S(1, 4), {"b": S(1, 4)}),  # replicated b scattered on the heads
    ((2, 4, 8, 16), (16, 8), S(1, 4), R, S(1, 4), {"b": None}),  # broadcast b: through f
    ((2, 8, 16), (16, 4), S(1, 8), R, S(1, 8), {"b": None}),  # a's rows (m) sharded
    ((2, 8, 16), (2, 16, 4), R, S(2, 4), S(2, 4), {"a": None}),  # b's columns (n) sharded
], ids=["heads", "scatter-b", "broadcast-b", "rows-of-a", "columns-of-b"])
def test_batched_matmul(a_shape, b_shape, pa, pb, out, enter):
    g = export(torch.matmul, a_shape, b_shape)
    a, b = g.inputs
    nodes = {"a": a, "b": b}
    got = mixer_rules.batched_matmul(g.node(aten.matmul.default), ctx({a: pa, b: pb}))
    assert got == Decision(out, {nodes[k]: how for k, how in enter.items()})


def test_bmm_scatters_a_replicated_operand():
    g = export(torch.bmm, (4, 8, 16), (4, 16, 8))
    a, b = g.inputs
    assert mixer_rules.batched_matmul(g.node(aten.bmm.default), ctx({a: S(0, 4)})) == Decision(S(0, 4), {b: S(0, 4)})


@pytest.mark.parametrize("pa,pb,why", [
    (S(2, 16), R, "contraction over a sharded dim"),
    (R, S(1, 16), "contraction over a sharded dim"),
    (S(1, 8), S(2, 4), "operands sharded on different dims"),  # rows of a, columns of b
])
def test_batched_matmul_refusals(pa, pb, why):
    g = export(torch.matmul, (2, 8, 16), (2, 16, 4))
    a, b = g.inputs
    with pytest.raises(NoRule, match=why):
        mixer_rules.batched_matmul(g.node(aten.matmul.default), ctx({a: pa, b: pb}))


def test_batched_matmul_refuses_a_vector_operand():
    g = export(torch.matmul, (2, 8, 16), (16,))
    a, b = g.inputs
    with pytest.raises(NoRule, match="vector matmul of a sharded tensor"):
        mixer_rules.batched_matmul(g.node(aten.matmul.default), ctx({a: S(1, 8)}))


# --- GEMMs with a weight parameter: row-parallel on a sharded contraction; pass-through on a sharded batch/row dim
@pytest.mark.parametrize("bias", [True, False])
def test_linear_row_parallel(bias):
    g = export(nn.Linear(32, 16, bias=bias), (2, 8, 32))
    (x,) = g.inputs
    got = rules.gemm(g.node(aten.linear.default), ctx({x: S(2, 32)}, params=g.params.values()))
    assert got == Decision(R, role=Role.ROW)


@pytest.mark.parametrize("fn,shapes,target", [
    (lambda x, w: torch.mm(x, w), [(4, 32), (32, 16)], aten.mm.default),
    (lambda x, w, b: torch.addmm(b, x, w), [(4, 32), (32, 16), (16,)], aten.addmm.default),
])
def test_mm_and_addmm_row_parallel(fn, shapes, target):
    g = export(fn, *shapes)
    x, w = g.inputs[:2]
    assert rules.gemm(g.node(target), ctx({x: S(1, 32)}, params={w})) == Decision(R, role=Role.ROW)


def test_gemm_row_parallel_indivisible():
    g = export(nn.Linear(6, 4), (2, 8, 6))
    (x,) = g.inputs
    with pytest.raises(Indivisible, match=r"parts \(6,\) of dim 2 are not divisible by t=4"):
        rules.gemm(g.node(aten.linear.default), ctx({x: S(2, 6)}, t=4, params=g.params.values()))


def test_gemm_refuses_a_weight_with_another_use():
    g = export(lambda x, w: (F.linear(x, w), w * 2), (2, 8, 32), (16, 32))  # tied: the weight is read twice
    x, w = g.inputs
    with pytest.raises(NoRule, match=r"contraction over a sharded dim with weight \w+, which is also read by mul"):
        rules.gemm(g.node(aten.linear.default), ctx({x: S(2, 32)}, params={w}))


def test_gemm_refuses_a_weight_that_is_not_a_parameter():
    g = export(F.linear, (2, 8, 32), (16, 32))
    x, w = g.inputs
    with pytest.raises(NoRule, match="which is not a parameter"):
        rules.gemm(g.node(aten.linear.default), ctx({x: S(2, 32)}))


def test_linear_passes_a_row_shard_through():
    # The input is sharded on a batch / sequence dim: every rank multiplies its rows by the whole weight.
    g = export(nn.Linear(32, 16), (2, 8, 32))
    (x,) = g.inputs
    w, b = g.params["weight"], g.params["bias"]
    got = rules.gemm(g.node(aten.linear.default), ctx({x: S(1, 8)}, params=(w, b)))
    assert got == Decision(S(1, 8), {w: None, b: None})


def test_addmm_passes_a_row_shard_through():
    g = export(lambda x, w, b: torch.addmm(b, x, w), (4, 32), (32, 16), (16,))
    x, w, b = g.inputs
    got = rules.gemm(g.node(aten.addmm.default), ctx({x: S(0, 4)}, params={w}))
    assert got == Decision(S(0, 4), {w: None, b: None})


# --- corners that once went wrong: arguments read by name, dtype donors, sharded weight operands, sharded masks ----
@pytest.mark.parametrize("fn", [lambda x: x.var(1, unbiased=False, keepdim=True),
                                lambda x: x.var(1, correction=0, keepdim=True)])
def test_reduction_reads_keepdim_by_name(fn):
    g = export(fn, (2, 8, 32))
    (x,) = g.inputs
    (node,) = [n for n in g.gm.graph.nodes if n.op == "call_function"]
    assert tuple(node.meta["val"].shape) == (2, 1, 32)
    assert rules.reduction(node, ctx({x: S(2, 32)})) == Decision(S(2, 32))  # var.dim's argument 2 is `unbiased`


def test_type_as_takes_only_a_dtype_from_its_second_operand():
    g = export(lambda x, m: x.type_as(m), (2, 8, 32), (2, 4, 8, 8))
    x, m = g.inputs
    node = g.node(aten.type_as.default)
    assert rule_for(node) is rules.like_input
    assert rules.like_input(node, ctx({x: S(2, 32)})) == Decision(S(2, 32))  # m's data never enters
    assert rules.like_input(node, ctx({m: S(1, 4)})) == Decision(R)  # only the dtype donor is sharded


def test_gemm_refuses_a_sharded_weight_operand():
    g = export(torch.mm, (4, 8), (8, 32))
    a, h = g.inputs
    with pytest.raises(NoRule):
        rules.gemm(g.node(aten.mm.default), ctx({h: S(1, 32)}))


def test_gemm_pass_through_refuses_a_sharded_weight_operand():
    g = export(torch.mm, (16, 8), (8, 32))
    a, h = g.inputs
    with pytest.raises(NoRule, match="weight or additive operand"):  # each rank holds 16 of h's 32 columns
        rules.gemm(g.node(aten.mm.default), ctx({a: S(0, 16), h: S(1, 32)}))


def test_sdpa_keeps_an_already_sharded_mask():
    g = _sdpa((2, 4, 8, 8))
    q, k, v, m = g.inputs
    s = S(1, 4)
    got = mixer_rules.sdpa(g.node(aten.scaled_dot_product_attention.default), ctx({q: s, k: s, v: s, m: s}))
    assert got == Decision(s)  # the mask is local already: no second scatter


# --- baddbmm: a batched matmul plus an additive input (GPT-NeoX-Japanese's attention scores)
def test_baddbmm_scatters_a_replicated_additive_input_and_keeps_a_sharded_one():
    g = export(lambda c, a, b: torch.baddbmm(c, a, b, alpha=0.5), (8, 4, 4), (8, 4, 16), (8, 16, 4))
    c, a, b = g.inputs
    node = g.node(aten.baddbmm.default)
    s = S(0, 8)  # batch x heads flattened, sharded
    assert mixer_rules.baddbmm(node, ctx({a: s, b: s})) == Decision(s, {c: s})
    assert mixer_rules.baddbmm(node, ctx({a: s, b: s, c: s})) == Decision(s)
    with pytest.raises(NoRule, match="its additive input is sharded as"):
        mixer_rules.baddbmm(node, ctx({a: s, b: s, c: S(1, 4)}))
    with pytest.raises(NoRule, match="contraction over a sharded dim"):
        mixer_rules.baddbmm(node, ctx({a: S(2, 16), b: S(1, 16)}))
