"""What normalizes the traced loss: a mean over valid tokens, and the program that counts them.

[Note: whole-batch semantics]
    A token-mean loss, `cross_entropy(logits, labels, ignore_index=-100)` (mean reduction), is S / n: the sum of
    the per-token losses over the n targets that are not ignore_index. Over a global batch cut into d dp slices of
    m microbatches, one process computes (sum of all S_i) / N with N the sum of all n_i; the mean of the microbatch
    means equals it only when every n_i is the same. Instruction tuning and packed sequences never have that. So
    step() counts every microbatch's valid targets before it runs (each rank holds the global batch, so no
    collective is needed), and weights microbatch i's loss by n_i * d / N instead of 1 / m: the dp reduction's mean
    over d then gives exactly the whole batch's S / N, for the loss and every gradient. A microbatch with no valid
    target (n_i = 0, its loss 0/0) contributes nothing to the loss and a zero seed to its backward: ATen's and the
    vocab-parallel cross-entropy's gradients are zero there (every target is ignored).

    Proven here, on the traced program: its one output is, through casts, views and multiplications by a Python
    number, an `aten.cross_entropy_loss` / `nll_loss_nd` / `nll_loss` with mean reduction, and the target it reads
    (and its class weights, if any) is computed from the call's inputs alone (labels, a shift, a pad, views): never
    from a parameter, a buffer or a random draw. Then `TokenCount` holds that computation as a graph of its own,
    and counts `target != ignore_index` (with class weights, the loss divides by the sum of the valid targets'
    weights, and so does step(): n_i is that sum). Anything else keeps the microbatch mean, and the plan says why.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.fx import Graph, GraphModule, Node

from fxpar.passes.ir.aliasing import Storage, writes
from fxpar.passes.ir.meta import USER, input_of, module_path, upstream
from fxpar.passes.ir.op_families import CASTS, SCALINGS, TOKEN_MEANS, VIEWS

aten = torch.ops.aten

_MEAN = 1  # at::Reduction::Mean
_PASS = CASTS | VIEWS | {aten.alias.default, aten.clone.default, aten.squeeze.default, aten.detach.default}


@dataclass(frozen=True)
class TokenCount:
    """Counts one microbatch's valid targets: `program(*inputs)` is the target the loss reads, from the call's flat
    inputs at `indices` (the user inputs, target included: [Note: the loss is traced] in fxpar/trace.py)."""

    program: GraphModule  # the target, and the class weights where the loss has them
    indices: tuple[int, ...]
    ignore_index: int
    what: str  # the loss, in words, for the plan

    def __call__(self, flat: list) -> float:
        """The microbatch's denominator: its count of valid targets, or their class weights' sum."""
        with torch.no_grad():
            target, *weight = self.program(*(flat[i] for i in self.indices))
            valid = target != self.ignore_index
            if weight:
                return float(weight[0][target.masked_fill(~valid, 0)].masked_fill(~valid, 0).double().sum())
            return float(valid.sum())


def token_count(gm: GraphModule) -> tuple[TokenCount | None, str]:
    """(TokenCount, "") where the one output of `gm` (a program traced with its loss) is a proven token mean;
    else (None, why not)."""
    out = next(n for n in gm.graph.nodes if n.op == "output").args[0]
    if not isinstance(out, (tuple, list)) or len(out) != 1 or not isinstance(out[0], Node):
        return None, "the traced program does not end in one loss"
    loss = _through_scales(out[0])
    if loss.op != "call_function" or loss.target not in TOKEN_MEANS:
        return None, f"the loss ends in {_name(loss)}, not a cross-entropy or nll_loss (mean over valid targets)"
    kw = loss.normalized_arguments(gm, normalize_to_only_use_kwargs=True).kwargs
    where = f"{loss.target.__name__} at {module_path(loss) or '<root>'}"
    if kw.get("reduction", _MEAN) != _MEAN:
        return None, f"{where} is not mean-reduced (reduction={kw['reduction']}): each microbatch's loss is averaged"
    target, weight = kw["target"], kw.get("weight")
    for what, value in (("target", target), ("class weights", weight)):
        bad = _not_from_inputs(value) if isinstance(value, Node) else None
        if bad is not None:
            return None, f"the {what} of {where} is computed from {bad}, not from the call's inputs alone"
    program, indices = _extract([target] if weight is None else [target, weight])
    ignore = int(kw.get("ignore_index", -100))
    return TokenCount(program, indices, ignore, f"{where}, ignore_index={ignore}"), ""


def _through_scales(n: Node) -> Node:
    """The loss under casts, views and multiplications or divisions by a Python number (linear in S / n)."""
    while n.op == "call_function":
        if n.target in _PASS:
            n = n.args[0]
        elif n.target in SCALINGS and isinstance(n.args[1], (int, float)) and isinstance(n.args[0], Node):
            n = n.args[0]
        else:
            break
    return n


def _name(n: Node) -> str:
    return getattr(n.target, "__name__", str(n.target)) if n.op == "call_function" else n.op


def _ancestors(n: Node) -> list[Node]:
    """n and every node it depends on, in graph order."""
    seen = set(upstream(n))
    return [x for x in n.graph.nodes if x in seen]


def _not_from_inputs(target: Node) -> str | None:
    """What makes `target` more than a function of the call's inputs (a weight, a random draw, a write into it by
    a node the count would not run), or None."""
    ancestors = _ancestors(target)
    storage, mine = Storage(), set(ancestors)
    roots = {r for a in ancestors for r in storage.roots(a)}
    for n in target.graph.nodes:
        written = writes(n)
        hit = n.all_input_nodes if written is None else written
        if n not in mine and any(storage.roots(w) & roots for w in hit):
            return f"{n.name} ({_name(n)}), which writes into it in place"
    for a in ancestors:
        if a.op == "placeholder" and input_of(a).kind != USER:
            return f"{input_of(a).kind} {input_of(a).key}"
        if a.op == "call_function" and torch.Tag.nondeterministic_seeded in getattr(a.target, "tags", ()):
            return f"a random draw ({a.name})"
        if a.op not in ("placeholder", "call_function", "get_attr"):
            return f"{a.op} {a.target}"
    return None


def _extract(values: list[Node]) -> tuple[GraphModule, tuple[int, ...]]:
    """A graph of its own that computes `values` from the user inputs they read."""
    gm = values[0].graph.owning_module
    graph, env, indices, attrs = Graph(), {}, [], torch.nn.Module()
    needed = {a for v in values for a in _ancestors(v)}
    for a in [n for n in gm.graph.nodes if n in needed]:
        if a.op == "placeholder" and input_of(a).kind == USER:
            env[a] = graph.placeholder(a.name)
            indices.append(input_of(a).index)
        elif a.op == "get_attr":
            setattr(attrs, a.target.replace(".", "_"), getattr(gm, a.target))
            env[a] = graph.get_attr(a.target.replace(".", "_"))
        else:
            env[a] = graph.node_copy(a, lambda x: env[x])
    graph.output(tuple(env[v] for v in values))
    return GraphModule(attrs, graph, class_name="TokenCount"), tuple(indices)


@dataclass(frozen=True)
class LossNormalization:
    """How step() weights the microbatch losses ([Note: whole-batch semantics]): by each one's share of the global
    batch's valid targets (`count` proven), or equally (`why` not)."""

    count: TokenCount | None
    why: str = ""

    def line(self) -> str:
        if self.count is not None:
            return (f"a mean over valid targets ({self.count.what}): step() weights microbatch i by n_i * d / N, N the "
                    "global batch's count of valid targets, as one process on the whole batch")
        return f"each microbatch's loss weighted 1 / m (its own normalization, not proven a token mean: {self.why})"


def loss_normalization(gm: GraphModule) -> LossNormalization:
    """The normalization of a program traced with its loss (see token_count)."""
    count, why = token_count(gm)
    return LossNormalization(count, why)
