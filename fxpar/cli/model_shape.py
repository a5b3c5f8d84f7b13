"""Read a GPT's shape (l, h, a, s, V) from a model traced on the meta device, for `fxpar plan TARGET`.

TARGET is `path/to/file.py:factory` or `package.module:factory`; `factory()` returns
`(model, example_args[, example_kwargs])`, as for `fxpar show`. It is called under `with torch.device("meta"):`,
so no weights are allocated (a 175B model traces in a few hundred MB), then traced with
`torch.export.export(..., strict=False)`.

Glossary: l layers, h hidden, a heads, s sequence, V vocabulary, f feed-forward hidden.
Where each number comes from in the graph:
  l     the entries of the main block of passes/frontend/layers.py (the ModuleList of transformer layers, from
        `nn_module_stack`: "blocks.0", "blocks.1", ... -> block "blocks", l = number of entries)
  V, h  the weight [V, h] of the token embedding: the `aten.embedding` whose indices are a graph input
        (else the embedding with the most rows)
  s     the last dimension of those indices
  a     the query [.., a, s, h/a] of `scaled_dot_product_attention`, else a [.., s, a, h/a] view
  f     the largest input width of a Linear in the first layer whose output width is h (0, meaning 4h,
        if there is none)
"""
from __future__ import annotations

import torch

from fxpar.cost.shape import ModelShape
from fxpar.passes.frontend.layers import find_layers
from fxpar.targets import load_factory, unpack_target

NN_MODULE_STACK = "nn_module_stack"


def trace_on_meta(factory) -> torch.export.ExportedProgram:
    """Build `factory()` on the meta device and export it (non-strict); no weight memory is allocated."""
    with torch.device("meta"):
        model, example_args, example_kwargs = unpack_target(factory(), "factory")
        return torch.export.export(model, example_args, example_kwargs, strict=False)


def _shape_of(node) -> tuple[int, ...] | None:
    value = node.meta.get("val") if isinstance(node, torch.fx.Node) else None
    return tuple(int(x) for x in value.shape) if isinstance(value, torch.Tensor) else None


def count_layers(graph: torch.fx.Graph) -> tuple[int, str]:
    """(l, block path): the entries of the graph's main block, e.g. (96, "blocks")."""
    main = find_layers(graph).main
    if main is None:
        raise ValueError("no repeated layers found: nn_module_stack has no '<block>.<index>' module paths; "
                         "pass --layers")
    return main.count, main.path


def token_embedding(graph: torch.fx.Graph) -> tuple[int, int, int]:
    """(V, h, s) from the token embedding (see the module docstring)."""
    found = []
    for node in graph.nodes:
        if node.op == "call_function" and node.target == torch.ops.aten.embedding.default:
            weight, ids = _shape_of(node.args[0]), _shape_of(node.args[1])
            if weight and ids and len(weight) == 2:
                found.append((node.args[1].op == "placeholder", weight[0], weight, ids))
    if not found:
        raise ValueError("no aten.embedding in the graph: cannot read hidden and vocabulary; pass --hidden "
                         "--vocab --seq")
    _, _, (vocab, hidden), ids = max(found)
    return vocab, hidden, ids[-1]


def count_heads(graph: torch.fx.Graph, hidden: int, seq: int) -> int:
    """a from scaled_dot_product_attention's query, else from a [.., s, a, h/a] view."""
    for node in graph.nodes:
        if node.op == "call_function" and "scaled_dot_product" in str(node.target):
            query = _shape_of(node.args[0])
            if query and len(query) >= 3 and query[-3] * query[-1] == hidden:
                return query[-3]
    for node in graph.nodes:
        shape = _shape_of(node)
        is_view = node.op == "call_function" and ("view" in str(node.target) or "reshape" in str(node.target))
        if is_view and shape and len(shape) == 4 and shape[1] == seq and shape[2] * shape[3] == hidden \
                and shape[3] < hidden:
            return shape[2]
    raise ValueError("cannot find the attention heads (no scaled_dot_product_attention, no [b, s, a, h/a] view); "
                     "pass --heads")


def ffn_hidden(graph: torch.fx.Graph, prefix: str, hidden: int) -> int:
    """f: the widest input of a Linear in layer 0 that maps back to h; 0 (meaning 4h) if none."""
    first = f"{prefix}.0" if prefix else "0"
    widths = []
    for node in graph.nodes:
        if node.op == "call_function" and node.target == torch.ops.aten.linear.default:
            paths = [path for path, _ in node.meta.get(NN_MODULE_STACK, {}).values()]
            weight = _shape_of(node.args[1])
            if weight and weight[0] == hidden and any(p == first or p.startswith(first + ".") for p in paths):
                widths.append(weight[1])
    return max(widths) if widths and max(widths) > hidden else 0


def shape_from_graph(graph_or_program, batch: int = 1) -> ModelShape:
    """ModelShape of a traced GPT: an ExportedProgram, a GraphModule or a Graph (global batch `batch`)."""
    graph = getattr(graph_or_program, "graph_module", graph_or_program)
    graph = getattr(graph, "graph", graph)
    layers, prefix = count_layers(graph)
    vocab, hidden, seq = token_embedding(graph)
    heads = count_heads(graph, hidden, seq)
    return ModelShape(layers=layers, hidden=hidden, heads=heads, seq=seq, vocab=vocab, batch=batch,
                      ffn_hidden=ffn_hidden(graph, prefix, hidden))


def shape_from_target(target: str, batch: int = 1) -> ModelShape:
    """Load TARGET, trace it on the meta device and read its shape."""
    return shape_from_graph(trace_on_meta(load_factory(target)), batch)
