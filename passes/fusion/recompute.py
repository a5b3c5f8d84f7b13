"""Activation recomputation as a graph pass: regions of the per-rank graph run under torch.utils.checkpoint.

    full       every transformer layer's forward is recomputed in backward. Layers are the entries of the repeated
               blocks of passes/frontend/layers.py (h.0, h.1; model.layers.3).
    selective  only the attention core, from q @ k^T (or the SDPA call) to its output (Korthikanti et al. 2022,
               "Reducing Activation Recomputation in Large Transformer Models", section 5).

Each region is cut out of the graph into a sub-GraphModule and called as `self.recompute_<i>(*inputs)`, a
Checkpointed module that runs it through checkpoint(..., use_reentrant=False): its forward keeps only the region's
inputs, and backward reruns the region (with the forward's random state, so dropout draws the same mask) to get the
tensors it needs. Recomputation alone is bit-exact: the autograd graph and every kernel are the same.

[Note: collectives stay outside recomputed regions]
    A region never contains g (the forward all-reduce), the gather, the scatter or the vocab lookup: recomputing them
    would communicate twice. A layer is cut into segments at each such call (its Megatron g after attention and after
    the MLP), and each segment is its own region. f is allowed inside: its forward is the identity and its backward
    all-reduce runs once either way.

[Note: recomputation in the joint program]
    Under Config(joint_graph=True) the regions are not cut out: their nodes are tagged as torch's selective
    checkpointing tags them (meta["recompute"] = MUST_RECOMPUTE, one ac_graph_id per region), the joint export copies
    the tags onto the nodes traced from them, and the min-cut partitioner recomputes exactly those in the backward
    program instead of saving their outputs. What backward keeps is then a decision on the joint graph, read from
    the forward program's outputs. "selective" tags each GeLU as well: eagerly, bias_gelu_pass (a custom backward)
    recomputes it, which the joint trace would undo (its common-subexpression pass merges the recomputed GeLU
    with the forward's, which then must be saved).

Glossary: *region*, a set of nodes that is contiguous in graph order, so one call can stand for it; *segment*, the
part of a layer between two collectives. Collectives are recognised by their tag (meta[FXPAR_COMM]).
"""
from __future__ import annotations

import operator

import torch
import torch.nn as nn
from torch.fx import Graph, GraphModule, Node
from torch.utils.checkpoint import CheckpointPolicy, checkpoint

from fxpar.cost.flops import RECOMPUTE_MODES
from fxpar.passes.ir import kernels
from fxpar.passes.frontend.layers import Layers, find_layers
from fxpar.passes.ir.meta import FXPAR_PLACEMENT, FXPAR_RANDOM, FXPAR_RECOMPUTE, comm_kind, copy_meta
from fxpar.passes.tensor_parallel.rng import streams_in
from fxpar.passes.ir.op_families import SDPA, SOFTMAX

aten = torch.ops.aten
_CUT = object()  # a collective: ends any region
_WORTH = SDPA | SOFTMAX | {  # ops that save activations: a region without one has nothing to recompute
    aten.linear.default, aten.mm.default, aten.addmm.default, aten.bmm.default, aten.matmul.default,
    aten.layer_norm.default, aten.native_layer_norm.default, aten.gelu.default, aten.silu.default,
    aten.relu.default, aten.tanh.default, aten.rsqrt.default, kernels.bias_gelu, kernels.bias_gelu_linear,
}


class Checkpointed(nn.Module):
    """Runs `body` through torch.utils.checkpoint (non-reentrant): backward recomputes its activations.

    The random streams its random ops draw from ([Note: random streams] in rng.py) are replayed too: their states at
    the forward are restored for the recompute (and put back after), so every mask is drawn again identically."""

    def __init__(self, body: GraphModule):
        super().__init__()
        self.body = body
        self.__dict__["streams"] = streams_in(body)  # not submodules: shared with the rest of the graph

    def forward(self, *args):
        if not self.streams:
            return checkpoint(self.body, *args, use_reentrant=False)
        at_forward = [s.get_states() for s in self.streams]
        calls = [0]

        def body(*inputs):
            calls[0] += 1
            if calls[0] == 1:
                return self.body(*inputs)
            now = [s.get_states() for s in self.streams]
            for s, states in zip(self.streams, at_forward):
                s.set_states(states)
            try:
                return self.body(*inputs)
            finally:
                for s, states in zip(self.streams, now):
                    s.set_states(states)

        return checkpoint(body, *args, use_reentrant=False)


def _is_cut(n: Node) -> bool:
    """A collective that moves data forward ([Note: collectives stay outside recomputed regions]), or any module
    call that is neither a collective nor a random op on its stream (it might be one, or a region already)."""
    kind = comm_kind(n)
    moves_data = kind is None or not kind.info.forward_identity
    return n.op == "call_module" and moves_data and FXPAR_RANDOM not in n.meta


def _layer_keys(gm: GraphModule, layers: Layers) -> dict[Node, str | None]:
    """Layer of every call node; collectives cut; a node that a pass inserted (no module stack) joins its layer
    when the calls around it agree (the bias after g, f before a GEMM)."""
    keys: dict[Node, str | None] = {}
    prev, pending = None, []
    for n in gm.graph.nodes:
        if n.op not in ("call_function", "call_module"):
            continue
        if _is_cut(n):
            keys.update(dict.fromkeys(pending + [n]))
            prev, pending = _CUT, []
        elif not n.meta.get("nn_module_stack"):
            pending.append(n)
        else:
            key = layers.layer(n)
            keys.update(dict.fromkeys(pending, key if prev in (key, _CUT) and key is not None else None))
            keys[n], prev, pending = key, key, []
    keys.update(dict.fromkeys(pending))
    return keys


def _full_regions(gm: GraphModule, layers: Layers) -> list[tuple[str, list[Node]]]:
    """Maximal runs of consecutive call nodes of one layer (collectives end a run)."""
    keys, runs, current, key = _layer_keys(gm, layers), [], [], None
    for n in gm.graph.nodes:
        if n not in keys:
            continue  # placeholders, get_attr, output: inputs, not members
        if keys[n] != key or keys[n] is None:
            if current and key is not None:
                runs.append((key, current))
            current, key = [], keys[n]
        if key is not None:
            current.append(n)
    if current and key is not None:
        runs.append((key, current))
    return [(f"full:{k}", nodes) for k, nodes in runs if any(_worth(n) for n in nodes)]


def _worth(n: Node) -> bool:
    return n.op == "call_function" and n.target in _WORTH


def _shape(n) -> tuple | None:
    v = n.meta.get("val") if isinstance(n, Node) else None
    return tuple(v.shape) if isinstance(v, torch.Tensor) else None


def _attention_core(softmax: Node) -> set[Node] | None:
    """Nodes from the scores matmul (q @ k^T) to the output matmul (probs @ v) around a softmax."""
    want, scores, seen, work = _shape(softmax), None, set(), [softmax.args[0]]
    while work and scores is None and len(seen) < 8:  # back through scale and mask to q @ k^T
        t = work.pop(0)
        if not isinstance(t, Node) or t.op != "call_function" or t in seen:
            continue
        seen.add(t)
        if t.target is aten.matmul.default and _shape(t) == want:
            scores = t
        work.extend(t.all_input_nodes)
    t = softmax
    for _ in range(3):  # forward through a cast and dropout to probs @ v
        if len(t.users) != 1:
            return None
        u = next(iter(t.users))
        if u.op == "call_function" and u.target is aten.matmul.default and u.args[0] is t:
            return _between(scores, u) if scores is not None else None
        t = u
    return None


def _between(src: Node, dst: Node) -> set[Node]:
    """Nodes on some path src -> dst, both included (a convex set)."""
    down, work = {src}, [src]
    while work:
        for u in work.pop().users:
            if u not in down:
                down.add(u)
                work.append(u)
    up, work = {dst}, [dst]
    while work:
        for a in work.pop().all_input_nodes:
            if a not in up:
                up.add(a)
                work.append(a)
    return down & up


def _random_sdpa(gm: GraphModule, n: Node) -> bool:
    """An SDPA with dropout, on its random stream (a call of passes/tensor_parallel/rng.py's ForkedRandom)."""
    return n.op == "call_module" and FXPAR_RANDOM in n.meta and getattr(gm.get_submodule(n.target), "op", None) in SDPA


def _selective_regions(gm: GraphModule, layers: Layers, tag: bool = False) -> list[tuple[str, list[Node]]]:
    """The attention cores; tagged for the joint program, each GeLU too (what bias_gelu_pass recomputes eagerly)."""
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    regions = []
    for n in gm.graph.nodes:
        core = None
        if n.op == "call_function" and n.target in SDPA or _random_sdpa(gm, n):
            core = {n}
        elif tag and n.op == "call_function" and n.target is aten.gelu.default:
            core = {n}
        elif n.op == "call_function" and n.target in SOFTMAX:
            core = _attention_core(n)
        if core:
            label = f"selective:{layers.layer(n) or n.name}"
            regions.append((label, sorted(core, key=order.__getitem__)))
    return regions


def _make_contiguous(gm: GraphModule, nodes: list[Node]) -> list[Node]:
    """Move the nodes interleaved with a convex region out of its span: those that do not depend on the region go
    before it, the others after it. Returns the region's nodes in their (unchanged) relative order."""
    inside = set(nodes)
    first, last = nodes[0], nodes[-1]
    span, n = [], first.next
    while n is not last and first is not last:
        span.append(n)
        n = n.next
    tainted, after = set(inside), []
    for n in span:
        if n in inside:
            continue
        if any(a in tainted for a in n.all_input_nodes):
            tainted.add(n)
            after.append(n)
        else:
            first.prepend(n)
    for n in reversed(after):
        last.append(n)
    return nodes


def _extract(gm: GraphModule, nodes: list[Node], name: str, label: str) -> None:
    """Replace the contiguous `nodes` by `self.<name>(*inputs)`, a Checkpointed sub-GraphModule, and getitems."""
    inside = set(nodes)
    inputs: list[Node] = []
    for n in nodes:
        inputs += [a for a in n.all_input_nodes if a not in inside and a not in inputs]
    outputs = [n for n in nodes if any(u not in inside for u in n.users)]
    sub, env = Graph(), {}
    for a in inputs:
        env[a] = sub.placeholder(a.name)
        env[a].meta = dict(a.meta)
    for n in nodes:
        env[n] = sub.node_copy(n, env.__getitem__)
    sub.output(tuple(env[o] for o in outputs))
    gm.add_submodule(name, Checkpointed(GraphModule(gm, sub, class_name=f"Recompute_{name}")))
    with gm.graph.inserting_before(nodes[0]):
        call = gm.graph.call_module(name, tuple(inputs))
        call.meta[FXPAR_RECOMPUTE] = label
        call.meta["val"] = tuple(o.meta.get("val") for o in outputs)
        if all(FXPAR_PLACEMENT in o.meta for o in outputs):
            call.meta[FXPAR_PLACEMENT] = tuple(o.meta[FXPAR_PLACEMENT] for o in outputs)
        stack = next((n.meta["nn_module_stack"] for n in nodes if n.meta.get("nn_module_stack")), None)
        if stack is not None:  # the region's layer, so the pipeline partition keeps it with its layer
            call.meta["nn_module_stack"] = stack
        getters = [gm.graph.call_function(operator.getitem, (call, i)) for i in range(len(outputs))]
    for o, get in zip(outputs, getters):
        copy_meta(o, get)
        o.replace_all_uses_with(get, delete_user_cb=lambda u: u not in inside)
    for n in reversed(nodes):
        gm.graph.erase_node(n)


def recompute_pass(gm: GraphModule, mode: str, tag: bool = False) -> GraphModule:
    """Checkpoint the layers ("full") or the attention cores ("selective") of `gm`; "none" returns gm untouched.

    tag: mark the regions' nodes instead ([Note: recomputation in the joint program]): the joint program's
    partitioner (passes/joint/export.py) then recomputes them in backward rather than saving them.

    Pattern: full, the calls of one transformer layer between collectives; selective, an SDPA call or the nodes
    between q @ k^T and probs @ v around a softmax. Safe: checkpoint keeps the region's inputs, recomputes its
    forward in backward with the saved random state, and leaves the autograd graph as it was, so loss and gradients
    are bit-identical; collectives stay outside ([Note: collectives stay outside recomputed regions]).
    Returns gm, rewritten in place (untouched when no region was found).
    """
    if mode not in RECOMPUTE_MODES:
        raise ValueError(f"recompute_pass: mode must be one of {RECOMPUTE_MODES}, got {mode!r}. "
                         "Fix: Config(recompute=...)")
    if mode == "none":
        return gm
    layers = find_layers(gm)
    if mode == "full" and layers.main is None:
        raise ValueError("fxpar recompute='full' checkpoints each transformer layer, but this model has no layer "
                         "list (no ModuleList or Sequential of at least two layers in nn_module_stack).\n"
                         "Fix: Config(recompute='selective') to recompute the attention cores, or 'none'.")
    regions = _full_regions(gm, layers) if mode == "full" else _selective_regions(gm, layers, tag)
    start = sum(1 for n, _ in gm.named_children() if n.startswith("recompute_"))
    for i, (label, nodes) in enumerate(regions):
        if tag:
            for n in nodes:  # torch copies both onto the joint nodes traced from n
                n.meta.update({"recompute": CheckpointPolicy.MUST_RECOMPUTE, "ac_graph_id": start + i,
                               FXPAR_RECOMPUTE: label})
            continue
        _extract(gm, _make_contiguous(gm, nodes), f"recompute_{start + i}", label)
    if regions and not tag:
        gm.graph.lint()
        gm.recompile()
    return gm
