"""Golden graph text for the pass tests (`assertExpectedInline`): one line per computing node,

    name = op(args)  # placement local-shape  [what it is: collective, in place, random stream, fused, recomputed]

so a change in what a pass emits shows as a readable diff. Refresh with EXPECTTEST_ACCEPT=1."""
from __future__ import annotations

import torch
from torch.fx import GraphModule

from fxpar.cli.show_command import placement_text
from fxpar.passes.ir.meta import FXPAR_FUSED, FXPAR_RANDOM, FXPAR_RECOMPUTE, comm_kind


def _op(gm: GraphModule, n) -> str:
    return n.target if n.op == "call_module" else getattr(n.target, "__name__", str(n.target))


def _notes(gm: GraphModule, n) -> str:
    notes = []
    if comm_kind(n) is not None:
        notes.append(f"{comm_kind(n)}{' in place' if getattr(gm.get_submodule(n.target), 'in_place', False) else ''}")
    for key, label in ((FXPAR_RANDOM, "stream"), (FXPAR_FUSED, "fused"), (FXPAR_RECOMPUTE, "recomputed")):
        if key in n.meta:
            notes.append(f"{label} {n.meta[key]}")
    return f"  [{'; '.join(notes)}]" if notes else ""


def graph_text(gm: GraphModule, placements: bool = True) -> str:
    lines = []
    for n in gm.graph.nodes:
        if n.op not in ("call_function", "call_module"):
            continue
        val = n.meta.get("val")
        shape = "x".join(map(str, val.shape)) if isinstance(val, torch.Tensor) else ""
        where = f"  # {placement_text(n)} {shape}".rstrip() if placements else ""
        lines.append(f"{n.name} = {_op(gm, n)}({', '.join(map(str, n.args))}){where}{_notes(gm, n)}")
    return "\n".join(lines) + "\n"
