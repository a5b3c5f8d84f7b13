"""What each layer communicates: the collectives of the tensor-parallel graph, layer by layer, each under the pass
that runs it, against Megatron's layer (Shoeybi et al. 2019, Sec. 3): 2 activation all-reduces forward (g) and 2
backward (f); with sequence parallelism (Korthikanti et al. 2022, Sec. 4.2.2) 2 all-gathers and 2 reduce-scatters
forward, and backward their conjugates (2 reduce-scatters, 2 all-gathers) plus 2 all-gathers of the blocks saved
for the column-parallel GEMMs: 4 + 6.

Glossary
    forward    the collectives that move activations in forward: g's all-reduce, all-gathers, reduce-scatters
    backward   those that move activation gradients in backward: f's all-reduce, a scatter's all-gather, the
               sequence-parallel conjugates and the all-gathers again of saved blocks. A collective whose kind runs
               one in each pass (seq_gather: all-gather forward, reduce-scatter backward) is listed under both, once
               per collective it runs there (CommInfo.runs, passes/ir/meta.py)
    small      the rest, which move at most a few values per token or a weight's gradient: the all-reduce of a
               partial statistic (`stat`, and its f), f of a replicated weight read inside a region (its gradient
               summed, as Megatron does a QK-norm's), f of a per-token factor that scales a partial sum (a routing
               weight, passes/tensor_parallel/merge_comm.py), a weight's or buffer's scatter, the vocabulary's per-token
               all-reduces, seq_weights
    layer      an entry of the stacks passes/frontend/layers.py finds (`model.layers.3`); a collective belongs to the
               layer of the value it moves. Collectives outside every layer (the vocabulary's, a final norm's f) are
               listed under "outside the layers".
    shape      the tensor a collective reads on this rank: the value in forward (and of an all-gather again), the
               gradient of the result in backward

A layer above the bound is a documented choice, never a silent one: its note names every forward collective and the
region (module) that closes with it, so the plan says which regions the layer was split into. A layer the model
applies k times (a looped block: torch.export marks the k-th call of a module `@k` on the node's module stack) is
bounded by k times Megatron's, and counted per application.
"""
from __future__ import annotations

import itertools
from collections import Counter
from dataclasses import dataclass

from tabulate import tabulate

from torch.fx import GraphModule, Node

from fxpar.passes.ir.meta import upstream
from fxpar.passes.ir.op_families import gemm_reading, rows_as_2d
from fxpar.passes.sharding.analysis import activations_of
from fxpar.passes.frontend.layers import calls_of, find_layers
from fxpar.passes.ir.meta import (ALL_GATHER, ALL_REDUCE, FXPAR_SCALE, REDUCE_SCATTER, REGATHER, Comm, comm_kind,
                                  module_path)

BOUND = 2  # activation all-reduces per layer, each way, in Megatron's layout (without sequence parallelism)
MEGATRON = {  # Megatron's collectives per layer, (forward, backward), by op; with sequence parallelism or not
    False: (Counter({ALL_REDUCE: BOUND}), Counter({ALL_REDUCE: BOUND})),
    True: (Counter({ALL_GATHER: 2, REDUCE_SCATTER: 2}), Counter({REGATHER: 2, REDUCE_SCATTER: 2, ALL_GATHER: 2})),
}
OUTSIDE = "outside the layers"
DP_ROW = "dp buckets (once a step)"  # the dp gradient reduction, in the last microbatch's backward program
FORWARD, BACKWARD = "forward", "backward"  # the halves of a joint program
_SEQUENCE = frozenset({Comm.SEQ_GATHER, Comm.SEQ_REDUCE_SCATTER, Comm.SEQ_GATHER_LINEAR})
_SMALL_F = {"f weight", "f stat", "f scale"}  # an f that kind_of finds moves a weight's or a statistic's gradient
# kinds that belong to the layer that reads them (they enter its region)
_ENTERING = frozenset({Comm.F, Comm.SCATTER, Comm.SEQ_GATHER, Comm.SEQ_GATHER_LINEAR, Comm.SEQ_WEIGHTS}) | _SMALL_F


def _runs(kind) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The activation collectives a kind runs, in forward and in backward (none: a small one)."""
    return kind.info.runs if isinstance(kind, Comm) else ((), ())


@dataclass(frozen=True)
class Collective:
    kind: str  # a Comm, or "f weight" / "f stat" / "f scale" / "scatter state" for the small ones (kind_of)
    node: str  # the collective's node
    module: str  # the module path of the value it moves
    shape: tuple[int, ...]  # the tensor it reads on this rank (see the glossary)
    op: str = ""  # the collective it runs in the pass it is listed under ("all-gather"); "" for a small one

    @property
    def what(self) -> str:
        """Its kind, and the collective it runs in this pass where its kind runs more than one (sequence
        parallelism's: `all-gather (seq_gather_linear)`)."""
        return f"{self.op} ({self.kind})" if sum(map(len, _runs(self.kind))) > 1 else str(self.kind)

    def __str__(self) -> str:
        return f"{self.what} of {self.module or '<root>'} [{'x'.join(map(str, self.shape))}]"


@dataclass(frozen=True)
class LayerComm:
    layer: str
    forward: tuple[Collective, ...]  # one per collective run in forward
    backward: tuple[Collective, ...]  # one per collective run in backward
    small: tuple[Collective, ...]
    calls: int = 1  # how many times the model applies the layer

    @property
    def sequence(self) -> bool:
        """The layer runs on sequence blocks between its regions (sequence parallelism)."""
        return any(c.kind in _SEQUENCE for c in (*self.forward, *self.backward))

    @property
    def megatron(self) -> tuple[Counter, Counter]:
        """Megatron's collectives for this layer's layout and applications, (forward, backward), by op."""
        return tuple(Counter({op: n * self.calls for op, n in half.items()}) for half in MEGATRON[self.sequence])

    @property
    def bound(self) -> tuple[int, int]:
        forward, backward = self.megatron
        return forward.total(), backward.total()

    @property
    def above_bound(self) -> bool:
        forward, backward = self.bound
        return self.layer != OUTSIDE and (len(self.forward) > forward or len(self.backward) > backward)

    @property
    def note(self) -> str:
        """Why the layer costs more than Megatron's layout: the regions it was split into, by their collectives."""
        parts, (forward, backward) = [], self.bound
        if len(self.forward) > forward:
            parts.append((f"{len(self.forward)} in forward, Megatron's {forward}: " if self.sequence else
                          f"{len(self.forward)} regions, each closed by its own collective: ")
                         + ", ".join(map(str, self.forward)))
        if len(self.backward) > backward:
            parts.append(f"{len(self.backward)} in backward: " + ", ".join(map(str, self.backward))
                         + (" (a scatter: a replicated activation read inside a region, all-gathered in backward)"
                            if any(c.kind == "scatter" for c in self.backward) else ""))
        if parts and self.calls > 1:
            parts.insert(0, f"applied {self.calls} times")
        return "; ".join(parts)


def _of_statistic(n: Node) -> bool:
    """n is computed from a `stat` all-reduce (an RMSNorm's rsqrt of the mean over all heads) before any other
    collective: its f carries b*s values, not an activation."""
    return any(comm_kind(a) == "stat" for a in upstream(n, through=lambda a: comm_kind(a) is None))


def _floating(n: Node) -> bool:
    value = n.meta.get("val")
    return value is not None and getattr(value, "is_floating_point", lambda: False)()


def kind_of(n: Node, activations: set[Node]) -> str | None:
    """The collective n calls, with f of a weight, f of a statistic and the scatter of a weight or buffer told apart
    ("f weight", "f stat", "scatter state"); activations: the graph's nodes computed from a model input."""
    kind = comm_kind(n)
    if kind == "scatter" and not (n.args[0] in activations and _floating(n.args[0])):
        return "scatter state"  # a weight, buffer or integer value: its all-gather in backward is small or none
    if kind == "f" and n.args[0] not in activations:
        return "f weight"
    if kind == "f" and n.meta.get(FXPAR_SCALE):
        return "f scale"
    if kind == "f" and _of_statistic(n.args[0]):
        return "f stat"
    return kind


def _shape(n: Node) -> tuple[int, ...]:
    value = n.meta.get("val")
    return tuple(value.shape) if isinstance(getattr(value, "shape", None), tuple) else ()


def _joins_its_gemms(n: Node) -> bool:
    """A seq_gather that gathered_gemms_pass (passes/tensor_parallel/sequence_parallel.py) will join with the GEMMs
    reading it, by that pass's own tests: every reader a GEMM taking it (or its rows viewed as 2-D) as the input. It
    runs as seq_gather_linear: the block saved, gathered again in backward."""
    reader = rows_as_2d(n) or n
    return bool(reader.users) and all(gemm_reading(u, reader) is not None for u in reader.users)


def audit(gm: GraphModule) -> tuple[LayerComm, ...]:
    """Every layer's collectives in the tensor-parallel graph `gm`, in layer order, then those outside the layers
    (omitted when there are none). A layer with no collective is listed too."""
    layers, activations = find_layers(gm), activations_of(gm)
    entries = list(layers.sequence) or list(dict.fromkeys(layers.entry_of.values()))
    found: dict[str, tuple[list, list, list]] = {e: ([], [], []) for e in entries}  # forward, backward, small
    calls: dict[str, set[str]] = {}
    for n in gm.graph.nodes:
        if (layer := layers.entry_of.get(n)) is not None:
            calls.setdefault(layer, set()).update(calls_of(n, layer))
        kind = kind_of(n, activations) if comm_kind(n) else None
        if kind is None:
            continue
        if kind == Comm.SEQ_GATHER and _joins_its_gemms(n):
            kind = Comm.SEQ_GATHER_LINEAR  # what runs
        src = n.args[0]
        # an f (or scatter) belongs to the layer whose region it enters, a g to the one whose region it closes
        reader = next(iter(n.users), src) if kind in _ENTERING and n.users else src
        forward, backward, small = found.setdefault(layers.entry_of.get(reader, OUTSIDE), ([], [], []))
        module, (ahead, back) = module_path(reader), _runs(kind)
        if not ahead and not back:
            small.append(Collective(kind, n.name, module, _shape(src)))
        forward += [Collective(kind, n.name, module, _shape(src), op) for op in ahead]
        # backward reads the gradient of n's result (n's shape), or the block saved in forward (src's)
        backward += [Collective(kind, n.name, module, _shape(src if op == REGATHER else n) or _shape(src), op)
                     for op in back]
    if not any(found.get(OUTSIDE, ())):
        found.pop(OUTSIDE, None)
    return tuple(LayerComm(layer, *map(tuple, cs), max(1, len(calls.get(layer, ())))) for layer, cs in found.items())


def per_layer(comm: tuple[LayerComm, ...]) -> tuple[float, float]:
    """Forward and backward activation collectives per layer and application, the mean over the layers (0, 0 with
    none)."""
    inside = [c for c in comm if c.layer != OUTSIDE]
    if not inside:
        return 0.0, 0.0
    return (sum(len(c.forward) / c.calls for c in inside) / len(inside),
            sum(len(c.backward) / c.calls for c in inside) / len(inside))


@dataclass(frozen=True)
class ProgramComm:
    """One layer's collectives in the joint programs that run it (passes/joint/comm_table.py)."""

    layer: str
    forward: tuple[str, ...]  # the functional collectives of the forward program, by op ("all_reduce"), in order
    backward: tuple[str, ...]
    comm_s: float = 0.0  # their time, estimated from a cluster's link rates (0: not estimated)
    exposed_s: float = 0.0  # what of it no compute hides (between each collective's start and its wait)
    hidden_gemms: int = 0  # the GEMMs that run while one of its collectives is in flight

    @staticmethod
    def cell(ops: tuple[str, ...]) -> str:
        return ", ".join(f"{n} {op}" for op, n in Counter(ops).items()) or "-"


def program_table(rows: tuple[ProgramComm, ...], cluster: str = "") -> str:
    """One row per run of consecutive layers with the same collectives (`model.layers.0..11`); with the name of the
    cluster the times were estimated for, each layer's communication and what stays exposed, in microseconds."""
    out = []
    for key, run in itertools.groupby(rows, key=lambda r: (ProgramComm.cell(r.forward), ProgramComm.cell(r.backward),
                                                           r.layer if r.layer in (OUTSIDE, DP_ROW) else "",
                                                           r.hidden_gemms,
                                                           round(r.comm_s * 1e6, 1), round(r.exposed_s * 1e6, 1))):
        rs = list(run)
        span = rs[0].layer if len(rs) == 1 else f"{rs[0].layer}..{rs[-1].layer.rsplit('.', 1)[-1]}"
        out.append([span, key[0], key[1], key[3], *([key[4], key[5]] if cluster else [])])
    times = [f"comm us ({cluster})", "exposed us"] if cluster else []
    return tabulate(out, headers=["layers", "forward program", "backward program", "GEMMs overlapped", *times])
