"""Typed graph metadata: what the stages of the compiler tell each other through node.meta, never through names.

Every key is a module constant here, so a pass reads `n.meta.get(FXPAR_COMM)` rather than guessing from a node or
submodule name. Glossary of the keys:

    FXPAR_INPUT      on every placeholder: the GraphInput it stands for (a parameter, buffer, constant, user input
                     or a value received from the previous pipeline chunk).
    FXPAR_ORIGIN     on every node of the traced graph and its rewritten copies: the name of the node of the traced
                     (reference) program whose value this node computes. Inserted nodes have none.
    FXPAR_PLACEMENT  after the tensor-parallel pass, on every node: its Placement on this rank's tp group
                     (Replicate, Partial, Shard, or a tuple of them for multi-output nodes).
    FXPAR_COMM       on the nodes that call a collective module: its kind, a Comm.
    FXPAR_FUSED      on the nodes a fusion made: the fusion's name ("sdpa", "bias_gelu_linear", ...).
    FXPAR_RECOMPUTE  on the call of a checkpointed region: "full:<layer>" or "selective:<layer>".
    FXPAR_RANDOM     on a random op's call: the stream it draws from ("replicated" or "sharded",
    passes/tensor_parallel/rng.py). FXPAR_SCALE      on an f of a per-token factor that scales a partial sum (a routing
    weight, passes/tensor_parallel/merge_comm.py):
                     it all-reduces a few values per token, not an activation.
    FXPAR_ASSUMES    on a node a fusion made from concrete buffer values (a mask proven causal): the GraphInputs
                     whose values it relied on; the executable checks them before each call.

[Note: one resolver] A graph's placeholders are resolved to tensors in exactly one place, `resolve_inputs`, from
the GraphInput records: the executable, the pipeline chunks, verify and the fusion pass's buffer values all go
through it.
"""
from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Mapping, Sequence

from torch.fx import GraphModule, Node

FXPAR_INPUT = "fxpar_input"
FXPAR_ORIGIN = "fxpar_origin"
FXPAR_PLACEMENT = "fxpar_placement"
FXPAR_COMM = "fxpar_comm"
FXPAR_FUSED = "fxpar_fused"
FXPAR_RECOMPUTE = "fxpar_recompute"
FXPAR_RANDOM = "fxpar_random"
FXPAR_ASSUMES = "fxpar_assumes"
FXPAR_SCALE = "fxpar_scale"
FXPAR_NODE = "fxpar_node"  # meta["custom"] key of a joint program's node: the chunk graph's node it was traced from

class Comm(str, Enum):
    """The collectives the tensor-parallel pass inserts (their modules: passes/tensor_parallel/rewrite.py COMM_MODULES),
    one per call_module node, whose meta[FXPAR_COMM] holds it. A str: a kind equals its name ("f" == Comm.F). What each
    does, and what it moves, is COMM_TABLE's: the rewrite, the audit, recomputation and `fxpar show` all read it."""

    F = "f"
    G = "g"
    STAT = "stat"
    GATHER = "gather"
    SCATTER = "scatter"
    VOCAB_EMBEDDING = "vocab_embedding"
    VOCAB_CROSS_ENTROPY = "vocab_cross_entropy"
    VOCAB_LOGSUMEXP = "vocab_logsumexp"
    VOCAB_GATHER = "vocab_gather"
    SEQ_GATHER = "seq_gather"  # f under sequence parallelism (passes/tensor_parallel/sequence_parallel.py)
    SEQ_REDUCE_SCATTER = "seq_reduce_scatter"  # g under sequence parallelism
    VOCAB_EMBEDDING_SEQ = "vocab_embedding_seq"  # the vocab-parallel lookup, reduce-scattered along the sequence
    SEQ_GATHER_LINEAR = "seq_gather_linear"  # seq_gather and the GEMMs that read it: the block saved, not the whole
    SEQ_WEIGHTS = "seq_weights"  # f of the weights a layer reads on sequence blocks: one all-reduce of their gradients

    __str__ = str.__str__  # prints as its name, in f-strings too
    __format__ = str.__format__

    @property
    def info(self) -> CommInfo:
        return COMM_TABLE[self]


# the collectives a Comm runs (CommInfo.runs), as the communication ledger names them
ALL_REDUCE, ALL_GATHER, REDUCE_SCATTER = "all-reduce", "all-gather", "reduce-scatter"
REGATHER = "all-gather again"  # in backward, of the block saved in forward (seq_gather_linear, as Megatron does)


@dataclass(frozen=True)
class CommInfo:
    text: str  # what it does, forward and backward, as `fxpar show` says it
    # the collectives it runs in forward and in backward, in order, where it moves an activation forward or its
    # gradient backward (g: ((all-reduce,), ())); none where it moves a few values per token or a weight's
    # gradient (statistics, the vocabulary's, seq_weights: the ledger's "small")
    runs: tuple[tuple[str, ...], tuple[str, ...]] = ((), ())
    forward_identity: bool = False  # its forward moves no data (allowed inside a recomputed region)
    # a vocab-parallel op that replaces the op of the same role (passes/tensor_parallel/vocab_kernels.py)
    vocab: bool = False


COMM_TABLE = {
    Comm.F: CommInfo("f: all-reduce in backward", ((), (ALL_REDUCE,)), forward_identity=True),
    Comm.G: CommInfo("g: all-reduce", ((ALL_REDUCE,), ())),
    Comm.STAT: CommInfo("all-reduce of a partial statistic (identity in backward)"),
    Comm.GATHER: CommInfo("all-gather", ((ALL_GATHER,), ())),
    Comm.SCATTER: CommInfo("scatter (all-gather in backward)", ((), (ALL_GATHER,))),
    Comm.VOCAB_EMBEDDING: CommInfo("vocab lookup + all-reduce", vocab=True),
    Comm.VOCAB_CROSS_ENTROPY: CommInfo("vocab-parallel cross-entropy (max + sum all-reduces per token)", vocab=True),
    Comm.VOCAB_LOGSUMEXP: CommInfo("vocab-parallel logsumexp (max + sum all-reduces per token)", vocab=True),
    Comm.VOCAB_GATHER: CommInfo("vocab-parallel gather (sum all-reduce per token)", vocab=True),
    Comm.SEQ_GATHER: CommInfo("all-gather along the sequence (reduce-scatter in backward)",
                              ((ALL_GATHER,), (REDUCE_SCATTER,))),
    Comm.SEQ_REDUCE_SCATTER: CommInfo("reduce-scatter along the sequence (all-gather in backward)",
                                      ((REDUCE_SCATTER,), (ALL_GATHER,))),
    Comm.VOCAB_EMBEDDING_SEQ: CommInfo("vocab lookup + reduce-scatter along the sequence", vocab=True),
    Comm.SEQ_GATHER_LINEAR: CommInfo("all-gather along the sequence into GEMMs (reduce-scatter in backward; the "
                                     "block is saved and gathered again)",
                                     ((ALL_GATHER,), (REGATHER, REDUCE_SCATTER))),
    Comm.SEQ_WEIGHTS: CommInfo("f of a layer's weights read on sequence blocks: one all-reduce of their gradients",
                               forward_identity=True),
}

PARAMETER, BUFFER, CONSTANT, USER, BOUNDARY = "parameter", "buffer", "constant", "user", "boundary"
INPUT_KINDS = (PARAMETER, BUFFER, CONSTANT, USER, BOUNDARY)
STATE_KINDS = (PARAMETER, BUFFER)


@dataclass(frozen=True)
class GraphInput:
    """What one placeholder of a graph stands for.

    kind   parameter | buffer (key: the model's state_dict key), constant (key: the lifted constant's name),
           user (index: position among the flattened user inputs), boundary (index: position among the values
           received from the previous pipeline chunk; key: that value's node name, for messages)
    """

    kind: str
    key: str = ""
    index: int = -1

    def __post_init__(self):
        if self.kind not in INPUT_KINDS:
            raise ValueError(f"GraphInput kind must be one of {INPUT_KINDS}, got {self.kind!r}")
        if self.kind in (USER, BOUNDARY) and self.index < 0:
            raise ValueError(f"GraphInput of kind {self.kind} needs an index >= 0, got {self.index}")
        if self.kind in (PARAMETER, BUFFER, CONSTANT) and not self.key:
            raise ValueError(f"GraphInput of kind {self.kind} needs a key")

    @property
    def is_state(self) -> bool:
        return self.kind in STATE_KINDS


def input_of(node: Node) -> GraphInput:
    """The GraphInput of a placeholder (every placeholder of an fxpar graph has one)."""
    gi = node.meta.get(FXPAR_INPUT)
    if gi is None:
        raise KeyError(f"placeholder {node.name} has no {FXPAR_INPUT} record: the graph was not made by fxpar.trace")
    return gi


def placeholders(gm: GraphModule) -> list[Node]:
    return [n for n in gm.graph.nodes if n.op == "placeholder"]


def graph_inputs(gm: GraphModule) -> tuple[GraphInput, ...]:
    """The GraphInput of every placeholder of gm, in call order."""
    return tuple(input_of(n) for n in placeholders(gm))


def param_nodes(gm: GraphModule) -> set[Node]:
    """The placeholders of gm that are parameters."""
    return {n for n in placeholders(gm) if input_of(n).kind == PARAMETER}


def resolve_inputs(inputs: Sequence[GraphInput], state: Mapping[str, object], constants: Mapping[str, object],
                   user: Sequence = (), boundary: Sequence = ()) -> list:
    """The values to call a graph with, one per GraphInput ([Note: one resolver]).

    Args:
        state: tensors by state_dict key (parameters and buffers; tied keys may map to one tensor).
        constants: lifted tensor constants by name.
        user: the call's flattened user inputs; boundary: the values received from the previous chunk.
    """
    out = []
    for gi in inputs:
        if gi.kind in STATE_KINDS:
            out.append(state[gi.key])
        elif gi.kind == CONSTANT:
            out.append(constants[gi.key])
        elif gi.kind == USER:
            out.append(user[gi.index])
        else:
            out.append(boundary[gi.index])
    return out


def upstream(n: Node, through=lambda a: True):
    """n and the nodes it is computed from, each once, looking past a node's inputs only where through(node)."""
    seen, todo = {n}, [n]
    while todo:
        a = todo.pop()
        yield a
        if through(a):
            for b in a.all_input_nodes:
                if b not in seen:
                    seen.add(b)
                    todo.append(b)


def module_path(node: Node) -> str:
    """The path of the innermost module whose forward made the node (`model.layers.0.mlp`), or ""."""
    stack = node.meta.get("nn_module_stack") or {}
    return list(stack.values())[-1][0] if stack else ""


def comm_kind(node: Node) -> Comm | None:
    """The collective a node calls, or None."""
    return node.meta.get(FXPAR_COMM)


def copy_meta(src: Node, dst: Node, keys=("val", "nn_module_stack", "stack_trace", FXPAR_PLACEMENT)) -> None:
    """Copy the value-describing metadata of src to dst (a node that computes the same value)."""
    for key in keys:
        if key in src.meta:
            dst.meta[key] = src.meta[key]
