"""Fused projections: find GEMMs whose output columns the model later cuts into parts (Q|K|V, gate|up).

Pattern: follow the GEMM's output feature dim forward through ops that keep it intact (views, transposes,
elementwise) until something partitions it:
    split / split_with_sizes / chunk along it            -> the pieces' sizes       (GPT-2 c_attn, Phi-3 gate_up)
    slices along it that tile it                         -> the slices' sizes       (Phi-3 qkv_proj, GQA sizes)
    a view/unflatten of it into (k, ...) with the product D, whose k dim is then selected or unbound (maybe after
    a transpose or permute)                              -> k parts of D/k          (nn.MultiheadAttention in_proj,
                                                                                     timm's view(B, N, 3, H, hd))
The analysis then shards the GEMM with Shard(parts=...), which is the head-interleaved layout of
[Note: head-interleaved QKV]; if the parts do not suit the model after all, its rules refuse and nothing is sharded.
A view into (nh, 3*hd) followed by a split of the inner dim (GPT-NeoX) is already head-major: no parts needed.
"""
from __future__ import annotations

import math

import torch
from torch.fx import Node

from fxpar.passes.ir.op_families import PICKS, SAME_DIMS, SPLITS
from fxpar.passes.sharding.rule_table import rule_for
from fxpar.passes.sharding.rules import elementwise

aten = torch.ops.aten


def _shape(n: Node) -> tuple:
    v = n.meta.get("val")
    return tuple(v.shape) if isinstance(v, torch.Tensor) else ()


def _norm(d: int, nd: int) -> int:
    return d + nd if d < 0 else d


def _split_sizes(user: Node) -> list[int]:
    vals = user.meta.get("val") or []
    return [v.shape[_norm(user.args[2] if len(user.args) > 2 else 0, len(_shape(user.args[0])))] for v in vals]


def _follow(node: Node, dim: int, depth: int = 0):
    """Parts sizes of `dim` of `node`, if something downstream partitions it; else None."""
    if depth > 12:
        return None
    shape, nd = _shape(node), len(_shape(node))
    slices = []
    for u in node.users:
        if u.op != "call_function":
            continue
        if u.target in SPLITS and _norm(u.args[2] if len(u.args) > 2 else 0, nd) == dim:
            return tuple(_split_sizes(u))
        if u.target is aten.slice.Tensor and _norm(u.args[1], nd) == dim:
            slices.append((u.args[2] or 0, min(u.args[3] if len(u.args) > 3 else shape[dim], shape[dim])))
            continue
        found = _through(u, node, dim, depth)
        if found:
            return found
    slices = sorted(set(slices))
    if slices and slices[0][0] == 0 and slices[-1][1] == shape[dim] and all(
        a[1] == b[0] for a, b in zip(slices, slices[1:])
    ):
        return tuple(e - s for s, e in slices)
    return None


def _keeps_channels(u: Node, src: Node, dim: int) -> bool:
    """u keeps every index of `dim` where it was, one for one: a unary elementwise op (silu after a conv), a slice
    of another dim, or a depthwise conv1d over the channels `dim` (Qwen3-Next's mixer over its fused q|k|v)."""
    if u.target is aten.slice.Tensor:
        return _norm(u.args[1], len(_shape(src))) != dim
    if u.target is aten.conv1d.default:
        w = u.args[1]
        groups = u.args[6] if len(u.args) > 6 else u.kwargs.get("groups", 1)
        return dim == 1 and u.args[0] is src and len(_shape(src)) == 3 and groups == _shape(src)[1] \
            and isinstance(w, Node) and _shape(w)[0] == groups
    inputs = [a for a in u.all_input_nodes if isinstance(a.meta.get("val"), torch.Tensor)]
    return rule_for(u) is elementwise and inputs == [src] and _shape(u) == _shape(src)


def _through(u: Node, src: Node, dim: int, depth: int):
    """Continue following `dim` through user `u`, which reads `src`."""
    nd, out = len(_shape(src)), _shape(u)
    if u.target in SAME_DIMS or _keeps_channels(u, src, dim):
        return _follow(u, dim, depth + 1)
    if u.target in (aten.transpose.int,):
        a, b = _norm(u.args[1], nd), _norm(u.args[2], nd)
        return _follow(u, {a: b, b: a}.get(dim, dim), depth + 1)
    if u.target in (aten.view.default, aten.reshape.default, aten.unflatten.int, aten._unsafe_view.default):
        before = math.prod(_shape(src)[:dim])
        size = _shape(src)[dim]
        for j in range(len(out)):
            if math.prod(out[:j]) != before:
                continue
            if out[j] == size:
                return _follow(u, j, depth + 1)  # the dim kept whole
            for end in range(j + 2, len(out) + 1):  # split into (k, ...) with the product D: (3, heads, hd)
                if math.prod(out[j:end]) == size:
                    k = out[j]  # parts if the k dim is later picked apart
                    return (size // k,) * k if k > 1 and _picked(u, j, depth) else None
        return None
    return None


def _picked(node: Node, dim: int, depth: int) -> bool:
    """Is `dim` of `node` later indexed apart (select / unbind), possibly after moving it?"""
    if depth > 12:
        return False
    nd = len(_shape(node))
    for u in node.users:
        if u.op != "call_function":
            continue
        if u.target in PICKS and _norm(u.args[1] if len(u.args) > 1 else 0, nd) == dim:
            return True
        if u.target in SAME_DIMS and _picked(u, dim, depth + 1):
            return True
        if u.target is aten.unsqueeze.default:
            k = _norm(u.args[1], nd + 1)
            if _picked(u, dim + (1 if k <= dim else 0), depth + 1):
                return True
        if u.target is aten.transpose.int:
            a, b = _norm(u.args[1], nd), _norm(u.args[2], nd)
            if _picked(u, {a: b, b: a}.get(dim, dim), depth + 1):
                return True
        if u.target is aten.permute.default:
            order = [_norm(d, nd) for d in u.args[1]]
            if _picked(u, order.index(dim), depth + 1):
                return True
        if u.target is aten.squeeze.dim:
            k = _norm(u.args[1], nd)
            if k != dim and _picked(u, dim - (1 if k < dim else 0), depth + 1):
                return True
    return False


def fused_parts(gemm: Node) -> tuple[int, ...] | None:
    """The parts of a GEMM's output feature dim (its last), or None for a plain projection."""
    parts = _follow(gemm, len(_shape(gemm)) - 1)
    return parts if parts and len(parts) > 1 else None
