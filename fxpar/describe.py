"""pm.plan: what the compiler decided for one rank, with what the rank holds and the joint programs it ran.

The executable (fxpar/runtime/) hands over what only it knows (the weights it holds, the joint programs of the
signatures it ran); everything else is the compiler's record. The plan's tables are made in passes/sharding/plan.py
and, for the joint programs' collectives, passes/joint/comm_table.py.
"""
from __future__ import annotations

from fxpar.compiler import Compiled
from fxpar.cost.cluster import get_cluster
from fxpar.passes.experts.dispatch import ledger_line
from fxpar.passes.joint.comm_table import program_comm
from fxpar.passes.sharding.plan import Plan, WeightShard, make_plan

ESTIMATE_ON = "h100"  # the cluster whose rates the plan estimates each layer's exposed communication with


def plan_of(program: Compiled, shards: list[WeightShard], joint: list, dp: list, d: int) -> Plan:
    """The plan of `program` on a rank holding `shards`. joint: (chunk graph, joint program) of the rank's chunks
    (fxpar/programs.py ProgramRecord); dp: the joint programs of its chunks' last microbatches that reduce the
    gradients over the d dp ranks."""
    partition = program.partition if program.target.pipelined else None
    table = program_comm(joint, program.target.comm.size, get_cluster(ESTIMATE_ON), dp, d) if joint else ()
    return make_plan(program.analysis, shards, partition, program.target.pp, program.traced.loss_note,
                     program.tp_graph, tuple(program.sequence.lines()), table, ESTIMATE_ON,
                     _loss_line(program), program.joint.why,
                     _experts(program))


def _loss_line(program: Compiled) -> str:
    """How step() weights the microbatch losses, and the loss's statistics over the batch's rows."""
    line = program.normalization.line() if program.normalization else ""
    stats = program.statistics
    if stats is not None:
        line += f"\n  statistics over the batch: {stats.line(program.target.dp.size)}"
    return line


def _rows_bytes(chain, ep: int, how: str) -> str:
    """What one microbatch's rows weigh: the chain's input and output rows on this rank, and what a dispatch of them
    moves (all-to-all: (ep-1)/ep of them leave the rank under even routing; all-gather: every other rank's)."""
    x, y = chain.x.meta["val"], chain.out.meta["val"]
    size = [t.numel() * t.element_size() for t in (x, y)]
    moved = [n * (ep - 1) / ep if how == "alltoall" else n * (ep - 1) for n in size]
    return (f"rows in {'x'.join(map(str, x.shape))} {str(x.dtype).removeprefix('torch.')} ({size[0] / 2**10:.1f} KiB), "
            f"out {'x'.join(map(str, y.shape))} ({size[1] / 2**10:.1f} KiB) per microbatch; each way the dispatch "
            f"moves {moved[0] / 2**10:.1f} KiB in and {moved[1] / 2**10:.1f} KiB out per rank"
            + (" under even routing" if how == "alltoall" else ""))


def _experts(program: Compiled) -> tuple[str, ...]:
    """The MoE layers: how their experts are split (expert parallelism, init_mesh(ep=E)), or why not."""
    found, ep = program.experts, program.target.ep.size
    if found is None or not (found.chains or found.reasons):
        return ()
    head = (f"experts: split over ep={ep} ranks (each holds {{}} of every layer's experts; dispatch "
            f"{program.config.ep_dispatch})" if ep > 1 else
            "experts: every rank holds every expert (init_mesh(ep=E) splits them over E of the dp ranks)")
    share = f"1/{ep}" if ep > 1 else "all"
    ledger = [f"  collectives per MoE layer and microbatch: {ledger_line(program.config.ep_dispatch)}",
              *(f"  {c.module}: {_rows_bytes(c, ep, program.config.ep_dispatch)}" for c in found.chains)] \
        if ep > 1 and found.chains else []
    return (head.format(share), *(f"  {line}" for line in found.lines()), *ledger)
