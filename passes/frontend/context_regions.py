"""Context regions inlined: `with torch.autocast(...)` and `with torch.no_grad()` inside a model's forward, as ops
the analysis can read.

torch.export records such a region as one higher-order op, `wrap_with_autocast(device, dtype, enabled, cache,
body, *inputs)`, whose body is a subgraph. No sharding rule sees into it, so a region around a rotary embedding or a
norm used to leave its whole attention replicated. This pass puts the body's ops in the graph in its place, between
`torch.amp.autocast_mode._enter_autocast(device, dtype, enabled, cache)` and `_exit_autocast(mode)`: the same
calls that enter and leave the context manager, at the same points, so the ops between run under the autocast state
the region set, as they did in the model (both calls are side-effectful to fx: no pass removes them). The region's
outputs are the body's; nothing is recomputed or cast.

A grad-mode region (`with torch.no_grad():`, `torch.set_grad_enabled(b)`: a looped model's inner steps run
without a gradient) is recorded as `wrap_with_set_grad_enabled(enabled, body, *inputs)` and inlined the same way,
between `prev = torch.is_grad_enabled()` with `torch._C._set_grad_enabled(enabled)` and
`torch._C._set_grad_enabled(prev)`: its ops run in the grad mode the model gave them, so what they output carries no
gradient, as before. The analysis may shard them like any op (a collective's backward there is never run).

[Note: passes keep regions whole]
    The enter and exit calls order nothing by data: a pass that moved an op out from between them would change the
    autocast state it runs under. fxpar's passes insert collectives and fused ops next to the nodes they replace and
    never hoist an op across other calls, and without `torch.autocast` around the call (fxpar's own mixed precision
    casts the weights instead) an `enabled=False` region is the state outside it anyway.
"""
from __future__ import annotations

import copy
import operator

import torch
from torch.fx import GraphModule, Node

WRAP = torch.ops.higher_order.wrap_with_autocast
GRAD = torch.ops.higher_order.wrap_with_set_grad_enabled
_enter, _exit = torch.amp.autocast_mode._enter_autocast, torch.amp.autocast_mode._exit_autocast  # in MODE_CALLS


def inline_context_pass(gm: GraphModule) -> GraphModule:
    """Inline every wrap_with_autocast and wrap_with_set_grad_enabled region of gm (see the module docstring);
    returns gm."""
    regions = [n for n in gm.graph.nodes if n.op == "call_function" and n.target in (WRAP, GRAD)]
    for node in regions:
        _inline(gm, node)
    if regions:
        gm.graph.eliminate_dead_code()  # the bodies' get_attr nodes
        for name, child in list(gm.named_children()):
            if isinstance(child, GraphModule) and not any(n.op == "get_attr" and n.target == name
                                                          for n in gm.graph.nodes):
                gm.delete_submodule(name)
        gm.graph.lint()
        gm.recompile()
    return gm


def _enter_and_exit(graph, node: Node):
    """Insert the calls that enter the region of `node` (before it); return the body's argument index, the region's
    kind and a function inserting the exit."""
    if node.target is WRAP:
        mode = graph.call_function(_enter, tuple(node.args[:4]))
        return 4, "autocast", lambda: graph.call_function(_exit, (mode,))
    prev = graph.call_function(torch.is_grad_enabled, ())
    graph.call_function(torch._C._set_grad_enabled, (node.args[0],))
    return 1, "grad-mode", lambda: graph.call_function(torch._C._set_grad_enabled, (prev,))


def _inline(gm: GraphModule, node: Node) -> None:
    env: dict[Node, object] = {}
    with gm.graph.inserting_before(node):
        at, kind, leave = _enter_and_exit(gm.graph, node)
        body_attr, inputs = node.args[at], node.args[at + 1:]
        body = inline_context_pass(copy.deepcopy(getattr(gm, body_attr.target)))  # a region nested in it first
        if any(n.op in ("get_attr", "call_module") for n in body.graph.nodes):
            raise ValueError(f"fxpar: the {kind} region {node.name} reads a module attribute inside its body; "
                             "pass the tensor in as an input of the region")
        outputs = ()
        for n in body.graph.nodes:
            if n.op == "placeholder":
                env[n] = inputs[len(env)]
            elif n.op == "output":
                outputs = n.args[0]
            else:
                env[n] = gm.graph.node_copy(n, lambda a: env[a])
                if not env[n].meta.get("nn_module_stack") and node.meta.get("nn_module_stack"):
                    env[n].meta["nn_module_stack"] = node.meta["nn_module_stack"]
        leave()
    results = [env[o] if isinstance(o, Node) else o for o in (outputs if isinstance(outputs, (tuple, list))
                                                                 else (outputs,))]
    for user in list(node.users):
        if user.op == "call_function" and user.target is operator.getitem:
            user.replace_all_uses_with(results[user.args[1]])
            gm.graph.erase_node(user)
    if node.users:
        raise ValueError(f"fxpar: the {kind} region {node.name} is read other than by index; cannot inline it")
    gm.graph.erase_node(node)
