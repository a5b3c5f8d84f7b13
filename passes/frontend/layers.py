"""Transformer layers, found from the module tree that torch.export records on every node (nn_module_stack).

Glossary
    indexed module  a module on a node's stack whose path ends in an integer: `h.3`, `model.layers.0`, `0`.
    block           the entries of one ModuleList (or Sequential) with at least two indices that are modules with
                    submodules of their own, or modules of the user's own classes (a layer that holds bare
                    Parameters): the modules whose paths are `<parent>.<i>`. A model can have several (an encoder's
                    and a decoder's layers; the experts inside each MoE layer). A Sequential of torch.nn's leaf
                    modules (Linear, ReLU) is not a block: its entries are ops, not layers.
    main block      the block whose entries own the most nodes, times the most entries, ties to the shortest path:
                    the model's transformer layers (`h`, `model.layers`).
    stacks          the main block and every other block not nested in one (an encoder's layers and a decoder's),
                    in the order the graph runs them. The pipeline cuts between the entries of all of them, as one
                    sequence of layers (`encoder.block.0`, `encoder.block.1`, `decoder.block.0`, ...), when the
                    graph runs that sequence in order; else between the main block's entries only.
    layer of a node its entry of the main block if it has one, else its outermost entry of any other block
                    (recomputation checkpoints these); for the main block also the entry's index (the pipeline
                    balances these).

This is the one place that decides what a layer is; partition, recompute and the planner's shape reader use it.
"""
from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass, field

from torch.fx import Graph, GraphModule, Node

_INDEXED = re.compile(r"^(?:(.*)\.)?(\d+)$")  # `<parent>.<index>` or a bare `<index>` at the top


@dataclass(frozen=True)
class Block:
    path: str  # the parent's path: "h", "model.layers" ("" for a top-level Sequential)
    indices: tuple[int, ...]  # the entries seen, sorted
    nodes: int  # nodes owned by its entries

    @property
    def count(self) -> int:
        return len(self.indices)


@dataclass
class Layers:
    """The blocks of a graph and each node's place in them."""

    blocks: dict[str, Block]
    main: Block | None
    entry_of: dict[Node, str] = field(default_factory=dict)  # node -> its outermost block entry ("h.3")
    index_of: dict[Node, int] = field(default_factory=dict)  # node -> its entry's index in the main block
    sequence: tuple[str, ...] = ()  # the pipeline's layers: entries of the stacks, in the order the graph runs them
    position_of: dict[Node, int] = field(default_factory=dict)  # node -> its layer's position in `sequence`

    def layer(self, node: Node) -> str | None:
        """The outermost block entry a node belongs to (`h.3`), or None."""
        return self.entry_of.get(node)


def _indexed(node: Node) -> list[tuple[str, int, str]]:
    """(parent path, index, entry path) of the indexed modules on node's stack, outermost first."""
    out = []
    for path, _ in (node.meta.get("nn_module_stack") or {}).values():
        m = _INDEXED.match(path)
        if m:
            out.append((m.group(1) or "", int(m.group(2)), path))
    return out


def _type_name(kind) -> str:
    """The qualified name of a module type as nn_module_stack records it (a class or its name)."""
    return kind if isinstance(kind, str) else f"{kind.__module__}.{kind.__qualname__}"


def calls_of(n: Node, path: str) -> list[str]:
    """Which call of the module at `path` n belongs to: "" for the first, "1" for the next (torch.export marks a
    module's k-th call `@k` on the node's module stack: a looped block)."""
    return [key.rpartition("@")[2] if "@" in key else ""
            for key, (p, _) in (n.meta.get("nn_module_stack") or {}).items() if p == path]


def find_layers(graph_or_gm: Graph | GraphModule) -> Layers:
    """The blocks of a graph, its main block, and the layer of every node (see the module docstring)."""
    graph = getattr(graph_or_gm, "graph", graph_or_gm)
    inner = set()  # every module path that has a submodule on some node's stack, or is of a user's class
    for n in graph.nodes:
        for path, kind in (n.meta.get("nn_module_stack") or {}).values():
            parts = path.split(".")
            inner.update(".".join(parts[:i]) for i in range(1, len(parts)))
            if not _type_name(kind).startswith("torch.nn."):
                inner.add(path)
    seen: dict[str, set[int]] = {}
    owned: Counter = Counter()
    stacks = {}
    for n in graph.nodes:
        stacks[n] = [(parent, i, path) for parent, i, path in _indexed(n) if path in inner]
        for parent, index, _ in stacks[n]:
            seen.setdefault(parent, set()).add(index)
            owned[parent] += 1
    blocks = {p: Block(p, tuple(sorted(ix)), owned[p]) for p, ix in seen.items() if len(ix) >= 2}
    main = max(blocks.values(), key=lambda b: (b.nodes * b.count, -len(b.path)), default=None)
    layers = Layers(blocks, main)
    for n, stack in stacks.items():
        in_main = [(i, path) for parent, i, path in stack if main is not None and parent == main.path]
        if in_main:
            layers.index_of[n], layers.entry_of[n] = in_main[0]
            continue
        entry = next((path for parent, _, path in stack if parent in blocks), None)
        if entry is not None:
            layers.entry_of[n] = entry
    _sequence(graph, layers, stacks)
    return layers


def _nested(block: Block, blocks: dict[str, Block]) -> bool:
    """Whether block lies inside an entry of another block (the experts of a MoE layer, T5's sub-layers)."""
    entries = (f"{b.path}.{i}" if b.path else str(i) for b in blocks.values() if b is not block for i in b.indices)
    return any(block.path == e or block.path.startswith(e + ".") for e in entries)


def _sequence(graph: Graph, layers: Layers, stacks: dict) -> None:
    """Fill layers.sequence and position_of: the stacks' entries in the order the graph runs them, if it runs
    every layer after the one before (positions never go back in graph order); else the main block's alone."""
    if layers.main is None:
        return
    tops = [b.path for b in layers.blocks.values() if not _nested(b, layers.blocks)]
    if layers.main.path not in tops:
        tops = [layers.main.path]
    for candidates in dict.fromkeys((tuple(tops), (layers.main.path,))):
        entry_at = {}  # in graph order
        for n in graph.nodes:
            entry = next((path for parent, _, path in stacks[n] if parent in candidates), None)
            if entry is not None:
                entry_at[n] = entry
        sequence = list(dict.fromkeys(entry_at.values()))  # by first appearance
        position = {e: i for i, e in enumerate(sequence)}
        steps = [position[e] for e in entry_at.values()]
        if all(a <= b for a, b in zip(steps, steps[1:])):
            layers.sequence = tuple(sequence)
            layers.position_of = {n: position[e] for n, e in entry_at.items()}
            return
    main = layers.main  # run out of order (a layer called twice): its entries by index, as the model lists them
    layers.sequence = tuple(f"{main.path}.{i}" if main.path else str(i) for i in main.indices)
    layers.position_of = {n: main.indices.index(i) for n, i in layers.index_of.items()}
