"""The plan: every sharding decision as data, with a printable table."""
from __future__ import annotations

import itertools
from dataclasses import dataclass

from tabulate import tabulate

from fxpar.passes.sharding.analysis import Analysis, Region
from fxpar.passes.sharding.comm_audit import OUTSIDE, LayerComm, ProgramComm, audit, program_table


@dataclass(frozen=True)
class WeightShard:
    key: str  # the original state_dict key
    shape: tuple  # global shape
    placement: str  # "R", "S(0)", "S(0, 3x[64]x1)" ...
    local_shape: tuple


@dataclass(frozen=True)
class Plan:
    tp: int
    regions: tuple[Region, ...]
    weights: tuple[WeightShard, ...]
    stages: tuple[tuple[int, int, tuple[int, ...], tuple[str, ...]], ...] = ()  # (chunk, pp rank, layers, sends)
    logits: str = ""  # what becomes of the LM head's logits: gathered (why), or kept sharded into the loss ops
    comm: tuple[LayerComm, ...] = ()  # each layer's collectives against Megatron's (passes/sharding/comm_audit.py)
    sequence: tuple[str, ...] = ()  # what sequence parallelism did, and where it gathered why (SequenceAnalysis.lines)
    # each layer's collectives read from the joint programs (Config.joint_graph; passes/joint/comm_table.py)
    program_comm: tuple[ProgramComm, ...] = ()
    comm_cluster: str = ""  # the cluster whose rates program_comm's times are estimated with
    loss: str = ""  # how step() weights the microbatch losses ([Note: whole-batch semantics])
    programs: str = ""  # how the chunks run where fxpar chose it (Config.joint_graph=None with compile), and why
    experts: tuple[str, ...] = ()  # the MoE layers' expert chains and how they are split (passes/experts/)

    def __post_init__(self):
        if self.tp < 1:
            raise ValueError(f"Plan.tp must be >= 1, got {self.tp}")

    @property
    def sharded_regions(self) -> list[Region]:
        return [r for r in self.regions if r.columns]

    @property
    def replicated(self) -> list[Region]:
        return [r for r in self.regions if r.replicated]

    def region_table(self) -> str:
        rows = []
        for r in self.regions:
            def named(gemms):
                return ", ".join(f"{g} ({r.modules[g]})" if r.modules.get(g) else g for g in gemms)

            rows.append([
                r.module or "<root>",
                named(r.columns) or "-",
                named(r.rows) or "-",
                "vocab" if r.kind == "vocab" else (f"f + {len(r.rows)} g" if r.columns else "-"),
                named(r.replicated) + (f": {r.reason}" if r.reason else "") if r.replicated else "",
            ])
        return tabulate(rows, headers=["module", "column-parallel", "row-parallel", "collectives", "replicated (why)"])

    def weight_table(self) -> str:
        rows = [[w.key, "x".join(map(str, w.shape)), w.placement, "x".join(map(str, w.local_shape))]
                for w in self.weights]
        return tabulate(rows, headers=["weight", "global", "placement", "local"])

    @property
    def above_bound(self) -> list[LayerComm]:
        """The layers that communicate more than Megatron's layout, each with its note."""
        return [c for c in self.comm if c.above_bound]

    def comm_table(self) -> str:
        """One row per run of consecutive layers with the same counts (`model.layers.0..11`)."""
        rows, looped = [], any(c.calls > 1 for c in self.comm)  # a layer applied k times: its bound is k times
        for (fwd, bwd, small, _, outside, calls, bound), run in itertools.groupby(self.comm, key=lambda c: (
                len(c.forward), len(c.backward), len(c.small), c.above_bound, c.layer == OUTSIDE, c.calls, c.bound)):
            cs = list(run)
            span = cs[0].layer if len(cs) == 1 else f"{cs[0].layer}..{cs[-1].layer.rsplit('.', 1)[-1]}"
            megatron = "-" if outside else " + ".join(map(str, bound))
            rows.append([span, fwd, bwd, small, *([calls] if looped else []), megatron, cs[0].note])
        return tabulate(rows, headers=["layers", "forward", "backward", "small", *(["applied"] if looped else []),
                                       "Megatron", "above Megatron's (why)"])

    def stage_table(self) -> str:
        def span(layers):
            return f"{layers[0]}..{layers[-1]}" if len(layers) > 1 else (layers[0] if layers else "-")

        rows = [[c, r, span(layers), ", ".join(sends) or "-"] for c, r, layers, sends in self.stages]
        return tabulate(rows, headers=["chunk", "pp rank", "layers", "sends"])

    def __str__(self) -> str:
        text = (
            f"fxpar plan, t={self.tp}: {len(self.sharded_regions)} sharded regions, "
            f"{len(self.replicated)} with replicated parts\n{self.region_table()}\n\n{self.weight_table()}"
        )
        text += f"\n\nlogits: {self.logits}" if self.logits else ""
        text += f"\n\nloss: {self.loss}" if self.loss else ""
        text += f"\n\nprograms: {self.programs}" if self.programs else ""
        text += "\n\n" + "\n".join(self.sequence) if self.sequence else ""
        text += "\n\n" + "\n".join(self.experts) if self.experts else ""
        text += f"\n\nactivation collectives per layer, each under the pass that runs it\n{self.comm_table()}" if any(
            c.forward or c.backward or c.small for c in self.comm) else ""
        text += ("\n\ncollectives per layer in the joint programs (outside them: pipeline sends; dp buckets no program "
                 "reduces)\n"
                 + program_table(self.program_comm, self.comm_cluster)) if self.program_comm else ""
        return text + (f"\n\npipeline chunks\n{self.stage_table()}" if self.stages else "")


def make_plan(analysis: Analysis, weights: list[WeightShard], partition=None, pp: int = 1, loss_note: str = "",
              tp_graph=None, sequence: tuple[str, ...] = (), program_comm: tuple[ProgramComm, ...] = (),
              comm_cluster: str = "", loss: str = "", programs: str = "", experts: tuple[str, ...] = ()) -> Plan:
    """The plan of one rank. `partition` (a pipeline's chunks) adds the stage table; loss_note: why a loss_fn was
    not traced with the model (fxpar/trace.py); tp_graph (the graph after tensor parallelism) adds each layer's
    collectives; program_comm, those the joint programs run (passes/joint/comm_table.py); loss: how step() weights
    the microbatch losses; programs: how the chunks run, where fxpar chose it; experts: the MoE layers' lines."""
    stages = () if partition is None else tuple(
        (c.index, c.index % pp, c.layers, tuple(b.name for b in c.boundary_out)) for c in partition.chunks)
    logits = "; ".join(r.logits.rstrip("; ") for r in analysis.regions if r.logits)
    logits = "; ".join(x for x in (logits, loss_note) if x)
    comm = audit(tp_graph) if tp_graph is not None and analysis.t > 1 else ()
    return Plan(analysis.t, tuple(analysis.regions), tuple(weights), stages, logits, comm, tuple(sequence),
                tuple(program_comm), comm_cluster, loss, programs, tuple(experts))
