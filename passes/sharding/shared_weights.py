"""Shared weights: one weight read by several GEMMs, sharded when every region shards it alike.

[Note: shared weights]
    A block applied twice (a looped layer, a recurrent depth) reads each weight in two GEMMs, one per application.
    Each GEMM is then a seed, or a row GEMM, of its own region, and the weight is stored sharded if every region
    shards it alike: each application is a Megatron layer over the same local shard, and the shard's gradient sums
    both, as the whole weight's does. Where the regions disagree (one column-parallel, the other row-parallel or
    replicated), the analysis runs again with every GEMM of that weight replicated, and the plan says why.
"""
from __future__ import annotations

from torch.fx import Node

from fxpar.passes.ir.meta import module_path
from fxpar.passes.ir.placements import Shard
from fxpar.passes.sharding.rules import GEMM_WEIGHT_ARG, Role, gemm_uses

SHARDING_GEMM = (Role.COLUMN, Role.ROW)


def weight_spec_of(g: Node, specs: dict) -> Shard | None:
    w = g.args[GEMM_WEIGHT_ARG[g.target][0]] if g.target in GEMM_WEIGHT_ARG else None
    return specs.get(w) if isinstance(w, Node) else None


def shared_conflicts(params: set[Node], use_specs: dict[Node, Shard]) -> dict[Node, str]:
    """[Note: shared weights] The GEMMs of every weight that several GEMMs read but the regions did not all shard
    alike -> why: the next analysis leaves them replicated."""
    out = {}
    for p in params:
        uses = gemm_uses(p)
        if not uses or len(uses) < 2 or not any(u in use_specs for u in uses):
            continue
        specs = [use_specs.get(u) for u in uses]
        if all(s == specs[0] for s in specs):
            continue
        names = ", ".join(f"{describe(u)}: {use_specs.get(u, 'replicated')}" for u in uses)
        out.update(dict.fromkeys(uses, f"weight {p.name} is read by {len(uses)} GEMMs that would store it "
                                       f"differently ({names}); all stay replicated"))
    return out


def describe(n: Node) -> str:
    """`name (module path)`: how the plan names a node."""
    return f"{n.name} (module {module_path(n) or '<root>'})"
