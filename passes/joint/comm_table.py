"""Each layer's collectives, read from the joint programs: the functional collectives of the forward and backward
programs that torch's partitioner cut from each joint graph (what runs, and what the dispatcher sees), attributed to
the layer of the fxpar collective each was traced from (passes/joint/export.py tags them; passes/sharding/comm_audit.py
says which layer an fxpar collective belongs to).

This is what the program does, op by op: under tensor parallelism a layer's row reads `2 all_reduce` forward and
`2 all_reduce` backward (Megatron's f and g); under sequence parallelism, forward `2 all_gather, 2 reduce_scatter`,
backward the same plus the re-gather of each block the all-gathering GEMMs saved (Korthikanti et al. 2022).
The data-parallel gradient buckets are a row of their own, read from the backward program of each chunk's last
microbatch (passes/joint/dp_buckets.py), once a step. What the runtime does outside the programs is not here:
pipeline sends and receives (and the dp buckets of a weight that several of a rank's chunks read, or of a program
without the dp_buckets pass: fxpar/runtime/buckets.py).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from torch.fx import GraphModule

from fxpar.passes.joint.dp_buckets import DP_BUCKET
from fxpar.passes.ir.op_families import DECOMPOSED_GEMMS
from fxpar.passes.joint.overlap import exposed_seconds, overlaps
from fxpar.passes.sharding.comm_audit import BACKWARD, DP_ROW, FORWARD, OUTSIDE, ProgramComm, audit


def collectives(program: GraphModule) -> list[tuple[str, str]]:
    """(op, fxpar node) of every functional collective of a program, in program order: op as "all_reduce", and the
    name of the chunk graph's node it was traced from."""
    return [(o.op, o.node) for o in overlaps(program)]


@dataclass
class _Row:
    """One layer's collectives as they are found: ops by half, estimated seconds, GEMMs that hide them."""

    forward: list[str] = field(default_factory=list)
    backward: list[str] = field(default_factory=list)
    comm: float = 0.0
    exposed: float = 0.0
    gemms: int = 0

    def add(self, half: str, o, ranks: int, cluster) -> None:
        (self.forward if half == FORWARD else self.backward).append(o.op)
        self.gemms += sum(n.target in DECOMPOSED_GEMMS for n in o.hidden)
        if cluster is not None:
            comm, hidden = exposed_seconds(o, ranks, cluster)
            self.comm += comm
            self.exposed += max(0.0, comm - hidden)


def program_comm(chunks: list[tuple[GraphModule, object]], t: int = 2, cluster=None, dp: list = (),
                 d: int = 1) -> tuple[ProgramComm, ...]:
    """Per layer, the collectives of the `forward` and `backward` programs of (chunk graph, joint program) pairs
    (fxpar/programs.py ProgramRecord), in chunk order; those outside every layer (the vocabulary's) next, as
    OUTSIDE; last, as DP_ROW, the dp buckets of the last microbatch's programs `dp` (over d ranks). With a cluster
    (fxpar.cost's), each row also estimates the layer's communication time and what of it the compute between each
    collective's start and wait hides (passes/joint/overlap.py)."""
    found: dict[str, _Row] = {}

    def row(layer) -> _Row:
        return found.setdefault(layer, _Row())

    for chunk_gm, traced in chunks:
        layer_of = {c.node: lc.layer for lc in audit(chunk_gm) for c in (*lc.forward, *lc.backward, *lc.small)}
        for layer in layer_of.values():
            row(layer)
        for half, program in ((FORWARD, traced.forward), (BACKWARD, traced.backward)):
            for o in overlaps(program):
                row(layer_of.get(o.node, OUTSIDE)).add(half, o, t, cluster)
    for traced in dp:
        for o in overlaps(traced.backward):
            if o.node.startswith(DP_BUCKET):
                row(DP_ROW).add(BACKWARD, o, d, cluster)
    last = [OUTSIDE, DP_ROW]
    order = [layer for layer in found if layer not in last] + [layer for layer in last if layer in found]
    return tuple(ProgramComm(layer, tuple(r.forward), tuple(r.backward), r.comm, r.exposed, r.gemms)
                 for layer, r in ((layer, found[layer]) for layer in order))
