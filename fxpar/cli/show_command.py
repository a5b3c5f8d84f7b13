"""`fxpar show TARGET --tp N [--rank R] [--format table|code|dot]`: the rewritten graph of one rank.

No torchrun needed: the rank is simulated (its collectives keep shapes and skip the communication), so this shows
exactly the graph and local weight shapes that rank would run. Everything printed comes from the compiler's record
(fxpar/compiler.py): every node's placement (meta[FXPAR_PLACEMENT]), local shape (meta["val"]), collective, fusion
and recomputed region.

    table   one row per node (placement, local shape, what it is), then the plan
    code    the rank's graph as Python, each value annotated with its local shape and dtype
    dot     Graphviz: one box per node, coloured by what it is, with a legend
With --pp P (and --vpp V) the model is cut into pipeline chunks: --chunk C shows that chunk in the chosen format;
without --chunk the plan, its chunks and every pipeline rank's proven action list are printed.
With --joint-graph the plan reads each layer's collectives from the chunks' joint programs (passes/joint/), and each
collective of the forward and backward programs is listed with the compute that runs while it is in flight.
"""
from __future__ import annotations

import argparse

import torch
from tabulate import tabulate

from fxpar.api import build
from fxpar.config import Config
from fxpar.passes.joint.overlap import describe
from fxpar.cost.bubble import default_schedule
from fxpar.passes.ir.meta import module_path
from fxpar.passes.tensor_parallel.collectives import TPComm
from fxpar.passes.ir.meta import FXPAR_FUSED, FXPAR_PLACEMENT, FXPAR_RECOMPUTE, comm_kind
from fxpar.passes.ir.placements import Partial, Shard
from fxpar.passes.pipeline.proofs import format_program
from fxpar.cli.config_flags import add_config_flags, config_overrides
from fxpar.targets import load_target

FORMATS = ("table", "code", "dot")
COLORS = {"collective": "tomato", "recomputed region": "khaki", "fused op": "palegreen",
          "sharded (S)": "lightblue", "partial sum (P)": "orange", "replicated (R)": "white"}


def add_parser(sub) -> None:
    p = sub.add_parser("show", help="show the rewritten graph of one simulated rank", description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("target", help="path/file.py:factory or module:factory; factory() returns (model, example_args"
                                  "[, example_kwargs])")
    p.add_argument("--tp", type=int, default=2, help="tensor-parallel degree t (default 2)")
    p.add_argument("--rank", type=int, default=0, help="the tp rank to show, 0..t-1 (default 0)")
    p.add_argument("--format", choices=FORMATS, default="table",
                   help="table: nodes and plan; code: annotated Python; dot: Graphviz (default table)")
    p.add_argument("--pp", type=int, default=1, help="pipeline stages p (default 1)")
    p.add_argument("--chunk", type=int, default=None, help="show one pipeline chunk, 0..p*v-1")
    p.add_argument("--ep", type=int, default=1, help="expert-parallel ranks: show ep rank 0's experts and their "
                                                     "dispatch (default 1)")
    add_config_flags(p, defaults={"microbatches": "p with a pipeline, else 1", "schedule": "the one for v"})
    p.set_defaults(func=run)


def placement_text(n) -> str:
    p = n.meta.get(FXPAR_PLACEMENT)
    if isinstance(p, tuple):
        return "(" + ", ".join(map(str, p)) + ")"
    return "-" if p is None else str(p)


def _shape(n) -> str:
    v = n.meta.get("val")
    if isinstance(v, torch.Tensor):
        return "x".join(map(str, v.shape))
    if isinstance(v, (tuple, list)):
        return "(" + ", ".join("x".join(map(str, x.shape)) for x in v if isinstance(x, torch.Tensor)) + ")"
    return ""


def _note(n) -> str:
    """What a node is beyond its op: a collective, a fused op, or part of a recomputed region."""
    if comm_kind(n) is not None:
        return comm_kind(n).info.text
    if FXPAR_RECOMPUTE in n.meta:
        return f"recomputed region {n.meta[FXPAR_RECOMPUTE]}"
    if FXPAR_FUSED in n.meta:
        return f"fused {n.meta[FXPAR_FUSED]}"
    return ""


def node_rows(gm) -> list[list]:
    rows = []
    for n in gm.graph.nodes:
        if n.op in ("placeholder", "output"):
            continue
        op = n.target if n.op == "call_module" else getattr(n.target, "__name__", str(n.target))
        args = ", ".join(a.name if hasattr(a, "name") else repr(a) for a in n.args)
        rows.append([n.name, op, module_path(n), args[:50], placement_text(n), _shape(n), _note(n)])
    return rows


def node_table(gm) -> str:
    return tabulate(node_rows(gm), headers=["node", "op", "module", "args", "placement", "local shape", "note"])


def _kind(n) -> str:
    p = n.meta.get(FXPAR_PLACEMENT)
    if comm_kind(n) is not None:
        return "collective"
    if FXPAR_RECOMPUTE in n.meta:
        return "recomputed region"
    if FXPAR_FUSED in n.meta:
        return "fused op"
    if isinstance(p, Partial):
        return "partial sum (P)"
    if isinstance(p, Shard) or (isinstance(p, tuple) and any(isinstance(x, Shard) for x in p)):
        return "sharded (S)"
    return "replicated (R)"


def to_dot(gm) -> str:
    lines = ["digraph fxpar {", "  node [shape=box, fontname=monospace];",
             "  subgraph cluster_legend {", '    label="legend"; fontname=monospace;']
    for i, (what, color) in enumerate(COLORS.items()):
        lines.append(f'    "legend{i}" [label="{what}", style=filled, fillcolor={color}];')
    lines.append("  }")
    for n in gm.graph.nodes:
        label = f"{n.name}\\n{placement_text(n)} {_shape(n)}".rstrip()
        lines.append(f'  "{n.name}" [style=filled, fillcolor={COLORS[_kind(n)]}, label="{label}"];')
        for a in n.all_input_nodes:
            lines.append(f'  "{a.name}" -> "{n.name}";')
    return "\n".join(lines + ["}"])


def to_code(gm, title: str) -> str:
    """gm's Python with every value annotated by its local shape and dtype (source-location comments dropped)."""
    code = gm.print_readable(print_output=False, include_stride=False, include_device=False, colored=False)
    lines = [line for line in code.splitlines() if not line.strip().startswith(("# File:", "# No stacktrace"))]
    return f"# {title}\n" + "\n".join(line for i, line in enumerate(lines) if line.strip() or lines[i - 1].strip())


def render(gm, fmt: str, title: str, plan=None) -> str:
    """One graph in the chosen format."""
    if fmt == "dot":
        return to_dot(gm)
    if fmt == "code":
        return to_code(gm, title)
    return f"# {title}\n\n{node_table(gm)}" + (f"\n\n{plan}" if plan is not None else "")


def _chunk_title(chunk, args, part) -> str:
    names = [part.entries[i] for i in chunk.layers] if part.entries else list(chunk.layers)
    layers = f"{names[0]} .. {names[-1]}" if len(names) > 2 else ", ".join(map(str, names))
    return (f"chunk {chunk.index} of {len(part.chunks)} (pipeline rank {chunk.index % args.pp}): layers "
            f"{layers or '-'} of {part.block!r}; receives: "
            f"{', '.join(map(str, chunk.boundary_in)) or '-'}; sends: {', '.join(map(str, chunk.boundary_out)) or '-'}")


def run(args) -> int:
    if args.tp < 1 or not 0 <= args.rank < args.tp or args.ep < 1:
        print(f"fxpar show: error: --rank {args.rank} must be in [0, {args.tp}), --tp >= 1 and --ep >= 1")
        return 2
    given = config_overrides(args)
    vpp = given.get("virtual_stages", 1)
    pipelined = args.pp > 1 or vpp != 1 or args.chunk is not None
    try:
        config = Config(**{"microbatches": args.pp if pipelined else 1, "schedule": default_schedule(vpp), **given})
    except (TypeError, ValueError) as e:
        print(f"fxpar show: error: {e}")
        return 2
    k = args.pp * config.virtual_stages
    if args.chunk is not None and not 0 <= args.chunk < k:
        print(f"fxpar show: error: --chunk must be in [0, {k}) for --pp {args.pp} --vpp {config.virtual_stages}")
        return 2
    model, ex_args, ex_kwargs = load_target(args.target)
    pm = build(model, TPComm(rank=args.rank, size=args.tp), ex_args, ex_kwargs, config=config,
               pp=args.pp if pipelined else 1, ep=args.ep)
    where = f"{args.target}: tp rank {args.rank} of {args.tp}" + (f", ep rank 0 of {args.ep}" if args.ep > 1 else "")
    compiled = pm.compiled
    if args.chunk is not None:
        chunk = compiled.partition.chunks[args.chunk]
        print(render(chunk.gm, args.format, f"{where}, {_chunk_title(chunk, args, compiled.partition)}"))
    elif pipelined:
        print(f"# {where}, {k} pipeline chunks over p={args.pp}\n\n{pm.plan}\n")
        print(f"actions of every pipeline rank (m={config.microbatches}, {config.schedule}), proven "
              f"deadlock-free:\n{format_program(compiled.program)}")
    else:
        print(render(compiled.partition.chunks[0].gm, args.format, where, pm.plan))
    if compiled.joint.on:
        for chunk in compiled.partition.chunks if args.chunk is None else [compiled.partition.chunks[args.chunk]]:
            traced = pm.rank.programs.runner(compiled, chunk.index).record
            for half, program in (("forward", traced.forward), ("backward", traced.backward)):
                print(f"\nchunk {chunk.index}, {half} program: each collective, and what runs while it is in "
                      "flight\n" + ("\n".join(describe(program)) or "no collective"))
    return 0
