"""The pipeline-parallel executable: this rank's chunks, its weights, its proven program, and `step()`.

`pm.step(*global_batch, target=...)` takes this dp rank's slice of the global batch, cuts it into m microbatches,
runs the rank's lowered program (fxpar.runtime.interpreter interprets it), all-reduces the gradients of parameters
shared between stages (tied embeddings) and over the dp group, and returns the batch's mean loss on every rank. The
optimizer then steps on `pm.parameters()`: only after the flush, so training stays strictly synchronous.
Everything here comes from the compiler's record: the chunks, the program and its proof (fxpar/compiler.py), one
record per mode and non-tensor arguments ([Note: the program includes its context] in fxpar/runtime/program_cache.py),
all cut into the same chunks, so this stage holds the same weights whichever runs.
"""
from __future__ import annotations

import dataclasses
import os
import warnings
from collections import Counter

import torch
import torch.distributed as dist
import torch.utils._pytree as pytree

from fxpar.runtime.executable import ParallelModule
from fxpar.guard import preserve_global_state
from fxpar.mesh import Groups, scatter_gather_wanted
from fxpar.runtime.optim import trainable
from fxpar.passes.ir.meta import PARAMETER
from fxpar.runtime.program_cache import describe_mismatch
from fxpar.passes.ir.pieces import DPReduce
from fxpar.passes.ir.pieces import buckets as bucket_keys
from fxpar.programs import DPBuckets, JointRequest
from fxpar.runtime.joint_runner import JointRunner
from fxpar.runtime.buckets import ChunkBuckets, GradBuckets
from fxpar.runtime.interpreter import P2P, Runtime, Stats, write_chrome_trace
from fxpar.runtime.weights import tensor_keys


def _variants(chunk_gm, request: JointRequest, buckets: list[list[str]], reduce: DPReduce, config, rank: int):
    """What makes the joint program of a chunk's last microbatch, the weights in `buckets` reduced over dp."""
    def make(has_acc: dict[str, bool]) -> JointRunner:
        dp = DPBuckets(tuple(map(tuple, buckets)), reduce, frozenset(k for k, a in has_acc.items() if a))
        return JointRunner(chunk_gm, dataclasses.replace(request, dp=dp), config, rank)

    return make


def _as_is(t: torch.Tensor) -> torch.Tensor:
    """A saved tensor kept as the tensor itself, which autograd then does not version-check ([Note: dp buckets in
    the program] in passes/joint/dp_buckets.py)."""
    return t


class _Pieces(list):
    """The m microbatch pieces of one leaf of the target (a list that is not part of the target's structure)."""


class Stage:
    """One pipeline rank's view of one compiled program: its chunks, how to run one, and the loss."""

    def __init__(self, pm: "PipelineModule", program):
        self.pm, self.program = pm, program
        g = pm.rank.groups
        self.chunks = {c.index: c for c in program.partition.chunks if c.index % g.pp == g.pp_rank}

    def run_chunk(self, chunk, received: list, flat_user: list, last=None) -> list:
        """last: (program, its further inputs) where the chunk's last microbatch reduces its gradients over dp in
        the program (fxpar/runtime/buckets.py)."""
        inputs = self.pm._chunk_inputs(chunk, flat_user, received, self.program)
        if last is not None:  # the accumulated gradients change in place until its backward reads them
            program, extra = last
            with torch.autograd.graph.saved_tensors_hooks(_as_is, _as_is):
                return list(program(*inputs, *extra))
        return list(self.pm.rank.programs.runner(self.program, chunk.index)(*inputs))

    def loss(self, outs: list, target) -> torch.Tensor:
        """The microbatch's loss: the last chunk's output when the loss was traced with the model ([Note: the loss
        is traced] in fxpar/trace.py), else loss_fn called on the model's gathered output."""
        if self.program.traced.with_loss:
            return outs[0]
        return self.pm.rank.loss_fn(pytree.tree_unflatten(outs, self.program.traced.out_spec), target)


class PipelineModule(ParallelModule):
    """A ParallelModule that holds only its pipeline stage's chunks and weights; train it with step()."""

    def __init__(self, model, compiled, groups: Groups, loss_fn):
        partition = compiled.partition
        mine = [c for c in partition.chunks if c.index % groups.pp == groups.pp_rank]
        used = {gi.key for c in mine for gi in c.inputs if gi.is_state}
        if groups.pp_rank == 0:  # state no chunk reads (a mask buffer that fusion made unused) stays with stage 0
            read = {gi.key for c in partition.chunks for gi in c.inputs if gi.is_state}
            used |= set(tensor_keys(model)) - read
        super().__init__(model, compiled, used_keys=used, mesh=groups, pipeline=True)
        self.rank.loss_fn = loss_fn
        self.rank.scatter_gather = scatter_gather_wanted(compiled.config.scatter_gather, groups)
        self.rank.programs.loss_fn = loss_fn
        self._tied = self._tied_groups(groups, partition)
        self.rank.replica_groups["tied"] = self._tied
        self.rank.stats = Stats()
        self._steps = 0

    def _tied_groups(self, groups: Groups, partition) -> dict[str, object]:
        """Parameters read on several pipeline ranks: key -> the group of their owners ([Note: pipeline ownership])."""
        p, d, t = groups.pp, groups.dp, groups.tp
        owners: dict[str, set[int]] = {}
        for c in partition.chunks:
            for gi in c.inputs:
                if gi.kind == PARAMETER:
                    owners.setdefault(self.rank.weights.aliases[gi.key], set()).add(c.index % p)
        out = {}
        for key, stages in sorted(owners.items()):
            if len(stages) < 2:
                continue
            for dp_i in range(d):  # every rank creates every group, in the same order
                for tp_i in range(t):
                    ranks = [groups.global_rank(q, dp_i, tp_i) for q in sorted(stages)]
                    group = dist.new_group(ranks)
                    if dist.get_rank() in ranks:
                        out[key] = group
        return out

    def forward(self, *args, **kwargs):
        if self.rank.groups.pp > 1:
            raise RuntimeError(
                "fxpar: with pipeline parallelism (pp > 1) the model runs as a schedule over all stages: "
                "call pm.step(*global_batch, target=...) instead of pm(...)."
            )
        with preserve_global_state():
            flat = self._flatten_inputs(args, kwargs)
            stage = Stage(self, self._program_for(flat))
            self._check_weights(stage.program, stage.chunks.values())
            received = []
            for i in sorted(stage.chunks):  # every chunk is on this rank: hand each one's outputs to the next
                received = stage.run_chunk(stage.chunks[i], received, flat)
            return pytree.tree_unflatten(received, stage.program.traced.out_spec)

    def _microbatches(self, args, kwargs, target, dp_rank: int | None = None) -> list[tuple[list, list, object]]:
        """The m microbatches of dp rank `dp_rank`'s slice (default: this rank's) of the global batch: (model inputs,
        inputs with the target, target) each, flat ([Note: the loss is traced] in fxpar/trace.py)."""
        g, m = self.rank.groups, self.config.microbatches
        dp_rank = g.dp_rank if dp_rank is None else dp_rank
        example, want = self.rank.programs.example(with_loss=False)
        flat, spec = self._traced.flatten(args, kwargs)
        if spec != want:
            raise ValueError(f"fxpar step: {describe_mismatch((example, want), args, kwargs)}; pass step() the same "
                             "arguments as "
                             "the traced example (keyword arguments included), with tensors of dp*m times its rows")

        def split(x):
            if not isinstance(x, torch.Tensor):
                return [x] * m
            if x.shape[0] % (g.dp * m):
                raise ValueError(
                    f"fxpar step: global batch {x.shape[0]} is not divisible by dp*microbatches = {g.dp}*{m} = "
                    f"{g.dp * m}; use a batch that is a multiple of {g.dp * m}"
                )
            return list(x.chunk(g.dp, dim=0)[dp_rank].chunk(m, dim=0))

        pieces = [split(x) for x in flat]
        micro = [[p[i] for p in pieces] for i in range(m)]
        rows = next((x.shape[0] for x in example if isinstance(x, torch.Tensor)), 1)
        self._traced.check_shapes(micro[0], "fxpar step (one microbatch)",
                                 f" per microbatch: a global batch of dp*m*{rows} = {g.dp * m * rows} rows", example)
        targets = pytree.tree_map(lambda x: _Pieces(split(x)), target)
        targets = [pytree.tree_map(lambda pieces: pieces[i], targets, is_leaf=lambda x: isinstance(x, _Pieces))
                   for i in range(m)]
        out = []
        for inputs, tgt in zip(micro, targets):
            args_i, kwargs_i = pytree.tree_unflatten(inputs, want)
            out.append((inputs, self._traced.flatten(args_i, kwargs_i, tgt)[0], tgt))
        return out

    def step(self, *args, target, **kwargs) -> torch.Tensor:
        """One batch forward and backward over the pipeline; returns the batch's mean loss on every rank."""
        with preserve_global_state():
            micro = self._microbatches(args, kwargs, target)
            if self.rank.programs.example_target is None:  # no example_target: the first step's traces the loss
                self.rank.programs.example_target = micro[0][2]
            program = self._program_for(micro[0][1], with_loss=True)
            if not program.traced.with_loss:  # the loss_fn could not be traced: the model's program, then loss_fn
                program = self._program_for(micro[0][0])
            stage = Stage(self, program)
            if program is not self._planned:
                self._planned, self.plan = program, self._make_plan(program)
            self._check_weights(stage.program, stage.chunks.values())
            inputs = [with_target if program.traced.with_loss else model for model, with_target, _ in micro]
            weights = self._loss_weights(program, micro, args, kwargs, target)
            return self._step(stage, inputs, [tgt for _, _, tgt in micro], weights)

    def _loss_weights(self, program, micro: list, args, kwargs, target) -> list[float] | None:
        """Each of this rank's microbatch losses' weight: n_i * d / N for a token-mean loss ([Note: whole-batch
        semantics] in passes/frontend/token_count.py), counted on the global batch every rank holds; None (1 / m
        each) where the counts are all equal or the normalization is not proven (said once, at the first step)."""
        g, norm, stats = self.rank.groups, program.normalization, program.statistics
        if stats is not None and not stats.why and len(micro) > 1 and not self.rank.warned_statistics:
            self.rank.warned_statistics = True  # [Note: batch statistics], passes/data_parallel/batch_statistics.py
            warnings.warn(f"fxpar step: the loss's statistics over the batch ({', '.join(stats.reduce)}) are "
                          f"all-reduced over the dp={g.dp} ranks' microbatch i, not over the whole batch (m="
                          f"{len(micro)}): they are the whole batch's at microbatches=1.", stacklevel=3)
        if g.dp * len(micro) == 1:
            return None
        if norm is None or norm.count is None:
            if not self.rank.warned_normalization:
                self.rank.warned_normalization = True
                why = norm.why if norm is not None else program.traced.loss_note or "the loss is not traced"
                warnings.warn(f"fxpar step: each of the {g.dp * len(micro)} microbatch losses (dp={g.dp}, "
                              f"m={len(micro)}) is weighted equally, which equals the whole batch's loss only when "
                              f"every microbatch is normalized by the same count ({why}). pm.plan says the same.",
                              stacklevel=3)
            return None
        counts = [[norm.count(with_target) for _, with_target, _ in
                   (micro if j == g.dp_rank else self._microbatches(args, kwargs, target, j))] for j in range(g.dp)]
        total = sum(map(sum, counts))
        if total == 0 or len({n for row in counts for n in row}) == 1:
            return None  # all ignored (the loss is NaN, as on one process), or the microbatch mean is the same
        return [n * g.dp / total for n in counts[g.dp_rank]]

    def _step(self, stage: Stage, micro: list, targets: list, weights: list[float] | None = None) -> torch.Tensor:
        self.rank.stats = Stats()
        p2p = P2P(self.rank.groups, stage.program.program, self.rank.scatter_gather, self.rank.stats)
        zero = self.rank.zero
        if self.config.zero and zero is None:
            raise ValueError("fxpar: Config(zero=1) shards the optimizer over dp, and step() reduce-scatters the "
                             "gradients into its pieces. Fix: make the optimizer with pm.optimizer(torch.optim.AdamW, "
                             "...) before the first step.")
        mp, scaler, w = self.config.mixed_precision, self.rank.scaler, self.rank.weights
        buckets = GradBuckets(self._chunk_params(stage), self.rank.groups, self.config.bucket_mb * 2**20,
                              self.rank.weights.grads, zero, mp.reduce_dtype if mp is not None else None,
                              self._program_buckets(stage),
                              frozenset(id(w.live[k]) for k in w.held_keys() if w.expert(k)))
        loss = Runtime(stage, stage.program.program, self.rank.groups, p2p, buckets, self.rank.stats,
                       scaler.scale if scaler is not None else None).run(micro, targets, weights)
        for key, group in self._tied.items():
            grad = self.rank.weights.grads.get(self.rank.weights.live[key]) if zero is None else zero.main[key].grad
            if grad is not None:
                dist.all_reduce(grad, group=group)
        if scaler is not None:  # unscale the main gradients; an overflow anywhere skips the optimizer's step
            grads = zero.grads().values() if zero is not None else \
                [self.rank.weights.grads.get(p) for p in trainable(self).values()]
            scaler.unscale([g for g in grads if g is not None])
        loss = loss.clone()
        if self.rank.groups.pp > 1:
            dist.all_reduce(loss, group=self.rank.groups.pp_group)  # only the last stage's is non-zero
        if self.rank.groups.dp > 1:
            dist.all_reduce(loss, group=self.rank.groups.dp_group)
            loss /= self.rank.groups.dp
        if self.config.trace_dir:
            write_chrome_trace(os.path.join(self.config.trace_dir, f"rank{dist.get_rank()}.json"),
                               self.rank.stats, dist.get_rank())
        self._steps += 1
        if self.config.check_replicas_every and self._steps % self.config.check_replicas_every == 0:
            self.check_replicas()
        return loss

    def _dp_programs(self, program) -> list:
        """Those of a step with every weight accumulating (m > 1), or none holding a gradient (m = 1)."""
        many = self.config.microbatches > 1
        return [cb.program({k: many for k in cb.params}).record
                for cb in self._program_buckets(Stage(self, program)).values()]

    def _program_buckets(self, stage: Stage) -> dict[int, ChunkBuckets]:
        """Chunk -> its weights that its last microbatch's backward program reduces over dp ([Note: dp buckets in
        the program] in passes/joint/dp_buckets.py): under the joint graph with the dp_buckets pass, at dp > 1, the
        weights no other chunk of this rank reads. Made once per program and set of weights."""
        if self.rank.groups.dp == 1:
            return {}
        params = self._chunk_params(stage)
        uses = Counter(id(p) for ps in params.values() for p in ps)
        mp, main = self.config.mixed_precision, self.rank.weights.grads.main
        reduce = DPReduce(self.rank.groups.dp, self.rank.groups.dp_group.group_name, scatter=bool(self.config.zero),
                          main_dtype=torch.float32 if main else None,
                          reduce_dtype=mp.reduce_dtype if mp is not None else None)
        made, out = self.rank.made_buckets, {}
        for c in stage.chunks.values():
            joint = stage.program.callables[c.index]
            if not isinstance(joint, JointRequest) or not joint.dp_in_program:
                continue
            trained = {id(p) for p in params[c.index] if uses[id(p)] == 1}
            mine = {gi.key: p for gi in c.inputs if gi.kind == PARAMETER
                    and id(p := self.rank.weights.live[self.rank.weights.aliases[gi.key]]) in trained}
            key = (id(stage.program), c.index, tuple(sorted(mine)), reduce)
            if key not in made:
                nbytes = {k: p.numel() * (4 if main else p.element_size()) for k, p in mine.items()}
                buckets = bucket_keys(joint.grad_order, mine, nbytes, self.config.bucket_mb * 2**20)
                made[key] = ChunkBuckets(buckets, mine, reduce, _variants(c.gm, joint, buckets, reduce, self.config,
                                                                          self.rank.comm.rank))
            out[c.index] = made[key]
        return out

    def _chunk_params(self, stage: Stage) -> dict[int, list]:
        out = {}
        for c in stage.chunks.values():
            keys = {self.rank.weights.aliases[gi.key] for gi in c.inputs if gi.kind == PARAMETER}
            out[c.index] = [self.rank.weights.live[k] for k in sorted(keys) if self.rank.weights.live[k].requires_grad]
        return out

    @torch.no_grad()
    def _full_tensors(self) -> dict[str, torch.Tensor]:
        """Full tensors under their keys, gathered over tp and pp; every rank receives the whole dict."""
        mine = super()._full_tensors()
        if self.rank.groups.pp == 1:
            return mine
        parts = [None] * self.rank.groups.pp
        dist.all_gather_object(parts, mine, group=self.rank.groups.pp_group)
        full = {}
        for part in parts:
            for k, v in part.items():
                full.setdefault(k, v)
        return {k: full[k] for k in self.rank.weights.keys}

