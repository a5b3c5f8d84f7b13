"""Canonicalization of the traced program, before any analysis: one placeholder per tensor, no metadata asserts.

torch.export lifts a tied parameter once per name: GPT-2's `wte.weight` and `lm_head.weight` are two placeholders
of one tensor. Left so, the analysis would see two parameters, each with fewer uses than the tensor has, and could
shard one name while the other reads the whole tensor ([Note: every use is proven] in analysis.py). This pass gives
each tensor one placeholder: the uses of every alias move to the canonical one (the model's first name for the
tensor, which is also where the executable registers it), and the aliases are erased.
"""
from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx import GraphModule, Node

from fxpar.passes.ir.aliasing import Storage
from fxpar.passes.ir.meta import FXPAR_INPUT, GraphInput, input_of, placeholders
from fxpar.passes.ir.op_families import LOG_SOFTMAX, METADATA_ASSERTS, ROW_VIEWS


def merge_aliases_pass(gm: GraphModule, canonical: dict[str, str]) -> GraphModule:
    """Merge placeholders whose state keys name one tensor; `canonical` maps every key to its tensor's first key.

    Returns gm (rewritten in place when something was merged)."""
    kept: dict[str, object] = {}
    merged = 0
    for n in placeholders(gm):
        gi = input_of(n)
        if not gi.is_state:
            continue
        key = canonical.get(gi.key, gi.key)
        if key not in kept:
            kept[key] = n
            if gi.key != key:
                n.meta[FXPAR_INPUT] = GraphInput(gi.kind, key)
            continue
        n.replace_all_uses_with(kept[key])
        gm.graph.erase_node(n)
        merged += 1
    if merged:
        gm.graph.lint()
        gm.recompile()
    return gm


# Nodes that only check a tensor's metadata (op_families.METADATA_ASSERTS) against what was traced and compute nothing. torch.export emits one for
# every `.to(dtype)`, `.float()` and `.type_as` (rotary tables upcast, norms computed in fp32); each has no users.
# The traced program keeps them (verify runs it); the working copy drops them, so that a shard, whose local size
# differs from the traced one, does not meet an assert about the global size, and no region is refused for them.
def drop_metadata_asserts_pass(gm: GraphModule) -> GraphModule:
    """Erase the metadata-only asserts (METADATA_ASSERTS) of gm; returns gm."""
    dropped = [n for n in gm.graph.nodes if n.op == "call_function" and n.target in METADATA_ASSERTS and not n.users]
    for n in dropped:
        gm.graph.erase_node(n)
    if dropped:
        gm.graph.lint()
        gm.recompile()
    return gm


def view_as_pass(gm: GraphModule) -> GraphModule:
    """`x.view_as(other)` -> `x.view(other's traced shape)`: other is read for its shape only, and a view with its
    shape spelled out is what the reshape rule localizes (passes/sharding/view_rules.py). Returns gm."""
    changed = False
    for n in gm.graph.nodes:
        if n.op == "call_function" and n.target is torch.ops.aten.view_as.default:
            shape = [int(d) for d in n.args[1].meta["val"].shape]
            n.target, n.args, n.kwargs = torch.ops.aten.view.default, (n.args[0], shape), {}
            changed = True
    if changed:
        gm.graph.lint()
        gm.recompile()
    return gm


def _functional(target):
    """aten's out-of-place twin of an in-place overload (`add_.Tensor` -> `add.Tensor`), or None. By aten's naming
    convention (which functionalization relies on) the twin computes the same values into a new tensor."""
    schema = getattr(target, "_schema", None)
    name = schema.name.split("::")[-1] if schema is not None else ""
    if not name.endswith("_") or name.startswith("_") or not schema.arguments \
            or not (schema.arguments[0].alias_info and schema.arguments[0].alias_info.is_write) \
            or torch.Tag.nondeterministic_seeded in target.tags:  # random draws keep their form (their streams)
        return None
    packet = getattr(torch.ops.aten, name[:-1], None)
    return getattr(packet, target._overloadname, None) if packet is not None else None


def fresh_in_place_pass(gm: GraphModule) -> GraphModule:
    """`y = a.add_(b)` -> `y = a.add(b)` where `a` is a fresh tensor (an op's new result, not a view, an input or a
    state tensor) that nothing but this op reads: no one can observe the write, so its value is the out-of-place
    op's, also for autograd. Only where the out-of-place result has the in-place one's shape and dtype (no
    broadcast of `a`, no type promotion). The rules then see the op they know; an in-place op anywhere else stays
    as written (Hugging Face's experts add their bias in place to a grouped GEMM's output). Returns gm."""
    storage, changed = Storage(), False
    for n in list(gm.graph.nodes):
        twin = _functional(n.target) if n.op == "call_function" else None
        a = n.args[0] if n.args else None
        if twin is None or not isinstance(a, Node) or a.op != "call_function" or len(a.users) != 1 \
                or storage.roots(a) != frozenset({a}):
            continue
        got = n.meta.get("val")
        args = torch.fx.node.map_arg((n.args, n.kwargs), lambda x: x.meta.get("val"))
        try:
            with FakeTensorMode(allow_non_fake_inputs=True) as mode:
                args = torch.utils._pytree.tree_map(
                    lambda v: mode.from_tensor(v) if isinstance(v, torch.Tensor) else v, args)
                want = twin(*args[0], **args[1])
        except Exception:  # noqa: BLE001 - an op the fake mode cannot run keeps its in-place form
            continue
        if not isinstance(got, torch.Tensor) or not isinstance(want, torch.Tensor) \
                or want.shape != got.shape or want.dtype != got.dtype:
            continue
        n.target = twin
        changed = True
    if changed:
        gm.graph.lint()
        gm.recompile()
    return gm


def cross_entropy_pass(gm: GraphModule) -> GraphModule:
    """`nll_loss(log_softmax(x, -1).view(-1, V), y, ...)` -> `cross_entropy_loss(x.view(-1, V), y, ...)`: ATen's
    cross-entropy is exactly that composition (log_softmax over the class dim, then nll_loss_nd), so the value is the
    same bit for bit, and the loss has one spelling that the vocab-parallel rule knows (passes/sharding/loss_rules.py).
    Only where the log-probabilities feed the nll_loss alone, through views that keep the class dim last, and the
    nll's input is [N, V] or [V]. Returns gm."""
    changed = False
    for n in list(gm.graph.nodes):
        if n.op != "call_function" or n.target is not torch.ops.aten.nll_loss_nd.default or n.kwargs:
            continue
        chain, x = [], n.args[0]
        while x.op == "call_function" and x.target in ROW_VIEWS and len(x.users) == 1 \
                and x.meta["val"].shape[-1] == x.args[0].meta["val"].shape[-1]:
            chain.append(x)
            x = x.args[0]
        if x.op != "call_function" or x.target not in LOG_SOFTMAX or len(x.users) != 1 \
                or n.args[0].meta["val"].dim() > 2:
            continue
        src, dim = x.args[0], x.args[1]
        if dim % src.meta["val"].dim() != src.meta["val"].dim() - 1 or x.target is torch.ops.aten._log_softmax.default \
                and x.args[2]:
            continue
        if x.target is torch.ops.aten.log_softmax.int and (x.args[2:] or x.kwargs.get("dtype")):
            continue  # a dtype cast inside the log_softmax: keep it as written
        (chain[-1] if chain else n).replace_input_with(x, src)
        gm.graph.erase_node(x)
        n.target = torch.ops.aten.cross_entropy_loss.default
        n.args = (*n.args[:5], *[None, 1, -100][len(n.args) - 2:], 0.0)
        changed = True
    if changed:
        gm.graph.lint()
        gm.recompile()
    return gm
