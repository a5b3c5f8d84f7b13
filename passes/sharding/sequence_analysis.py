"""Sequence parallelism, decided from the placements the tensor-parallel rewrite left (Korthikanti et al. 2022).

Between its regions a tensor-parallel layer runs its norms, dropouts, biases and residual adds on the whole
activation, on every rank. Under sequence parallelism each rank runs them on its block of the tokens instead: g
becomes a reduce-scatter along the sequence (each rank keeps the sum of its block), f an all-gather (each region
still reads every token). The bytes on the wire are those of tensor parallelism; the activations between regions
are 1/t.

Glossary
    seed       a value the rewrite all-reduced (g, and the vocab-parallel embedding's lookup): under sequence
               parallelism it is reduce-scattered, and comes out sharded along the sequence
    tokens     a seed's dims but the features: (b, s) or (s, b). A seed computed on the tokens flattened ([b*s, h],
               a GEMM spelled on 2-D rows) takes them from the view that unflattens it; its blocks along s are
               then the layout Shard(0, (s,), pre=b)
    sequence   the token dim along which attention mixes tokens; found by a probe, never assumed
    end        a node that reads a sequence-sharded value and is not token-wise along it (a cumulative sum over
               positions, a pooling, the model's output): the value is all-gathered before it, and the plan says why

A write in place into a value on blocks (`y[:, 0] = 0` between the layers) would write a block where the model
writes the sequence, and later readers would miss it: sequence parallelism then stays off and the plan names the op.

Pattern: probe each candidate (a token dim's length, which names the dim in every seed whatever its order: [b, s, h],
[s, b, h], rows flattened either way) by propagating blocks along it from every seed with the op rules
(passes/sharding/rules.py), through f as if it were the identity, into the regions. The length whose propagation the
attention refuses (softmax, SDPA or a matmul of two activations over it) is the sequence's; a batch dim passes
through attention untouched. Where the batch and the sequence have the same length the dims cannot be told apart by
it, and sequence parallelism stays off with that reason. Then
propagate Shard(sequence) from the seeds through the replicated ops, with the same rules, until every path reaches
an f (which becomes the all-gather) or an end (a gather before it). Why it is exact: every rule is exact for the
placements it accepts, and a replicated input read by a sequence block enters as the rules say: scattered (its
block; all-gathered in backward) or through f (whole; its gradient, a partial sum over the ranks' tokens, is
all-reduced). That is how a norm's weight or a bias added after g gets the gradient of every token, derived from
its placement, not from its module type.
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass, field

import torch
from torch.fx import GraphModule, Node

import math

from fxpar.passes.ir.aliasing import Storage, writes
from fxpar.passes.ir.meta import Comm, comm_kind
from fxpar.passes.ir.op_families import ROW_VIEWS
from fxpar.passes.ir.placements import Placement, Shard
from fxpar.passes.sharding.analysis import apply_rule, describe, grad_nodes, is_sharded
from fxpar.passes.sharding.rule_table import rule_for
from fxpar.passes.sharding.mixer_rules import batched_matmul, sdpa
from fxpar.passes.sharding.rules import Ctx, Decision, NoRule, Role, elementwise, softmax

SEEDS = (Comm.G, Comm.VOCAB_EMBEDDING)  # the all-reduces a reduce-scatter replaces
_MIXERS = (softmax, sdpa, batched_matmul)  # rules that refuse a dim attention mixes tokens along


@dataclass
class SequenceAnalysis:
    """What the sequence-parallel rewrite does, and why (the plan prints it)."""

    t: int
    length: int | None = None  # the sequence's length: the token dim of this size is the sequence in every seed
    seeds: dict[Node, Shard] = field(default_factory=dict)  # g / vocab lookup -> the block each rank keeps
    entries: dict[Node, Shard] = field(default_factory=dict)  # f -> the all-gather it becomes
    decisions: dict[Node, Decision] = field(default_factory=dict)  # ops run on sequence blocks
    placements: dict[Node, Placement] = field(default_factory=dict)  # of the seeds and the decided ops
    ends: dict[Node, str] = field(default_factory=dict)  # node -> why its sharded inputs are gathered before it
    grad_nodes: set[Node] = field(default_factory=set)
    reason: str = ""  # why sequence parallelism is off, where it is

    @property
    def applied(self) -> bool:
        return bool(self.seeds)

    def lines(self) -> list[str]:
        """The plan's account: the sequence, what was converted, where the blocks were gathered and why."""
        if not self.applied:
            return [f"sequence parallelism: off ({self.reason})"] if self.reason else []
        out = [f"sequence parallelism: the sequence (the token dim of length {self.length}) in t={self.t} blocks; "
               f"{len(self.seeds)} all-reduces -> reduce-scatters, {len(self.entries)} f -> all-gathers, "
               f"{len(self.decisions)} ops on sequence blocks"]
        out += [f"  gathered before {describe(n)}: {why}" for n, why in self.ends.items()]
        return out


def sequence_analysis(gm: GraphModule, t: int, params: set[Node]) -> SequenceAnalysis:
    """Decide sequence parallelism on the tensor-parallel graph `gm` (its nodes carry this rank's shapes)."""
    out = SequenceAnalysis(t)
    tokens = {n: _tokens(n) for n in gm.graph.nodes if comm_kind(n) in SEEDS}
    tokens = {n: dims for n, dims in tokens.items() if dims}  # a seed of unknown tokens stays an all-reduce
    if t == 1 or not tokens:
        out.reason = "t = 1" if t == 1 else "no region closes with an all-reduce of token rows"
        return out
    candidates = _candidates(tokens)
    mixing = [k for k in candidates if _mixes(gm, tokens, k, params)]
    if len(mixing) != 1:
        same = {d for dims in tokens.values() for d in dims if dims.count(d) > 1}
        kinds = sorted(set(tokens.values()))
        out.reason = (f"attention mixes tokens along the token dims of lengths {mixing}; one is the sequence, fxpar "
                      "cannot tell which" if mixing else
                      f"the batch and the sequence have the same length {sorted(same)}: trace with another batch size"
                      if same and not candidates else
                      f"the regions' outputs have token dims {kinds} (two sequences of different lengths, as an "
                      "encoder's and a decoder's): one sequence length is split, not two" if len(kinds) > 1 else
                      "no attention mixes tokens along a dim of the residual stream: there is no sequence to split")
        return out
    out.length = k = mixing[0]
    if k % t:
        n, dims = next(iter(tokens.items()))
        raise ValueError(
            f"fxpar: sequence parallelism splits the sequence (length {k}, token dims {dims} of the output of "
            f"{describe(n)}) into t={t} blocks, but {k} is not divisible by {t}. Fix: pad the sequence to a multiple "
            f"of {t}, or set Config(sequence_parallel=False).")
    out.seeds = {n: _block(n, dims, k) for n, dims in tokens.items()}
    out.grad_nodes = grad_nodes(gm, params)
    _spread(gm, out, Ctx(dict(out.seeds), t, params))
    out.placements = {**out.seeds, **{n: d.out for n, d in out.decisions.items()}}
    writer = _writes_into(gm, set(out.seeds) | set(out.decisions) | set(out.ends))
    if writer is not None:
        return SequenceAnalysis(t, reason=f"{describe(writer)} writes in place into a value between the regions (a "
                                          "block would be written, not the sequence)")
    return out


def _writes_into(gm: GraphModule, values: set[Node]) -> Node | None:
    """The first op that writes in place into the storage of one of `values` (or of a view of one), if any."""
    storage = Storage()
    for n in gm.graph.nodes:
        written = writes(n) if n.op == "call_function" else []
        if written is None:
            written = n.all_input_nodes  # a mutable op whose written arguments the schema does not name
        if any(storage.roots(a) & values for a in written):
            return n
    return None


def _shape(n: Node) -> tuple:
    v = n.meta.get("val")
    return tuple(v.shape) if isinstance(v, torch.Tensor) else ()


def _tokens(seed: Node) -> tuple[int, ...]:
    """The token dims of a seed's rows: its leading dims, or for rows flattened to 2-D ([b*s, h]) the dims of the
    view that unflattens them (reached through ops on whole rows: the bias added after g); () if none is found."""
    shape = _shape(seed)
    if len(shape) != 2:
        return shape[:-1]
    rows, n = shape[0], seed
    while len(n.users) == 1:
        n = next(iter(n.users))
        out = _shape(n)
        if n.op == "call_function" and n.target in ROW_VIEWS and len(out) > 2 and math.prod(out[:-1]) == rows:
            return out[:-1]
        if n.op != "call_function" or rule_for(n) is not elementwise or out != shape:
            break
    return ()


def _block(seed: Node, tokens: tuple[int, ...], length: int) -> Shard:
    """Blocks along the token dim of this length of a seed's rows, laid out as the seed holds them."""
    i = tokens.index(length)
    if len(_shape(seed)) > 2:
        return Shard(i, (tokens[i],))
    return Shard(0, (tokens[i],), math.prod(tokens[:i]), math.prod(tokens[i + 1:]))


def _candidates(tokens: dict[Node, tuple[int, ...]]) -> list[int]:
    """The lengths (above 1) of token dims that every seed has exactly once: each names one dim in every seed."""
    first = next(iter(tokens.values()))
    return [k for k in dict.fromkeys(first) if k > 1 and all(dims.count(k) == 1 for dims in tokens.values())]


def _mixes(gm: GraphModule, tokens: dict[Node, tuple[int, ...]], k: int, params: set[Node]) -> bool:
    """Does attention refuse blocks along the token dim of length k, propagated from the seeds (through f, into the
    regions)?
    The probe asks the rules at t=1: the question is which ops mix tokens, not whether sizes divide."""
    seeds = list(tokens)
    ctx = Ctx({n: _block(n, dims, k) for n, dims in tokens.items()}, 1, params)
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    heap = [(order[u], id(u), u) for n in seeds for u in n.users]
    heapq.heapify(heap)
    seen = set(seeds)
    while heap:
        n = heapq.heappop(heap)[2]
        if n in seen or n.op == "output":
            continue
        seen.add(n)
        if comm_kind(n) == Comm.F:
            ctx.placements[n] = ctx.p(n.args[0])  # the probe looks through f into the region
        elif comm_kind(n) is not None:
            continue
        else:
            rule = rule_for(n)
            if rule is None:
                continue
            try:
                ctx.placements[n] = apply_rule(rule, n, ctx).out
            except NoRule:
                if rule in _MIXERS:
                    return True
                continue
        if is_sharded(ctx.placements[n]):
            for u in n.users:
                heapq.heappush(heap, (order[u], id(u), u))
    return False


def _spread(gm: GraphModule, out: SequenceAnalysis, ctx: Ctx) -> None:
    """Propagate the seeds' sequence blocks through the replicated ops, in graph order, into `out`."""
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    heap = [(order[u], id(u), u) for n in out.seeds for u in n.users]
    heapq.heapify(heap)
    while heap:
        n = heapq.heappop(heap)[2]
        if n in out.decisions or n in out.entries or n in out.ends:
            continue
        why = _why_not(n, ctx)
        if why is None and comm_kind(n) == Comm.F:
            out.entries[n] = ctx.p(n.args[0])
            continue
        d = None
        if why is None:
            try:
                d = apply_rule(rule_for(n), n, ctx)
            except NoRule as e:
                why = str(e)
        if d is not None:
            why = _reads_sharded_whole(n, d, ctx)
        if why is not None:
            out.ends[n] = why
            continue
        out.decisions[n] = d
        ctx.placements[n] = d.out
        if is_sharded(d.out):
            for u in n.users:
                heapq.heappush(heap, (order[u], id(u), u))


def _why_not(n: Node, ctx: Ctx) -> str | None:
    """Why n cannot run on sequence blocks, before its rule is asked (None: ask it)."""
    kind = comm_kind(n)
    if n.op == "output":
        return "the model's outputs are whole"
    if kind == Comm.F:
        blocks = {ctx.p(a) for a in n.all_input_nodes}
        return None if len(blocks) == 1 and is_sharded(next(iter(blocks))) else "f of a partly sharded value"
    if kind is not None:
        return f"a {kind} collective reads the whole value"
    if rule_for(n) is None:
        return f"no sharding rule for {n.target} (not proven token-wise)"
    return None


def _reads_sharded_whole(n: Node, d: Decision, ctx: Ctx) -> str | None:
    """A decision that would read a sequence block as the whole value, or needs a rewrite this pass has not."""
    whole = [a for a in d.enter if is_sharded(ctx.placements.get(a))]
    if whole:
        return f"reads {whole[0].name} whole"
    if d.role not in (None, Role.REDUCE):
        return f"its rule makes it a {d.role} GEMM"
    return None

