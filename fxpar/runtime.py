"""The pipeline runtime: interprets one rank's lowered action list, one handler per action kind.

    F / B            run a chunk's forward, or its backward for one microbatch
    SEND_* / RECV_*  point-to-point over torch.distributed: sends are non-blocking (isend, waited at the flush),
                     receives block where the list puts them; the lowering proved the order deadlock-free.
With scatter/gather each tp rank sends only its 1/t of a boundary tensor and the receiver all-gathers it inside
its tp group (Narayanan et al. 2021, Sec. 4.1), so the bytes between stages drop by t.
Data-parallel gradients go in buckets: a parameter joins a bucket when its last microbatch's backward on this rank
is done, and a full bucket is all-reduced at once, asynchronously, while the rest of the flush runs.
"""
from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from fxpar.passes.schedules import B, F, RECV_B, RECV_F, SEND_B, SEND_F


@dataclass
class Groups:
    """This rank's place in the (pp, dp, tp) mesh and the groups it talks in."""

    pp_rank: int
    pp: int
    tp_rank: int
    tp: int
    dp: int
    dp_rank: int
    global_rank_of_stage: list[int]  # pp rank -> global rank with this rank's dp and tp coordinates
    tp_group: object = None
    dp_group: object = None
    pp_group: object = None


@dataclass
class Stats:
    bytes_sent: dict = field(default_factory=dict)  # (chunk, microbatch, "F"/"B") -> bytes sent
    peak_in_flight: int = 0  # most microbatches holding saved activations at once
    saved_bytes: dict = field(default_factory=dict)  # (chunk, microbatch) -> saved-tensor bytes
    events: list = field(default_factory=list)  # (name, start_us, duration_us)


class P2P:
    """Boundary tensors between stages, with optional scatter/gather over the tp group."""

    def __init__(self, groups: Groups, scatter_gather: bool, stats: Stats):
        self.g, self.sg, self.stats = groups, scatter_gather and groups.tp > 1, stats
        self.pending, self.posted = [], {}  # isends to wait for at the flush; irecvs posted ahead of their action

    def _tag(self, a) -> int:
        return (a.microbatch * 4096 + a.message()[2]) * 2 + (a.kind in (SEND_B, RECV_B))

    def send(self, a, tensors: list[torch.Tensor]) -> None:
        dst, sent = self.g.global_rank_of_stage[a.peer], 0
        for x in tensors:
            flat = x.detach().contiguous().view(-1)
            if self.sg and flat.numel() % self.g.tp == 0:
                flat = flat.chunk(self.g.tp)[self.g.tp_rank].clone()
            self.pending.append((dist.isend(flat, dst=dst, tag=self._tag(a)), a))
            sent += flat.numel() * flat.element_size()
        self.stats.bytes_sent[(a.chunk, a.microbatch, a.kind[-1])] = sent

    def post(self, a, specs: list[tuple]) -> None:
        """Post the receive of action `a` now (non-blocking); recv(a) waits for it where the schedule needs it."""
        src, posted = self.g.global_rank_of_stage[a.peer], []
        for shape, dtype in specs:
            numel = int(torch.Size(shape).numel())
            split = self.sg and numel % self.g.tp == 0
            buf = torch.empty(numel // self.g.tp if split else numel, dtype=dtype)
            posted.append((dist.irecv(buf, src=src, tag=self._tag(a)), buf, shape, split))
        self.posted[a] = posted

    def recv(self, a, specs: list[tuple]) -> list[torch.Tensor]:
        if a not in self.posted:
            self.post(a, specs)
        out = []
        for work, buf, shape, split in self.posted.pop(a):
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


def _wait(work, action, peer: int) -> None:
    try:
        work.wait()
    except RuntimeError as e:
        raise RuntimeError(
            f"fxpar pipeline: {action} with global rank {peer} failed: rank {peer} stopped answering "
            f"(it may have died or hit an error of its own). gloo said: {e}"
        ) from e


class GradBuckets:
    """Data-parallel gradient all-reduce in buckets, launched as soon as their gradients are final."""

    def __init__(self, params_of_chunk: dict[int, list], groups: Groups, bucket_bytes: float):
        self.g, self.cap = groups, bucket_bytes
        self.params_of_chunk = params_of_chunk
        self.uses = {}
        for ps in params_of_chunk.values():
            for p in ps:
                self.uses[p] = self.uses.get(p, 0) + 1
        self.reset()

    def reset(self) -> None:
        self.left, self.bucket, self.size, self.launched = dict(self.uses), [], 0, []

    def chunk_done(self, chunk: int) -> None:
        """Called after a chunk's last-microbatch backward: its parameters may now be final."""
        if self.g.dp == 1:
            return
        for p in self.params_of_chunk[chunk]:
            self.left[p] -= 1
            if self.left[p] == 0 and p.grad is not None:
                self.bucket.append(p)
                self.size += p.grad.numel() * p.grad.element_size()
                if self.size >= self.cap:
                    self._launch()

    def _launch(self) -> None:
        if self.bucket:
            flat = torch.cat([p.grad.reshape(-1) for p in self.bucket])
            self.launched.append((dist.all_reduce(flat, group=self.g.dp_group, async_op=True), flat, self.bucket))
            self.bucket, self.size = [], 0

    def finish(self) -> None:
        if self.g.dp == 1:
            return
        self._launch()
        for work, flat, params in self.launched:
            work.wait()
            flat /= self.g.dp
            offset = 0
            for p in params:
                n = p.grad.numel()
                p.grad.copy_(flat[offset : offset + n].view_as(p.grad))
                offset += n
        self.reset()


class Runtime:
    """Runs a lowered schedule for one pipeline rank; see the module docstring."""

    def __init__(self, stage, actions, groups: Groups, p2p: P2P, buckets: GradBuckets, stats: Stats):
        self.stage, self.actions, self.g = stage, actions, groups
        self.p2p, self.buckets, self.stats = p2p, buckets, stats
        self.handlers = {F: self.forward, B: self.backward, SEND_F: self.send_forward, RECV_F: self.recv_forward,
                         SEND_B: self.send_backward, RECV_B: self.recv_backward}

    def run(self, microbatches: list, targets: list) -> torch.Tensor:
        self.inputs, self.targets, self.m = microbatches, targets, len(microbatches)
        self.recv_act, self.recv_grad, self.saved, self.grads_in = {}, {}, {}, {}
        self.loss = torch.zeros(())
        early = self._early_receives()
        for i, a in enumerate(self.actions):
            start = time.perf_counter()
            for r in early.get(i, ()):
                self.p2p.post(r, self._recv_specs(r))
            self.handlers[a.kind](a)
            self.stats.peak_in_flight = max(self.stats.peak_in_flight, len(self.saved))
            self.stats.events.append((str(a), start, time.perf_counter() - start))
        self.p2p.flush()
        self.buckets.finish()
        return self.loss

    def _early_receives(self) -> dict[int, list]:
        """Each receive is posted right after the rank's previous send (as torch.distributed.pipelining does), so a
        peer's send need not wait for this rank's compute before the receive exists; it is still waited for at its
        own place in the list. Posting early cannot deadlock: irecv does not block."""
        early, last_send = {}, 0
        for i, a in enumerate(self.actions):
            if a.kind in (SEND_F, SEND_B):
                last_send = i + 1
            elif a.kind in (RECV_F, RECV_B) and last_send < i:
                early.setdefault(last_send, []).append(a)
        return early

    def _recv_specs(self, a) -> list[tuple]:
        chunk = self.stage.chunks[a.chunk]
        if a.kind == RECV_F:
            return self.stage.boundary_specs(chunk.boundary_in)
        return [s for s in self.stage.boundary_specs(chunk.boundary_out) if s[1].is_floating_point]

    def forward(self, a) -> None:
        chunk = self.stage.chunks[a.chunk]
        received = self.recv_act.pop((a.chunk, a.microbatch), [])
        bytes_ = [0]

        def pack(t):
            bytes_[0] += t.numel() * t.element_size()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            outs = self.stage.run_chunk(chunk, received, self.inputs[a.microbatch])
        self.stats.saved_bytes[(a.chunk, a.microbatch)] = bytes_[0]
        if not chunk.boundary_out:  # the last chunk: its output is the model's output
            loss = self.stage.loss(outs, self.targets[a.microbatch]) / self.m
            self.loss = self.loss + loss.detach()
            outs = [loss]
        self.saved[(a.chunk, a.microbatch)] = (received, outs)

    def backward(self, a) -> None:
        received, outs = self.saved.pop((a.chunk, a.microbatch))
        grads = self.recv_grad.pop((a.chunk, a.microbatch), None)
        outs = [o for o in outs if o.is_floating_point()]  # only these have gradients to receive
        pairs = [(o, g) for o, g in zip(outs, grads or [None] * len(outs)) if o.requires_grad]
        if pairs:
            torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs] if grads else None)
        self.grads_in[(a.chunk, a.microbatch)] = [
            x.grad if x.grad is not None else torch.zeros_like(x) for x in received if x.is_floating_point()
        ]
        if a.microbatch == self.m - 1:
            self.buckets.chunk_done(a.chunk)

    def send_forward(self, a) -> None:
        _, outs = self.saved[(a.chunk, a.microbatch)]
        self.p2p.send(a, outs)

    def recv_forward(self, a) -> None:
        xs = self.p2p.recv(a, self._recv_specs(a))
        self.recv_act[(a.chunk, a.microbatch)] = [x.requires_grad_() if x.is_floating_point() else x for x in xs]

    def send_backward(self, a) -> None:
        self.p2p.send(a, self.grads_in.pop((a.chunk, a.microbatch)))

    def recv_backward(self, a) -> None:
        self.recv_grad[(a.chunk, a.microbatch)] = self.p2p.recv(a, self._recv_specs(a))


def write_chrome_trace(path: str, stats: Stats, rank: int) -> None:
    """Perfetto-viewable trace of the last step's actions on this rank."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    t0 = stats.events[0][1] if stats.events else 0.0
    events = [{"name": name, "ph": "X", "pid": rank, "tid": 0, "ts": (s - t0) * 1e6, "dur": d * 1e6}
              for name, s, d in stats.events]
    with open(path, "w") as f:
        json.dump({"traceEvents": events, "displayTimeUnit": "ms"}, f)
