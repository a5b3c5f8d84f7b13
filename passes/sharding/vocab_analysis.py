"""Vocabulary parallelism: the token embedding and the LM head share one shard of the vocabulary.

Pattern: the token embedding is the largest aten.embedding over a weight parameter whose ids are an integer model
input (through views and copies only: not positions computed from an arange or a mask); its rows are the
vocabulary V. Each rank keeps rows [r*V/t, (r+1)*V/t): it looks up the ids in its range, zeroes the others, and
all-reduces (one all-reduce forward, none backward). A GEMM with a weight parameter whose output features are V
and whose logits reach the output (or whose weight is the embedding's, when tied) and that no region claimed is the
LM head: column-parallel over the vocabulary, its input through f, and its logits all-gathered so the caller sees
the full logits, unless they flow only into the loss ([Note: the loss of sharded logits]). Tied weights share the
one shard, so their gradients meet in the same local tensor. Why it is safe: both are exact reformulations with the
sums and concatenations done by the collectives.

[Note: the loss of sharded logits]
    When the loss is traced with the model (fxpar/trace.py), the logits may flow only into the loss. Then they are
    not gathered: their sharding is propagated with the op rules (views, the fp32 cast, a shift) to the ops that
    close it, the vocab-parallel cross-entropy, logsumexp and gather (passes/sharding/loss_rules.py, vocab_kernels.py),
    which all-reduce per-token values only. If any path cannot be closed so (the logits are also an output, or an op has
    no rule), the head gathers its logits as before and the plan says why.

[Note: an untied head alone]
    The LM head is the GEMM whose rows match the table's; when none does (moshi's table has 65 rows, its vocabulary
    and one more id, its head 64; a head over another vocabulary than the input's), it is a GEMM of its own weight
    whose logits reach the output and that is at least as wide as its input. A table t does not divide stays
    whole, but an untied head is still column-parallel over its rows when t divides them: a head is exact over any
    rows it owns; only the lookup needs the table's rows split.
"""
from __future__ import annotations

import dataclasses

import torch
from torch.fx import Node

from fxpar.passes.sharding.analysis import Analysis, Region, activations_of, spread
from fxpar.passes.ir.meta import USER, input_of, module_path
from fxpar.passes.ir.op_families import GEMMS, SAME_VALUES
from fxpar.passes.ir.placements import Replicate, Shard, plain_shard
from fxpar.passes.sharding.rules import GEMM_WEIGHT_ARG, Ctx, Decision, NoRule, Role, other_use

aten = torch.ops.aten




def _ids_are_an_input(ids) -> bool:
    """The lookup's ids are a model input, reshaped or copied at most (token ids, not computed positions)."""
    while isinstance(ids, Node) and ids.op == "call_function" and ids.target in SAME_VALUES:
        ids = ids.args[0]
    return isinstance(ids, Node) and ids.op == "placeholder" and input_of(ids).kind == USER


def _embeddings(gm, params):
    return [
        n for n in gm.graph.nodes
        if n.op == "call_function" and n.target is aten.embedding.default and n.args[0] in params
        and _ids_are_an_input(n.args[1])
    ]




def _reaches_output(n: Node) -> bool:
    """Some path from n reaches the graph's output without passing another GEMM: logits, not a hidden state that
    a later layer multiplies (a GEMM with H = V output features inside a layer is not the LM head)."""
    seen, todo = set(), [n]
    while todo:
        for u in todo.pop().users:
            if u.op == "output":
                return True
            if u not in seen and not (u.op == "call_function" and u.target in GEMMS):
                seen.add(u)
                todo.append(u)
    return False


def _heads(gm, params, analysis: Analysis, vocab: int, weight: Node):
    """Linear GEMMs over the vocabulary that no region decided, whose input is replicated, whose own weight (an
    untied head's) has no other use ([Note: every use is proven] in analysis.py), and whose logits reach the output
    (an untied head's: with its weight's rows V it could be any GEMM of H = V features). vocab None: the table
    stays whole, and an untied head is one with at least as many rows as features, t dividing them."""
    for n in gm.graph.nodes:
        if n.op != "call_function" or n.target is not aten.linear.default or n in analysis.decisions:
            continue
        w = n.args[1]
        rows, features = tuple(w.meta["val"].shape) if w in params else (0, 0)
        if w not in params or not (w is weight or rows == vocab or (vocab is None and rows >= features)):
            continue
        if w is not weight and rows % analysis.t:
            continue
        if w is not weight and not _reaches_output(n):
            continue
        if w is not weight and other_use(w, n) is not None:
            continue
        if not isinstance(analysis.placements.get(n.args[0], Replicate()), Replicate):
            continue
        yield n


def _plain_lookup(e: Node) -> bool:
    """aten.embedding(weight, ids[, padding_idx]) without scale_grad_by_freq or sparse gradients."""
    return not any(e.args[3:5]) and not e.kwargs.get("scale_grad_by_freq") and not e.kwargs.get("sparse")


def vocab_analysis(gm, analysis: Analysis, params: set[Node]) -> Analysis:
    """Add the vocab-parallel embedding and LM head decisions to `analysis` (in place; returns it)."""
    t = analysis.t
    embeddings = _embeddings(gm, params)
    if t == 1 or not embeddings:
        return analysis
    table = max(embeddings, key=lambda n: n.args[0].meta["val"].shape[0]).args[0]
    vocab = table.meta["val"].shape[0]
    record = Region(module_path(next(iter(table.users))), [], kind="vocab")
    heads = list(_heads(gm, params, analysis, vocab, table)) or list(_heads(gm, params, analysis, None, None))
    others = [u for u in table.users if not (u.target is aten.embedding.default and u.args[0] is table
                                              and _plain_lookup(u)) and u not in heads]
    if vocab % t or others:
        record.replicated = [table.name]
        record.reason = (
            f"vocabulary {vocab} not divisible by t={t}: pad it to {-(-vocab // t) * t}"
            if vocab % t else f"{table.name} is also read by {others[0].name} (module "
                              f"{module_path(others[0]) or '<root>'}), neither a plain embedding lookup nor the LM head"
        )
        if not others:  # [Note: an untied head alone]
            _shard_heads(gm, analysis, params, record, [h for h in heads if h.args[1] is not table])
        analysis.regions.append(record)
        return analysis
    for e in table.users:
        if e.target is aten.embedding.default:
            analysis.decisions[e] = Decision(Replicate(), role=Role.VOCAB_EMBEDDING)
            record.columns.append(e.name)
            record.modules[e.name] = module_path(e)
    _shard_heads(gm, analysis, params, record, heads)
    analysis.param_specs[table] = plain_shard(0, vocab)
    analysis.regions.append(record)
    return analysis


def _shard_heads(gm, analysis: Analysis, params: set[Node], record: Region, heads: list[Node]) -> None:
    """Each head column-parallel over its rows: its input through f, its logits kept sharded into the loss or
    gathered. The analysis' refusal of each (its logits reach the output) gives way to this."""
    names = {h.name for h in heads}
    analysis.regions[:] = [r for r in analysis.regions if r.columns or not names & set(r.replicated)]
    for h in heads:
        spec = plain_shard(0, h.args[1].meta["val"].shape[0])
        enter = {h.args[0]: None}
        analysis.param_specs[h.args[1]] = spec
        bias = h.args[2] if len(h.args) > 2 and isinstance(h.args[2], Node) else None
        if bias is not None and bias in params and other_use(bias, h) is None:
            analysis.param_specs[bias] = spec
        elif bias is not None:
            enter[bias] = spec  # read elsewhere too: it stays whole and is scattered here
        analysis.decisions[h] = Decision(Replicate(), enter, role=Role.VOCAB_HEAD)
        record.rows.append(h.name)
        record.modules[h.name] = module_path(h)
        _keep_sharded(gm, analysis, h, params, record)


def _keep_sharded(gm, analysis: Analysis, head: Node, params: set[Node], record: Region) -> None:
    """[Note: the loss of sharded logits] Keep the head's logits sharded if every path from them ends in a loss op
    over the vocabulary (a cross-entropy, a logsumexp, the target's gather: passes/sharding/loss_rules.py) or another
    closing rule; else they are gathered, and the record says why."""
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    ctx = Ctx(dict(analysis.placements), analysis.t, params)
    ctx.placements[head] = Shard(head.meta["val"].dim() - 1, (head.meta["val"].shape[-1],))
    decisions, specs = {}, {}
    frozen = dict.fromkeys(analysis.decisions, "an earlier region")
    try:
        spread([head], decisions, specs, ctx, order, frozen, activations_of(gm))
    except NoRule as e:
        record.logits += f"{head.name}: gathered ({e}); "
        return
    analysis.decisions[head] = dataclasses.replace(analysis.decisions[head], out=ctx.placements[head],
                                                   role=Role.VOCAB_HEAD_LOCAL)
    analysis.decisions.update(decisions)
    analysis.placements.update({n: ctx.placements[n] for n in [head, *decisions]})
    analysis.param_specs.update(specs)
    closing = [n.name for n, d in decisions.items() if d.role]
    record.logits += f"{head.name}: kept sharded into {', '.join(closing)}; "


__all__ = ["vocab_analysis", "GEMM_WEIGHT_ARG", "Shard"]
