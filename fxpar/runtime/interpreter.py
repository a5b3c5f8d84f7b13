"""The pipeline runtime: interprets one rank's lowered action list, one handler per action kind.

    RECV_*   post a non-blocking irecv for a chunk's inputs (the lowering put it right after the rank's previous send)
    F / B    wait for the inputs the RECV posted (or take them from a chunk on this rank), then run a chunk's
             forward, or its backward for one microbatch
    SEND_*   a non-blocking isend of a chunk's outputs (or input gradients); all are waited for at the flush
These are exactly the semantics the compiler's proof replays ([Note: p2p semantics] in passes/pipeline/lower.py),
and messages carry the tags of the same Program, so the program that was proven deadlock-free is the one that runs.
With scatter/gather each tp rank sends only its 1/t of a replicated boundary tensor and the receiver all-gathers it
inside its tp group (Narayanan et al. 2021, Sec. 4.1), so the bytes between stages drop by t; a sharded boundary
value goes from tp rank i to tp rank i whole ([Note: boundaries carry placements]).
Data-parallel gradients go in buckets (fxpar/runtime/buckets.py): reduced by a chunk's last-microbatch program,
or by the runtime once the last microbatch's backward of the weight's last chunk on this rank is done.
"""
from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from fxpar.mesh import Groups
from fxpar.runtime.buckets import GradBuckets
from fxpar.passes.pipeline.lower import Program
from fxpar.passes.ir.placements import Replicate
from fxpar.passes.pipeline.schedules import B, F, RECV_B, RECV_F, SEND_B, SEND_F, rank_of_chunk


@dataclass
class Stats:
    bytes_sent: dict = field(default_factory=dict)  # (chunk, microbatch, "F"/"B") -> bytes sent
    peak_in_flight: int = 0  # most microbatches holding saved activations at once
    events: list = field(default_factory=list)  # (name, start_us, duration_us)


class P2P:
    """Boundary tensors between stages, tagged by the Program, with scatter/gather of replicated values over tp."""

    def __init__(self, groups: Groups, program: Program, scatter_gather: bool, stats: Stats):
        self.g, self.program, self.stats = groups, program, stats
        self.sg = scatter_gather and groups.tp > 1
        self.pending, self.posted = [], {}  # isends to wait for at the flush; message -> posted irecvs

    def _split(self, value, numel: int) -> bool:
        """Send only this tp rank's 1/t: for replicated values whose size t divides (the same rule on both ends)."""
        return self.sg and isinstance(value.placement, Replicate) and numel % self.g.tp == 0

    def send(self, a, tensors: list[torch.Tensor], values) -> None:
        dst, sent = self.g.global_rank_of_stage[a.peer], 0
        for x, value in zip(tensors, values):
            flat = x.detach().contiguous().view(-1)
            if self._split(value, flat.numel()):
                flat = flat.chunk(self.g.tp)[self.g.tp_rank].clone()
            self.pending.append((dist.isend(flat, dst=dst, tag=self.program.tag(a)), a))
            sent += flat.numel() * flat.element_size()
        self.stats.bytes_sent[(a.chunk, a.microbatch, a.kind[-1])] = sent

    def post(self, a, values) -> None:
        """Post the receives of action `a` (non-blocking); the compute action that needs them waits in `take`."""
        src, posted = self.g.global_rank_of_stage[a.peer], []
        for value in values:
            numel = int(torch.Size(value.shape).numel())
            split = self._split(value, numel)
            buf = torch.empty(numel // self.g.tp if split else numel, dtype=value.dtype, device=self.g.device)
            posted.append((dist.irecv(buf, src=src, tag=self.program.tag(a)), buf, value.shape, split))
        self.posted[a.message()] = (a, posted)

    def take(self, message: tuple) -> list[torch.Tensor]:
        """Wait for the receives of `message` (posted by its RECV) and return the full tensors."""
        a, posted = self.posted.pop(message)
        out = []
        for work, buf, shape, split in posted:
            _wait(work, a, self.g.global_rank_of_stage[a.peer])
            if split:
                parts = [torch.empty_like(buf) for _ in range(self.g.tp)]
                dist.all_gather(parts, buf, group=self.g.tp_group)
                buf = torch.cat(parts)
            out.append(buf.view(shape))
        return out

    def flush(self) -> None:
        for work, a in self.pending:
            _wait(work, a, self.g.global_rank_of_stage[a.peer])
        self.pending.clear()
        if self.posted:
            raise RuntimeError(f"fxpar pipeline: receives posted but never used: {sorted(self.posted)}")


def _wait(work, action, peer: int) -> None:
    try:
        work.wait()
    except RuntimeError as e:
        raise RuntimeError(
            f"fxpar pipeline: {action} with global rank {peer} failed: rank {peer} stopped answering "
            f"(it may have died or hit an error of its own). gloo said: {e}"
        ) from e


class Runtime:
    """Runs a lowered schedule for one pipeline rank; see the module docstring."""

    def __init__(self, stage, program: Program, groups: Groups, p2p: P2P, buckets: GradBuckets, stats: Stats,
                 loss_scale: torch.Tensor | None = None):
        self.stage, self.actions, self.g = stage, program.actions[groups.pp_rank], groups
        self.p2p, self.buckets, self.stats = p2p, buckets, stats
        self.loss_scale = loss_scale  # fp16: the backward starts from the loss times this ([Note: mixed precision])
        self.handlers = {F: self.forward, B: self.backward, SEND_F: self.send_forward, RECV_F: self.post_receive,
                         SEND_B: self.send_backward, RECV_B: self.post_receive}

    def run(self, microbatches: list, targets: list, weights: list[float] | None = None) -> torch.Tensor:
        """weights: each microbatch loss's weight (default 1 / m; [Note: whole-batch semantics] in
        passes/frontend/token_count.py)."""
        self.inputs, self.targets, self.m = microbatches, targets, len(microbatches)
        self.weights = weights
        self.saved, self.grads_in, self.handoff = {}, {}, {}
        # float64 on every stage, whatever the model's dtype: the stages all-reduce it, and only the last adds to it
        self.loss = torch.zeros((), dtype=torch.float64, device=self.g.device)
        self.buckets.start(self.m, warm(self.actions, self.m))
        for a in self.actions:
            start = time.perf_counter()
            self.handlers[a.kind](a)
            self.stats.peak_in_flight = max(self.stats.peak_in_flight, len(self.saved))
            self.stats.events.append((str(a), start, time.perf_counter() - start))
        self.p2p.flush()
        self.buckets.finish()
        assert not self.handoff and not self.saved, (sorted(self.handoff), sorted(self.saved))
        return self.loss

    def _inputs(self, message: tuple) -> list[torch.Tensor]:
        """The tensors a compute action consumes: from a chunk on this rank, or through the p2p receive."""
        producer = message[1]
        if rank_of_chunk(producer, self.g.pp) == self.g.pp_rank:
            return self.handoff.pop(message)
        return self.p2p.take(message)

    def forward(self, a) -> None:
        chunk = self.stage.chunks[a.chunk]
        received = []
        if chunk.boundary_in:
            xs = self._inputs((F, a.chunk - 1, a.chunk, a.microbatch))
            received = [x.detach().requires_grad_() if x.is_floating_point() else x for x in xs]
        last = self.buckets.last_microbatch(a.chunk) if a.microbatch == self.m - 1 else None
        outs = self.stage.run_chunk(chunk, received, self.inputs[a.microbatch], last)
        if not chunk.boundary_out:  # the last chunk: its output is the model's output
            loss = self.stage.loss(outs, self.targets[a.microbatch])
            weight = None if self.weights is None else self.weights[a.microbatch]
            loss = loss / self.m if weight is None else loss * weight
            if weight != 0:  # no valid target: its loss is 0/0, and it adds nothing (its backward seeds zeros)
                self.loss = self.loss + loss.detach()
            outs = [loss if self.loss_scale is None else loss * self.loss_scale]
        elif rank_of_chunk(a.chunk + 1, self.g.pp) == self.g.pp_rank:
            self.handoff[(F, a.chunk, a.chunk + 1, a.microbatch)] = outs
        self.saved[(a.chunk, a.microbatch)] = (received, outs)

    def backward(self, a) -> None:
        received, outs = self.saved.pop((a.chunk, a.microbatch))
        chunk = self.stage.chunks[a.chunk]
        grads = self._inputs((B, a.chunk + 1, a.chunk, a.microbatch)) if chunk.boundary_out else None
        outs = [o for o in outs if o.is_floating_point()]  # only these have gradients to receive
        pairs = [(o, g) for o, g in zip(outs, grads or [None] * len(outs)) if o.requires_grad]
        if pairs:
            torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs] if grads else None)
        grads_in = [x.grad if x.grad is not None else torch.zeros_like(x) for x in received if x.is_floating_point()]
        if chunk.boundary_in and rank_of_chunk(a.chunk - 1, self.g.pp) == self.g.pp_rank:
            self.handoff[(B, a.chunk, a.chunk - 1, a.microbatch)] = grads_in
        elif chunk.boundary_in:
            self.grads_in[(a.chunk, a.microbatch)] = grads_in
        if a.microbatch == self.m - 1:
            self.buckets.chunk_done(a.chunk)

    def send_forward(self, a) -> None:
        _, outs = self.saved[(a.chunk, a.microbatch)]
        self.p2p.send(a, outs, self.stage.chunks[a.chunk].boundary_out)

    def send_backward(self, a) -> None:
        values = [v for v in self.stage.chunks[a.chunk].boundary_in if v.differentiable]
        self.p2p.send(a, self.grads_in.pop((a.chunk, a.microbatch)), values)

    def post_receive(self, a) -> None:
        if a.kind == RECV_F:
            values = self.stage.chunks[a.chunk].boundary_in
        else:
            values = [v for v in self.stage.chunks[a.chunk].boundary_out if v.differentiable]
        self.p2p.post(a, values)


def warm(actions, m: int) -> set[int]:
    """The chunks whose first backward runs before their last microbatch's forward in `actions` (one rank's): their
    weights hold this step's gradient by then."""
    out, last_forward_seen = set(), set()
    for a in actions:
        if a.kind == F and a.microbatch == m - 1:
            last_forward_seen.add(a.chunk)
        elif a.kind == B and a.chunk not in last_forward_seen:
            out.add(a.chunk)
    return out


def write_chrome_trace(path: str, stats: Stats, rank: int) -> None:
    """Perfetto-viewable trace of the last step's actions on this rank."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    t0 = stats.events[0][1] if stats.events else 0.0
    events = [{"name": name, "ph": "X", "pid": rank, "tid": 0, "ts": (s - t0) * 1e6, "dur": d * 1e6}
              for name, s, d in stats.events]
    with open(path, "w") as f:
        json.dump({"traceEvents": events, "displayTimeUnit": "ms"}, f)
