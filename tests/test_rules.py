"""Unit tests of the sharding rules of passes/sharding/rules.py, one rule at a time: placement in, Decision (or a
refusal) out.

Each test exports a tiny function or module with torch.export (non-strict, as fxpar's frontend does), so the nodes
carry the ATen overloads the rules register and fake-tensor metadata with global shapes. It then places the inputs
by hand and calls one rule directly with a Ctx. An accepted case asserts the whole Decision: the output placement,
which replicated inputs enter through f (None) or are scattered (a Shard), the localized args, and role / target
where they matter. A refusal asserts NoRule (or Indivisible) and the reason. `rule_for` is tested for every family
and for ops without a rule. One process, no communication; the whole file takes a few seconds.

This file holds the layout rules (elementwise, views, moves, slicing, splitting, joining); test_rules_compute.py the
reductions, norms, attention and GEMMs.
"""
from __future__ import annotations

import operator

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from fxpar.passes.sharding import mixer_rules, rules
from fxpar.passes.ir.placements import Partial
from fxpar.passes.sharding.rule_table import rule_for
from fxpar.passes.sharding.rules import Decision, Indivisible, NoRule
from tests.rule_helpers import MAX, Graph, R, S, aten, ctx, export


# --- rule_for: each family's overloads as export writes them; None without a rule ------------------------------------
def _zoo(x, y, w, q, k, v):
    h = x.view(2, 8, 4, 8)
    return (x + y, x.relu(), x.type_as(y), h, x.reshape(16, 32), aten._unsafe_view(x, [16, 32]), x.unflatten(2, (4, 8)),
            h.flatten(2), x[:, :1].expand(2, 8, 32), x.transpose(1, 2), x.permute(2, 0, 1), x.unsqueeze(1),
            x.unsqueeze(1).squeeze(1), x[0], x[:, :, 8:16], x.split(16, 2), x.split([8, 24], 2), x.chunk(2, 2),
            x.unbind(0), torch.cat([x, y]), torch.stack([x, y]), x.softmax(-1), x.log_softmax(-1),
            aten._softmax(x, -1, False), x.sum(-1), x.mean(1), x.amax(1), x.var(1), F.layer_norm(x, (32,)),
            F.rms_norm(x, (32,)), F.scaled_dot_product_attention(q, k, v), q @ k, torch.bmm(x, x.transpose(1, 2)),
            F.linear(x, w), torch.mm(x[0], w.t()), torch.addmm(w[:, 0], x[0], w.t()), x.cumprod(-1))


@pytest.fixture(scope="module")
def zoo() -> Graph:
    return export(_zoo, (2, 8, 32), (2, 8, 32), (16, 32), (2, 4, 8, 8), (2, 4, 8, 8), (2, 4, 8, 8))


@pytest.mark.parametrize("target,rule", [
    (aten.add.Tensor, rules.elementwise), (aten.relu.default, rules.elementwise),
    (aten.type_as.default, rules.like_input),
    (aten.view.default, rules.view), (aten.reshape.default, rules.view), (aten._unsafe_view.default, rules.view),
    (aten.unflatten.int, rules.view), (aten.flatten.using_ints, rules.view),
    (aten.expand.default, rules.expand), (aten.transpose.int, rules.transpose), (aten.permute.default, rules.permute),
    (aten.unsqueeze.default, rules.unsqueeze), (aten.squeeze.dim, rules.squeeze), (aten.select.int, rules.select),
    (aten.slice.Tensor, rules.slice_), (aten.split.Tensor, rules.split), (aten.split_with_sizes.default, rules.split),
    (aten.chunk.default, rules.split), (aten.unbind.int, rules.split), (operator.getitem, rules.getitem),
    (aten.cat.default, rules.cat), (aten.stack.default, rules.stack),
    (aten.softmax.int, rules.softmax), (aten.log_softmax.int, rules.softmax), (aten._softmax.default, rules.softmax),
    (aten.sum.dim_IntList, rules.reduction), (aten.mean.dim, rules.reduction), (aten.amax.default, rules.reduction),
    (aten.var.dim, rules.reduction), (aten.layer_norm.default, rules.norm), (aten.rms_norm.default, rules.norm),
    (aten.scaled_dot_product_attention.default, mixer_rules.sdpa),
    (aten.matmul.default, mixer_rules.batched_matmul), (aten.bmm.default, mixer_rules.batched_matmul),
    (aten.linear.default, rules.gemm), (aten.mm.default, rules.gemm), (aten.addmm.default, rules.gemm),
])
def test_rule_for_finds_the_family(zoo, target, rule):
    assert rule_for(zoo.node(target)) is rule


def test_rule_for_is_none_without_a_rule(zoo):
    assert rule_for(zoo.node(aten.cumprod.default)) is None
    assert all(rule_for(n) is None for n in zoo.gm.graph.nodes if n.op in ("placeholder", "output"))
    mod = torch.fx.symbolic_trace(nn.Sequential(nn.ReLU()))
    (call,) = [n for n in mod.graph.nodes if n.op == "call_module"]
    assert rule_for(call) is None


# --- elementwise: the shard on the broadcast output dim; replicated operands are scattered or enter through f -------
@pytest.mark.parametrize("y_shape,how", [
    ((32,), S(0, 32)),  # a bias over the sharded features: scattered to the local block
    ((8, 32), S(1, 32)),
    ((2, 8, 32), S(2, 32)),
    ((2, 8, 1), None),  # broadcast along the sharded dim: the whole tensor, through f
    ((8, 1), None),
], ids=["bias", "matrix", "same-shape", "broadcast-3d", "broadcast-2d"])
def test_elementwise_replicated_operand(y_shape, how):
    g = export(torch.add, (2, 8, 32), y_shape)
    x, y = g.inputs
    assert rules.elementwise(g.node(aten.add.Tensor), ctx({x: S(2, 32)})) == Decision(S(2, 32), {y: how})


def test_elementwise_keeps_a_fused_layout_for_the_scattered_operand():
    g = export(torch.mul, (2, 8, 64), (64,))
    x, y = g.inputs
    qkv = S(2, 32, 16, 16)
    assert rules.elementwise(g.node(aten.mul.Tensor), ctx({x: qkv})) == Decision(qkv, {y: S(0, 32, 16, 16)})


def test_elementwise_unary_and_scalar_operands():
    g = export(lambda x: torch.relu(x) * 2.0, (2, 8, 32))
    (x,) = g.inputs
    relu = g.node(aten.relu.default)
    assert rules.elementwise(relu, ctx({x: S(1, 8)})) == Decision(S(1, 8))
    assert rules.elementwise(g.node(aten.mul.Tensor), ctx({relu: S(1, 8)})) == Decision(S(1, 8))


def test_elementwise_operands_sharded_alike_after_broadcast():
    g = export(torch.add, (2, 8, 32), (32,))
    x, y = g.inputs
    assert rules.elementwise(g.node(aten.add.Tensor), ctx({x: S(2, 32), y: S(0, 32)})) == Decision(S(2, 32))


def test_elementwise_refuses_operands_sharded_differently():
    g = export(torch.add, (2, 8, 32), (2, 8, 32))
    x, y = g.inputs
    with pytest.raises(NoRule, match=r"inputs sharded differently: S\(2\), S\(1\)"):
        rules.elementwise(g.node(aten.add.Tensor), ctx({x: S(2, 32), y: S(1, 8)}))


def test_elementwise_refuses_a_partial_operand():
    g = export(torch.add, (2, 8, 32), (2, 8, 32))
    x, y = g.inputs
    with pytest.raises(NoRule, match="is P"):
        rules.elementwise(g.node(aten.add.Tensor), ctx({x: S(2, 32), y: Partial()}))


# --- view / reshape / _unsafe_view / unflatten / flatten: where the shard lands, and the local shape argument ------
@pytest.mark.parametrize("fn,src,shard,out,shape", [
    (lambda x: x.view(2, 8, 4, 8), (2, 8, 32), S(2, 32), S(2, 4), [2, 8, 2, 8]),  # the heads take the shard
    (lambda x: x.view(2, 8, -1, 8), (2, 8, 32), S(2, 32), S(2, 4), [2, 8, -1, 8]),  # -1 stays -1
    (lambda x: x.view(2, 8, 3, 32), (2, 8, 96), S(2, 32, 32, 32), S(3, 32), [2, 8, 3, 16]),  # Q|K|V unflattened
    (lambda x: x.reshape(2, 8, 32), (2, 8, 4, 8), S(2, 4), S(2, 32), [2, 8, 16]),  # the heads merged back
    (lambda x: x.reshape(16, 32), (2, 8, 32), S(2, 32), S(1, 32), [16, 16]),
    (lambda x: aten._unsafe_view(x, [16, 32]), (2, 8, 32), S(2, 32), S(1, 32), [16, 16]),
], ids=["view-heads", "view-heads-minus-1", "view-qkv", "reshape-merge-heads", "reshape-rows", "unsafe_view"])
def test_view_localizes_the_shape(fn, src, shard, out, shape):
    g = export(fn, src)
    (x,) = g.inputs
    (node,) = [n for n in g.gm.graph.nodes if n.op == "call_function"]
    assert rules.view(node, ctx({x: shard})) == Decision(out, args=(x, shape))


@pytest.mark.parametrize("dim,sizes,local", [(2, (4, 8), [2, 8]), (-1, (4, 8), [2, 8]), (2, (-1, 8), [2, 8])])
def test_view_unflatten_gets_local_sizes(dim, sizes, local):
    g = export(lambda x: x.unflatten(dim, sizes), (2, 8, 32))
    (x,) = g.inputs
    assert rules.view(g.node(aten.unflatten.int), ctx({x: S(2, 32)})) == Decision(S(2, 4), args=(x, dim, local))


def test_view_flatten_keeps_its_args():
    g = export(lambda x: x.flatten(2), (2, 8, 4, 8))
    (x,) = g.inputs
    assert rules.view(g.node(aten.flatten.using_ints), ctx({x: S(2, 4)})) == Decision(S(2, 32))


@pytest.mark.parametrize("t", [2, 4])
def test_view_heads_indivisible_by_t(t):
    g = export(lambda x: x.view(2, 8, 2, 16), (2, 8, 32))  # 2 heads of 16
    (x,) = g.inputs
    node = g.node(aten.view.default)
    if t == 2:
        assert rules.view(node, ctx({x: S(2, 32)}, t)) == Decision(S(2, 2), args=(x, [2, 8, 1, 16]))
    else:
        why = r"dim 2 of \(2, 8, 2, 16\) has 2 \(heads or features\) to split over t=4"
        with pytest.raises(Indivisible, match=why):
            rules.view(node, ctx({x: S(2, 32)}, t))


def test_view_refuses_moving_elements_between_shards():
    g = export(lambda x: x.view(3, 8), (2, 12))
    (x,) = g.inputs
    with pytest.raises(NoRule, match="would move elements between the 2 shards of dim 1") as e:
        rules.view(g.node(aten.view.default), ctx({x: S(1, 12)}))
    assert not isinstance(e.value, Indivisible)


# --- expand: the sharded dim is never the expanded one; its size becomes local
@pytest.mark.parametrize("src,shard,sizes,out,local", [
    ((2, 1, 32), S(2, 32), (2, 8, 32), S(2, 32), [2, 8, 16]),
    ((2, 1, 32), S(2, 32), (-1, 8, -1), S(2, 32), [-1, 8, -1]),
    ((8, 32), S(1, 32), (4, 8, 32), S(2, 32), [4, 8, 16]),  # a new leading dim moves the shard
], ids=["sizes", "minus-1", "new-leading-dim"])
def test_expand_localizes_the_sizes(src, shard, sizes, out, local):
    g = export(lambda x: x.expand(*sizes), src)
    (x,) = g.inputs
    assert rules.expand(g.node(aten.expand.default), ctx({x: shard})) == Decision(out, args=(x, local))


def test_expand_refuses_expanding_the_sharded_dim():
    # Defensive: a real shard is never 1 wide. A size-1 "shard" shows the guard.
    g = export(lambda x: x.expand(2, 8, 32), (2, 1, 32))
    (x,) = g.inputs
    with pytest.raises(NoRule, match="expands the sharded dim 1"):
        rules.expand(g.node(aten.expand.default), ctx({x: S(1, 1)}))


# --- transpose / permute / unsqueeze / squeeze: the shard follows its dim (these rules never refuse)
@pytest.mark.parametrize("a,b,shard,out", [
    (1, 2, S(2, 32), S(1, 32)), (1, 2, S(1, 8), S(2, 8)), (1, 2, S(0, 2), S(0, 2)), (-1, -2, S(2, 32), S(1, 32)),
    (1, 2, S(2, 16, 8, 8), S(1, 16, 8, 8)),  # the layout travels with the dim
])
def test_transpose(a, b, shard, out):
    g = export(lambda x: x.transpose(a, b), (2, 8, 32))
    (x,) = g.inputs
    assert rules.transpose(g.node(aten.transpose.int), ctx({x: shard})) == Decision(out)


@pytest.mark.parametrize("order,shard,out", [
    ((2, 0, 1), S(2, 32), S(0, 32)), ((2, 0, 1), S(0, 2), S(1, 2)), ((-1, 0, 1), S(1, 8), S(2, 8)),
])
def test_permute(order, shard, out):
    g = export(lambda x: x.permute(*order), (2, 8, 32))
    (x,) = g.inputs
    assert rules.permute(g.node(aten.permute.default), ctx({x: shard})) == Decision(out)


@pytest.mark.parametrize("dim,shard,out", [
    (1, S(2, 32), S(3, 32)), (2, S(2, 32), S(3, 32)), (-1, S(2, 32), S(2, 32)), (-2, S(2, 32), S(3, 32)),
    (0, S(0, 2), S(1, 2)),
])
def test_unsqueeze(dim, shard, out):
    g = export(lambda x: x.unsqueeze(dim), (2, 8, 32))
    (x,) = g.inputs
    assert rules.unsqueeze(g.node(aten.unsqueeze.default), ctx({x: shard})) == Decision(out)


@pytest.mark.parametrize("fn,src,shard,out", [
    (lambda x: x.squeeze(1), (2, 1, 32), S(2, 32), S(1, 32)),
    (lambda x: x.squeeze(), (2, 1, 32), S(2, 32), S(1, 32)),
    (lambda x: x.squeeze((0, 1)), (2, 1, 32), S(2, 32), S(1, 32)),  # dim 0 is not 1 wide: it stays
    (lambda x: x.squeeze(-1), (2, 32, 1), S(1, 32), S(1, 32)),
], ids=["dim", "all", "dims", "last"])
def test_squeeze(fn, src, shard, out):
    g = export(fn, src)
    (x,) = g.inputs
    (node,) = [n for n in g.gm.graph.nodes if n.op == "call_function"]
    assert rules.squeeze(node, ctx({x: shard})) == Decision(out)


# --- select: fine on another dim, refused on the sharded one
@pytest.mark.parametrize("dim,shard,out", [(0, S(2, 32), S(1, 32)), (2, S(1, 8), S(1, 8)), (-2, S(2, 32), S(1, 32))])
def test_select_on_another_dim(dim, shard, out):
    g = export(lambda x: x.select(dim, 1), (2, 8, 32))
    (x,) = g.inputs
    assert rules.select(g.node(aten.select.int), ctx({x: shard})) == Decision(out)


@pytest.mark.parametrize("dim", [2, -1])
def test_select_refuses_the_sharded_dim(dim):
    g = export(lambda x: x.select(dim, 0), (2, 8, 32))
    (x,) = g.inputs
    with pytest.raises(NoRule, match="selects an index of the sharded dim 2"):
        rules.select(g.node(aten.select.int), ctx({x: S(2, 32)}))


# --- slice: another dim passes through; on the sharded dim the whole dim or one whole part of a fused layout
def test_slice_on_another_dim():
    g = export(lambda x: x[:, 2:6], (2, 8, 32))
    (x,) = g.inputs
    assert rules.slice_(g.node(aten.slice.Tensor), ctx({x: S(2, 32)})) == Decision(S(2, 32))


@pytest.mark.parametrize("dim,end", [(2, 32), (2, MAX), (-1, 32)])
def test_slice_whole_sharded_dim(dim, end):
    g = export(lambda x: aten.slice.Tensor(x, dim, 0, end), (2, 8, 32))
    (x,) = g.inputs
    assert rules.slice_(g.node(aten.slice.Tensor), ctx({x: S(2, 32)})) == Decision(S(2, 32), args=(x, 2, 0, 16))


@pytest.mark.parametrize("shard,start,end,local", [
    (S(2, 32, 32, 32), 0, 32, (0, 16)),  # q of a fused Q|K|V: rank r holds [q_r | k_r | v_r]
    (S(2, 32, 32, 32), 32, 64, (16, 32)),
    (S(2, 32, 32, 32), 64, 96, (32, 48)),
    (S(2, 64, 16, 16), 64, 80, (32, 40)),  # k of a grouped-query Q|K|V
], ids=["q", "k", "v", "gqa-k"])
def test_slice_one_part_of_a_fused_shard(shard, start, end, local):
    g = export(lambda x: x[..., start:end], (2, 8, shard.size))
    (x,) = g.inputs
    assert rules.slice_(g.node(aten.slice.Tensor), ctx({x: shard})) == Decision(S(2, end - start), args=(x, 2, *local))


@pytest.mark.parametrize("fn,shard,why", [
    (lambda x: x[..., 8:16], S(2, 96), r"\[8:16:1\]"),  # inside one rank's block
    (lambda x: x[..., ::3], S(2, 32, 32, 32), r"\[0:96:3\]"),  # strided, a shard's block not a multiple of 3
    (lambda x: x[..., 2::2], S(2, 96), r"\[2:96:2\]"),  # strided from past the first step
    (lambda x: x[..., 16:48], S(2, 32, 32, 32), r"\[16:48:1\]"),  # straddles q and k
])
def test_slice_refuses_across_shards(fn, shard, why):
    g = export(fn, (2, 8, 96))
    (x,) = g.inputs
    with pytest.raises(NoRule, match=why + " across the shards of dim 2"):
        rules.slice_(g.node(aten.slice.Tensor), ctx({x: shard}))


@pytest.mark.parametrize("start,shard,out", [
    (0, S(2, 96), S(2, 48)), (1, S(2, 96), S(2, 48)),  # GPT-OSS's interleaved gate|up: [::2] and [1::2]
    (0, S(2, 32, 32, 32), S(2, 16, 16, 16)),  # every other column of each part
])
def test_slice_every_step_th_element_of_aligned_blocks(start, shard, out):
    g = export(lambda x: x[..., start::2], (2, 8, 96))
    (x,) = g.inputs
    assert rules.slice_(g.node(aten.slice.Tensor), ctx({x: shard})) == Decision(out, args=(x, 2, start, 48, 2))


# --- split / split_with_sizes / chunk / unbind: other dims pass through; on the sharded dim the pieces are its parts
@pytest.mark.parametrize("fn,target", [
    (lambda x: x.split(32, 2), aten.split.Tensor), (lambda x: x.chunk(3, 2), aten.chunk.default),
])
def test_split_fused_qkv_into_its_parts(fn, target):
    g = export(fn, (2, 8, 96))
    (x,) = g.inputs
    assert rules.split(g.node(target), ctx({x: S(2, 32, 32, 32)})) == Decision(
        (S(2, 32),) * 3, args=(x, [16, 16, 16], 2), target=aten.split_with_sizes.default)


def test_split_with_sizes_grouped_query_parts():
    g = export(lambda x: x.split([64, 16, 16], 2), (2, 8, 96))
    (x,) = g.inputs
    assert rules.split(g.node(aten.split_with_sizes.default), ctx({x: S(2, 64, 16, 16)})) == Decision(
        (S(2, 64), S(2, 16), S(2, 16)), args=(x, [32, 8, 8], 2), target=aten.split_with_sizes.default)


@pytest.mark.parametrize("fn,target", [
    (lambda x: x.split(4, 1), aten.split.Tensor), (lambda x: x.chunk(2, 0), aten.chunk.default),
    (lambda x: x.split([2, 6], 1), aten.split_with_sizes.default),
])
def test_split_on_another_dim(fn, target):
    g = export(fn, (2, 8, 96))
    (x,) = g.inputs
    assert rules.split(g.node(target), ctx({x: S(2, 96)})) == Decision((S(2, 96),) * 2)


@pytest.mark.parametrize("dim,src,shard,out", [(0, (3, 8, 32), S(2, 32), S(1, 32)), (-1, (2, 8, 4), S(1, 8), S(1, 8))])
def test_unbind_another_dim(dim, src, shard, out):
    g = export(lambda x: x.unbind(dim), src)
    (x,) = g.inputs
    assert rules.split(g.node(aten.unbind.int), ctx({x: shard})) == Decision((out,) * src[dim])


@pytest.mark.parametrize("fn,shard,why", [
    (lambda x: x.split(32, 2), S(2, 96), r"into \[32, 32, 32\]"),  # a plain shard: each piece spans ranks
    (lambda x: x.split(48, 2), S(2, 64, 16, 16), r"into \[48, 48\]"),  # pieces that are not the parts
])
def test_split_refuses_across_shards(fn, shard, why):
    g = export(fn, (2, 8, 96))
    (x,) = g.inputs
    with pytest.raises(NoRule, match=f"splits dim 2 of size 96 {why}, across its shards"):
        rules.split(g.node(aten.split.Tensor), ctx({x: shard}))


def test_split_refuses_unbinding_the_sharded_dim():
    g = export(lambda x: x.unbind(1), (2, 4, 8))
    (x,) = g.inputs
    with pytest.raises(NoRule, match="unbinds the sharded dim"):
        rules.split(g.node(aten.unbind.int), ctx({x: S(1, 4)}))


def test_split_parts_indivisible_by_t():
    g = export(lambda x: x.split(6, 2), (2, 8, 12))
    (x,) = g.inputs
    with pytest.raises(Indivisible, match=r"parts \(6,\) of dim 2 are not divisible by t=4"):
        rules.split(g.node(aten.split.Tensor), ctx({x: S(2, 6, 6)}, t=4))


# --- getitem: picks one placement of a sequence
def test_getitem_picks_its_piece():
    g = export(lambda x: x.split([64, 16, 16], 2), (2, 8, 96))
    pieces = g.node(aten.split_with_sizes.default)
    outs = (S(2, 64), S(2, 16), S(2, 16))
    assert rules.getitem(g.node(operator.getitem, 0), ctx({pieces: outs})) == Decision(S(2, 64))
    assert rules.getitem(g.node(operator.getitem, 2), ctx({pieces: outs})) == Decision(S(2, 16))


def test_getitem_refuses_a_non_sequence():
    g = export(lambda x: x.split(32, 2), (2, 8, 96))
    pieces = g.node(aten.split.Tensor)
    with pytest.raises(NoRule, match=r"getitem of a non-sequence placement S\(2\)"):
        rules.getitem(g.node(operator.getitem), ctx({pieces: S(2, 96)}))


# --- cat: along another dim, inputs alike; replicated inputs are scattered
def test_cat_scatters_a_replicated_input():
    g = export(lambda x, y: torch.cat([x, y], 1), (2, 8, 32), (2, 4, 32))
    x, y = g.inputs
    assert rules.cat(g.node(aten.cat.default), ctx({x: S(2, 32)})) == Decision(S(2, 32), {y: S(2, 32)})


def test_cat_inputs_sharded_alike():
    g = export(lambda x, y: torch.cat([x, y]), (2, 8, 32), (2, 8, 32))
    x, y = g.inputs
    assert rules.cat(g.node(aten.cat.default), ctx({x: S(2, 32), y: S(2, 32)})) == Decision(S(2, 32))


@pytest.mark.parametrize("sizes,shards,out", [
    ((32, 16, 16), (S(2, 32), S(2, 16), S(2, 16)), S(2, 32, 16, 16)),  # q|k|v projected apart, joined for a conv
    ((32, 32), (S(2, 32), S(2, 32)), S(2, 32, 32)),
    ((96, 16), (S(2, 32, 32, 32), S(2, 16)), S(2, 32, 32, 32, 16)),  # a fused input's parts stay parts
])
def test_cat_along_the_sharded_dim_makes_each_input_parts(sizes, shards, out):
    g = export(lambda *xs: torch.cat(xs, -1), *((2, 8, n) for n in sizes))
    got = rules.cat(g.node(aten.cat.default), ctx(dict(zip(g.inputs, shards))))
    assert got == Decision(out), got


@pytest.mark.parametrize("dim,py", [(2, R), (0, S(1, 8))])
def test_cat_refuses_along_or_across_shards(dim, py):
    g = export(lambda x, y: torch.cat([x, y], dim), (2, 8, 32), (2, 8, 32))
    x, y = g.inputs
    with pytest.raises(NoRule, match="concatenates along or across shards"):
        rules.cat(g.node(aten.cat.default), ctx({x: S(2, 32), y: py}))


# --- stack: a new dim; inputs alike, replicated ones scattered
@pytest.mark.parametrize("dim,out", [(1, S(3, 32)), (-1, S(2, 32)), (0, S(3, 32))])
def test_stack_scatters_a_replicated_input(dim, out):
    g = export(lambda x, y: torch.stack([x, y], dim), (2, 8, 32), (2, 8, 32))
    x, y = g.inputs
    assert rules.stack(g.node(aten.stack.default), ctx({x: S(2, 32)})) == Decision(out, {y: S(2, 32)})


def test_stack_inputs_sharded_alike():
    g = export(lambda x, y: torch.stack([x, y]), (2, 8, 32), (2, 8, 32))
    x, y = g.inputs
    assert rules.stack(g.node(aten.stack.default), ctx({x: S(2, 32), y: S(2, 32)})) == Decision(S(3, 32))


def test_stack_refuses_differently_sharded_inputs():
    g = export(lambda x, y: torch.stack([x, y]), (2, 8, 32), (2, 8, 32))
    x, y = g.inputs
    with pytest.raises(NoRule, match=r"stacks differently sharded inputs \(S\(2\), S\(1\)\)"):
        rules.stack(g.node(aten.stack.default), ctx({x: S(2, 32), y: S(1, 8)}))


# --- pad, tril / triu, zeros_like, copy_: the ops of a chunked scan (tests/test_linear_attention.py)
@pytest.mark.parametrize("widths,ok", [((0, 0, 0, 2), True), ((0, 2), True), ((0, 0, 0, 0, 1, 1), False)])
def test_pad_other_dims_only(widths, ok):
    g = export(lambda x: F.pad(x, widths), (2, 4, 8, 16))  # [b, heads, s, hd], heads sharded
    (x,) = g.inputs
    node = next(n for n in g.gm.graph.nodes if rule_for(n) is rules.pad)
    if ok:
        assert rules.pad(node, ctx({x: S(1, 4)})) == Decision(S(1, 4))
    else:
        with pytest.raises(NoRule, match="pads the sharded dim 1"):
            rules.pad(node, ctx({x: S(1, 4)}))


@pytest.mark.parametrize("fn", [torch.tril, torch.triu])
def test_tril_triu_mask_the_last_two_dims(fn):
    g = export(lambda x: fn(x, 1), (2, 4, 8, 8))
    (x,) = g.inputs
    node = g.node(aten.tril.default if fn is torch.tril else aten.triu.default)
    assert rules.triangular(node, ctx({x: S(1, 4)})) == Decision(S(1, 4))
    with pytest.raises(NoRule, match="masks the sharded dim 3"):
        rules.triangular(node, ctx({x: S(3, 8)}))


def test_zeros_like_is_sharded_as_its_input():
    g = export(lambda x: torch.zeros_like(x) + 1, (2, 4, 8))
    (x,) = g.inputs
    assert rules.constant_like(g.node(aten.zeros_like.default), ctx({x: S(1, 4)})) == Decision(S(1, 4))


def test_copy_into_a_sharded_buffer():
    def fill(x, y):
        out = torch.zeros_like(x)
        out[:, :, :2] = y
        return out

    g = export(fill, (2, 4, 8), (2, 4, 2))
    x, y = g.inputs
    node = g.node(aten.copy_.default)
    dst = node.args[0]
    assert rules.copy_into(node, ctx({dst: S(1, 4), y: S(1, 4)})) == Decision(S(1, 4))
    assert rules.copy_into(node, ctx({dst: S(1, 4)})) == Decision(S(1, 4), {y: S(1, 4)})  # y scattered
    with pytest.raises(NoRule, match="writes a sharded value into the replicated"):
        rules.copy_into(node, ctx({y: S(1, 4)}))
    with pytest.raises(NoRule, match="inputs sharded differently"):
        rules.copy_into(node, ctx({dst: S(1, 4), y: S(2, 2)}))
