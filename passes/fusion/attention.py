"""Fusion: explicit attention -> aten.scaled_dot_product_attention.

    matmul(q, k^T) [* c] [masked_fill(causal mask, -inf) | + mask] -> softmax(-1) [-> dropout] -> matmul(., v)

A mask is only dropped (is_causal=True) when its value, evaluated at pass time, is causal: a masked_fill's boolean
mask, or an additive mask of 0 and -inf (or the dtype's lowest value, as Hugging Face fills). The value is folded
from the buffers and constants the mask reads (`values` maps the graph's buffer and constant inputs, GraphInput
records of passes/ir/meta.py, to tensors) and from constants built in the graph (`torch.triu(torch.ones(T, T), 1)`,
`torch.full((T, T), -inf).triu(1)`, comparisons of `arange`s): deterministic ops of no model input, no random op.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping

import torch
import torch.utils._pytree as pytree
from torch.fx import GraphModule, Node

from fxpar.passes.fusion.match import erase, done, is_call, ndim, new_node, only_user, scalar_operand, val
from fxpar.passes.ir.meta import FXPAR_ASSUMES, input_of
from fxpar.passes.ir.op_families import MASK_BUILDERS, SOFTMAX

aten = torch.ops.aten


_MISSING = object()


def _evaluate(n, values: Mapping, depth: int = 0):
    """The concrete value of a mask expression over buffers/constants, or _MISSING if it depends on anything else."""
    if not isinstance(n, Node):
        return n
    if n.op == "placeholder":
        return values.get(input_of(n), _MISSING)
    if n.op != "call_function" or n.target not in MASK_BUILDERS or depth > 32:
        return _MISSING
    args, kwargs = pytree.tree_map(lambda a: _evaluate(a, values, depth + 1), (n.args, n.kwargs),
                                   is_leaf=lambda a: isinstance(a, Node))
    if any(a is _MISSING for a in pytree.tree_leaves((args, kwargs))):
        return _MISSING
    with torch.no_grad():
        return n.target(*args, **kwargs)


def _inputs_of(n: Node) -> tuple:
    """The GraphInputs of the placeholders an expression reads (what a proof from their values relied on)."""
    seen, work, out = set(), [n], []
    while work:
        x = work.pop()
        if not isinstance(x, Node) or x in seen:
            continue
        seen.add(x)
        if x.op == "placeholder":
            out.append(input_of(x))
        work.extend(x.all_input_nodes)
    return tuple(out)


def _provably_causal(mask: Node, scores: Node, values: Mapping | None, additive: bool = False) -> bool:
    """The mask, evaluated now, is causal with only size-1 leading dims: a boolean ~tril(ones(L, S)) to fill, or
    (additive) 0 on and below the diagonal and -inf or the lowest finite value of the scores' dtype above it (the
    softmax of either is exactly 0 there: a causal row always keeps its diagonal)."""
    sv = val(scores)
    if sv is None:
        return False
    m = _evaluate(mask, values or {})
    if not isinstance(m, torch.Tensor) or not 2 <= m.dim() <= sv.dim() or m.dtype != (sv.dtype if additive else
                                                                                      torch.bool):
        return False
    L, S = sv.shape[-2:]
    if tuple(m.shape[-2:]) != (L, S) or any(d != 1 for d in m.shape[:-2]):
        return False
    m, above = m.reshape(L, S).cpu(), ~torch.ones(L, S, dtype=torch.bool).tril()
    if not additive:
        return torch.equal(m, above)
    lowest = torch.finfo(m.dtype).min
    return bool((m[~above] == 0).all() and ((m[above] == float("-inf")) | (m[above] == lowest)).all())


@dataclass
class _Attention:
    q: Node
    k: Node
    v: Node
    out: Node  # matmul(probs, v)
    chain: list  # the nodes the SDPA replaces, from q @ k^T to softmax and on to the dropout
    k_t: Node
    scale: float = 1.0
    attn_mask: Node | None = None
    mask_expr: Node | None = None  # the boolean masked_fill mask, dropped when proven causal
    is_causal: bool = False
    dropout_p: float = 0.0


def _softmax_last_dim(s: Node) -> bool:
    x, nd = s.args[0], ndim(s.args[0])
    if nd is None or s.args[1] % nd != nd - 1:
        return False
    if s.target is aten._softmax.default:
        return not s.args[2]
    dtype = s.args[2] if len(s.args) > 2 else s.kwargs.get("dtype")
    return dtype in (None, val(x).dtype)


def _match_mask_and_scale(t: Node, a: _Attention, values) -> Node | None:
    """Walk back from the softmax input through [masked_fill | + mask] and [* c | / c]; returns the scores node."""
    if is_call(t, aten.masked_fill.Scalar):
        fill = t.args[2]
        if not (isinstance(fill, float) and math.isinf(fill) and fill < 0):
            return None
        if not _provably_causal(t.args[1], t.args[0], values):
            return None
        a.is_causal, a.mask_expr = True, t.args[1]
        a.chain.append(t)
        t = t.args[0]
    elif is_call(t, aten.add.Tensor) and not t.kwargs and all(isinstance(x, Node) for x in t.args):
        for scores, mask in (t.args, t.args[::-1]):
            sv, mv = val(scores), val(mask)
            if is_call(scores, aten.mul.Tensor, aten.div.Tensor, aten.matmul.default) and sv is not None and \
                    mv is not None and mv.dtype == sv.dtype and mv.dim() <= sv.dim() and val(t).shape == sv.shape:
                if _provably_causal(mask, scores, values, additive=True):
                    a.is_causal, a.mask_expr = True, mask
                else:
                    a.attn_mask = mask
                a.chain.append(t)
                t = scores
                break
        else:
            return None
    op = scalar_operand(t, aten.mul.Tensor) if is_call(t, aten.mul.Tensor) else None
    if is_call(t, aten.div.Tensor) and len(t.args) == 2 and isinstance(t.args[1], (int, float)) and t.args[1] != 0:
        op = (t.args[0], 1.0 / t.args[1])
    if op is not None:
        a.chain.append(t)
        t, a.scale = op
    return t


def _match_attention(softmax: Node, values) -> _Attention | None:
    """matmul(q, k^T) [* c] [mask] -> softmax(-1) [-> dropout] -> matmul(., v), with every step read only once."""
    if not _softmax_last_dim(softmax):
        return None
    a = _Attention(q=None, k=None, v=None, out=None, chain=[], k_t=None)
    scores = _match_mask_and_scale(softmax.args[0], a, values)
    if not is_call(scores, aten.matmul.default) or not isinstance(scores.args[1], Node):
        return None
    a.q, a.k_t = scores.args
    if not is_call(a.k_t, aten.transpose.int) or any(ndim(n) != 4 for n in (a.q, a.k_t)):
        return None
    if sorted(d % 4 for d in a.k_t.args[1:3]) != [2, 3]:
        return None
    a.k = a.k_t.args[0]
    a.chain = [scores] + a.chain[::-1] + [softmax]
    t = softmax
    u = only_user(t)
    if is_call(u, aten.to.dtype) and len(u.args) == 2 and not u.kwargs and u.args[1] == val(t).dtype:
        a.chain.append(u)
        t, u = u, only_user(u)
    if is_call(u, aten.dropout.default):
        a.dropout_p = float(u.args[1]) if u.args[2] else 0.0
        a.chain.append(u)
        t, u = u, only_user(u)
    if not is_call(u, aten.matmul.default) or u.args[0] is not t or ndim(u.args[1]) != 4:
        return None
    a.v, a.out = u.args[1], u
    if any(only_user(n) is not nxt for n, nxt in zip(a.chain, a.chain[1:] + [u])):
        return None  # an intermediate (the probabilities, the scores) is read elsewhere
    return a


def _erase_dead_inputs(gm: GraphModule, nodes) -> None:
    work = [n for n in nodes if isinstance(n, Node)]
    while work:
        n = work.pop()
        if n.op == "call_function" and n.target in MASK_BUILDERS | {aten.transpose.int} and not n.users:
            work.extend(n.all_input_nodes)
            gm.graph.erase_node(n)


def attention_to_sdpa_pass(gm: GraphModule, values: Mapping | None = None, dropout: bool = True) -> GraphModule:
    """Explicit attention -> aten.scaled_dot_product_attention(q, k, v, attn_mask, dropout_p, is_causal, scale).

    Pattern: matmul(q, transpose(k, -2, -1)), then * c or / c with c a Python number (no scale: c = 1), then either
    masked_fill(mask, -inf) with a mask that `values` proves causal at pass time (a tril buffer of ones, sliced and
    compared == 0) or + an additive float mask that does not broadcast the scores, then softmax over the last dim,
    an optional no-op cast and dropout, then matmul(., v); 4-D q, k, v. Safe: SDPA computes softmax(q k^T * scale +
    mask) v, the same math. Anything else (a tensor scale, another softmax dim, a mask of another shape or value, an
    intermediate read elsewhere) is left alone. With dropout p > 0 in training SDPA draws its own mask: the same
    distribution, not the same bits. dropout=False leaves an attention with dropout in training as it is (a joint
    program takes its dropout's noise as an input, and SDPA's own draw it could not: passes/joint/random_inputs.py).
    """
    changed = 0
    for node in list(gm.graph.nodes):
        if not is_call(node, *SOFTMAX) or node.graph is not gm.graph or not node.users:
            continue
        a = _match_attention(node, values)
        if a is None or (a.dropout_p and not dropout):
            continue
        kwargs = {"dropout_p": a.dropout_p} if a.dropout_p else {}
        if a.is_causal:
            kwargs["is_causal"] = True
        kwargs["scale"] = a.scale
        args = (a.q, a.k, a.v) + ((a.attn_mask,) if a.attn_mask is not None else ())
        fused = new_node(gm, a.out, aten.scaled_dot_product_attention.default, args, kwargs, a.out, "sdpa", "sdpa")
        if a.is_causal:  # proven from the buffers' values now: the executable checks they stay the same
            fused.meta[FXPAR_ASSUMES] = _inputs_of(a.mask_expr)
        a.out.replace_all_uses_with(fused)
        erase(gm, [a.out] + a.chain)
        _erase_dead_inputs(gm, [a.k_t, a.mask_expr])
        changed += 1
    return done(gm, changed)
