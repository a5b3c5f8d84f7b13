"""The collectives of expert parallelism: each row of an expert chain (passes/experts/find.py) to the rank that holds
its expert, and each result back to the row it came from.

A rank's chain input x [S, h] holds its own tokens' (token, expert) rows sorted by expert, `offs` where each of the E
experts' rows end. With ep ranks, rank q holds experts [q * E/ep, (q + 1) * E/ep): the rows of those experts are one
contiguous run of x. The dispatcher gives every rank the rows of its experts from every rank of its ep group,
expert by expert, and within an expert source rank by source rank (each in its sorted order); the chain then runs on
those rows with the local offsets, on the local slice of each expert weight; the combiner puts each result row back
where its input row was. Nothing is computed for a row on a rank that does not hold the row's expert.

    alltoall   the counts [ep, E/ep] are exchanged, then each rank sends each other rank only the rows of that rank's
               experts (all_to_all_single with uneven splits); the results go back the same way.
    allgather  every rank's rows and counts are all-gathered; each rank picks the rows of its experts; the results are
               placed at their rows of the gathered layout, zeros elsewhere, and reduce-scattered: each row's sum has
               one non-zero term, so it is the result itself (static sizes; the bytes of ep copies of the rows).

The two are adjoint: the backward of dispatching is combining the gradient, and the backward of combining is
dispatching it. `routing` (an int64 tensor [ep, 2 * E/ep + 1], made by the dispatch and read by the combine of the
same call) says for each peer rank how many rows of each of its experts this rank sends, how many of each of this
rank's experts it receives from it, and (allgather) where its run of this rank's experts starts.

Hugging Face's batched_mm experts keep the rows in (token, k) order and gather each row's expert weights by its id:
DispatchUnsorted sorts them by expert first (stably) and CombineUnsorted puts each result back at its row.

Every row is checked to belong to an expert: offs[-1] must be S, which fails when a router's id falls outside
[0, E - 1] (an error naming the layer, not a wrong sum). Rows counted here are the rows each rank's expert GEMMs
compute (`rows`, summed over calls): the tests compare them with the routing of the unmodified model. So are the
collectives each call runs (`ran`, by kind and pass), which the tests compare with what the plan says (LEDGER).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn

from fxpar.passes.ir.placements import Shard
from fxpar.passes.tensor_parallel.collectives import TPComm

EP_DISPATCHERS = ("alltoall", "allgather")
# per chain and microbatch: (collective, pass) -> how many, and what each moves ("counts": E/ep integers per rank;
# "rows": the chain's rows of h (input) or of its output width)
LEDGER = {
    "alltoall": {("all_to_all", "forward"): (2, "counts, then rows"), ("all_to_all", "combine"): (1, "rows"),
                 ("all_to_all", "backward"): (2, "rows back, rows out")},
    "allgather": {("all_gather", "forward"): (2, "counts, then rows"), ("reduce_scatter", "combine"): (1, "rows"),
                  ("reduce_scatter", "backward"): (1, "rows"), ("all_gather", "backward"): (1, "rows")},
}


def ledger_line(how: str) -> str:
    """The plan's line for one chain per microbatch."""
    return ", ".join(f"{n} {kind} ({what}, {where})" for (kind, where), (n, what) in LEDGER[how].items())


@dataclass
class Routing:
    """routing's numbers for one call, on the host: send[q][j] rows of rank q's j-th expert go to q, recv[s][j] rows
    of this rank's j-th expert come from s, start[s] the first of them in s's rows (allgather)."""

    send: list[list[int]]
    recv: list[list[int]]
    start: list[int]

    @staticmethod
    def of(t: torch.Tensor) -> "Routing":
        e = (t.shape[1] - 1) // 2
        rows = t.tolist()
        return Routing([r[:e] for r in rows], [r[e:2 * e] for r in rows], [r[2 * e] for r in rows])

    def expert_major(self) -> list[tuple[int, int, int]]:
        """(source rank, first row within what it sent, rows) of every block, in the order the chain reads them:
        expert by expert, source by source."""
        blocks, experts = [], len(self.recv[0]) if self.recv else 0
        for j in range(experts):
            for s, counts in enumerate(self.recv):
                blocks.append((s, sum(counts[:j]), counts[j]))
        return blocks


def _index(routing: Routing, base: list[int]) -> torch.Tensor:
    """The rows of the chain's input, in order, as positions in a buffer where source s's rows start at base[s]."""
    parts = [torch.arange(base[s] + first, base[s] + first + n) for s, first, n in routing.expert_major() if n]
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int64)


def _count(ran, kind: str, where: str) -> None:
    if ran is not None:
        ran[(kind, where)] = ran.get((kind, where), 0) + 1


def _a2a(x: torch.Tensor, out_rows: list[int], in_rows: list[int], comm: TPComm) -> torch.Tensor:
    out = x.new_empty((sum(out_rows), *x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), out_rows, in_rows, group=comm.group)
    return out


def _received(routing: Routing) -> list[int]:
    return [sum(c) for c in routing.recv]


def _base(rows: list[int]) -> list[int]:
    return [sum(rows[:s]) for s in range(len(rows))]


def send(x: torch.Tensor, routing: Routing, how: str, comm: TPComm, ran=None, where: str = "forward"):
    """The rows of this rank's experts from every rank of the group, expert-major ([S, ...] -> [n, ...])."""
    _count(ran, "all_to_all" if how == "alltoall" else "all_gather", where)
    if how == "alltoall":
        got = _received(routing)
        buf = _a2a(x, got, [sum(c) for c in routing.send], comm)
        return buf[_index(routing, _base(got)).to(x.device)]
    s = x.shape[0]
    full = torch.cat(comm.all_gather(x))
    return full[_index(routing, [q * s + routing.start[q] for q in range(comm.size)]).to(x.device)]


def back(y: torch.Tensor, routing: Routing, how: str, comm: TPComm, rows: int, ran=None, where: str = "combine"):
    """send's adjoint: each of this rank's result rows back to its source rank, at its row ([n, ...] -> [rows, ...])."""
    _count(ran, "all_to_all" if how == "alltoall" else "reduce_scatter", where)
    if how == "alltoall":
        got = _received(routing)
        buf = y.new_empty((sum(got), *y.shape[1:]))
        buf[_index(routing, _base(got)).to(y.device)] = y
        return _a2a(buf, [sum(c) for c in routing.send], got, comm)
    full = y.new_zeros((rows * comm.size, *y.shape[1:]))
    full[_index(routing, [q * rows + routing.start[q] for q in range(comm.size)]).to(y.device)] = y
    return comm.reduce_scatter(full, Shard(0, (rows * comm.size,)))


class _Send(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, routing, how, comm, ran):
        ctx.routing, ctx.how, ctx.comm, ctx.rows, ctx.ran = routing, how, comm, x.shape[0], ran
        return send(x, routing, how, comm, ran)

    @staticmethod
    def backward(ctx, grad):
        return back(grad.contiguous(), ctx.routing, ctx.how, ctx.comm, ctx.rows, ctx.ran, "backward"), \
            None, None, None, None


class _Back(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y, routing, how, comm, rows, ran):
        ctx.routing, ctx.how, ctx.comm, ctx.ran = routing, how, comm, ran
        return back(y, routing, how, comm, rows, ran)

    @staticmethod
    def backward(ctx, grad):
        return send(grad.contiguous(), ctx.routing, ctx.how, ctx.comm, ctx.ran, "backward"), \
            None, None, None, None, None


class _EPModule(nn.Module):
    """Holds the rank's expert-parallel context (rank, size, group), the dispatcher's kind and the layer's name."""

    def __init__(self, comm: TPComm, how: str, experts: int, layer: str):
        super().__init__()
        if how not in EP_DISPATCHERS:
            raise ValueError(f"ep dispatch must be one of {EP_DISPATCHERS}, got {how!r}")
        self.comm, self.how, self.experts, self.layer = comm, how, experts, layer
        self.local = experts // comm.size
        self.rows = 0  # rows this rank's experts computed, summed over calls (forward)
        self.ran: dict = {}  # (collective, pass) -> how many this chain ran, summed over calls


class DispatchToExperts(_EPModule):
    """(x, offs) -> (the rows of this rank's experts, their offsets, each row's local expert, routing)."""

    def forward(self, x: torch.Tensor, offs: torch.Tensor):
        counts = torch.diff(offs.to(torch.int64), prepend=offs.new_zeros(1, dtype=torch.int64))
        if int(offs[-1]) != x.shape[0] or bool((counts < 0).any()):
            raise ValueError(
                f"fxpar expert parallelism ({self.layer}): the router's expert ids must lie in "
                f"[0, {self.experts - 1}]: the {self.experts} experts count {int(offs[-1])} of the {x.shape[0]} rows")
        mine = counts.view(self.comm.size, self.local)  # [peer, its j-th expert]: rows this rank sends it
        _count(self.ran, "all_to_all" if self.how == "alltoall" else "all_gather", "forward")  # the counts
        if self.how == "alltoall":
            recv = torch.empty_like(mine)
            dist.all_to_all_single(recv, mine.contiguous(), group=self.comm.group)
            start = torch.zeros(self.comm.size, 1, dtype=torch.int64)
        else:
            every = torch.stack(self.comm.all_gather(counts))  # [source, expert]
            first = self.comm.rank * self.local
            recv = every[:, first:first + self.local]
            start = every[:, :first].sum(1, keepdim=True)
        routing_t = torch.cat([mine, recv, start], 1).cpu()
        routing = Routing.of(routing_t)
        x_local = _Send.apply(x, routing, self.how, self.comm, self.ran)
        per_expert = recv.sum(0).to(offs.device)
        self.rows += int(per_expert.sum())
        local_offs = per_expert.cumsum(0).to(offs.dtype)
        local_ids = torch.repeat_interleave(torch.arange(self.local, device=offs.device), per_expert)
        return x_local, local_offs, local_ids, routing_t


class DispatchUnsorted(DispatchToExperts):
    """(x, ids) of rows in any order (Hugging Face's batched_mm experts: each row gathers its expert's weights) ->
    DispatchToExperts' four, and the stable sort that put the rows in expert order (CombineUnsorted undoes it)."""

    def forward(self, x: torch.Tensor, ids: torch.Tensor):
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= self.experts):
            raise ValueError(f"fxpar expert parallelism ({self.layer}): the router's expert ids must lie in "
                             f"[0, {self.experts - 1}], got [{int(ids.min())}, {int(ids.max())}]")
        perm = torch.argsort(ids, stable=True)
        offs = torch.bincount(ids, minlength=self.experts).cumsum(0)
        return (*super().forward(x[perm], offs), perm)


class CombineFromExperts(_EPModule):
    """(the result rows of this rank's experts, routing, the rows x had) -> each result at its row of x."""

    def __init__(self, comm: TPComm, how: str, experts: int, layer: str, ran: dict):
        super().__init__(comm, how, experts, layer)
        self.ran = ran  # the dispatch's: one ledger per chain

    def forward(self, y: torch.Tensor, routing: torch.Tensor, rows: int):
        return _Back.apply(y, Routing.of(routing), self.how, self.comm, rows, self.ran)


class CombineUnsorted(CombineFromExperts):
    """CombineFromExperts, then each row back where it was before DispatchUnsorted sorted it."""

    def forward(self, y: torch.Tensor, routing: torch.Tensor, rows: int, perm: torch.Tensor):
        return super().forward(y, routing, rows)[torch.argsort(perm)]
