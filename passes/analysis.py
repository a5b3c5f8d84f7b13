"""Sharding analysis: find the tensor-parallel regions of a traced graph and prove each one with the op rules.

Glossary
    region   the ops between a replicated activation X and the GEMMs that bring the result back to Replicate:
             X -> f -> column-parallel GEMMs -> sharded ops -> row-parallel GEMMs -> g. Megatron's MLP and attention
             blocks are regions; each costs one all-reduce forward (g) and one backward (f).
    seed     a GEMM with a weight parameter whose input is replicated; seeds that read the same X form one group.

Pattern: for each group of seeds, in graph order, shard the seeds column-wise (their output features, with the
parts found by fused.py), and propagate that placement forward through the users with the rules of rules.py. A
GEMM whose weight parameter contracts the sharded dim becomes row-parallel and ends the path. If every path ends
that way, the region is proven; if any op refuses, we try the largest subset of the seeds that works (grouped-query
k/v projections whose heads t does not divide stay replicated; their heads are scattered into the region), and
otherwise leave the group replicated and record why. Why it is safe: every rule is exact for the placements it
accepts, and a region's only exits are row-parallel GEMMs followed by g.
"""
from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass, field

import torch
from torch.fx import GraphModule, Node

from .fused import fused_parts
from .meta import USER, input_of
from .placements import Placement, Replicate, Shard, plain_shard
from .rules import GEMM_WEIGHT_ARG, Ctx, Decision, Indivisible, NoRule, rule_for

aten = torch.ops.aten


@dataclass
class Region:
    """One proven (or refused) tensor-parallel region, for the plan. GEMMs are named by their ATen node name;
    `modules` maps each to its module path (`model.layers.0.self_attn.q_proj`)."""

    module: str
    columns: list[str]
    rows: list[str] = field(default_factory=list)
    replicated: list[str] = field(default_factory=list)  # seeds of the group left replicated
    reason: str = ""  # why seeds were left replicated
    indivisible: bool = False  # the reason is a size that t does not divide
    kind: str = "tp"  # "tp": column- then row-parallel GEMMs; "vocab": the vocab-parallel embedding and LM head
    modules: dict[str, str] = field(default_factory=dict)


@dataclass
class Analysis:
    t: int
    placements: dict[Node, Placement]
    decisions: dict[Node, Decision]
    param_specs: dict[Node, Shard]  # weight/bias placeholder -> how it is sharded
    regions: list[Region]
    grad_nodes: set[Node]


def module_path(node: Node) -> str:
    stack = node.meta.get("nn_module_stack") or {}
    return list(stack.values())[-1][0] if stack else ""


def _grad_nodes(gm: GraphModule, params: set[Node]) -> set[Node]:
    """Nodes that can carry a gradient: floating tensors downstream of parameters or float inputs."""
    out = set()
    for n in gm.graph.nodes:
        v = n.meta.get("val")
        floating = isinstance(v, torch.Tensor) and v.is_floating_point()
        if n in params or (n.op == "placeholder" and floating and input_of(n).kind == USER):
            out.add(n)
        elif n.op == "call_function" and any(a in out for a in n.all_input_nodes):
            if floating or isinstance(v, (list, tuple)):
                out.add(n)
    return out


def _seed_spec(gemm: Node, t: int) -> Shard:
    out_features = gemm.meta["val"].shape[-1]
    parts = fused_parts(gemm) or (out_features,)
    return Shard(gemm.meta["val"].dim() - 1, tuple(parts))


def _weight_specs(gemm: Node, s: Shard, role: str) -> dict[Node, Shard]:
    """Column: weight's output-feature dim and bias take the layout. Row: weight's input-feature dim."""
    w_idx, _, w_in_dim = GEMM_WEIGHT_ARG[gemm.target]
    w = gemm.args[w_idx]
    layout = (s.parts, s.pre, s.post)
    if role == "row":
        return {w: Shard(w_in_dim, *layout)}
    specs = {w: Shard(1 - w_in_dim, *layout)}
    bias = gemm.args[2] if gemm.target is aten.linear.default and len(gemm.args) > 2 else None
    bias = gemm.args[0] if gemm.target is aten.addmm.default else bias
    if isinstance(bias, Node):
        specs[bias] = Shard(0, *layout)
    return specs


def _grow(seeds: list[Node], ctx: Ctx, order: dict[Node, int]) -> tuple[dict, dict]:
    """Propagate the seeds' column sharding; returns (decisions, param specs) or raises NoRule."""
    decisions, specs, heap = {}, {}, []

    def push_users(n):
        for u in n.users:
            heapq.heappush(heap, (order[u], id(u), u))

    for g in seeds:
        s = _seed_spec(g, ctx.t)
        if not s.divisible(ctx.t):
            raise Indivisible(f"{g.name}: output features {s.size} (parts {s.parts}) not divisible by t={ctx.t}")
        x = g.args[GEMM_WEIGHT_ARG[g.target][1]]
        decisions[g] = Decision(s, {x: None}, role="column")
        specs.update(_weight_specs(g, s, "column"))
        ctx.placements[g] = s
        push_users(g)
    while heap:
        n = heapq.heappop(heap)[2]
        if n in decisions:
            continue
        if n.op == "output":
            raise NoRule("a sharded value reaches the model output")
        rule = rule_for(n)
        if rule is None:
            raise NoRule(f"{n.name}: no sharding rule for {n.target}")
        d = rule(n, ctx)
        decisions[n], ctx.placements[n] = d, d.out
        if d.role == "row":
            x = n.args[GEMM_WEIGHT_ARG[n.target][1]]
            specs.update(_weight_specs(n, ctx.placements[x], "row"))
        elif isinstance(d.out, Shard) or (isinstance(d.out, tuple) and any(isinstance(o, Shard) for o in d.out)):
            push_users(n)
    return decisions, specs


def _common_module(nodes: list[Node]) -> str:
    paths = [module_path(n).split(".") for n in nodes]
    common = []
    for parts in zip(*paths):
        if len(set(parts)) > 1:
            break
        common.append(parts[0])
    return ".".join(common)


def _seed_groups(gm: GraphModule, params: set[Node]) -> dict[Node, list[Node]]:
    groups: dict[Node, list[Node]] = {}
    for n in gm.graph.nodes:
        if n.op == "call_function" and n.target in GEMM_WEIGHT_ARG:
            w_idx, x_idx, _ = GEMM_WEIGHT_ARG[n.target]
            if n.args[w_idx] in params and len(n.args[w_idx].users) == 1:
                groups.setdefault(n.args[x_idx], []).append(n)
    return groups


def _subsets(seeds: list[Node]):
    """Seed subsets, largest first (all subsets for small groups, else the whole and each single seed)."""
    if len(seeds) <= 6:
        for k in range(len(seeds), 0, -1):
            yield from itertools.combinations(seeds, k)
    else:
        yield tuple(seeds)
        yield from ((s,) for s in seeds)


def analyze(gm: GraphModule, t: int, params: set[Node]) -> Analysis:
    """Decide the placement of every node of `gm` for tensor parallelism of degree t."""
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    placements: dict[Node, Placement] = {}
    decisions: dict[Node, Decision] = {}
    param_specs: dict[Node, Shard] = {}
    regions, claimed = [], set()
    if t > 1:
        for x, seeds in _seed_groups(gm, params).items():
            seeds = [s for s in seeds if s not in claimed]
            if not seeds:
                continue
            region = Region(module_path(seeds[0]), [], modules={s.name: module_path(s) for s in seeds})
            first_error = None
            for subset in _subsets(seeds):
                ctx = Ctx(dict(placements), t, params)
                try:
                    got, specs = _grow(list(subset), ctx, order)
                except NoRule as e:
                    if first_error is None:
                        first_error = f"{e} (module {module_path(seeds[0]) or '<root>'})"
                        region.indivisible = isinstance(e, Indivisible)
                    continue
                placements.update(ctx.placements)
                decisions.update(got)
                param_specs.update(specs)
                region.columns = [s.name for s in subset]
                region.module = _common_module([n for n, d in got.items() if d.role])
                region.rows = [n.name for n, d in got.items() if d.role == "row"]
                region.modules.update({n.name: module_path(n) for n, d in got.items() if d.role == "row"})
                claimed.update(n for n, d in got.items() if d.role)
                break
            region.replicated = [s.name for s in seeds if s.name not in region.columns]
            region.reason = first_error or ""
            regions.append(region)
    return Analysis(t, placements, decisions, param_specs, regions, _grad_nodes(gm, params))


def weight_specs(analysis: Analysis) -> dict[str, Shard]:
    """state_dict key -> Shard of every sharded weight (the keys come from the placeholders' GraphInput records)."""
    return {input_of(n).key: s for n, s in analysis.param_specs.items()}


def check_divisible(analysis: Analysis) -> None:
    """Raise ValueError if some region could be sharded but for a size (heads, features) that t does not divide:
    that is a wrong tensor-parallel degree, not a model to run replicated."""
    blocked = [r for r in analysis.regions if r.indivisible and not r.columns]
    if blocked:
        r = blocked[0]
        gemms = ", ".join(f"{g} ({r.modules[g]})" if r.modules.get(g) else g for g in r.replicated)
        raise ValueError(
            f"fxpar: cannot split {len(blocked)} region(s) over t={analysis.t}. First: module {r.module or '<root>'}, "
            f"GEMMs {gemms}: {r.reason}.\n"
            "Fix: choose a tensor-parallel degree that divides the heads and hidden sizes."
        )


__all__ = ["Analysis", "Region", "analyze", "check_divisible", "module_path", "weight_specs", "plain_shard",
           "Replicate"]
