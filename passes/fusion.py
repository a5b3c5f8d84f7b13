"""Fusion passes on the per-rank ATen graph: bias+GeLU, bias+dropout+residual-add, explicit attention -> SDPA.

Every pass matches a fixed pattern, checks the conditions under which the rewrite computes the same math, and leaves
anything else alone: a near miss (a mask of another shape, a scale that is a tensor, softmax over another dim) is no
match, never a guess. Each pass rewrites in place and returns the same GraphModule; it calls lint() and recompile()
only when something matched. Fused nodes carry node.meta[FXPAR_FUSED] = the fusion's name, for `fxpar show`.

Glossary:
    biased GEMM   y + b where y is a GEMM output and b a 1-D bias along the last dim, in one of three spellings:
                  aten.linear(x, w, b) | aten.addmm(b, x, w) (Hugging Face Conv1D) | aten.add(gemm_out, b)
                  (the row-parallel bias that the tensor-parallel pass adds after g), optionally seen through a
                  view that keeps the last dim (GPT-2 flattens to 2-D around addmm).
    split         the biased GEMM becomes its bias-free GEMM (linear without b, or mm) and the fused op adds b.
    values        concrete tensors of the graph's buffer/constant placeholders, by placeholder name; the attention
                  pass evaluates a mask from them to prove it causal at pass time.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping

import torch
import torch.utils._pytree as pytree
from torch.fx import GraphModule, Node

from . import fused_ops

aten = torch.ops.aten
FXPAR_FUSED = "fxpar_fused"  # node.meta key: the name of the fusion that created this node

_ASSERT = aten._assert_tensor_metadata.default
_VIEWS = {aten.view.default, aten.reshape.default, aten._unsafe_view.default}
_SOFTMAX = {aten.softmax.int, aten._softmax.default}
_RANDOM = {aten.dropout.default, aten.native_dropout.default, aten.bernoulli.default, aten.bernoulli.p,
           aten.bernoulli_.float, aten.rand_like.default, aten.randn_like.default, aten.rand.default,
           aten.randn.default, aten.scaled_dot_product_attention.default, fused_ops.bias_dropout_add}
_MASK_OPS = {aten.alias.default, aten.slice.Tensor, aten.view.default, aten.reshape.default, aten.unsqueeze.default,
             aten.squeeze.dim, aten.expand.default, aten.eq.Scalar, aten.ne.Scalar, aten.logical_not.default,
             aten.bitwise_not.default, aten.to.dtype, aten._to_copy.default, aten.detach.default, aten.clone.default,
             aten.select.int, aten.lt.Scalar, aten.le.Scalar, aten.gt.Scalar, aten.ge.Scalar}
SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)


# ---------------------------------------------------------------------------------------------------- small helpers
def _is(n, *targets) -> bool:
    return isinstance(n, Node) and n.op == "call_function" and n.target in targets


def _val(n):
    """n's traced value (a FakeTensor); through f and g, which keep their input's shape, since the tensor-parallel
    pass inserts them without one."""
    if isinstance(n, Node) and n.op == "call_module" and str(n.target).startswith(("tp_f_", "tp_g_")):
        return _val(n.args[0])
    v = n.meta.get("val") if isinstance(n, Node) else None
    if v is None and _is(n, aten.add.Tensor) and all(isinstance(a, Node) for a in n.args):  # the bias after g
        vals = [_val(a) for a in n.args]
        if all(x is not None for x in vals):
            return max(vals, key=lambda x: x.dim())
    return v if isinstance(v, torch.Tensor) else None


def _ndim(n) -> int | None:
    v = _val(n)
    return v.dim() if v is not None else None


def _users(n: Node) -> list[Node]:
    """Users that consume the value (shape/dtype asserts only watch it)."""
    return [u for u in n.users if not _is(u, _ASSERT)]


def _only_user(n: Node) -> Node | None:
    users = _users(n)
    return users[0] if len(users) == 1 else None


def _const(x, want: float, rel: float = 0.0) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and abs(x - want) <= rel * abs(want)


def _scalar_operand(n: Node, target) -> tuple[Node, float] | None:
    """(tensor, c) if n is target(tensor, c) or target(c, tensor) with c a Python number."""
    if not _is(n, target) or len(n.args) != 2 or n.kwargs:
        return None
    a, b = n.args
    if isinstance(a, Node) and isinstance(b, (int, float)):
        return a, b
    if isinstance(b, Node) and isinstance(a, (int, float)):
        return b, a
    return None


def _erase(gm: GraphModule, nodes) -> None:
    """Erase `nodes` (now unused, with their assert users) in reverse graph order."""
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    for n in sorted(set(nodes), key=order.__getitem__, reverse=True):
        for u in list(n.users):
            if _is(u, _ASSERT):
                gm.graph.erase_node(u)
        assert not n.users, f"fxpar fusion: {n.name} still has users {list(n.users)}"
        gm.graph.erase_node(n)


def _new(gm: GraphModule, before: Node, fn, args: tuple, kwargs: dict, like: Node, fusion: str, name: str) -> Node:
    """A call_function node before `before`, with `like`'s value/module metadata and the fusion's mark."""
    with gm.graph.inserting_before(before):
        node = gm.graph.create_node("call_function", fn, args, kwargs, name=name)
    for key in ("val", "tensor_meta", "nn_module_stack", "stack_trace"):
        if key in like.meta:
            node.meta[key] = like.meta[key]
    node.meta[FXPAR_FUSED] = fusion
    return node


def _done(gm: GraphModule, changed: int) -> GraphModule:
    if changed:
        gm.graph.lint()
        gm.recompile()
    return gm


# ------------------------------------------------------------------------------------------------------ biased GEMM
@dataclass
class _Biased:
    out: Node  # the node whose value is y + b (what the activation / dropout reads)
    gemm: Node  # linear / addmm / the add of the bias
    bias: Node
    kind: str  # "linear" | "addmm" | "add"
    view: Node | None = None


def _keeps_last_dim(view: Node, src: Node) -> bool:
    a, b = _val(view), _val(src)
    return a is not None and b is not None and a.dim() >= 1 and a.shape[-1] == b.shape[-1]


def _match_biased(n: Node) -> _Biased | None:
    """n = y + b for a GEMM output y and a 1-D bias b (see the glossary)."""
    view = None
    if _is(n, *_VIEWS) and isinstance(n.args[0], Node) and _only_user(n.args[0]) is n:
        if not _keeps_last_dim(n, n.args[0]):
            return None
        view, n = n, n.args[0]
    if _is(n, aten.linear.default) and len(n.args) == 3 and isinstance(n.args[2], Node):
        bias, kind = n.args[2], "linear"
    elif _is(n, aten.addmm.default) and not n.kwargs and isinstance(n.args[0], Node):
        bias, kind = n.args[0], "addmm"
    elif _is(n, aten.add.Tensor) and not n.kwargs and all(isinstance(a, Node) for a in n.args):
        ys = [a for a in n.args if _ndim(a) not in (None, 1)]
        bs = [a for a in n.args if _ndim(a) == 1]
        if len(ys) != 1 or len(bs) != 1 or _val(n) is not None and _val(ys[0]).shape != _val(n).shape:
            return None  # the bias must not broadcast y to a bigger shape
        bias, kind = bs[0], "add"
    else:
        return None
    if _ndim(bias) != 1:
        return None
    return _Biased(view or n, n, bias, kind, view)


def _split_bias(gm: GraphModule, m: _Biased) -> Node:
    """Drop the bias from the GEMM; returns the node holding y (the pre-activation, bias-free)."""
    if m.kind == "linear":
        m.gemm.args = m.gemm.args[:2]
        m.gemm.meta[FXPAR_FUSED] = "bias_split"
    elif m.kind == "addmm":
        mm = _new(gm, m.gemm, aten.mm.default, m.gemm.args[1:], {}, m.gemm, "bias_split", "mm")
        m.gemm.replace_all_uses_with(mm)
        gm.graph.erase_node(m.gemm)
        return m.view or mm
    else:  # y + b: y itself, read through the view if there is one
        y = next(a for a in m.gemm.args if a is not m.bias)
        if m.view is None:
            return y
        m.view.replace_input_with(m.gemm, y)
    return m.view or m.gemm


# ---------------------------------------------------------------------------------------------------- bias + GeLU
def _match_gelu(n: Node) -> tuple[Node, str, list[Node]] | None:
    """(x, approximate, pattern nodes) if n computes gelu(x): aten.gelu, or GPT-2's NewGELU written out."""
    if _is(n, aten.gelu.default) and isinstance(n.args[0], Node):
        approximate = n.kwargs.get("approximate", n.args[1] if len(n.args) > 1 else "none")
        return n.args[0], approximate, [n]
    return _match_new_gelu(n)


def _match_new_gelu(n: Node) -> tuple[Node, str, list[Node]] | None:
    """0.5 * x * (1 + tanh(sqrt(2/pi) * (x + 0.044715 * x^3))), as torch.export writes GPT-2's NewGELU."""
    if not _is(n, aten.mul.Tensor) or len(n.args) != 2 or not all(isinstance(a, Node) for a in n.args):
        return None
    for half, one_plus in (n.args, n.args[::-1]):
        found = _new_gelu_parts(half, one_plus)
        if found is None:
            continue
        x, nodes = found
        nodes.append(n)
        inside = set(nodes)
        if any(u not in inside for m in nodes[:-1] for u in _users(m)) or set(_users(x)) - inside:
            continue  # an intermediate is read elsewhere: fusing would drop it
        return x, "tanh", nodes
    return None


def _new_gelu_parts(half: Node, one_plus: Node) -> tuple[Node, list[Node]] | None:
    """(x, [0.5*x, x^3, 0.044715*x^3, x + ..., sqrt(2/pi)*(...), tanh, 1 + tanh]) or None."""
    h, t1 = _scalar_operand(half, aten.mul.Tensor), _scalar_operand(one_plus, aten.add.Tensor)
    if h is None or not _const(h[1], 0.5) or t1 is None or not _const(t1[1], 1.0):
        return None
    x, tanh = h[0], t1[0]
    if not _is(tanh, aten.tanh.default):
        return None
    inner = _scalar_operand(tanh.args[0], aten.mul.Tensor)
    if inner is None or not _const(inner[1], SQRT_2_OVER_PI, 1e-6) or not _is(inner[0], aten.add.Tensor):
        return None
    s = inner[0]
    if len(s.args) != 2 or s.kwargs or x not in s.args or s.args[0] is s.args[1]:
        return None
    w = s.args[1] if s.args[0] is x else s.args[0]
    cube = _scalar_operand(w, aten.mul.Tensor) if isinstance(w, Node) else None
    if cube is None or not _const(cube[1], 0.044715) or not _is(cube[0], aten.pow.Tensor_Scalar):
        return None
    pow_ = cube[0]
    if pow_.args[0] is not x or not _const(pow_.args[1], 3.0):
        return None
    return x, [half, pow_, w, s, tanh.args[0], tanh, one_plus]


def _second_gemm(h: Node) -> tuple[Node, Node | None, dict] | None:
    """(gemm, view, how) if the activation h's only consumer is a GEMM: linear(h, w[, b]) or view -> mm/addmm."""
    user = _only_user(h)
    if _is(user, aten.linear.default) and user.args[0] is h and len(_users(h)) == len(h.users):
        bias = user.args[2] if len(user.args) > 2 else None
        return user, None, dict(weight=user.args[1], out_bias=bias, flat_shape=None, layout="linear")
    if _is(user, *_VIEWS) and _keeps_last_dim(user, h) and _ndim(user) == 2 and len(_users(h)) == len(h.users):
        gemm = _only_user(user)
        if _is(gemm, aten.mm.default) and gemm.args[0] is user:
            return gemm, user, dict(weight=gemm.args[1], out_bias=None, flat_shape=list(user.args[1]), layout="mm")
        if _is(gemm, aten.addmm.default) and not gemm.kwargs and gemm.args[1] is user:
            return gemm, user, dict(weight=gemm.args[2], out_bias=gemm.args[0], flat_shape=list(user.args[1]),
                                    layout="mm")
    return None


def bias_gelu_pass(gm: GraphModule) -> GraphModule:
    """gelu(biased GEMM) -> bias_gelu(y, b); folded with the next GEMM as bias_gelu_linear when that is its only user.

    Pattern: y + b (see the glossary) whose only user is gelu (erf, tanh, or NewGELU written out), optionally followed
    by a GEMM that is the activation's only user. Safe: y + b and gelu are the same ATen ops in the same order (NewGELU
    becomes aten.gelu(approximate="tanh"), the same formula to fp32 rounding), and the folded GEMM is the same kernel;
    only backward differs, recomputing gelu(y + b) from the saved y, which saves one [b, s, 4h/t] activation per MLP.
    """
    changed, gone = 0, set()
    for node in list(gm.graph.nodes):
        found = None if node in gone else _match_gelu(node)
        if found is None:
            continue
        x, approximate, gelu_nodes = found
        m = _match_biased(x)
        if m is None or any(u not in gelu_nodes for u in _users(x)):
            continue
        consumer = _second_gemm(node)
        y = _split_bias(gm, m)
        dead = gelu_nodes + ([m.gemm] if m.kind == "add" else [])
        if consumer is None:
            fused = _new(gm, node, fused_ops.bias_gelu, (y, m.bias, approximate), {}, node, "bias_gelu",
                         "bias_gelu")
            node.replace_all_uses_with(fused)
        else:
            gemm, view, how = consumer
            fused = _new(gm, gemm, fused_ops.bias_gelu_linear, (y, m.bias), dict(approximate=approximate, **how),
                         gemm, "bias_gelu_linear", "bias_gelu_linear")
            gemm.replace_all_uses_with(fused)
            dead += [gemm] + ([view] if view is not None else [])
        _erase(gm, dead)
        gone.update(dead)
        changed += 1
    return _done(gm, changed)


# ------------------------------------------------------------------------------------- bias + dropout + residual add
def _draws_random(n: Node) -> bool:
    if n.op == "call_module":
        return not str(n.target).startswith(("tp_f_", "tp_g_"))  # anything else might draw
    if _is(n, aten.dropout.default, fused_ops.bias_dropout_add):
        p, train = (n.args[1], n.args[2]) if n.target is aten.dropout.default else (n.args[3], n.args[4])
        return bool(train) and p > 0
    if _is(n, aten.scaled_dot_product_attention.default):
        return n.kwargs.get("dropout_p", n.args[4] if len(n.args) > 4 else 0.0) > 0
    return _is(n, *_RANDOM)


def _random_between(a: Node, b: Node) -> bool:
    n = a.next
    while n is not b:
        if _draws_random(n):
            return True
        n = n.next
    return False


def bias_dropout_add_pass(gm: GraphModule) -> GraphModule:
    """residual + dropout(biased GEMM) -> bias_dropout_add(y, b, residual, p, train).

    Pattern: aten.dropout(y + b, p, train) whose only user is an add with a residual. Safe: the fused op adds the bias,
    draws its noise exactly as aten.dropout does at the add's position ([Note: same random stream] in fused_ops; the
    pass refuses when another random op runs between the dropout and the add), and adds the residual; backward keeps
    a 1-byte mask instead of the float noise.
    """
    changed = 0
    for drop in list(gm.graph.nodes):
        if not _is(drop, aten.dropout.default) or not isinstance(drop.args[0], Node):
            continue
        add = _only_user(drop)
        if not _is(add, aten.add.Tensor) or add.kwargs or len(add.args) != 2 or add.args[0] is add.args[1]:
            continue
        residual = add.args[1] if add.args[0] is drop else add.args[0]
        m = _match_biased(drop.args[0])
        p, train = drop.args[1], drop.args[2]
        if not isinstance(residual, Node) or m is None or _only_user(m.out) is not drop:
            continue
        shapes = [_val(x) for x in (residual, m.out, add)]
        if any(v is None for v in shapes) or len({tuple(v.shape) for v in shapes}) != 1:
            continue  # the add would broadcast: its gradients would need summing
        if train and p > 0 and _random_between(drop, add):
            continue
        y = _split_bias(gm, m)
        fused = _new(gm, add, fused_ops.bias_dropout_add, (y, m.bias, residual, p, train),
                     {"residual_first": add.args[0] is residual}, add, "bias_dropout_add", "bias_dropout_add")
        add.replace_all_uses_with(fused)
        _erase(gm, [add, drop] + ([m.gemm] if m.kind == "add" else []))
        changed += 1
    return _done(gm, changed)


# ---------------------------------------------------------------------------------------- explicit attention -> SDPA
_MISSING = object()


def _evaluate(n, values: Mapping, depth: int = 0):
    """The concrete value of a mask expression over buffers/constants, or _MISSING if it depends on anything else."""
    if not isinstance(n, Node):
        return n
    if n.op == "placeholder":
        return values.get(n.name, _MISSING)
    if n.op != "call_function" or n.target not in _MASK_OPS or depth > 32:
        return _MISSING
    args, kwargs = pytree.tree_map(lambda a: _evaluate(a, values, depth + 1), (n.args, n.kwargs),
                                   is_leaf=lambda a: isinstance(a, Node))
    if any(a is _MISSING for a in pytree.tree_leaves((args, kwargs))):
        return _MISSING
    with torch.no_grad():
        return n.target(*args, **kwargs)


def _provably_causal(mask: Node, scores: Node, values: Mapping | None) -> bool:
    """The boolean mask, evaluated now from the buffers, is ~tril(ones(L, S)) with only size-1 leading dims."""
    sv = _val(scores)
    if sv is None or values is None:
        return False
    m = _evaluate(mask, values)
    if not isinstance(m, torch.Tensor) or m.dtype != torch.bool or not 2 <= m.dim() <= sv.dim():
        return False
    L, S = sv.shape[-2:]
    if tuple(m.shape[-2:]) != (L, S) or any(d != 1 for d in m.shape[:-2]):
        return False
    return torch.equal(m.reshape(L, S).cpu(), ~torch.ones(L, S, dtype=torch.bool).tril())


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
    x, nd = s.args[0], _ndim(s.args[0])
    if nd is None or s.args[1] % nd != nd - 1:
        return False
    if s.target is aten._softmax.default:
        return not s.args[2]
    dtype = s.args[2] if len(s.args) > 2 else s.kwargs.get("dtype")
    return dtype in (None, _val(x).dtype)


def _match_mask_and_scale(t: Node, a: _Attention, values) -> Node | None:
    """Walk back from the softmax input through [masked_fill | + mask] and [* c | / c]; returns the scores node."""
    if _is(t, aten.masked_fill.Scalar):
        fill = t.args[2]
        if not (isinstance(fill, float) and math.isinf(fill) and fill < 0):
            return None
        if not _provably_causal(t.args[1], t.args[0], values):
            return None
        a.is_causal, a.mask_expr = True, t.args[1]
        a.chain.append(t)
        t = t.args[0]
    elif _is(t, aten.add.Tensor) and not t.kwargs and all(isinstance(x, Node) for x in t.args):
        for scores, mask in (t.args, t.args[::-1]):
            sv, mv = _val(scores), _val(mask)
            if _is(scores, aten.mul.Tensor, aten.div.Tensor, aten.matmul.default) and sv is not None and \
                    mv is not None and mv.dtype == sv.dtype and mv.dim() <= sv.dim() and _val(t).shape == sv.shape:
                a.attn_mask = mask
                a.chain.append(t)
                t = scores
                break
        else:
            return None
    op = _scalar_operand(t, aten.mul.Tensor) if _is(t, aten.mul.Tensor) else None
    if _is(t, aten.div.Tensor) and len(t.args) == 2 and isinstance(t.args[1], (int, float)) and t.args[1] != 0:
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
    if not _is(scores, aten.matmul.default) or not isinstance(scores.args[1], Node):
        return None
    a.q, a.k_t = scores.args
    if not _is(a.k_t, aten.transpose.int) or any(_ndim(n) != 4 for n in (a.q, a.k_t)):
        return None
    if sorted(d % 4 for d in a.k_t.args[1:3]) != [2, 3]:
        return None
    a.k = a.k_t.args[0]
    a.chain = [scores] + a.chain[::-1] + [softmax]
    t = softmax
    u = _only_user(t)
    if _is(u, aten.to.dtype) and len(u.args) == 2 and not u.kwargs and u.args[1] == _val(t).dtype:
        a.chain.append(u)
        t, u = u, _only_user(u)
    if _is(u, aten.dropout.default):
        a.dropout_p = float(u.args[1]) if u.args[2] else 0.0
        a.chain.append(u)
        t, u = u, _only_user(u)
    if not _is(u, aten.matmul.default) or u.args[0] is not t or _ndim(u.args[1]) != 4:
        return None
    a.v, a.out = u.args[1], u
    if any(_only_user(n) is not nxt for n, nxt in zip(a.chain, a.chain[1:] + [u])):
        return None  # an intermediate (the probabilities, the scores) is read elsewhere
    return a


def _erase_dead_inputs(gm: GraphModule, nodes) -> None:
    work = [n for n in nodes if isinstance(n, Node)]
    while work:
        n = work.pop()
        if n.op == "call_function" and n.target in _MASK_OPS | {aten.transpose.int} and not n.users:
            work.extend(n.all_input_nodes)
            gm.graph.erase_node(n)


def attention_to_sdpa_pass(gm: GraphModule, values: Mapping[str, torch.Tensor] | None = None) -> GraphModule:
    """Explicit attention -> aten.scaled_dot_product_attention(q, k, v, attn_mask, dropout_p, is_causal, scale).

    Pattern: matmul(q, transpose(k, -2, -1)), then * c or / c with c a Python number (no scale: c = 1), then either
    masked_fill(mask, -inf) with a mask that `values` proves causal at pass time (a tril buffer of ones, sliced and
    compared == 0) or + an additive float mask that does not broadcast the scores, then softmax over the last dim,
    an optional no-op cast and dropout, then matmul(., v); 4-D q, k, v. Safe: SDPA computes softmax(q k^T * scale +
    mask) v, the same math. Anything else (a tensor scale, another softmax dim, a mask of another shape or value, an
    intermediate read elsewhere) is left alone. With dropout p > 0 in training SDPA draws its own mask: the same
    distribution, not the same bits.
    """
    changed = 0
    for node in list(gm.graph.nodes):
        if not _is(node, *_SOFTMAX) or node.graph is not gm.graph or not node.users:
            continue
        a = _match_attention(node, values)
        if a is None:
            continue
        kwargs = {"dropout_p": a.dropout_p} if a.dropout_p else {}
        if a.is_causal:
            kwargs["is_causal"] = True
        kwargs["scale"] = a.scale
        args = (a.q, a.k, a.v) + ((a.attn_mask,) if a.attn_mask is not None else ())
        fused = _new(gm, a.out, aten.scaled_dot_product_attention.default, args, kwargs, a.out, "sdpa", "sdpa")
        a.out.replace_all_uses_with(fused)
        _erase(gm, [a.out] + a.chain)
        _erase_dead_inputs(gm, [a.k_t, a.mask_expr])
        changed += 1
    return _done(gm, changed)


# ------------------------------------------------------------------------------------------------------ the driver
def fusion_pass(gm: GraphModule, values: Mapping[str, torch.Tensor] | None = None) -> GraphModule:
    """All fusions, in order: attention -> SDPA, bias+dropout+add (it takes the second GEMM's bias first, so that
    bias+GeLU can fold a bias-free GEMM), bias+GeLU. Returns gm, rewritten in place (untouched if nothing matched)."""
    gm = attention_to_sdpa_pass(gm, values)
    gm = bias_dropout_add_pass(gm)
    return bias_gelu_pass(gm)


def placeholder_values(inputs, tensors: Mapping[str, torch.Tensor], constants: Mapping[str, torch.Tensor]) -> dict:
    """Placeholder name -> concrete tensor for buffer and constant placeholders (the `values` of the passes).

    Args:
        inputs: Traced.inputs, (placeholder name, kind, state_dict key) per placeholder.
        tensors: the model's buffers by key, e.g. dict(model.named_buffers(remove_duplicate=False)).
        constants: Traced.constants (lifted tensor constants).
    """
    out = {}
    for name, kind, key in inputs:
        if kind == "buffer" and key in tensors:
            out[name] = tensors[key]
        elif kind == "constant" and key in constants:
            out[name] = constants[key]
    return out


def compile_graph(gm: GraphModule, backend: str = "inductor", **options):
    """torch.compile(gm) (Config.compile, off by default): one compiled callable per graph chunk.

    Safe: torch.compile preserves semantics; the fused autograd Functions and checkpointed regions trace through
    dynamo. Returns the compiled module (call it like gm); `backend="aot_eager"` skips code generation (tests).
    """
    return torch.compile(gm, backend=backend, **options)
