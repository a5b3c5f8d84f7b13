"""What each layer communicates: the collectives of the tensor-parallel graph, layer by layer, against Megatron's
bound of 2 activation all-reduces forward (g) and 2 backward (f) per layer (Shoeybi et al. 2019, Sec. 3).

Glossary
    forward    the collectives that move activations in forward: g (all-reduce) and all-gathers
    backward   those that move activation gradients in backward: f (all-reduce), and a scatter's all-gather
    small      the rest, which move at most a few values per token or a weight's gradient: the all-reduce of a
               partial statistic (`stat`, and its f), f of a replicated weight read inside a region (its gradient
               summed, as Megatron does a QK-norm's), f of a per-token factor that scales a partial sum (a routing
               weight, passes/tensor_parallel/merge_comm.py), a weight's or buffer's scatter, the vocabulary's per-token
               all-reduces
    layer      an entry of the stacks passes/frontend/layers.py finds (`model.layers.3`); a collective belongs to the
    layer of
               the value it moves. Collectives outside every layer (the vocabulary's, a final norm's f) are listed
               under "outside the layers".

A layer above the bound is a documented choice, never a silent one: its note names every forward collective and the
region (module) that closes with it, so the plan says which regions the layer was split into. A layer the model
applies k times (a looped block: torch.export marks the k-th call of a module `@k` on the node's module stack) is
bounded by k times 2 + 2, and counted per application.
"""
from __future__ import annotations

import itertools
from collections import Counter
from dataclasses import dataclass

from tabulate import tabulate

from torch.fx import GraphModule, Node

from fxpar.passes.sharding.analysis import activations_of, upstream
from fxpar.passes.frontend.layers import calls_of, find_layers
from fxpar.passes.ir.meta import FXPAR_SCALE, Comm, comm_kind, module_path

BOUND = 2  # activation all-reduces per layer, each way, in Megatron's layout
OUTSIDE = "outside the layers"
DP_ROW = "dp buckets (once a step)"  # the dp gradient reduction, in the last microbatch's backward program
FORWARD, BACKWARD = "forward", "backward"  # the halves of a joint program
_FORWARD = frozenset(c for c in Comm if c.info.moves == "forward")  # g, all-gather
_BACKWARD = frozenset(c for c in Comm if c.info.moves == "backward")  # f, scatter
_SMALL_F = {"f weight", "f stat", "f scale"}  # an f that kind_of finds moves a weight's or a statistic's gradient
_ENTERING = _BACKWARD | _SMALL_F | {Comm.SEQ_WEIGHTS}  # kinds that belong to the layer that reads them


@dataclass(frozen=True)
class Collective:
    kind: str  # a Comm, or "f weight" / "f stat" / "f scale" / "scatter state" for the small ones (kind_of)
    node: str  # the collective's node
    module: str  # the module path of the value it moves
    shape: tuple[int, ...]  # the value's shape on this rank

    def __str__(self) -> str:
        return f"{self.kind} of {self.module or '<root>'} [{'x'.join(map(str, self.shape))}]"


@dataclass(frozen=True)
class LayerComm:
    layer: str
    forward: tuple[Collective, ...]
    backward: tuple[Collective, ...]
    small: tuple[Collective, ...]
    calls: int = 1  # how many times the model applies the layer

    @property
    def above_bound(self) -> bool:
        bound = BOUND * self.calls
        return self.layer != OUTSIDE and (len(self.forward) > bound or len(self.backward) > bound)

    @property
    def note(self) -> str:
        """Why the layer costs more than Megatron's layout: the regions it was split into, by their collectives."""
        parts = []
        if len(self.forward) > BOUND * self.calls:
            parts.append(f"{len(self.forward)} regions, each closed by its own collective: "
                         + ", ".join(map(str, self.forward)))
        if len(self.backward) > BOUND * self.calls:
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


def audit(gm: GraphModule) -> tuple[LayerComm, ...]:
    """Every layer's collectives in the tensor-parallel graph `gm`, in layer order, then those outside the layers
    (omitted when there are none). A layer with no collective is listed too."""
    layers, activations = find_layers(gm), activations_of(gm)
    entries = list(layers.sequence) or list(dict.fromkeys(layers.entry_of.values()))
    found: dict[str, list[Collective]] = {e: [] for e in entries}
    calls: dict[str, set[str]] = {}
    for n in gm.graph.nodes:
        if (layer := layers.entry_of.get(n)) is not None:
            calls.setdefault(layer, set()).update(calls_of(n, layer))
        kind = kind_of(n, activations) if comm_kind(n) else None
        if kind is None:
            continue
        src = n.args[0]
        value = src.meta.get("val")
        shape = tuple(value.shape) if value is not None and hasattr(value, "shape") else ()
        # an f (or scatter) belongs to the layer whose region it enters, a g to the one whose region it closes
        reader = next(iter(n.users), src) if kind in _ENTERING and n.users else src
        collective = Collective(kind, n.name, module_path(reader), shape)
        found.setdefault(layers.entry_of.get(reader, OUTSIDE), []).append(collective)
    if not found.get(OUTSIDE):
        found.pop(OUTSIDE, None)

    def of(cs, kinds, inside=True):
        return tuple(c for c in cs if (c.kind in kinds) == inside)

    return tuple(LayerComm(layer, of(cs, _FORWARD), of(cs, _BACKWARD), of(cs, _FORWARD | _BACKWARD, inside=False),
                           max(1, len(calls.get(layer, ()))))
                 for layer, cs in found.items())


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
