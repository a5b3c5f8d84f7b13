"""The sequence-parallel rewrite: apply a SequenceAnalysis (passes/sharding/sequence_analysis.py) to the graph.

Each seed's all-reduce becomes a reduce-scatter along the sequence (g -> seq_reduce_scatter, the vocab-parallel
lookup -> its reduce-scattering form); each f that reads a sequence block becomes an all-gather (seq_gather); the
ops between run on the block, their shape constants made local; a replicated input they read enters as the rules
decided (scattered to its block, or through f: its gradient all-reduced); where an end reads a block, the block is
all-gathered first. Nodes keep their names; each carries its placement, so `fxpar show` prints what was decided.
The values' shapes are still those before this pass; the compiler's next stage propagates this rank's shapes.

gathered_gemms_pass then joins each all-gather whose every reader is a GEMM into one op with them: it saves the
block for backward and gathers it again there, so a layer keeps 1/t of its regions' inputs, as Megatron does.
"""
from __future__ import annotations

import operator

import torch
from torch.fx import GraphModule, Node

from fxpar.passes.frontend.layers import find_layers
from fxpar.passes.ir.op_families import gemm_reading, rows_as_2d
from fxpar.passes.ir.meta import (FXPAR_COMM, FXPAR_PLACEMENT, PARAMETER, Comm, comm_kind, copy_meta, input_of,
                                  module_path)
from fxpar.passes.ir.placements import Replicate, Shard
from fxpar.passes.sharding.rules import Role
from fxpar.passes.sharding.sequence_analysis import SequenceAnalysis
from fxpar.passes.tensor_parallel.collectives import TPComm
from fxpar.passes.tensor_parallel.rewrite import REWRITES, Inserter, comm_module, spec_kwargs

_SEED_FORM = {Comm.G: Comm.SEQ_REDUCE_SCATTER, Comm.VOCAB_EMBEDDING: Comm.VOCAB_EMBEDDING_SEQ}


def sequence_parallel_pass(gm: GraphModule, seq: SequenceAnalysis, comm: TPComm) -> GraphModule:
    """Rewrite `gm` in place as `seq` decided; returns gm (unchanged where sequence parallelism was not applied)."""
    if not seq.applied:
        return gm
    ins, weights = Inserter(gm, seq, comm), {}
    for node, block in seq.seeds.items():
        _swap(gm, node, _SEED_FORM[comm_kind(node)], comm, block, block)
    for node, block in seq.entries.items():
        _swap(gm, node, Comm.SEQ_GATHER, comm, block, Replicate())
    for node in list(gm.graph.nodes):
        d = seq.decisions.get(node)
        if d is not None:
            node.meta[FXPAR_PLACEMENT] = d.out
            if d.args is not None:
                node.args = d.args
            if d.target is not None:
                node.target = d.target
            for inp, how in d.enter.items():
                if how is None and inp.op == "placeholder" and input_of(inp).kind == PARAMETER:
                    weights.setdefault(node, []).append(inp)  # through its layer's seq_weights, below
                else:
                    node.replace_input_with(inp, ins.enter(inp, how, node))
            if d.role is Role.REDUCE:
                REWRITES[Role.REDUCE](gm, node, comm)
        elif node in seq.ends:
            for inp in node.all_input_nodes:
                block = seq.placements.get(inp)
                if isinstance(block, Shard):
                    node.replace_input_with(inp, ins.gather(inp, block, node))
    _weights_by_layer(gm, weights, comm)
    gm.graph.lint()
    gm.recompile()
    return gm


def _weights_by_layer(gm: GraphModule, readers: dict[Node, list[Node]], comm: TPComm) -> None:
    """The weights read on sequence blocks enter through f, one seq_weights per layer and grad-mode span (its
    gradients all-reduced as one tensor, when the layer's backward is done), placed before the first reader in it: a
    layer's weights stay in the layer's pipeline chunk. [Note: seq_weights per grad-mode span]"""
    layers, spans, groups = find_layers(gm), _grad_mode_spans(gm), {}
    for node, ws in readers.items():
        groups.setdefault((_layer_of(node, layers), spans[node]), {}).setdefault(node, ws)
    for group in groups.values():
        unique, first = list(dict.fromkeys(w for ws in group.values() for w in ws)), next(iter(group))
        with gm.graph.inserting_before(first):
            f = gm.graph.call_module(comm_module(gm, Comm.SEQ_WEIGHTS, comm), tuple(unique))
            outs = {w: gm.graph.call_function(operator.getitem, (f, i)) for i, w in enumerate(unique)}
        f.meta.update({FXPAR_COMM: Comm.SEQ_WEIGHTS, FXPAR_PLACEMENT: tuple(Replicate() for _ in unique)})
        for node in (f, *outs.values()):  # in its readers' layer (a pipeline chunk keeps it)
            copy_meta(first, node, keys=("nn_module_stack",))
        for w, out in outs.items():
            copy_meta(w, out, keys=("val",))
            out.meta[FXPAR_PLACEMENT] = Replicate()
        for node, ws in group.items():
            for w in ws:
                node.replace_input_with(w, outs[w])


def _grad_mode_spans(gm: GraphModule) -> dict[Node, int]:
    """Each node's grad-mode span: how many grad-mode calls run before it.

    [Note: seq_weights per grad-mode span]
        A looped block reads its layer's weights in every application, and a recurrent-depth model runs the early
        ones under `torch.no_grad()` (passes/frontend/context_regions.py). One seq_weights placed before the first
        application would run under no_grad: its outputs would carry no gradient, and the application that trains
        would read weights whose partial-sum gradient is never all-reduced (or never reaches the weight at all).
        Each span gets its own, made in the grad mode of the readers it feeds; within a span, one seq_weights
        serves every application (its backward all-reduces the sum of their gradients, which is linear)."""
    spans, count = {}, 0
    for n in gm.graph.nodes:
        if n.op == "call_function" and n.target is torch._C._set_grad_enabled:
            count += 1
        spans[n] = count
    return spans


def _layer_of(node: Node, layers) -> str:
    """The layer of a node (outside the layers: its module's path), or that of the nearest node it is computed from
    that has a module (a node a pass inserted, the bias after g, has none of its own)."""
    todo, seen = [node], set()
    while todo:
        n = todo.pop(0)
        if n in layers.entry_of:
            return layers.entry_of[n]
        if n.meta.get("nn_module_stack"):
            return module_path(n)
        seen.add(n)
        todo += [a for a in n.all_input_nodes if a not in seen and a.op != "placeholder"]
    return ""


def _swap(gm: GraphModule, node: Node, kind: Comm, comm: TPComm, block: Shard, placement) -> None:
    """`node` calls a new collective of `kind` in place of its own: the same arguments, and the sequence blocks."""
    gm.delete_submodule(node.target)
    node.target = comm_module(gm, kind, comm)
    node.kwargs = {**node.kwargs, **spec_kwargs(block)}
    node.meta[FXPAR_COMM] = kind
    node.meta[FXPAR_PLACEMENT] = placement


def gathered_gemms_pass(gm: GraphModule, comm: TPComm) -> GraphModule:
    """Each seq_gather read only by GEMMs (aten.linear, as their input) becomes one seq_gather_linear call whose
    outputs replace the GEMMs' (passes/tensor_parallel/collectives.py GatherSequenceLinear); returns gm."""
    changed = False
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    for node in list(gm.graph.nodes):
        if comm_kind(node) != Comm.SEQ_GATHER:
            continue
        flat = rows_as_2d(node)  # the rows flattened to 2-D first (a GEMM spelled on rows: GPT-2's Conv1D)
        reader = flat or node
        gemms = sorted(reader.users, key=order.get)
        forms = [gemm_reading(u, reader) for u in gemms]
        if not gemms or None in forms:
            continue
        weights = [w for form in forms for w in form[1:]]
        if any(isinstance(w, Node) and order[w] > order[gemms[0]] for w in weights):
            continue  # a weight computed after the first GEMM: the joined op could not run where it stands
        with gm.graph.inserting_before(gemms[0]):
            fused = gm.graph.call_module(comm_module(gm, Comm.SEQ_GATHER_LINEAR, comm), node.args,
                                         {"weights": weights, "kinds": tuple(f[0] for f in forms), **node.kwargs,
                                          "flat": flat is not None})
            outs = [gm.graph.call_function(operator.getitem, (fused, i)) for i in range(len(gemms))]
        copy_meta(gemms[0], fused, keys=("nn_module_stack", "stack_trace"))
        fused.meta.update({FXPAR_COMM: Comm.SEQ_GATHER_LINEAR, "val": tuple(u.meta.get("val") for u in gemms),
                           FXPAR_PLACEMENT: tuple(u.meta.get(FXPAR_PLACEMENT) for u in gemms)})
        for gemm, out in zip(gemms, outs):
            copy_meta(gemm, out, keys=tuple(gemm.meta))
            gemm.replace_all_uses_with(out)
            gm.graph.erase_node(gemm)
        if flat is not None:
            gm.graph.erase_node(flat)
        gm.graph.erase_node(node)
        gm.delete_submodule(node.target)
        changed = True
    if changed:
        gm.graph.lint()
        gm.recompile()
    return gm
