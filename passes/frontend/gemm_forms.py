"""GEMM forms: every contraction of an activation with a 2-D weight parameter, however it is spelled, as one of the
forms the analysis seeds regions from (rules.GEMM_WEIGHT_ARG: linear, addmm, mm).

torch.export keeps the user's spelling: `x @ W.T` is matmul(x, numpy_T(W)), `x @ W.t()` matmul(x, t(W)),
`F.linear` linear, `x @ W` with a weight stored [in, out] matmul(x, W), `torch.einsum('bsh,hf->bsf', x, W)` einsum.
This pass rewrites them (in place, before the analysis) as

    matmul / mm (x, T(W))            -> linear(x, W)                      T: t, numpy_T, transpose or permute of 2 dims
    addmm(b, x, T(W))                -> linear(x, W, b)
    addmm(a, x, W, beta=β, alpha=α)  -> add(mm(x, W) * α, a * β)   where a is not a bias of shape [out] (an
                                        activation, a broadcast column) or β, α are given; then as mm(x, W)
    matmul(x, W), x of rank k >= 2   -> view(mm(reshape(x, [rows, in]), W), [*x.shape[:-1], out])   (mm if k = 2)
    einsum('...c,cf->...f', x, W)    -> as matmul(x, W);   einsum('...c,fc->...f', x, W) -> linear(x, W)
    transformers::grouped_mm_fallback(x, W.transpose(-2, -1), offs), W [E, out, in]
                                     -> fxpar::grouped_linear(x, W, offs)   (passes/frontend/grouped_gemm.py: MoE
                                     experts)
    bmm(x, W), W [E, in, out]        -> fxpar::expert_bmm(x, W)

Why it is exact: each form computes the same sum of products, one output element at a time; for k > 2, matmul
itself folds x to 2-D and calls mm, which is what the rewrite spells out. The node computing the original value
keeps its FXPAR_ORIGIN (verify compares it with the traced node); inserted views and mm have none.
"""
from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx import GraphModule, Node

from fxpar.passes.frontend.grouped_gemm import EXPERT_BMM, expert_bmm_form, grouped_form
from fxpar.passes.ir.meta import FXPAR_ORIGIN, param_nodes
from fxpar.passes.ir.op_families import TRANSPOSES

aten = torch.ops.aten


def _transposed_weight(n, params: set[Node]) -> Node | None:
    """W when n is a transpose of a 2-D weight parameter W (t, .T, transpose(0, 1), permute([1, 0]))."""
    if not isinstance(n, Node) or n.op != "call_function" or n.target not in TRANSPOSES:
        return None
    w = n.args[0]
    if w not in params or len(w.meta["val"].shape) != 2:
        return None
    if n.target is aten.transpose.int and sorted(d % 2 for d in n.args[1:3]) != [0, 1]:
        return None
    if n.target is aten.permute.default and [d % 2 for d in n.args[1]] != [1, 0]:
        return None
    return w


def _einsum_form(n: Node, params: set[Node]) -> tuple[Node, Node, bool] | None:
    """(x, W, stored_out_in) when n is einsum('<A>c,cf-><A>f' or '<A>c,fc-><A>f', x, W) with W a 2-D parameter."""
    eq, operands = n.args[0], n.args[1]
    if len(operands) != 2 or "->" not in eq or "." in eq:
        return None
    ins, out = eq.replace(" ", "").split("->")
    sx, sw = ins.split(",")
    x, w = operands
    if w not in params or len(sw) != 2 or not sx or len(set(sx)) != len(sx):
        return None
    c = sx[-1]
    if sw[0] == c and sw[1] not in sx and out == sx[:-1] + sw[1]:
        return x, w, False
    if sw[1] == c and sw[0] not in sx and out == sx[:-1] + sw[0]:
        return x, w, True
    return None


def _call(gm: GraphModule, like: Node, target, args: tuple, val) -> Node:
    node = gm.graph.call_function(target, args)
    node.meta.update({k: like.meta[k] for k in ("nn_module_stack", "stack_trace") if k in like.meta})
    node.meta["val"] = val
    return node


def _fake(mode: FakeTensorMode, like, shape) -> torch.Tensor:
    """A value record of `shape` with like's dtype and device (made in this pass's own fake mode: the traced values'
    mode may be in use by another rank's thread; local_shapes re-propagates every value later)."""
    with mode:
        return torch.empty(shape, dtype=like.dtype, device=like.device)


def _as_mm(gm: GraphModule, n: Node, x: Node, w: Node, mode: FakeTensorMode) -> None:
    """n = x @ W with W [in, out] a parameter: mm on x folded to 2-D, then back to x's leading dims."""
    xv, wv = x.meta["val"], w.meta["val"]
    with gm.graph.inserting_before(n):
        if xv.dim() == 2:
            out = _call(gm, n, aten.mm.default, (x, w), n.meta["val"])
        else:
            lead, rows = list(xv.shape[:-1]), xv.numel() // xv.shape[-1]
            flat = _call(gm, n, aten.reshape.default, (x, [rows, xv.shape[-1]]), _fake(mode, xv, (rows, xv.shape[-1])))
            mm = _call(gm, n, aten.mm.default, (flat, w), _fake(mode, xv, (rows, wv.shape[1])))
            out = _call(gm, n, aten.view.default, (mm, lead + [wv.shape[1]]), n.meta["val"])
    out.meta[FXPAR_ORIGIN] = n.meta.get(FXPAR_ORIGIN)
    n.replace_all_uses_with(out)
    gm.graph.erase_node(n)


def _bias_apart(gm: GraphModule, n: Node, mode: FakeTensorMode) -> bool:
    """addmm(a, x, W, beta=β, alpha=α) as add(mm(x, W) * α, a * β), in place of n (which keeps its name and
    FXPAR_ORIGIN), unless a is a plain bias: a node of shape [out] with β = α = 1. The analysis then sees a GEMM
    and an elementwise add, each with its own rule, instead of an additive term it would shard like a bias."""
    a, x, w = n.args
    beta, alpha = n.kwargs.get("beta", 1), n.kwargs.get("alpha", 1)
    out = n.meta["val"]
    if beta == 1 and alpha == 1 and isinstance(a, Node) and tuple(a.meta["val"].shape) == (out.shape[-1],):
        return False
    with gm.graph.inserting_before(n):
        prod = _call(gm, n, aten.mm.default, (x, w), _fake(mode, out, out.shape))
        if alpha != 1:
            prod = _call(gm, n, aten.mul.Tensor, (prod, alpha), _fake(mode, out, out.shape))
        if beta != 1:
            a = _call(gm, n, aten.mul.Tensor, (a, beta), _fake(mode, out, a.meta["val"].shape))
    n.target, n.args, n.kwargs = aten.add.Tensor, (prod, a), {}
    return True


def _as_linear(gm: GraphModule, n: Node, x: Node, w: Node, bias=None) -> None:
    with gm.graph.inserting_before(n):
        out = _call(gm, n, aten.linear.default, (x, w) if bias is None else (x, w, bias), n.meta["val"])
    out.meta[FXPAR_ORIGIN] = n.meta.get(FXPAR_ORIGIN)
    n.replace_all_uses_with(out)
    gm.graph.erase_node(n)


def gemm_forms_pass(gm: GraphModule) -> GraphModule:
    """Rewrite every weight contraction of gm into a GEMM_WEIGHT_ARG form (see the module docstring); returns gm."""
    params = param_nodes(gm)
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    changed = False
    for n in list(gm.graph.nodes):
        if n.op == "call_function" and n.target is aten.addmm.default:
            changed |= _bias_apart(gm, n, mode)
    for n in list(gm.graph.nodes):
        if n.op != "call_function":
            continue
        if n.target in (aten.matmul.default, aten.mm.default) and isinstance(n.args[0], Node):
            x, b = n.args[0], n.args[1]
            if x.meta["val"].dim() < 2:
                continue
            w = _transposed_weight(b, params)
            if w is not None:
                _as_linear(gm, n, x, w)
            elif n.target is aten.matmul.default and b in params and b.meta["val"].dim() == 2:
                _as_mm(gm, n, x, b, mode)
            else:
                continue
        elif n.target is aten.addmm.default and _transposed_weight(n.args[2], params) is not None \
                and not n.kwargs and isinstance(n.args[0], Node) and n.args[0].meta["val"].dim() == 1:
            _as_linear(gm, n, n.args[1], _transposed_weight(n.args[2], params), n.args[0])
        elif (grouped := grouped_form(n, params)) is not None:
            n.target, n.args = grouped  # the same value: n keeps its name and FXPAR_ORIGIN
        elif (batched := expert_bmm_form(n, params)) is not None:
            n.target, n.args = EXPERT_BMM, batched
        elif n.target is aten.einsum.default and (form := _einsum_form(n, params)) is not None:
            x, w, out_in = form
            if x.meta["val"].dim() < 2:
                continue
            if out_in:
                _as_linear(gm, n, x, w)
            else:
                _as_mm(gm, n, x, w, mode)
        else:
            continue
        changed = True
    if changed:
        for n in reversed(list(gm.graph.nodes)):  # the transposes nobody reads any more
            if n.op == "call_function" and n.target in TRANSPOSES and not n.users:
                gm.graph.erase_node(n)
        gm.graph.lint()
        gm.recompile()
    return gm
