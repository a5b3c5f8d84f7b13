"""The sequence-parallel rewrite: apply a SequenceAnalysis (passes/sharding/sequence_analysis.py) to the graph.

Each seed's all-reduce becomes a reduce-scatter along the sequence (g -> seq_reduce_scatter, the vocab-parallel
lookup -> its reduce-scattering form); each f that reads a sequence block becomes an all-gather (seq_gather); the
ops between run on the block, their shape constants made local; a replicated input they read enters as the rules
decided (scattered to its block, or through f: its gradient all-reduced); where an end reads a block, the block is
all-gathered first. Nodes keep their names; each carries its placement, so `fxpar show` prints what was decided.
The values' shapes are still those before this pass; the compiler's next stage propagates this rank's shapes.
"""
from __future__ import annotations

from torch.fx import GraphModule, Node

from fxpar.passes.ir.meta import FXPAR_COMM, FXPAR_PLACEMENT, Comm, comm_kind
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
    ins = Inserter(gm, seq, comm)
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
                node.replace_input_with(inp, ins.enter(inp, how, node))
            if d.role is Role.REDUCE:
                REWRITES[Role.REDUCE](gm, node, comm)
        elif node in seq.ends:
            for inp in node.all_input_nodes:
                block = seq.placements.get(inp)
                if isinstance(block, Shard):
                    node.replace_input_with(inp, ins.gather(inp, block, node))
    gm.graph.lint()
    gm.recompile()
    return gm


def _swap(gm: GraphModule, node: Node, kind: Comm, comm: TPComm, block: Shard, placement) -> None:
    """`node` calls a new collective of `kind` in place of its own: the same arguments, and the sequence blocks."""
    gm.delete_submodule(node.target)
    node.target = comm_module(gm, kind, comm)
    node.kwargs = {**node.kwargs, **spec_kwargs(block)}
    node.meta[FXPAR_COMM] = kind
    node.meta[FXPAR_PLACEMENT] = placement
