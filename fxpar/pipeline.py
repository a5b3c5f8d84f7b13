"""The pipeline-parallel executable: this rank's chunks, its weights, its schedule, and `step()`.

`pm.step(*global_batch, target=...)` takes this dp rank's slice of the global batch, cuts it into m microbatches,
runs the rank's lowered schedule (fxpar.runtime interprets it), all-reduces the gradients of parameters shared
between stages (tied embeddings) and over the dp group, and returns the batch's mean loss on every rank. The
optimizer then steps on `pm.parameters()`: only after the flush, so training stays strictly synchronous.
"""
from __future__ import annotations

import os

import torch
import torch.distributed as dist
import torch.utils._pytree as pytree
from torch._subclasses.fake_tensor import FakeTensorMode

from fxpar.executable import ParallelModule, local_fake_inputs, propagate_local_shapes
from fxpar.passes.lower_schedule import lower
from fxpar.passes.partition import partition_pass
from fxpar.passes.schedules import build_schedule
from fxpar.runtime import P2P, GradBuckets, Groups, Runtime, Stats, write_chrome_trace


def mesh_groups(mesh) -> Groups:
    pp_rank, dp_rank, tp_rank = (mesh.get_local_rank(d) for d in ("pp", "dp", "tp"))
    p, d, t = mesh.mesh.shape
    stage_ranks = [int(mesh.mesh[q, dp_rank, tp_rank]) for q in range(p)]
    return Groups(pp_rank, p, tp_rank, t, d, dp_rank, stage_ranks, mesh.get_group("tp"), mesh.get_group("dp"),
                  mesh.get_group("pp"))


class PipelineModule(ParallelModule):
    """A ParallelModule that holds only its pipeline stage's chunks and weights; train it with step()."""

    def __init__(self, model, compiled, comm, mesh, config, loss_fn):
        self.__dict__["compiled"] = compiled
        traced, gm = compiled.traced, compiled.gm
        groups = mesh_groups(mesh)
        k = groups.pp * config.virtual_stages
        mode = FakeTensorMode(allow_non_fake_inputs=True)
        propagate_local_shapes(gm, local_fake_inputs(model, traced, compiled.specs, comm.size, mode), mode)
        partition = partition_pass(gm, traced.param_nodes(), k)
        chunks = {c.index: c for c in partition.chunks if c.index % groups.pp == groups.pp_rank}
        kinds = {name: (kind, key) for name, kind, key in traced.inputs}
        used = {kinds[n][1] for c in chunks.values() for n in c.inputs if n in kinds and kinds[n][0] != "user"}
        if groups.pp_rank == 0:  # state no chunk reads (a mask buffer that fusion made unused) stays with stage 0
            read = {kinds[n][1] for c in partition.chunks for n in c.inputs if n in kinds}
            used |= set(model.state_dict(keep_vars=True)) - read
        super().__init__(model, traced, gm, compiled.specs, comm, used_keys=used)
        self.__dict__.update(partition=partition, chunks=chunks, groups=groups, loss_fn=loss_fn, config=config)
        self._kinds = kinds
        self._user_index = {name: i for i, name in enumerate(n for n, kind, _ in traced.inputs if kind == "user")}
        self._specs_of = {n.name: (tuple(n.meta["val"].shape), n.meta["val"].dtype)
                          for n in gm.graph.nodes if isinstance(n.meta.get("val"), torch.Tensor)}
        full = build_schedule(config.schedule, groups.pp, config.microbatches, config.virtual_stages)
        self.actions = lower(full, groups.pp, config.virtual_stages)[groups.pp_rank]
        self._tied = self._tied_groups(mesh, partition, kinds)
        self._callables = {i: c.gm for i, c in chunks.items()}  # what runs each chunk (compiled with Config.compile)
        self.stats = Stats()

    def _tied_groups(self, mesh, partition, kinds) -> dict[str, object]:
        """Parameters read on several pipeline ranks: key -> the group of their owners ([Note: pipeline ownership])."""
        p, d, t = mesh.mesh.shape
        owners: dict[str, set[int]] = {}
        for c in partition.chunks:
            for n in c.inputs:
                if n in kinds and kinds[n][0] == "parameter":
                    owners.setdefault(self._aliases[kinds[n][1]], set()).add(c.index % p)
        out = {}
        for key, stages in sorted(owners.items()):
            if len(stages) < 2:
                continue
            for dp_i in range(d):  # every rank creates every group, in the same order
                for tp_i in range(t):
                    ranks = [int(mesh.mesh[q, dp_i, tp_i]) for q in sorted(stages)]
                    group = dist.new_group(ranks)
                    if dist.get_rank() in ranks:
                        out[key] = group
        return out

    def compile_graphs(self, compile_fn) -> None:
        """Config(compile=True): one compiled callable per chunk of this stage."""
        super().compile_graphs(compile_fn)
        self._callables = {i: compile_fn(c.gm) for i, c in self.chunks.items()}

    def boundary_specs(self, names) -> list[tuple]:
        return [self._specs_of[n] for n in names]

    def _value(self, name: str, flat_user: list):
        kind, key = self._kinds[name]
        if kind in ("parameter", "buffer"):
            return self._state[self._aliases[key]]
        if kind == "constant":
            return self.traced.constants[key]
        return flat_user[self._user_index[name]]

    def run_chunk(self, chunk, received: list, flat_user: list) -> list:
        values = dict(zip(chunk.boundary_in, received))
        out = self._callables[chunk.index](*[values[n] if n in values else self._value(n, flat_user)
                                             for n in chunk.inputs])
        return list(out)

    def loss(self, outs: list, target) -> torch.Tensor:
        return self.loss_fn(pytree.tree_unflatten(outs, self.traced.out_spec), target)

    def forward(self, *args, **kwargs):
        if self.groups.pp == 1:
            return super().forward(*args, **kwargs)
        raise RuntimeError(
            "fxpar: with pipeline parallelism (pp > 1) the model runs as a schedule over all stages: "
            "call pm.step(*global_batch, target=...) instead of pm(...)."
        )

    def _microbatches(self, args, kwargs, target):
        g, m = self.groups, self.config.microbatches
        flat, spec = pytree.tree_flatten((tuple(args), kwargs))
        if spec != self.traced.in_spec:
            raise ValueError(f"fxpar step: arguments {spec} differ from the traced example's {self.traced.in_spec}")
        dp_rank = g.dp_rank

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
        for i, (got, want) in enumerate(zip(micro[0], self.traced.example_inputs)):
            if isinstance(want, torch.Tensor) and got.shape != want.shape:
                raise ValueError(
                    f"fxpar step: microbatch input {i} has shape {tuple(got.shape)} but the model was traced with "
                    f"{tuple(want.shape)}; the global batch must be dp*m*{want.shape[0]} = "
                    f"{g.dp * m * want.shape[0]} rows"
                )
        return micro, split(target)

    def step(self, *args, target, **kwargs) -> torch.Tensor:
        """One batch forward and backward over the pipeline; returns the batch's mean loss on every rank."""
        micro, targets = self._microbatches(args, kwargs, target)
        self.stats = Stats()
        p2p = P2P(self.groups, self.config.scatter_gather, self.stats)
        buckets = GradBuckets(self._chunk_params(), self.groups, self.config.bucket_mb * 2**20)
        loss = Runtime(self, self.actions, self.groups, p2p, buckets, self.stats).run(micro, targets)
        for key, group in self._tied.items():
            grad = self._state[key].grad
            if grad is not None:
                dist.all_reduce(grad, group=group)
        loss = loss.clone()
        if self.groups.pp > 1:
            dist.all_reduce(loss, group=self.groups.pp_group)  # only the last stage's is non-zero
        if self.groups.dp > 1:
            dist.all_reduce(loss, group=self.groups.dp_group)
            loss /= self.groups.dp
        if self.config.trace_dir:
            write_chrome_trace(os.path.join(self.config.trace_dir, f"rank{dist.get_rank()}.json"),
                               self.stats, dist.get_rank())
        return loss

    def _chunk_params(self) -> dict[int, list]:
        out = {}
        for c in self.chunks.values():
            keys = {self._aliases[self._kinds[n][1]] for n in c.inputs
                    if n in self._kinds and self._kinds[n][0] == "parameter"}
            out[c.index] = [self._state[k] for k in sorted(keys) if self._state[k].requires_grad]
        return out

    @torch.no_grad()
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Full tensors under the original keys, gathered over tp and pp; every rank receives the whole dict."""
        mine = super().full_state_dict()
        if self.groups.pp == 1:
            return mine
        parts = [None] * self.groups.pp
        dist.all_gather_object(parts, mine, group=self.groups.pp_group)
        full = {}
        for part in parts:
            for k, v in part.items():
                full.setdefault(k, v)
        return {k: full[k] for k in self._keys}
