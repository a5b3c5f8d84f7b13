"""Partition: cut a (tensor-parallel) graph into p*v pipeline chunks at transformer-layer boundaries.

Glossary
    layer     an entry of the model's stacks of repeated modules (GPT's `h.N`, Llama's `model.layers.N`; T5's
              `encoder.block.N` then `decoder.block.N`): the sequence of passes/frontend/layers.py, found from
              nn_module_stack. Chunk.layers are positions in that sequence.
    chunk     a contiguous run of layers; chunk i runs on pipeline rank i mod p ([Note: boundaries carry placements]
    A value crosses a boundary as this rank holds it, with its placement (BoundaryValue.placement). Only Replicate
    values may use scatter/gather (each tp rank sends its 1/t, the receiver all-gathers): they are identical on
    every tp rank. A Shard value goes from tp rank i to tp rank i whole; a Partial value must be reduced (g) in its
    own chunk, which the proofs check.

[Note: pipeline ownership]).
              The embedding (everything before the first layer) joins chunk 0; the head and the model's outputs
              join the last chunk.
    boundary  the values a chunk hands to the next: every value made from parameters in an earlier chunk and used
              in a later one (usually just the residual stream). Values made only from the inputs, buffers and
              constants (masks, rotary tables, position ids) are not sent: each chunk recomputes its own copy.
              Each boundary value is described as data (BoundaryValue: name, this rank's local shape, dtype,
              placement), which is what the runtime allocates and the proofs compare.

Pattern: layers get a cost (GEMM FLOPs, plus elements for the rest), and a linear-partition DP splits them into p*v
contiguous chunks that minimize the most expensive chunk. Every layer lands in exactly one chunk, so a layer count
that p*v does not divide is balanced, never dropped. Why it is safe: each chunk's graph is the original nodes in
their original order; the boundary carries exactly the values that cross it, so chaining the chunks computes the
same function as the whole graph.

[Note: pipeline ownership]
    Chunk i belongs to pp rank i mod p. A parameter used by chunks on two ranks (tied embeddings) has one owner of
    record (the first) and both owners all-reduce its gradient after the flush.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch.fx import Graph, GraphModule, Node

from fxpar.passes.frontend.layers import calls_of, find_layers
from fxpar.passes.ir.meta import BOUNDARY, FXPAR_INPUT, FXPAR_PLACEMENT, GraphInput, copy_meta, input_of, param_nodes
from fxpar.passes.ir.placements import Placement, Replicate
from fxpar.passes.sharding.rules import GEMM_WEIGHT_ARG

aten = torch.ops.aten


@dataclass(frozen=True)
class BoundaryValue:
    """One value that crosses from a chunk to the next, as this rank holds it."""

    name: str  # its node's name in the rank's graph
    shape: tuple[int, ...]  # local shape
    dtype: torch.dtype
    placement: Placement

    @property
    def differentiable(self) -> bool:
        """Only floating values carry a gradient back."""
        return self.dtype.is_floating_point

    def __str__(self) -> str:
        return f"{self.name}: {self.placement} {'x'.join(map(str, self.shape))} {str(self.dtype).split('.')[-1]}"


@dataclass(frozen=True)
class Chunk:
    index: int
    gm: GraphModule
    inputs: tuple[GraphInput, ...]  # one per placeholder of gm: graph inputs, and BOUNDARY values received
    boundary_in: tuple[BoundaryValue, ...]  # what it receives from the previous chunk (BOUNDARY index order)
    boundary_out: tuple[BoundaryValue, ...]  # what it sends to the next chunk (empty for the last chunk)
    layers: tuple[int, ...]  # positions in Partition.entries


@dataclass(frozen=True)
class Partition:
    chunks: tuple[Chunk, ...]
    block: str  # the stacks' paths, e.g. "model.layers", or "encoder.block, decoder.block"
    layer_cost: tuple[float, ...]  # per layer, in sequence order
    entries: tuple[str, ...] = ()  # each layer's module path ("model.layers.3"), in sequence order

    def __post_init__(self):
        seen = [layer for c in self.chunks for layer in c.layers]
        if len(seen) != len(self.layer_cost) or seen != sorted(set(seen)):
            raise ValueError(f"partition must cover every layer once, in order; got {seen}")


def node_cost(n: Node) -> float:
    """FLOPs of a GEMM from its meta shapes; elements written for anything else."""
    v = n.meta.get("val")
    if not isinstance(v, torch.Tensor):
        return 0.0
    if n.target in GEMM_WEIGHT_ARG or n.target in (aten.matmul.default, aten.bmm.default):
        a = n.args[GEMM_WEIGHT_ARG[n.target][1]] if n.target in GEMM_WEIGHT_ARG else n.args[0]
        k = a.meta["val"].shape[-1] if isinstance(a, Node) and isinstance(a.meta.get("val"), torch.Tensor) else 1
        return 2.0 * v.numel() * k
    if n.target is aten.scaled_dot_product_attention.default:
        q = n.args[0].meta["val"]
        return 4.0 * q.numel() * n.args[1].meta["val"].shape[-2]
    return float(v.numel())


def balance(costs: list[float], pre: float, post: float, k: int) -> list[list[int]]:
    """Split layers into k contiguous non-empty runs minimizing the largest run's cost (pre/post join the ends)."""
    L = len(costs)
    if k > L:
        raise ValueError(f"cannot cut {L} layers into p*v = {k} chunks: each chunk needs a layer; use p*v <= {L}")
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)

    def cost(i, j):  # layers i..j-1 as one chunk
        return prefix[j] - prefix[i] + (pre if i == 0 else 0.0) + (post if j == L else 0.0)

    best = [[math.inf] * (L + 1) for _ in range(k + 1)]
    cut = [[0] * (L + 1) for _ in range(k + 1)]
    best[0][0] = 0.0
    for c in range(1, k + 1):
        for j in range(c, L - (k - c) + 1):
            for i in range(c - 1, j):
                val = max(best[c - 1][i], cost(i, j))
                if val < best[c][j]:
                    best[c][j], cut[c][j] = val, i
    runs, j = [], L
    for c in range(k, 0, -1):
        i = cut[c][j]
        runs.append(list(range(i, j)))
        j = i
    return runs[::-1]


def _chunk_of_nodes(gm: GraphModule, position: dict[Node, int], runs: list[list[int]]) -> dict[Node, int]:
    """Chunk of every call node; `position` is a node's layer position (0..L-1) in the sequence. A node outside
    the layers (the embedding, a norm between two stacks, an inserted f or g) joins the chunk of the last layer
    before it in graph order, or a later one its inputs are in: never a chunk after one of its readers."""
    chunk_of_layer = {layer: c for c, run in enumerate(runs) for layer in run}
    out: dict[Node, int] = {}
    sourced = []  # outside the layers, reading only graph inputs (f of a weight, a mask built from constants)
    current = 0  # the chunk of the last layer node so far
    for n in gm.graph.nodes:
        if n.op in ("placeholder", "get_attr"):
            continue
        if n.op == "output":
            out[n] = len(runs) - 1
        elif n in position:
            out[n] = current = chunk_of_layer[position[n]]
        else:
            ins = [out[a] for a in n.all_input_nodes if a in out]
            out[n] = max(ins + [current])
            if not ins:
                sourced.append(n)
    for n in reversed(sourced):  # ... go with their first reader: a weight's f sits with the layer that reads it
        readers = [out[u] for u in n.users if u in out]
        if readers:
            out[n] = min(readers)
    return out


def _param_dependent(gm: GraphModule, params: set[Node]) -> set[Node]:
    dep = set(params)
    for n in gm.graph.nodes:
        if n.op != "placeholder" and any(a in dep for a in n.all_input_nodes):
            dep.add(n)
    return dep


def _stacks(entries: tuple[str, ...]) -> str:
    """The stacks' paths, in order: "h", or "encoder.block, decoder.block"."""
    return ", ".join(dict.fromkeys(e.rpartition(".")[0] for e in entries))


def whole_graph(gm: GraphModule) -> Partition:
    """The one-chunk partition: gm itself, every placeholder an input (no pipeline, or p*v = 1)."""
    entries = find_layers(gm).sequence
    inputs = tuple(input_of(n) for n in gm.graph.nodes if n.op == "placeholder")
    chunk = Chunk(0, gm, inputs, (), (), tuple(range(len(entries))))
    return Partition((chunk,), _stacks(entries), (0.0,) * len(entries), entries)


def partition_pass(gm: GraphModule, k: int, chunk_layers: tuple | None = None) -> Partition:
    """Cut gm into k chunks (see the module docstring). The chunks share nothing with gm's graph; k = 1 is gm.

    chunk_layers: the layers (positions) of each chunk, to keep a cut made before (else balanced here)."""
    if k == 1:
        return whole_graph(gm)
    layers = find_layers(gm)
    if layers.main is None:
        raise ValueError("no repeated block (a ModuleList of layers) found in nn_module_stack: cannot cut into "
                         f"{k} pipeline chunks")
    entries, position = layers.sequence, layers.position_of
    looped = next((n for n in position if any(calls_of(n, e) != [""] for e in entries if calls_of(n, e))), None)
    if looped is not None:
        raise ValueError(f"fxpar: pipeline parallelism cuts the layer list into chunks, but {looped.name} (module "
                         f"{layers.entry_of.get(looped)}) runs in a second application of its layer (a looped block, "
                         "each layer's weights read more than once): one layer would belong to two chunks. "
                         "Fix: pp=1 (tensor and data parallelism shard a looped block)")
    costs = [0.0] * len(entries)
    pre = post = 0.0
    first = min(i for i, n in enumerate(gm.graph.nodes) if n in position)
    for i, n in enumerate(gm.graph.nodes):
        if n in position:
            costs[position[n]] += node_cost(n)
        elif i < first:
            pre += node_cost(n)
        else:
            post += node_cost(n)
    runs = balance(costs, pre, post, k) if chunk_layers is None else _pinned(chunk_layers, len(entries), k)
    chunk_of = _chunk_of_nodes(gm, position, runs)
    sent = _param_dependent(gm, param_nodes(gm))
    crossing = _crossing(gm, chunk_of, sent, k)
    chunks = tuple(_build_chunk(gm, c, chunk_of, sent, crossing, tuple(runs[c]))
                   for c in range(k))
    return Partition(chunks, _stacks(entries), tuple(costs), entries)


def _pinned(chunk_layers: tuple, count: int, k: int) -> list[list[int]]:
    """The pinned chunk layers as runs; refuses a cut that does not fit this graph's `count` layers."""
    if len(chunk_layers) != k or [i for run in chunk_layers for i in run] != list(range(count)):
        raise ValueError(f"fxpar partition: the pinned cut {chunk_layers} does not cover this graph's layers "
                         f"{list(range(count))} in {k} chunks")
    return [list(run) for run in chunk_layers]


def _crossing(gm, chunk_of, sent, k) -> list[list[Node]]:
    """crossing[c]: parameter-dependent values made before chunk c and used in chunk c or later, in graph order."""
    last_use: dict[Node, int] = {}
    for n in gm.graph.nodes:
        for a in n.all_input_nodes:
            if a in sent and a in chunk_of and chunk_of[a] < chunk_of.get(n, 0):
                last_use[a] = max(last_use.get(a, 0), chunk_of[n])
    return [[a for a in last_use if chunk_of[a] < c <= last_use[a]] for c in range(k)]


def boundary_value(n: Node) -> BoundaryValue:
    """How a crossing value travels: its local shape, dtype and placement, from the rank's graph metadata."""
    v = n.meta.get("val")
    if not isinstance(v, torch.Tensor):
        raise ValueError(f"fxpar partition: {n.name} crosses a pipeline boundary but is not a tensor ({type(v)})")
    return BoundaryValue(n.name, tuple(v.shape), v.dtype, n.meta.get(FXPAR_PLACEMENT, Replicate()))


def _build_chunk(gm, c, chunk_of, sent, crossing, layers) -> Chunk:
    graph, env = Graph(), {}
    own = [n for n in gm.graph.nodes if chunk_of.get(n) == c and n.op != "output"]
    needed = _recompute_closure(own, chunk_of, sent, set(crossing[c]), c)
    for i, a in enumerate(crossing[c]):
        env[a] = graph.placeholder(a.name)
        copy_meta(a, env[a])
        env[a].meta[FXPAR_INPUT] = GraphInput(BOUNDARY, a.name, i)
    inputs = [n for n in gm.graph.nodes if n.op == "placeholder"
              and any(n in u.all_input_nodes for u in needed + own)]
    for n in inputs:
        env[n] = graph.placeholder(n.name)
        env[n].meta = dict(n.meta)
    for n in needed + own:
        env[n] = graph.node_copy(n, lambda a: env[a])
    if c == len(crossing) - 1:
        out = next(n for n in gm.graph.nodes if n.op == "output")
        graph.output(torch.fx.map_arg(out.args[0], lambda a: env[a]))
        boundary_out = ()
    else:
        nxt = crossing[c + 1]
        graph.output(tuple(env[a] for a in nxt))
        boundary_out = tuple(boundary_value(a) for a in nxt)
    sub = GraphModule(_modules_used(gm, needed + own), graph, class_name=f"Chunk{c}")
    chunk_inputs = tuple(env[a].meta[FXPAR_INPUT] for a in crossing[c]) + tuple(input_of(n) for n in inputs)
    return Chunk(c, sub, chunk_inputs, tuple(boundary_value(a) for a in crossing[c]), boundary_out, layers)


def _recompute_closure(own, chunk_of, sent, received, c) -> list[Node]:
    """Earlier-chunk nodes that own nodes need and that are recomputed here (not parameter-dependent)."""
    need, stack = set(), [a for n in own for a in n.all_input_nodes]
    while stack:
        a = stack.pop()
        if a in need or a in received or a.op == "placeholder" or chunk_of.get(a) == c:
            continue
        assert a not in sent, f"{a.name} depends on parameters but does not cross the boundary"
        need.add(a)
        stack.extend(a.all_input_nodes)
    order = {n: i for i, n in enumerate(next(iter(own)).graph.nodes)} if own else {}
    return sorted(need, key=order.__getitem__)


def _modules_used(gm: GraphModule, nodes: list[Node]) -> torch.nn.Module:
    root = torch.nn.Module()
    for n in nodes:
        if n.op == "call_module":
            root.add_module(n.target, gm.get_submodule(n.target))
    return root
