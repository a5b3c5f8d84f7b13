"""`fxpar show TARGET --tp N [--rank R] [--format code|table|dot]`: the rewritten graph of one rank.

No torchrun needed: the rank is simulated (its collectives keep shapes and skip the communication), so this shows
exactly the graph and local weight shapes that rank would run.
"""
from __future__ import annotations

import torch
from tabulate import tabulate

from fxpar.api import build
from fxpar.passes.ops import COMM_MODULES, TPComm
from fxpar.target import load_target

COLLECTIVE = {"tp_f": "f: all-reduce in backward", "tp_g": "g: all-reduce", "tp_gather": "all-gather",
              "tp_scatter": "scatter (all-gather in backward)", "tp_vocab_embedding": "vocab lookup + all-reduce"}


def add_parser(sub) -> None:
    p = sub.add_parser("show", help="dump the rewritten graph of one rank")
    p.add_argument("target", help="path/file.py:factory or module:factory; factory() returns (model, example_args)")
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--rank", type=int, default=0)
    p.add_argument("--format", choices=("code", "table", "dot"), default="code")
    p.set_defaults(func=run)


def _local_shapes(pm, args, kwargs) -> dict[str, tuple]:
    pm.propagate_local_shapes(pm.flatten_inputs(args, kwargs))
    return {n.name: tuple(n.meta["val"].shape) for n in pm.graph_module.graph.nodes
            if isinstance(n.meta.get("val"), torch.Tensor)}


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
        rows.append([n.name, op, args[:60], str(p or "R"), "x".join(map(str, shapes.get(n.name, ()))),
                     COLLECTIVE.get(n.target.rsplit("_", 1)[0], "") if n.op == "call_module" else ""])
    return rows


def to_dot(pm) -> str:
    lines = ["digraph fxpar {", "  node [shape=box, fontname=monospace];"]
    placements = {n.name: p for n, p in pm.compiled.analysis.placements.items()}
    for n in pm.graph_module.graph.nodes:
        color = "tomato" if n.op == "call_module" and n.target.rsplit("_", 1)[0] in COMM_MODULES else "lightblue" if n.name in placements else "white"
        lines.append(f'  "{n.name}" [style=filled, fillcolor={color}, label="{n.name}\\n{placements.get(n.name, "")}"];')
        for a in n.all_input_nodes:
            lines.append(f'  "{a.name}" -> "{n.name}";')
    return "\n".join(lines + ["}"])


def run(args) -> int:
    if args.tp < 1 or not 0 <= args.rank < args.tp:
        print(f"fxpar show: error: --rank {args.rank} must be in [0, {args.tp}) and --tp >= 1")
        return 2
    model, ex_args, ex_kwargs = load_target(args.target)
    pm = build(model, TPComm(rank=args.rank, size=args.tp), ex_args, ex_kwargs)
    if args.format == "dot":
        print(to_dot(pm))
        return 0
    print(f"# {args.target}: tp rank {args.rank} of {args.tp}\n")
    if args.format == "code":
        shapes = _local_shapes(pm, ex_args, ex_kwargs)
        print(tabulate(node_rows(pm, shapes), headers=["node", "op", "args", "placement", "local shape", "collective"]))
        print()
    print(pm.plan)
    return 0
