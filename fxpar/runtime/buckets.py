"""The step's data-parallel gradient reduction, in buckets launched as soon as their gradients are final.

Two ways, per weight:
    in the program  under Config(joint_graph=True) with the `dp_buckets` pass (Config.overlap), a chunk's weights
                    are reduced by the backward program of its last microbatch ([Note: dp buckets in the program] in
                    passes/joint/dp_buckets.py): each bucket is a functional collective there, issued as soon as its
                    last gradient exists. ChunkBuckets holds that program; GradBuckets feeds it the accumulated
                    gradients and moves the reduced ones in after the step.
    by the runtime  otherwise (and for a weight that several of this rank's chunks read): a weight joins a bucket
                    when the last microbatch's backward of its last chunk on this rank is done, and a full bucket is
                    all-reduced at once, asynchronously, while the rest of the flush runs.

With expert parallelism (init_mesh(ep=E)) the weights split over the experts' ranks (`experts`) go in buckets of their
own, all-reduced over the dp ranks that hold the same experts (the edp group) and divided by dp like every other
gradient: each such rank's gradient already sums every ep rank's tokens routed to its experts, so the edp sum is the
whole dp batch's.

With the distributed optimizer (`zero`, fxpar/runtime/zero.py) a bucket is reduce-scattered instead: each dp rank
receives the pieces of the gradients it owns ([Note: pieces]). Gradients are read and written through `grads`
(fxpar/runtime/precision.py Grads: the main gradients under mixed precision), reduced in `reduce_dtype`.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.distributed as dist

from fxpar.passes.ir.pieces import handle_dtype, handle_shape, piece_size


@dataclass
class ChunkBuckets:
    """A chunk's weights reduced in its last microbatch's program: the buckets (placeholder keys, in the program's
    order), the weight under each key, and that program (`make(has_acc)`: a JointRunner of the chunk's request
    with its dp buckets, fxpar/runtime/joint_runner.py), one per set of weights that pass an accumulated gradient."""

    buckets: list[list[str]]
    params: dict[str, torch.Tensor]
    reduce: object  # passes/joint/dp_buckets.py DPReduce
    make: Callable
    programs: dict = field(default_factory=dict)

    def program(self, has_acc: dict[str, bool]):
        key = tuple(sorted(k for k, a in has_acc.items() if a))
        if key not in self.programs:
            self.programs[key] = self.make(has_acc)
        return self.programs[key]

    def handle(self, p: torch.Tensor) -> torch.Tensor:
        """A leaf whose gradient will be p's reduced one; nothing reads its value (one element, expanded)."""
        dtype = handle_dtype(self.reduce, p.dtype)
        return torch.empty((), dtype=dtype, device=p.device).expand(handle_shape(self.reduce, p.shape)) \
            .requires_grad_()


class GradBuckets:
    """Data-parallel gradient reduction of one step (see the module docstring). programs: chunk -> ChunkBuckets."""

    def __init__(self, params_of_chunk: dict[int, list], groups, bucket_bytes: float, grads, zero=None,
                 reduce_dtype: torch.dtype | None = None, programs: dict[int, ChunkBuckets] | None = None,
                 experts: frozenset = frozenset()):
        self.g, self.cap, self.grads, self.zero, self.dtype = groups, bucket_bytes, grads, zero, reduce_dtype
        self.experts = experts  # ids of the parameters split over ep: reduced over the edp group
        self.programs = programs or {}
        in_program = {p for cb in self.programs.values() for p in cb.params.values()}
        self.params_of_chunk = {c: [p for p in ps if p not in in_program] for c, ps in params_of_chunk.items()}
        self.uses = {}
        for ps in self.params_of_chunk.values():
            for p in ps:
                self.uses[p] = self.uses.get(p, 0) + 1
        self.reset()

    def reset(self) -> None:
        self.left, self.pending, self.launched = dict(self.uses), {False: ([], 0), True: ([], 0)}, []
        self.handles, self.filled = [], set()

    def start(self, m: int, warm=frozenset()) -> None:
        """Before the step's first backward, over m > 1 microbatches: every weight reduced in a program gets a
        gradient to accumulate into, so the one its last microbatch's program reads is the whole step's ([Note: dp
        buckets in the program]). The chunks in `warm` run a backward before their last microbatch's forward (1F1B
        past its warm-up): autograd has made their weights' gradients by then, and nothing is filled."""
        if m == 1:
            return
        for chunk, cb in self.programs.items():
            if chunk in warm:
                continue
            for p in cb.params.values():
                if self.grads.get(p) is None:
                    self.grads.set(p, torch.zeros(p.shape, dtype=cb.reduce.main_dtype or p.dtype, device=p.device))
                    self.filled.add(p)

    def last_microbatch(self, chunk: int):
        """(the program, the inputs it takes after the chunk's own) for chunk's last microbatch; None: the chunk's
        own program (its weights are reduced by the runtime)."""
        cb = self.programs.get(chunk)
        if cb is None:
            return None
        inputs, accumulated = [], {k: self.grads.get(p) for k, p in cb.params.items()}
        for keys in cb.buckets:
            params = [cb.params[k] for k in keys]
            handles = [cb.handle(p) for p in params]
            inputs += [accumulated[k] for k in keys if accumulated[k] is not None] + handles
            self.handles += zip(params, handles)
        return cb.program({k: a is not None for k, a in accumulated.items()}), inputs

    def chunk_done(self, chunk: int) -> None:
        """Called after a chunk's last-microbatch backward: its parameters may now be final."""
        if self.g.dp == 1 and self.zero is None:
            return
        for p in self.params_of_chunk[chunk]:
            self.left[p] -= 1
            if self.left[p] == 0 and self.grads.get(p) is not None:
                self._add(p)

    def _add(self, p: torch.Tensor) -> None:
        grad, expert = self.grads.get(p), id(p) in self.experts
        bucket, size = self.pending[expert]
        bucket.append(p)
        self.pending[expert] = (bucket, size + grad.numel() * grad.element_size())
        if self.pending[expert][1] >= self.cap:
            self._launch(expert)

    def _launch(self, expert: bool) -> None:
        bucket = self.pending[expert][0]
        self.pending[expert] = ([], 0)
        if not bucket:
            return
        if self.zero is not None:
            n, _, group = self.zero.split(bucket[0])  # dp, or edp for the experts'
            flat = self.zero.layout(bucket)  # fp32 at least; float64 stays float64
            flat = flat.to(self.dtype or torch.promote_types(flat.dtype, torch.float32))
            mine = flat if n == 1 else flat.new_empty(flat.numel() // n)
            work = None if n == 1 else dist.reduce_scatter_single(mine, flat, group=group, async_op=True)
            self.launched.append((work, mine, bucket))
        else:  # the experts' over edp, the rest over dp
            n, group = (self.g.edp, self.g.edp_group) if expert else (self.g.dp, self.g.dp_group)
            flat = torch.cat([self.grads.get(p).reshape(-1) for p in bucket])
            flat = flat.to(self.dtype or flat.dtype)
            work = dist.all_reduce(flat, group=group, async_op=True) if n > 1 else None
            self.launched.append((work, flat, bucket))

    def finish(self) -> None:
        self._from_programs()
        if self.g.dp == 1 and self.zero is None:
            self.reset()
            return
        self._launch(False)
        self._launch(True)
        for work, flat, params in self.launched:
            if work is not None:
                work.wait()
            if self.zero is not None:
                sizes = [piece_size(p.numel(), self.zero.split(p)[0]) for p in params]
                self.zero.receive(params, flat.split(sizes))
                continue
            flat /= self.g.dp
            offset = 0
            for p in params:
                grad = self.grads.get(p)
                n = grad.numel()
                grad.copy_(flat[offset : offset + n].view_as(grad))
                offset += n
        self.reset()

    def _from_programs(self) -> None:
        """Each handle's gradient, reduced by the program, becomes its weight's. A weight no gradient reached keeps
        none (the zeros `start` gave it go), or, holding one from before the step, is reduced by the runtime."""
        reduced = [(p, h.grad) for p, h in self.handles if h.grad is not None]
        if self.zero is not None and reduced:
            self.zero.receive([p for p, _ in reduced], [g for _, g in reduced])
        elif reduced:
            for p, g in reduced:
                self.grads.set(p, g)
        for p, h in self.handles:
            if h.grad is None:
                if p in self.filled:
                    self.grads.set(p, None)
                elif self.grads.get(p) is not None:
                    self._add(p)
