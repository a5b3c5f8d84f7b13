"""`fxpar show TARGET --tp N [--rank R] [--format code|table|dot]`: the rewritten graph of one rank.

No torchrun needed: the rank is simulated (its collectives keep shapes and skip the communication), so this shows
exactly the graph and local weight shapes that rank would run.
"""
from __future__ import annotations

import torch
from tabulate import tabulate

from fxpar.api import build
from fxpar.config import Config
from fxpar.passes.fusion import FXPAR_FUSED
from fxpar.passes.ops import COMM_MODULES, TPComm
from fxpar.passes.recompute import FXPAR_RECOMPUTE
from fxpar.target import load_target

COLLECTIVE = {"tp_f": "f: all-reduce in backward", "tp_g": "g: all-reduce", "tp_gather": "all-gather",
              "tp_scatter": "scatter (all-gather in backward)", "tp_vocab_embedding": "vocab lookup + all-reduce"}


def add_parser(sub) -> None:
    p = sub.add_parser("show", help="dump the rewritten graph of one rank")
    p.add_argument("target", help="path/file.py:factory or module:factory; factory() returns (model, example_args)")
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--rank", type=int, default=0)
    p.add_argument("--format", choices=("code", "table", "dot"), default="code")
    p.add_argument("--pp", type=int, default=1, help="pipeline stages (with --chunk: show one chunk)")
    p.add_argument("--vpp", type=int, default=1, help="virtual stages (chunks) per pipeline rank")
    p.add_argument("--chunk", type=int, default=None, help="the chunk to show, 0..pp*vpp-1")
    p.add_argument("--no-fuse", action="store_true", help="show the graph without the fusion passes")
    p.add_argument("--recompute", choices=("none", "selective", "full"), default="none")
    p.set_defaults(func=run)


def show_chunk(pm, args, ex_args, ex_kwargs) -> int:
    """One pipeline chunk of the rewritten graph: its layers, boundary and code."""
    from fxpar.passes.partition import partition_pass

    k = args.pp * args.vpp
    if args.chunk is None or not 0 <= args.chunk < k:
        print(f"fxpar show: error: --chunk must be in [0, {k}) for --pp {args.pp} --vpp {args.vpp}")
        return 2
    pm.propagate_local_shapes(pm.flatten_inputs(ex_args, ex_kwargs))
    part = partition_pass(pm.graph_module, pm.traced.param_nodes(), k)
    chunk = part.chunks[args.chunk]
    print(f"# chunk {chunk.index} of {k} (pipeline rank {chunk.index % args.pp}): layers {list(chunk.layers)} "
          f"of block {part.block!r}")
    print(f"# receives: {', '.join(chunk.boundary_in) or '-'}; sends: {', '.join(chunk.boundary_out) or '-'}")
    print(chunk.gm.code)
    return 0


def _local_shapes(pm, args, kwargs) -> dict[str, tuple]:
    pm.propagate_local_shapes(pm.flatten_inputs(args, kwargs))
    return {n.name: tuple(n.meta["val"].shape) for n in pm.graph_module.graph.nodes
            if isinstance(n.meta.get("val"), torch.Tensor)}


def _note(n) -> str:
    """What a node is beyond its op: a collective, a fused op, or part of a recomputed region."""
    if n.op == "call_module" and n.target.rsplit("_", 1)[0] in COLLECTIVE:
        return COLLECTIVE[n.target.rsplit("_", 1)[0]]
    if FXPAR_RECOMPUTE in n.meta:
        return f"recomputed region {n.meta[FXPAR_RECOMPUTE]}"
    if FXPAR_FUSED in n.meta:
        return f"fused {n.meta[FXPAR_FUSED]}"
    return ""


def node_rows(pm, shapes) -> list[list]:
    placements = {n.name: p for n, p in pm.compiled.analysis.placements.items()}
    rows = []
    for n in pm.graph_module.graph.nodes:
        if n.op in ("placeholder", "output"):
            continue
        op = n.target if n.op == "call_module" else getattr(n.target, "__name__", str(n.target))
        args = ", ".join(a.name if hasattr(a, "name") else repr(a) for a in n.args)
        p = placements.get(n.name)
        if isinstance(p, tuple):
            p = "(" + ", ".join(map(str, p)) + ")"
        rows.append([n.name, op, args[:60], str(p or "R"), "x".join(map(str, shapes.get(n.name, ()))), _note(n)])
    return rows


def to_dot(pm) -> str:
    lines = ["digraph fxpar {", "  node [shape=box, fontname=monospace];"]
    placements = {n.name: p for n, p in pm.compiled.analysis.placements.items()}
    for n in pm.graph_module.graph.nodes:
        color = ("tomato" if n.op == "call_module" and n.target.rsplit("_", 1)[0] in COMM_MODULES else
                 "khaki" if FXPAR_RECOMPUTE in n.meta else "palegreen" if FXPAR_FUSED in n.meta else
                 "lightblue" if n.name in placements else "white")
        label = f"{n.name}\\n{placements.get(n.name, '')}"
        lines.append(f'  "{n.name}" [style=filled, fillcolor={color}, label="{label}"];')
        for a in n.all_input_nodes:
            lines.append(f'  "{a.name}" -> "{n.name}";')
    return "\n".join(lines + ["}"])


def run(args) -> int:
    if args.tp < 1 or not 0 <= args.rank < args.tp:
        print(f"fxpar show: error: --rank {args.rank} must be in [0, {args.tp}) and --tp >= 1")
        return 2
    model, ex_args, ex_kwargs = load_target(args.target)
    config = Config(fuse=not args.no_fuse, recompute=args.recompute)
    pm = build(model, TPComm(rank=args.rank, size=args.tp), ex_args, ex_kwargs, config=config)
    if args.pp > 1 or args.chunk is not None:
        return show_chunk(pm, args, ex_args, ex_kwargs)
    if args.format == "dot":
        print(to_dot(pm))
        return 0
    print(f"# {args.target}: tp rank {args.rank} of {args.tp}\n")
    if args.format == "code":
        shapes = _local_shapes(pm, ex_args, ex_kwargs)
        print(tabulate(node_rows(pm, shapes), headers=["node", "op", "args", "placement", "local shape", "note"]))
        print()
    print(pm.plan)
    return 0
