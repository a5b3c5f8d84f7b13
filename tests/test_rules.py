"""Unit tests of the sharding rules of passes/rules.py, one rule at a time: placement in, Decision (or a refusal) out.

Each test exports a tiny function or module with torch.export (non-strict, as fxpar's frontend does), so the nodes
carry the ATen overloads the rules register and fake-tensor metadata with global shapes. It then places the inputs
by hand and calls one rule directly with a Ctx. An accepted case asserts the whole Decision: the output placement,
which replicated inputs enter through f (None) or are scattered (a Shard), the localized args, and role / target
where they matter. A refusal asserts NoRule (or Indivisible) and the reason. `rule_for` is tested for every family
and for ops without a rule. One process, no communication; the whole file takes a few seconds.

The xfail(strict=True) tests at the end are known gaps in rules.py: each asserts what the rule should do.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.fx import GraphModule, Node

from fxpar.passes import rules
from fxpar.passes.placements import Partial, Replicate, Shard
from fxpar.passes.rules import Ctx, Decision, Indivisible, NoRule, rule_for

aten = torch.ops.aten
R = Replicate()
MAX = 2**63 - 1  # the end of an open slice, as export writes it


# --- helpers: export a tiny graph, find its nodes, call a rule -------------------------------------------------------
@dataclass
class Graph:
    gm: GraphModule
    inputs: list[Node]  # user inputs, in order
    params: dict[str, Node]  # parameter name ("weight") -> placeholder

    def node(self, target, i: int = 0) -> Node:
        """The i-th call of `target` in graph order."""
        return [n for n in self.gm.graph.nodes if n.op == "call_function" and n.target == target][i]


class _Fn(nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, *xs):
        return self.fn(*xs)


def export(fn, *shapes) -> Graph:
    """The ATen graph of `fn` (a function or an nn.Module) on random inputs of these global shapes."""
    mod = fn if isinstance(fn, nn.Module) else _Fn(fn)
    ep = torch.export.export(mod, tuple(torch.randn(s) for s in shapes), strict=False)
    sig = ep.graph_signature
    nodes = {n.name: n for n in ep.graph_module.graph.nodes if n.op == "placeholder"}
    return Graph(ep.graph_module, [nodes[name] for name in sig.user_inputs],
                 {fqn: nodes[name] for name, fqn in sig.inputs_to_parameters.items()})


def ctx(placements: dict, t: int = 2, params=()) -> Ctx:
    return Ctx(dict(placements), t, set(params))


def S(dim: int, *parts: int, pre: int = 1) -> Shard:
    """Shard(dim, parts, pre), shorter: S(2, 32) is a plain split of a 32-wide dim 2; S(2, 32, 32, 32) is Q|K|V."""
    return Shard(dim, parts, pre)


# --- rule_for: each family's overloads as export writes them; None without a rule ------------------------------------
def _zoo(x, y, w, q, k, v):
    h = x.view(2, 8, 4, 8)
    return (x + y, x.relu(), x.type_as(y), h, x.reshape(16, 32), aten._unsafe_view(x, [16, 32]), x.unflatten(2, (4, 8)),
            h.flatten(2), x[:, :1].expand(2, 8, 32), x.transpose(1, 2), x.permute(2, 0, 1), x.unsqueeze(1),
            x.unsqueeze(1).squeeze(1), x[0], x[:, :, 8:16], x.split(16, 2), x.split([8, 24], 2), x.chunk(2, 2),
            x.unbind(0), torch.cat([x, y]), torch.stack([x, y]), x.softmax(-1), x.log_softmax(-1),
            aten._softmax(x, -1, False), x.sum(-1), x.mean(1), x.amax(1), x.var(1), F.layer_norm(x, (32,)),
            F.rms_norm(x, (32,)), F.scaled_dot_product_attention(q, k, v), q @ k, torch.bmm(x, x.transpose(1, 2)),
            F.linear(x, w), torch.mm(x[0], w.t()), torch.addmm(w[:, 0], x[0], w.t()), x.topk(2))


@pytest.fixture(scope="module")
def zoo() -> Graph:
    return export(_zoo, (2, 8, 32), (2, 8, 32), (16, 32), (2, 4, 8, 8), (2, 4, 8, 8), (2, 4, 8, 8))


@pytest.mark.parametrize("target,rule", [
    (aten.add.Tensor, rules.elementwise), (aten.relu.default, rules.elementwise),
    (aten.type_as.default, rules.elementwise),
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
    (aten.scaled_dot_product_attention.default, rules.sdpa),
    (aten.matmul.default, rules.batched_matmul), (aten.bmm.default, rules.batched_matmul),
    (aten.linear.default, rules.gemm), (aten.mm.default, rules.gemm), (aten.addmm.default, rules.gemm),
])
def test_rule_for_finds_the_family(zoo, target, rule):
    assert rule_for(zoo.node(target)) is rule


def test_rule_for_is_none_without_a_rule(zoo):
    assert rule_for(zoo.node(aten.topk.default)) is None
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
    (lambda x: x[..., ::2], S(2, 96), r"\[0:96:2\]"),  # strided
    (lambda x: x[..., 16:48], S(2, 32, 32, 32), r"\[16:48:1\]"),  # straddles q and k
])
def test_slice_refuses_across_shards(fn, shard, why):
    g = export(fn, (2, 8, 96))
    (x,) = g.inputs
    with pytest.raises(NoRule, match=why + " across the shards of dim 2"):
        rules.slice_(g.node(aten.slice.Tensor), ctx({x: shard}))


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


@pytest.mark.parametrize("dim,py", [(2, R), (-1, S(2, 32)), (0, S(1, 8))])
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


@pytest.mark.parametrize("fn,target,why", [
    (lambda x: x.sum(2), aten.sum.dim_IntList, "reduces over the sharded dim 2"),
    (lambda x: x.mean((0, -1)), aten.mean.dim, "reduces over the sharded dim 2"),
    (lambda x: x.sum(), aten.sum.default, "full reduction of a sharded tensor"),
])
def test_reduction_refuses_the_sharded_dim(fn, target, why):
    g = export(fn, (2, 8, 32))
    (x,) = g.inputs
    with pytest.raises(NoRule, match=why):
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
    assert rules.sdpa(node, ctx({q: shard, k: shard, v: shard})) == Decision(shard)


def test_sdpa_scatters_a_replicated_value():
    g = _sdpa()
    q, k, v = g.inputs
    node = g.node(aten.scaled_dot_product_attention.default)
    assert rules.sdpa(node, ctx({q: S(1, 4), k: S(1, 4)})) == Decision(S(1, 4), {v: S(1, 4)})


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
    assert rules.sdpa(node, ctx({q: S(1, 4), k: S(1, 4), v: S(1, 4)})) == Decision(S(1, 4), {m: how})


def test_sdpa_refuses_grouped_kv_heads():
    g = export(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, enable_gqa=True),
               (2, 4, 8, 8), (2, 2, 8, 8), (2, 2, 8, 8))
    q, k, v = g.inputs
    with pytest.raises(NoRule, match="grouped k/v heads 2 vs query heads 4"):
        rules.sdpa(g.node(aten.scaled_dot_product_attention.default), ctx({q: S(1, 4)}))


@pytest.mark.parametrize("pq,pk", [(S(2, 8), S(2, 8)), (S(3, 8), S(3, 8)), (S(1, 4), S(0, 2))])
def test_sdpa_refuses_sequence_head_dim_or_unlike_shards(pq, pk):
    g = _sdpa()
    q, k, v = g.inputs
    with pytest.raises(NoRule, match="q/k/v must be sharded alike on a batch or heads dim"):
        rules.sdpa(g.node(aten.scaled_dot_product_attention.default), ctx({q: pq, k: pk, v: pk}))


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
    got = rules.batched_matmul(g.node(aten.matmul.default), ctx({a: pa, b: pb}))
    assert got == Decision(out, {nodes[k]: how for k, how in enter.items()})


def test_bmm_scatters_a_replicated_operand():
    g = export(torch.bmm, (4, 8, 16), (4, 16, 8))
    a, b = g.inputs
    assert rules.batched_matmul(g.node(aten.bmm.default), ctx({a: S(0, 4)})) == Decision(S(0, 4), {b: S(0, 4)})


@pytest.mark.parametrize("pa,pb,why", [
    (S(2, 16), R, "contraction over a sharded dim"),
    (R, S(1, 16), "contraction over a sharded dim"),
    (S(1, 8), S(2, 4), "operands sharded on different dims"),  # rows of a, columns of b
])
def test_batched_matmul_refusals(pa, pb, why):
    g = export(torch.matmul, (2, 8, 16), (2, 16, 4))
    a, b = g.inputs
    with pytest.raises(NoRule, match=why):
        rules.batched_matmul(g.node(aten.matmul.default), ctx({a: pa, b: pb}))


def test_batched_matmul_refuses_a_vector_operand():
    g = export(torch.matmul, (2, 8, 16), (16,))
    a, b = g.inputs
    with pytest.raises(NoRule, match="vector matmul of a sharded tensor"):
        rules.batched_matmul(g.node(aten.matmul.default), ctx({a: S(1, 8)}))


# --- GEMMs with a weight parameter: row-parallel on a sharded contraction; pass-through on a sharded batch/row dim
@pytest.mark.parametrize("bias", [True, False])
def test_linear_row_parallel(bias):
    g = export(nn.Linear(32, 16, bias=bias), (2, 8, 32))
    (x,) = g.inputs
    got = rules.gemm(g.node(aten.linear.default), ctx({x: S(2, 32)}, params=g.params.values()))
    assert got == Decision(R, role="row")


@pytest.mark.parametrize("fn,shapes,target", [
    (lambda x, w: torch.mm(x, w), [(4, 32), (32, 16)], aten.mm.default),
    (lambda x, w, b: torch.addmm(b, x, w), [(4, 32), (32, 16), (16,)], aten.addmm.default),
])
def test_mm_and_addmm_row_parallel(fn, shapes, target):
    g = export(fn, *shapes)
    x, w = g.inputs[:2]
    assert rules.gemm(g.node(target), ctx({x: S(1, 32)}, params={w})) == Decision(R, role="row")


def test_gemm_row_parallel_indivisible():
    g = export(nn.Linear(6, 4), (2, 8, 6))
    (x,) = g.inputs
    with pytest.raises(Indivisible, match=r"parts \(6,\) of dim 2 are not divisible by t=4"):
        rules.gemm(g.node(aten.linear.default), ctx({x: S(2, 6)}, t=4, params=g.params.values()))


def test_gemm_refuses_a_weight_with_another_use():
    g = export(lambda x, w: (F.linear(x, w), w * 2), (2, 8, 32), (16, 32))  # tied: the weight is read twice
    x, w = g.inputs
    with pytest.raises(NoRule, match="contraction over a sharded dim with weight .* that cannot be sharded"):
        rules.gemm(g.node(aten.linear.default), ctx({x: S(2, 32)}, params={w}))


def test_gemm_refuses_a_weight_that_is_not_a_parameter():
    g = export(F.linear, (2, 8, 32), (16, 32))
    x, w = g.inputs
    with pytest.raises(NoRule, match="cannot be sharded"):
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


# --- known gaps in rules.py (see the report): each test asserts what the rule should do --------------------------
@pytest.mark.xfail(strict=True, reason="reduction reads keepdim from args[2], which is var.dim's `unbiased` "
                                       "(and var.correction passes keepdim as a kwarg)")
@pytest.mark.parametrize("fn", [lambda x: x.var(1, unbiased=False, keepdim=True),
                                lambda x: x.var(1, correction=0, keepdim=True)])
def test_gap_var_keepdim(fn):
    g = export(fn, (2, 8, 32))
    (x,) = g.inputs
    (node,) = [n for n in g.gm.graph.nodes if n.op == "call_function"]
    assert tuple(node.meta["val"].shape) == (2, 1, 32)
    assert rules.reduction(node, ctx({x: S(2, 32)})) == Decision(S(2, 32))  # rules.py says S(1)


@pytest.mark.xfail(strict=True, reason="type_as's second operand only gives a dtype, but elementwise treats it as a "
                                       "broadcast operand and scatters it with a layout its shape does not have")
def test_gap_type_as_other_is_not_an_operand():
    g = export(lambda x, m: x.type_as(m), (2, 8, 32), (2, 4, 8, 8))
    x, m = g.inputs
    got = rules.elementwise(g.node(aten.type_as.default), ctx({x: S(2, 32)}))
    assert got.out == S(2, 32) and got.enter.get(m) is None  # rules.py scatters m as S(3, 32) on an 8-wide dim


@pytest.mark.xfail(strict=True, raises=AttributeError,
                   reason="gemm assumes the input operand is the sharded one: AttributeError, not NoRule")
def test_gap_gemm_sharded_weight_operand_crashes():
    g = export(torch.mm, (4, 8), (8, 32))
    a, h = g.inputs
    with pytest.raises(NoRule):
        rules.gemm(g.node(aten.mm.default), ctx({h: S(1, 32)}))


@pytest.mark.xfail(strict=True, reason="gemm's pass-through sends a sharded weight operand through f as if whole")
def test_gap_gemm_pass_through_ignores_a_sharded_weight_operand():
    g = export(torch.mm, (16, 8), (8, 32))
    a, h = g.inputs
    with pytest.raises(NoRule):  # rules.py: Decision(S(0), {h: None}), but each rank holds 16 of h's 32 columns
        rules.gemm(g.node(aten.mm.default), ctx({a: S(0, 16), h: S(1, 32)}))


@pytest.mark.xfail(strict=True, reason="sdpa puts the mask in `enter` without looking at its placement")
def test_gap_sdpa_scatters_an_already_sharded_mask():
    g = _sdpa((2, 4, 8, 8))
    q, k, v, m = g.inputs
    s = S(1, 4)
    got = rules.sdpa(g.node(aten.scaled_dot_product_attention.default), ctx({q: s, k: s, v: s, m: s}))
    assert got == Decision(s)  # rules.py: enter={m: S(1, 4)}, a second scatter of a local tensor
