"""The expert chains of a graph: where a mixture-of-experts layer's experts run, found by what they compute.

Hugging Face's experts (passes/frontend/grouped_gemm.py) sort the k * T (token, expert) pairs by expert, gather each
pair's token row, and run every expert on its run of rows:

    ids, perm = sort(top_k_index.reshape(-1))                   the rows' experts, ascending
    offs      = cumsum(histc(ids.float(), bins=E, min=0, max=E-1))   where each expert's rows end
    x         = hidden[perm // k]                                [S, h], S = k * T rows, sorted by expert
    h1        = grouped(x, W1, offs) (+ b1[ids])                 each row times its expert's slice of W1 [E, ...]
    h2        = act(h1) ...                                      row-wise
    y         = grouped(h2, W2, offs) (+ b2[ids])                [S, h]
    ... y * weights[perm], back to token order, summed over k   (outside the chain: it stays as the model wrote it)

(In bf16 Hugging Face calls torch's own kernel instead, aten._grouped_mm(x, W.transpose(-2, -1), offs): the same
chain. Its batched_mm experts keep the rows in (token, k) order and multiply each by its own expert's weights,
bmm(W[ids], x.unsqueeze(-1)) with ids = top_k_index.reshape(-1): a chain keyed by those ids instead of offsets,
whose rows the dispatcher sorts by expert itself.) An expert chain is the part from x to y: grouped GEMMs sharing
one `offs`, the ops between them, and the per-expert biases added after the last. Each of its rows depends only on
the same row of x and on that row's expert, which is what lets expert parallelism move rows between ranks, run each
expert where its weights are, and move the results back to the same rows: nothing else in the model changes, so the
router, the weighted sum over k (its order and dtype) and the auxiliary losses stay the reference's own ops on the
reference's own values.

What is checked, for each chain (else it is not a chain, the experts stay as tensor parallelism leaves them, and
`reasons` says why, with the node and its module path):
    - `offs` is cumsum(histc(ids, E, 0, E-1)) of `ids`, the values of a sort: the rows are sorted by expert and offs
      counts them (each integer id in [0, E-1] falls in its own bin of histc); the dispatcher checks at run time that
      every row is counted (offs[-1] == S: no id outside [0, E-1]);
    - every grouped GEMM's weight is a parameter [E, ...]; every other tensor a chain op reads is a chain node, x,
      a per-expert bias gathered by the rows' experts (`b[ids]`, b a parameter [E, ...]), or a 0-d tensor;
    - every op between is row-wise: pointwise (torch.Tag.pointwise), a cast, or a split or slice of the last dim;
      no op writes in place into x;
    - one node of the chain is read outside it (y), with S rows.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass, field

import torch
from torch.fx import GraphModule, Node

from fxpar.passes.frontend.grouped_gemm import GROUPED_LINEAR, GROUPED_MM
from fxpar.passes.ir.meta import PARAMETER, input_of, module_path
from fxpar.passes.ir.op_families import CASTS, SPLITS, SQUEEZES

aten = torch.ops.aten
# fxpar's grouped GEMMs (Hugging Face's fallback loop, passes/frontend/grouped_gemm.py) and torch's own, which
# Hugging Face calls where its kernel runs (bf16 on CPU): aten._grouped_mm(x [S, K], W [E, K, N], offs)
GROUPED = (GROUPED_LINEAR, GROUPED_MM, aten._grouped_mm.default)
_BMM = aten.bmm.default  # batched_mm experts: bmm(W[ids], x[:, :, None]) or bmm(x[:, None], W[ids]), row by row
_LAST_DIM = SPLITS | {aten.slice.Tensor}


@dataclass
class ExpertChain:
    """One layer's experts: the rows x sorted by expert, `offs` and the sorted `ids`, the grouped GEMMs, their
    weights, the per-expert bias gathers, every node from the first GEMM to `out` (graph order)."""

    x: Node
    offs: Node | None  # None: batched_mm experts, the rows in any order (the dispatcher sorts them by `ids`)
    ids: Node
    experts: int  # E
    grouped: list[Node]
    weights: list[Node]  # parameter placeholders [E, ...], read by the grouped GEMMs (directly, or transposed)
    biases: list[Node]  # `b[ids]` gathers, b a parameter [E, ...]
    nodes: list[Node]
    out: Node
    module: str = ""
    params: list[Node] = field(default_factory=list)  # every parameter split over the experts: weights, then biases
    keys: tuple[str, ...] = ()  # their state keys

    def __post_init__(self):
        self.params = list(dict.fromkeys(self.weights + [b.args[0] for b in self.biases]))
        self.keys = tuple(input_of(p).key for p in self.params)


@dataclass
class Experts:
    """The expert chains of a graph, and why each grouped GEMM outside one is not in one."""

    chains: list[ExpertChain] = field(default_factory=list)
    reasons: list[str] = field(default_factory=list)

    def lines(self) -> list[str]:
        return [f"{c.module or c.out.name}: {c.experts} experts, {len(c.grouped)} "
                f"{'batched' if c.offs is None else 'grouped'} GEMMs from {c.x.name} to {c.out.name}"
                for c in self.chains] + self.reasons


def find_experts(gm: GraphModule) -> Experts:
    by_offs: dict[Node, list[Node]] = {}
    for n in gm.graph.nodes:
        if n.op == "call_function" and n.target in GROUPED and isinstance(_offs(n), Node):
            by_offs.setdefault(_offs(n), []).append(n)
        elif n.op == "call_function" and n.target is _BMM and _gathered(n) is not None:
            by_offs.setdefault(_gathered(n).args[1][0], []).append(n)  # keyed by the rows' expert ids
    found = Experts()
    for key, grouped in by_offs.items():
        chain = _chain(key, grouped) if grouped[0].target in GROUPED else _batched(key, grouped)
        if isinstance(chain, str):
            first = grouped[0]
            found.reasons.append(f"{module_path(first) or first.name}: the experts stay as tensor parallelism "
                                 f"leaves them (not expert-parallel): {chain}")
        else:
            found.chains.append(chain)
    return found


def _offs(n: Node):
    return n.args[2] if len(n.args) > 2 else n.kwargs.get("offs")


def _gathered(n: Node) -> Node | None:
    """The `W[ids]` operand of a bmm, W a parameter [E, ...] gathered by 1-D ids (batched_mm experts), or None."""
    for a in n.args[:2]:
        if isinstance(a, Node) and a.target is aten.index.Tensor and len(a.args[1]) == 1 \
                and isinstance(a.args[1][0], Node) and a.args[1][0].meta["val"].dim() == 1 \
                and a.args[0].op == "placeholder" and input_of(a.args[0]).kind == PARAMETER:
            return a
    return None


def _weight(n: Node) -> Node:
    """The parameter a grouped GEMM reads, through a transpose of its last two dims (torch's _grouped_mm of W^T);
    a batched one's, through its gather by the rows' ids."""
    if n.target is _BMM:
        return _gathered(n).args[0]
    w = n.args[1]
    if w.op == "call_function" and w.target is aten.transpose.int and sorted(d % 3 for d in w.args[1:]) == [1, 2]:
        return w.args[0]
    return w


def _rows(n) -> int | None:
    v = n.meta.get("val") if isinstance(n, Node) else None
    return int(v.shape[0]) if isinstance(v, torch.Tensor) and v.dim() else None


def _sorted_ids(offs: Node) -> Node | str:
    """The sort's values node that `offs` counts, or why offs is not cumsum(histc(ids, E, 0, E-1))."""
    if offs.target is not aten.cumsum.default or offs.args[1:2] != (0,):
        return f"{offs.name}, the grouped GEMMs' offsets, is {offs.target}, not the cumsum of a histc over the experts"
    hist = offs.args[0]
    if not isinstance(hist, Node) or hist.target is not aten.histc.default:
        return f"{offs.name} sums {getattr(hist, 'name', hist)}, not a histc of the rows' experts"
    values = offs.meta["val"]
    e = int(values.shape[0])
    bins, lo, hi = (list(hist.args[1:]) + [100, 0, 0][len(hist.args) - 1:])[:3]
    if (bins, lo, hi) != (e, 0, e - 1):
        return f"{hist.name} is histc(bins={bins}, min={lo}, max={hi}), not one bin per expert of {e} over [0, {e - 1}]"
    ids = hist.args[0]
    if isinstance(ids, Node) and ids.target in CASTS:
        ids = ids.args[0]
    sort = ids.args[0] if isinstance(ids, Node) and ids.target is operator.getitem \
        and ids.args[1] == 0 else None
    if not isinstance(sort, Node) or sort.target not in (aten.sort.default, aten.sort.stable) \
            or sort.args[0].meta["val"].dim() != 1 or sort.kwargs.get("descending") or \
            (sort.target is aten.sort.default and len(sort.args) > 2 and sort.args[2]):
        return f"{hist.name} counts {getattr(ids, 'name', ids)}, not the ascending sort of the rows' experts"
    return ids


def _batched(ids: Node, grouped: list[Node]) -> ExpertChain | str:
    """The chain of batched_mm experts: bmm's of the rows by their own experts' weights, W[ids]."""
    return _members(None, ids, int(_weight(grouped[0]).meta["val"].shape[0]), grouped)


def _chain(offs: Node, grouped: list[Node]) -> ExpertChain | str:
    ids = _sorted_ids(offs)
    if isinstance(ids, str):
        return ids
    return _members(offs, ids, int(offs.meta["val"].shape[0]), grouped)


def _members(offs: Node | None, ids: Node, e: int, grouped: list[Node]) -> ExpertChain | str:
    """The chain of `grouped` over rows whose experts are `ids` (sorted, counted by `offs`; or in any order)."""
    s = _rows(ids)
    for g in grouped:
        w = _weight(g)
        if w.op != "placeholder" or input_of(w).kind != PARAMETER or w.meta["val"].dim() != 3 \
                or w.meta["val"].shape[0] != e or (g.target is aten._grouped_mm.default and (
                    g.args[0].meta["val"].dim() != 2 or any(g.kwargs.get(k) is not None for k in ("bias",)))):
            return f"{g.name} reads {w.name}, not a parameter with one slice per expert ({e})"
    last = grouped[-1]
    inside = set(grouped) | (_descendants(grouped) & _ancestors(last))
    nodes = [n for n in last.graph.nodes if n in inside]
    out = last
    while len(out.users) == 1:  # the per-expert biases added after the last GEMM (a batched one's: its squeeze)
        user = next(iter(out.users))
        if not (_pointwise(user) or _row_view(user)) or any(
                _kind(a, inside, ids, e, None) not in ("chain", "bias", "scalar") for a in user.all_input_nodes):
            break
        nodes.append(user)
        inside.add(user)
        out = user
    entries = set()
    for n in nodes:
        why = _row_wise(n, inside, ids, e, offs, entries)
        if why:
            return f"{n.name} ({module_path(n)}): {why}"
    if len(entries) != 1:
        return f"the chain from {grouped[0].name} reads {len(entries)} row inputs ({sorted(x.name for x in entries)})"
    x = entries.pop()
    leaving = [n for n in nodes if any(u not in inside for u in n.users)]
    if leaving != [out]:
        return f"{[n.name for n in leaving]} are read outside the experts; only {out.name} may be"
    if _rows(x) != s or _rows(out) != s:
        return f"{x.name} or {out.name} does not have the {s} rows of {ids.name}"
    biases = [a for n in nodes for a in n.all_input_nodes if _kind(a, inside, ids, e, None) == "bias"]
    return ExpertChain(x, offs, ids, e, grouped, [_weight(g) for g in grouped], list(dict.fromkeys(biases)), nodes,
                       out, module_path(grouped[0]))


def _row_wise(n: Node, inside: set, ids: Node, e: int, offs: Node, entries: set) -> str:
    if n.target in GROUPED:
        kind = _kind(n.args[0], inside, ids, e, entries)
        return "" if kind in ("chain", "entry") and _offs(n) is offs else \
            f"grouped GEMM on {getattr(n.args[0], 'name', n.args[0])} ({kind})"
    if n.target is _BMM:
        kinds = sorted(_kind(a, inside, ids, e, entries) for a in n.args[:2])
        return "" if offs is None and kinds in (["bias", "chain"], ["bias", "entry"]) else \
            f"a bmm of {[a.name for a in n.args[:2]]} ({kinds}), not of the rows by their experts' weights"
    if _row_view(n):
        return "" if _kind(n.args[0], inside, ids, e, entries) in ("chain", "entry") else \
            f"reads {n.args[0].name}, which is not a row of the experts' input"
    if n.op == "call_function" and n.target is operator.getitem:
        return "" if n.args[0] in inside else "reads a value from outside the experts"
    row_op = _pointwise(n) or n.target in CASTS or (n.target in _LAST_DIM and _last_dim(n))
    if not row_op:
        return f"{n.target} is not row-wise (pointwise, a cast, or a split of the last dim)"
    for i, a in enumerate(n.all_input_nodes):
        kind = _kind(a, inside, ids, e, entries)
        if kind == "other":
            return f"reads {a.name}, which is not a row of the experts' input, a per-expert bias or a scalar"
        if kind == "entry" and i == 0 and _in_place(n):
            return f"writes into {a.name} in place"
    return ""


def _kind(a: Node, inside: set, ids: Node, e: int, entries: set | None) -> str:
    if a in inside:
        return "chain"
    v = a.meta.get("val")
    if isinstance(v, torch.Tensor) and v.dim() == 0:
        return "scalar"
    if a.op == "call_function" and a.target is aten.index.Tensor and len(a.args[1]) == 1 and a.args[1][0] is ids:
        p = a.args[0]
        if p.op == "placeholder" and input_of(p).kind == PARAMETER and p.meta["val"].shape[0] == e:
            return "bias"
    if entries is not None and _rows(a) == _rows(ids):
        entries.add(a)
        return "entry"
    return "other"


def _row_view(n: Node) -> bool:
    """An unsqueeze or squeeze of a dim other than the rows' (around a batched expert GEMM)."""
    if n.op != "call_function" or n.target not in SQUEEZES:
        return False
    rank = n.meta["val"].dim() if n.target is aten.unsqueeze.default else n.args[0].meta["val"].dim()
    return n.args[1] % rank != 0


def _pointwise(n: Node) -> bool:
    return n.op == "call_function" and isinstance(n.target, torch._ops.OpOverload) and \
        torch.Tag.pointwise in n.target.tags


def _in_place(n: Node) -> bool:
    return isinstance(n.target, torch._ops.OpOverload) and n.target._schema.name.endswith("_")


def _last_dim(n: Node) -> bool:
    rank = n.args[0].meta["val"].dim()
    at = 1 if n.target is aten.slice.Tensor else 2  # slice(x, dim, ...); split / chunk(x, size, dim)
    dim = n.args[at] if len(n.args) > at else n.kwargs.get("dim", 0)
    return rank >= 2 and dim % rank == rank - 1


def _descendants(start: list[Node]) -> set[Node]:
    return _closure(start, lambda n: n.users)


def _ancestors(end: Node) -> set[Node]:
    return _closure([end], lambda n: n.all_input_nodes)


def _closure(start: list[Node], step) -> set[Node]:
    """Every node reached from `start` by `step` (its users, or its inputs), `start` itself only if reached."""
    seen, todo = set(), list(start)
    while todo:
        for a in step(todo.pop()):
            if a not in seen:
                seen.add(a)
                todo.append(a)
    return seen
