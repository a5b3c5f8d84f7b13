"""Sharding analysis: find the tensor-parallel regions of a traced graph and prove each one with the op rules.

Glossary
    region   the ops between a replicated activation X and the GEMMs that bring the result back to Replicate:
             X -> f -> column-parallel GEMMs -> sharded ops -> row-parallel GEMMs -> g. Megatron's MLP and attention
             blocks are regions; each costs one all-reduce forward (g) and one backward (f).
    seed     a GEMM with a weight parameter whose input is replicated; seeds that read the same X form one group.

Pattern: for each group of seeds, in graph order, shard the seeds column-wise (their output features, with the parts
found by fused_projections.py), and propagate that placement forward through the users with the rules of rules.py. A
GEMM whose weight parameter contracts the sharded dim becomes row-parallel and ends the path. If every path ends that
way, the region is proven; if any op refuses, we try the largest subset of the seeds that works (grouped-query k/v
projections whose heads t does not divide stay replicated; their heads are scattered into the region), and otherwise
leave the group replicated and record why. Why it is safe: every rule is exact for the placements it accepts, and a
region's only exits are row-parallel GEMMs followed by g.

[Note: one decision per node]
    A node's placement is decided at most once. Once a region is proven, its nodes and the inputs it read as
    replicated are frozen: a later region that would decide one of them again is refused (its GEMMs stay
    replicated and the plan says which node conflicted), never allowed to overwrite. A seed's input must itself be
    replicated, and a rule may not read a sharded value as replicated.

[Note: regions close at row GEMMs]
    A region's sharded values leave it only through row-parallel GEMMs (then g) or a statistic's all-reduce. A
    replicated activation scattered on its features (last dim) into an elementwise op would let the sharding run
    on through the residual stream (an output projection's sharded features added to the residual, normalized by
    partial statistics, fed to the next layer as a row-parallel input): exact, but an all-reduce per GEMM. That is
    refused; the GEMM stays replicated or closes the region Megatron's way. Parameters and buffers may be
    scattered (a norm's weight).

[Note: regions with two inputs]
    Seeds are grouped by the activation they read, but one attention block can read two: a cross-attention's
    queries come from the decoder, its keys and values from the encoder's output, which every decoder layer reads
    (one group across the layers). Grown alone, the first group would scatter the other's projections into its
    region and the second would then conflict with it, leaving both half replicated. So a proven region that
    scatters in the output of an undecided seed (through layout ops only) is grown again with that seed as one of
    its own, and keeps the larger region only if it is proven too.

[Note: low-rank pairs]
    A row-parallel GEMM all-reduces its output. In Megatron's layers that output is as wide as the region's input
    (h -> 4h -> h, also when the inner size is below h, as in most MoE experts). The up-projection of a low-rank
    pair (MLA's q_a_proj -> q_b_proj, a gate's f_a -> f_b: h -> r -> w, w > h and w > r) would all-reduce w values
    per token instead. Megatron-Core shards MLA the other way: the down-projection replicated (r*h redundant FLOPs
    per token), the up-projection column-parallel. So a region with a row GEMM that outputs more features than both
    its region reads and it contracts is refused, the seeds it is computed from stay replicated, and the rest of
    its seeds are grown again; the up-projection, which then reads a replicated activation, is a seed of its own.

[Note: every use is proven]
    A parameter is sharded only if its every use is inside its region: a GEMM weight read by any other node keeps
    the GEMM replicated (the plan names the other use); a bias read elsewhere stays whole and is scattered into the
    region at its GEMM. Rules that fail on a node they did not expect refuse their region, naming themselves.
"""
from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass, field

import torch
from torch.fx import GraphModule, Node

from fxpar.passes.sharding.fused_projections import fused_parts
from fxpar.passes.ir.aliasing import Storage, writes
from fxpar.passes.ir.meta import USER, input_of, module_path, upstream
from fxpar.passes.ir.op_families import FILLS_LIKE, ROW_VIEWS
from fxpar.passes.ir.placements import Placement, Replicate, Shard, plain_shard
from fxpar.passes.sharding.rule_table import rule_for, undeclared
from fxpar.passes.sharding.shared_weights import SHARDING_GEMM, describe, shared_conflicts, weight_spec_of
from fxpar.passes.sharding.rules import (DTYPE_ONLY, GEMM_WEIGHT_ARG, GEMM_WEIGHT_OUT, Ctx, Decision, Indivisible,
                                         NoRule, Role, elementwise, gemm_uses, other_use)

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
    logits: str = ""  # vocab: what becomes of the LM head's sharded logits (gathered, or the loss ops they reach)
    modules: dict[str, str] = field(default_factory=dict)


@dataclass
class Analysis:
    t: int
    placements: dict[Node, Placement]
    decisions: dict[Node, Decision]
    param_specs: dict[Node, Shard]  # weight/bias placeholder -> how it is sharded
    regions: list[Region]
    grad_nodes: set[Node]


def _differentiable_inputs(n: Node) -> list[Node]:
    """The inputs a gradient can flow back to (not one read for its dtype, shape or device only)."""
    if n.target in FILLS_LIKE:
        return []
    skip = n.args[DTYPE_ONLY[n.target]] if n.target in DTYPE_ONLY and len(n.args) > 1 else None
    return [a for a in n.all_input_nodes if a is not skip]


def grad_nodes(gm: GraphModule, params: set[Node]) -> set[Node]:
    """Nodes that can carry a gradient: floating tensors downstream of parameters or float inputs, and every value
    living in a storage that an op writes a gradient-carrying value into (`buf = zeros_like(y); buf[:, :2] = y`:
    buf and its views carry y's gradient from then on). Written storage found late sends the walk round again."""
    storage, out, written = Storage(), set(), set()
    while True:
        size = (len(out), len(written))
        for n in gm.graph.nodes:
            v = n.meta.get("val")
            floating = isinstance(v, torch.Tensor) and v.is_floating_point()
            if n in params or (n.op == "placeholder" and floating and input_of(n).kind == USER):
                out.add(n)
            elif n.op == "call_function" and any(a in out for a in _differentiable_inputs(n)):
                if floating or isinstance(v, (list, tuple)):
                    out.add(n)
            elif floating and written and storage.roots(n) & written:
                out.add(n)
            if n in out and writes(n) != []:
                targets = writes(n) if writes(n) is not None else n.all_input_nodes
                written.update(r for a in targets for r in storage.roots(a))
        if (len(out), len(written)) == size:
            return out


def activations_of(gm: GraphModule) -> set[Node]:
    """Nodes whose value depends on a model input (not only on parameters, buffers and constants)."""
    out = set()
    for n in gm.graph.nodes:
        if (n.op == "placeholder" and input_of(n).kind == USER) or any(a in out for a in n.all_input_nodes):
            out.add(n)
    return out


def _seed_spec(gemm: Node, t: int) -> Shard:
    out_features = gemm.meta["val"].shape[-1]
    parts = fused_parts(gemm) or (out_features,)
    return Shard(gemm.meta["val"].dim() - 1, tuple(parts))


def _column(gemm: Node, s: Shard, params: set[Node], x: Node) -> tuple[Decision, dict[Node, Shard]]:
    """A seed's decision and specs: its weight's output-feature dim takes the layout; so does its bias when the bias
    is a parameter used only here, else the bias stays as it is and enters the region scattered."""
    w_idx = GEMM_WEIGHT_ARG[gemm.target][0]
    layout = (s.parts, s.pre, s.post)
    specs = {gemm.args[w_idx]: Shard(GEMM_WEIGHT_OUT[gemm.target], *layout)}
    enter: dict[Node, Shard | None] = {x: None}
    bias = gemm.args[2] if gemm.target is aten.linear.default and len(gemm.args) > 2 else None
    bias = gemm.args[0] if gemm.target is aten.addmm.default else bias
    if isinstance(bias, Node):
        if (bias in params or row_block(bias, params) is not None) and other_use(bias, gemm) is None:
            specs[bias] = Shard(0, *layout)
        else:
            enter[bias] = Shard(0, *layout)
    return Decision(s, enter, role=Role.COLUMN), specs


def _row_spec(gemm: Node, s: Shard) -> dict[Node, Shard]:
    """A row-parallel GEMM's weight: its input-feature dim takes the layout of the sharded input."""
    w_idx, _, w_in_dim = GEMM_WEIGHT_ARG[gemm.target]
    return {gemm.args[w_idx]: Shard(w_in_dim, s.parts, s.pre, s.post)}


def is_sharded(p) -> bool:
    return isinstance(p, Shard) or (isinstance(p, tuple) and any(isinstance(o, Shard) for o in p))


def _grow(seeds: list[Node], ctx: Ctx, order: dict[Node, int], frozen: dict[Node, str],
          activations: set[Node]) -> tuple[dict, dict]:
    """Propagate the seeds' column sharding; returns (decisions, param specs) or raises NoRule.

    frozen: nodes that earlier regions decided, or read as replicated, -> which region. Deciding one of them again
    is a conflict ([Note: one decision per node]): the region is refused, never overwritten. activations: the
    nodes computed from a model input; one scattered on its features into an elementwise op would be the residual
    stream joining the region ([Note: regions close at row GEMMs])."""
    decisions, specs = {}, {}
    for g in seeds:
        s = _seed_spec(g, ctx.t)
        if not s.divisible(ctx.t):
            raise Indivisible(f"{g.name}: output features {s.size} (parts {s.parts}) not divisible by t={ctx.t}")
        if not s.plain and g.args[GEMM_WEIGHT_ARG[g.target][0]] not in ctx.params:
            raise NoRule(f"{g.name}: a row block of a weight with parts {s.parts}")
        x = g.args[GEMM_WEIGHT_ARG[g.target][1]]
        decisions[g], got = _column(g, s, ctx.params, x)
        specs.update(got)
        ctx.placements[g] = s
    spread(seeds, decisions, specs, ctx, order, frozen, activations)
    for g in seeds:  # a seed computed from another seed of the region (a low-rank pair's up-projection)
        x = g.args[GEMM_WEIGHT_ARG[g.target][1]]
        if is_sharded(ctx.placements.get(x)):
            raise NoRule(f"{describe(g)} would read {x.name}, which the region shards ({ctx.placements[x]}), as "
                         "replicated: a seed's input must be replicated")
    specs.update(_shard_scattered_params(decisions, ctx))
    return decisions, specs


def spread(starts: list[Node], decisions: dict, specs: dict, ctx: Ctx, order: dict[Node, int],
           frozen: dict[Node, str], activations: set[Node]) -> None:
    """Propagate the sharded placements of `starts` (decided, in ctx) through their users with the op rules, into
    `decisions` and `specs`, until every path is closed (Replicate); raises NoRule where one cannot be."""
    heap = []

    def push_users(n):
        for u in n.users:
            heapq.heappush(heap, (order[u], id(u), u))

    for n in starts:
        push_users(n)
    while heap:
        n = heapq.heappop(heap)[2]
        if n in decisions:
            continue
        if n.op == "output":
            raise NoRule("a sharded value reaches the model output")
        if n in frozen:
            raise NoRule(f"{describe(n)} was already decided by the region of {frozen[n]}: one decision per node")
        rule = rule_for(n)
        if rule is None:
            raise NoRule(f"{n.name}: no sharding rule for {n.target}{undeclared(n.target)}")
        d = apply_rule(rule, n, ctx)
        for inp, how in list(d.enter.items()):
            if how is not None and inp not in frozen and (param := _gathered_param(inp, how, ctx)) is not None:
                specs[param] = ctx.placements[param] = how.moved(how.dim - _index_dims(inp) + len(inp.args[1]))
                decisions[inp], ctx.placements[inp] = Decision(how, {}), how
                del d.enter[inp]
        for inp, how in d.enter.items():
            if is_sharded(ctx.placements.get(inp)):
                raise NoRule(f"{n.name}: would read the sharded {inp.name} as replicated")
            if how is not None and rule is elementwise and inp in activations and \
                    how.dim == len(ctx.shape(inp)) - 1:
                raise NoRule(f"{n.name}: would shard the replicated activation {inp.name} by scattering it (a "
                             "residual stream); the region closes at its row-parallel GEMMs instead")
        decisions[n], ctx.placements[n] = d, d.out
        if d.role is Role.ROW:
            x = n.args[GEMM_WEIGHT_ARG[n.target][1]]
            for p, spec in _row_spec(n, ctx.placements[x]).items():
                if specs.setdefault(p, spec) != spec:  # [Note: shared weights]: both uses in one region
                    raise NoRule(f"{describe(n)} would store its weight {p.name} as {spec}, another GEMM of the "
                                 f"region as {specs[p]}: the two would store it differently")
        elif is_sharded(d.out):
            push_users(n)


def _index_dims(n: Node) -> int:
    return len(torch.broadcast_shapes(*(i.meta["val"].shape for i in n.args[1])))


def _gathered_param(inp: Node, how: Shard, ctx: Ctx) -> Node | None:
    """The parameter P when `inp` is `P[ids]` (rows of P picked by an index computed from the input: a bias per
    expert, gathered per token), read by nothing else, and `how` scatters a dim of P's that the index keeps whole:
    P is then stored sharded on that dim and gathered locally, instead of scattering the gathered rows (a
    replicated activation, [Note: regions close at row GEMMs])."""
    if inp.op != "call_function" or inp.target is not aten.index.Tensor or len(inp.users) != 1:
        return None
    param, ids = inp.args[0], inp.args[1]
    if param not in ctx.params or other_use(param, inp) is not None or not ids \
            or not all(isinstance(i, Node) for i in ids):
        return None
    return param if how.dim >= _index_dims(inp) else None


def row_block(w: Node, params: set[Node]) -> Node | None:
    """P when w is `P[a:b]`, rows of a parameter P whose every use is such a block, the blocks disjoint, each read
    by one node (a GEMM cut per part, passes/frontend/unfuse.py); else None."""
    if not (isinstance(w, Node) and w.op == "call_function" and w.target is aten.slice.Tensor):
        return None
    p = w.args[0]
    if p not in params:
        return None
    rows = []
    for u in p.users:
        args = list(u.args) + [0, None, None, 1][len(u.args) - 1:]
        if u.target is not aten.slice.Tensor or u.args[0] is not p or args[1] != 0 or args[4] != 1 \
                or len(u.users) != 1 or (args[2] or 0) < 0:
            return None
        rows.append((u.meta["val"].shape[0], args[2] or 0))
    rows = sorted((start, start + n) for n, start in rows)
    return p if all(a[1] <= b[0] for a, b in zip(rows, rows[1:])) else None


def _compose_row_blocks(param_specs: dict, decisions: dict, placements: dict, t: int) -> None:
    """[Note: whole parts] The specs the seeds gave row blocks P[a:b] become one spec of P: the sharded blocks are
    parts split over t, every other row range a whole part; each block reads its rows of P's local tensor."""
    by_param: dict[Node, dict[Node, Shard]] = {}
    for n in [n for n in param_specs if n.op == "call_function"]:
        by_param.setdefault(n.args[0], {})[n] = param_specs.pop(n)
    for p, sharded in by_param.items():
        size = p.meta["val"].shape[0]
        blocks = sorted(((u.args[2] or 0, u) for u in p.users), key=lambda b: b[0])
        cuts = sorted({0, size} | {a for a, _ in blocks} | {a + u.meta["val"].shape[0] for a, u in blocks})
        sizes = [b - a for a, b in zip(cuts, cuts[1:])]
        starts = cuts[:-1]
        split_at = {a for a, u in blocks if u in sharded}
        spec = Shard(0, tuple(sizes), whole=frozenset(i for i, a in enumerate(starts) if a not in split_at))
        local = dict(zip(starts, itertools.accumulate([0] + list(spec.local_parts(t)))))
        param_specs[p] = placements[p] = spec
        for a, u in blocks:
            n = u.meta["val"].shape[0]
            out = sharded[u] if u in sharded else Replicate()
            end = local[a] + (n // t if u in sharded else n)
            decisions[u], placements[u] = Decision(out, args=(p, 0, local[a], end)), out


def _shard_scattered_params(decisions: dict[Node, Decision], ctx: Ctx) -> dict[Node, Shard]:
    """A parameter that enters the region scattered at its every use, alike (an RMSNorm's weight over the sharded
    features), is stored sharded instead: no copy of it, and no all-gather of its gradient."""
    specs = {}
    scattered = {i for d in decisions.values() for i, how in d.enter.items() if how is not None and i in ctx.params}
    for p in scattered:
        hows = {decisions[u].enter.get(p) if u in decisions else None for u in p.users}
        if len(hows) == 1 and None not in hows:
            specs[p] = ctx.placements[p] = hows.pop()
            for u in p.users:
                del decisions[u].enter[p]
    return specs


def apply_rule(rule, n: Node, ctx: Ctx) -> Decision:
    """rule(n, ctx); a rule that fails on input it did not expect refuses (never guess), naming itself."""
    try:
        return rule(n, ctx)
    except NoRule:
        raise
    except Exception as e:  # noqa: BLE001 - any failure of a rule is a refusal of its region
        raise NoRule(f"{n.name}: the {rule.__name__} rule cannot place {n.target} ({type(e).__name__}: {e})") from e


def _common_module(nodes: list[Node]) -> str:
    paths = [module_path(n).split(".") for n in nodes]
    common = []
    for parts in zip(*paths):
        if len(set(parts)) > 1:
            break
        common.append(parts[0])
    return ".".join(common)


def _seed_groups(gm: GraphModule, params: set[Node], banned: dict[Node, str]
                 ) -> tuple[dict[Node, list[Node]], list[Region]]:
    """GEMMs with a weight parameter, grouped by the activation they read; and a refusal for each whose weight has
    a use other than as a GEMM's weight ([Note: every use is proven]: a sharded weight's every use must be in its
    region, or a GEMM of its own sharding it alike: [Note: shared weights] in shared_weights.py), or that `banned`
    names."""
    groups: dict[Node, list[Node]] = {}
    refused = []
    for n in gm.graph.nodes:
        if n.op == "call_function" and n.target in GEMM_WEIGHT_ARG:
            w_idx, x_idx, _ = GEMM_WEIGHT_ARG[n.target]
            w = n.args[w_idx]
            if w not in params and (n.target is not aten.linear.default or row_block(w, params) is None):
                continue
            other = other_use(w, n)
            shared = w in params and gemm_uses(w) is not None
            if n in banned or (other is not None and not shared):
                why = banned.get(n) or f"weight {w.name} is also read by {describe(other)}"
                refused.append(Region(module_path(n), [], replicated=[n.name], modules={n.name: module_path(n)},
                                      reason=why))
            else:
                groups.setdefault(_activation_root(n.args[x_idx]), []).append(n)
    return groups, refused


def _activation_root(x: Node) -> Node:
    """x, or the activation x folds to 2-D for an mm (`x.flatten(0, 1)`, `view(x, [-1, h])`: the leading dims merged,
    the features kept): GEMMs of one activation are one group however each spells its input."""
    while isinstance(x, Node) and x.op == "call_function" and x.target in ROW_VIEWS:
        src = x.args[0]
        out, inp = x.meta.get("val"), getattr(src, "meta", {}).get("val")
        if out is None or inp is None or out.dim() > inp.dim() or out.shape[-1] != inp.shape[-1]:
            break
        x = src
    return x


def _seed_input(g: Node) -> Node:
    return g.args[GEMM_WEIGHT_ARG[g.target][1]]


class WideRow(NoRule):
    """A proven region whose g would all-reduce more values per token than its f: a low-rank pair."""

    def __init__(self, message: str, seeds: set[Node]):
        super().__init__(message)
        self.seeds = seeds


def _check_widths(got: dict[Node, Decision], subset, x: Node) -> None:
    """[Note: low-rank pairs] Raise WideRow if a row GEMM of the region outputs more features than it contracts and
    than the region reads, naming the seeds it is computed from."""
    width = x.meta["val"].shape[-1]
    for r, d in got.items():
        if d.role is not Role.ROW:
            continue
        out, contracted = r.meta["val"].shape[-1], _seed_input(r).meta["val"].shape[-1]
        seeds = {s for s in subset if s in _upstream_in(r, got)}
        if out <= max(contracted, width) or not seeds:
            continue
        names = ", ".join(describe(s) for s in sorted(seeds, key=lambda s: s.name))
        raise WideRow(f"{names} stays replicated: as a region with {describe(r)}, that row-parallel GEMM would "
                      f"all-reduce {out} values per token, more than the {width} the region reads and the "
                      f"{contracted} it contracts (a low-rank pair); its up-projection reads it replicated instead",
                      seeds)


def _upstream_in(n: Node, got: dict) -> set[Node]:
    """The nodes of the region `got` that n is computed from."""
    return {a for a in upstream(n, through=lambda a: a is n or a in got) if a in got and a is not n}


def _subsets(seeds: list[Node]):
    """Seed subsets, largest first (all subsets for small groups, else the whole and each single seed)."""
    if len(seeds) <= 6:
        for k in range(len(seeds), 0, -1):
            yield from itertools.combinations(seeds, k)
    else:
        yield tuple(seeds)
        yield from ((s,) for s in seeds)


def _blocked_by(e: NoRule, seeds, placements, params, order, frozen, activations) -> NoRule:
    """e, or, when e is a size t does not divide, the refusal the same region meets with every size divisible (the
    seeds grown at t=1): a router over 5 experts is refused for its top-k, not for the 5, and check_divisible then
    leaves the model alone instead of asking for another t."""
    if not isinstance(e, Indivisible):
        return e
    try:
        _grow(list(seeds), Ctx(dict(placements), 1, params), order, frozen, activations)
    except NoRule as other:
        return other
    return e


def _producers(x: Node, candidates: set[Node], frozen: dict, placements: dict) -> list[Node]:
    """The seed GEMMs x is computed from by replicated ops alone (a key projection viewed into heads; a gate's
    up-projection through its softplus), in graph order from x back; the walk stops at seeds, and at what earlier
    regions decided (the layer's input comes through a row GEMM's g)."""
    def through(a: Node) -> bool:
        return a is x or (a.op == "call_function" and a not in candidates and a not in frozen and a not in placements)

    return [a for a in upstream(x, through=through) if a in candidates]


def _pull_in(seeds: list[Node], ctx: Ctx, got: dict, specs: dict, candidates: set[Node], placements, order, frozen,
             activations) -> tuple[list[Node], Ctx, dict, dict]:
    """[Note: regions with two inputs] A proven region that scatters in the output of another, still undecided
    seed (cross-attention: the queries come from the decoder, the keys and values from the encoder's output, two
    groups) grows again with that seed as one of its own, column-parallel with its own f; kept only if proven."""
    def scattered_seeds():  # undecided seeds whose outputs the region scatters in
        for d in got.values():
            for inp, how in d.enter.items():
                for g in (_producers(inp, candidates, frozen, placements) if how is not None else ()):
                    if g not in seeds and g not in frozen and g not in tried \
                            and not is_sharded(placements.get(_seed_input(g))):
                        yield g

    tried: set[Node] = set()
    while (g := next(scattered_seeds(), None)) is not None:
        tried.add(g)
        trial = Ctx(dict(placements), ctx.t, ctx.params, ctx.refused)
        try:
            grown, grown_specs = _grow(seeds + [g], trial, order, frozen, activations)
        except NoRule:
            continue
        seeds, ctx, got, specs = seeds + [g], trial, grown, grown_specs
    return seeds, ctx, got, specs


def analyze(gm: GraphModule, t: int, params: set[Node]) -> Analysis:
    """Decide the placement of every node of `gm` for tensor parallelism of degree t; again, with the GEMMs of a
    shared weight that was sharded unalike left replicated ([Note: shared weights] in shared_weights.py), until none
    is."""
    banned: dict[Node, str] = {}
    while True:
        analysis, use_specs = _analyze(gm, t, params, banned)
        conflicts = shared_conflicts(params, use_specs)
        if not conflicts:
            return analysis
        if conflicts.keys() <= banned.keys():  # banned GEMMs are never column- or row-parallel: cannot happen
            raise RuntimeError(f"fxpar: shared weights still conflict with their GEMMs replicated: {conflicts}")
        banned.update(conflicts)


def _analyze(gm: GraphModule, t: int, params: set[Node], banned: dict[Node, str]
             ) -> tuple[Analysis, dict[Node, Shard]]:
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    placements: dict[Node, Placement] = {}
    decisions: dict[Node, Decision] = {}
    param_specs: dict[Node, Shard] = {}
    regions, frozen, use_specs = [], {}, {}
    activations = activations_of(gm)
    if t > 1:
        groups, regions = _seed_groups(gm, params, banned)
        candidates = {g for seeds in groups.values() for g in seeds}
        for x, seeds in groups.items():
            seeds = [s for s in seeds if s not in frozen]
            if not seeds:
                continue
            region = Region(module_path(seeds[0]), [], modules={s.name: module_path(s) for s in seeds})
            first_error = None
            sharded = [s for s in seeds if is_sharded(placements.get(_seed_input(s)))]
            if sharded or is_sharded(placements.get(x)):  # a seed's input must be proven Replicate
                inp = _seed_input(sharded[0]) if sharded else x
                first_error = f"input {inp.name} of {', '.join(s.name for s in seeds)} is sharded ({placements[inp]})"
                seeds_to_try = []
            else:
                seeds_to_try = _subsets(seeds)
            pending = list(seeds_to_try)
            while pending:
                subset = pending.pop(0)
                ctx = Ctx(dict(placements), t, params, banned)
                try:
                    got, specs = _grow(list(subset), ctx, order, frozen, activations)
                    _check_widths(got, subset, x)
                except NoRule as e:
                    if first_error is None:
                        e = _blocked_by(e, subset, placements, params, order, frozen, activations)
                        first_error = f"{e} (module {module_path(seeds[0]) or '<root>'})"
                        region.indivisible = isinstance(e, Indivisible)
                    rest = tuple(s for s in subset if s not in getattr(e, "seeds", subset))
                    if rest:  # WideRow: the same seeds less the low-rank ones, next
                        pending.insert(0, rest)
                    continue
                subset, ctx, got, specs = _pull_in(list(subset), ctx, got, specs, candidates, placements, order,
                                                   frozen, activations)
                placements.update(ctx.placements)
                decisions.update(got)
                param_specs.update(specs)
                use_specs.update({g: weight_spec_of(g, specs) for g, d in got.items() if d.role in SHARDING_GEMM})
                region.columns = [s.name for s in subset]
                region.module = _common_module([n for n, d in got.items() if d.role])
                region.rows = [n.name for n, d in got.items() if d.role is Role.ROW]
                region.modules.update({n.name: module_path(n) for n, d in got.items() if d.role})
                label = subset[0].name
                frozen.update(dict.fromkeys(got, label))
                frozen.update(dict.fromkeys((i for d in got.values() for i in d.enter), label))
                break
            region.replicated = [s.name for s in seeds if s.name not in region.columns]
            region.reason = first_error or ""
            regions.append(region)
        _compose_row_blocks(param_specs, decisions, placements, t)
    return Analysis(t, placements, decisions, param_specs, regions, grad_nodes(gm, params)), use_specs


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


__all__ = ["Analysis", "Region", "activations_of", "analyze", "spread", "check_divisible", "weight_specs",
           "plain_shard", "Replicate"]
