"""The per-rank executable: the compiled programs plus this rank's local weights.

Its parameters are registered under the original model's names (`transformer.h.0.attn.c_attn.weight`), holding the
local shards, so any torch.optim optimizer works on them. Tied parameters are one Parameter here too. Every call
reads the weights the module holds now (fxpar/runtime/weights.py), resolves the graph's inputs from their GraphInput
records ([Note: one resolver] in passes/ir/meta.py), runs the program compiled for the current mode and non-tensor
arguments ([Note: the program includes its context] in fxpar/runtime/program_cache.py), and restores grad mode, autocast
and the random generators if it raises.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.utils._pytree as pytree

from fxpar.runtime.clip import clip_grad_norm_
from fxpar.compiler import Compiled
from fxpar.programs import JointRequest
from fxpar.guard import preserve_global_state
from fxpar.mesh import Groups
from fxpar.passes.tensor_parallel.collectives import TPComm
from fxpar.runtime.optim import MainParamsOptimizer, trainable
from fxpar.passes.ir.meta import resolve_inputs
from fxpar.passes.ir.placements import local_shard, unshard
from fxpar.passes.sharding.plan import Plan, WeightShard
from fxpar.describe import plan_of
from fxpar.runtime.precision import Grads, LossScaler
from fxpar.runtime.program_cache import Programs, describe_mismatch
from fxpar.runtime.replicas import check_replicas
from fxpar.runtime.weights import (RankWeights, all_experts, check_state, from_model_spelling, has_state_hooks,
                                   load_full_or_local, own_experts, tensor_keys, to_model_spelling)


def _holder(root: nn.Module, key: str) -> tuple[nn.Module, str]:
    *path, leaf = key.split(".")
    mod = root
    for p in path:
        if p not in mod._modules:
            mod.add_module(p, nn.Module())
        mod = mod._modules[p]
    return mod, leaf


class RankState:
    """This rank's part of the parallel model, for fxpar's own modules (optimizers, clipping, replicas, checkpoints,
    verify, the pipeline runtime); the user's surface is the ParallelModule's (tests/test_surface.py freezes it)."""

    def __init__(self, comm: TPComm, streams, programs: Programs, replica_groups: dict):
        self.comm = comm  # the tp group: rank, size, collectives
        self.streams = streams  # the random streams ([Note: random streams] in passes/tensor_parallel/rng.py)
        self.programs = programs  # the compiled programs by mode and arguments (fxpar/runtime/program_cache.py)
        self.replica_groups = replica_groups  # where this rank's weights have replicas: tp, dp (and tied)
        self.weights: RankWeights | None = None  # what it holds (fxpar/runtime/weights.py)
        self.scaler: LossScaler | None = None  # fp16's loss scaler
        self.zero = None  # Config(zero=1): the distributed optimizer pm.optimizer made (fxpar/runtime/zero.py)
        self.groups = None  # a pipeline rank's mesh groups (fxpar/runtime/pipeline_executable.py)
        self.loss_fn = None  # a pipeline rank's loss
        self.scatter_gather = False  # a pipeline rank sends 1/t of each boundary value
        self.stats = None  # a pipeline rank's last step's timings (fxpar/runtime/interpreter.py Stats)
        self.spelling: nn.Module | None = None  # the model whose state-dict hooks spell its state (weights.py)
        self.warned_normalization = False  # a pipeline rank said once that its microbatch losses weigh equally
        self.warned_statistics = False  # ... and that its loss's batch statistics span microbatch i of every dp rank
        self.made_buckets: dict = {}  # a pipeline rank's dp buckets in the program, by program, chunk and weights

    @property
    def specs(self) -> dict:
        """Registered key -> how its tensor is sharded over tp (absent: replicated)."""
        return self.weights.specs


class ParallelModule(nn.Module):
    """`pm(*args)` returns what `model(*args)` returns; its parameters are this rank's shards."""

    def __init__(self, model: nn.Module, compiled: Compiled, used_keys: set[str] | None = None,
                 mesh: Groups | None = None, pipeline: bool = False):
        """used_keys: the state keys this rank's chunks read (a pipeline stage holds only its own); None: all.
        mesh: the decoded mesh (fxpar/mesh.py decode_mesh); pipeline: a pipeline rank, which keeps it as rank.groups."""
        super().__init__()
        self.rank = RankState(compiled.target.comm, compiled.target.streams, Programs(compiled, model.training),
                              {} if mesh is None else {"tp": mesh.tp_group, "dp": mesh.dp_group,
                                                       "edp": mesh.edp_group, "ep": mesh.ep_group})
        originals = dict(model.named_parameters(remove_duplicate=False))
        originals.update(dict(model.named_buffers(remove_duplicate=False)))
        aliases = compiled.aliases  # every original key -> the key its tensor is registered under
        keys = tensor_keys(model)  # persistent keys, in the model's order ([Note: state-dict hooks])
        self.rank.spelling = model if has_state_hooks(model) else None
        specs = {aliases[k]: s for k, s in compiled.specs.items()}  # tied keys share one shard
        owned = None if used_keys is None else {aliases[k] for k in used_keys}
        ep, experts = compiled.target.ep, {aliases[k] for k in compiled.expert_keys}
        slots, unloaded = {}, set()
        for key, reg in aliases.items():
            if key != reg or (owned is not None and key not in owned):
                continue
            tensor = originals[key]
            local = tensor.detach()
            if key in specs:
                local = local_shard(local, specs[key], self.rank.comm.rank, self.rank.comm.size)
            if key in experts:  # this rank's experts (passes/experts/expert_parallel.py)
                local = own_experts(local, ep)
            if local.is_meta:  # built on the meta device: only this rank's shard is allocated, filled by a load
                local = torch.empty(local.shape, dtype=local.dtype, device=compiled.target_device)
                unloaded.add(key)
            holder, leaf = _holder(self, key)
            if isinstance(tensor, nn.Parameter):
                holder.register_parameter(leaf, nn.Parameter(local.clone(), requires_grad=tensor.requires_grad))
            else:
                holder.register_buffer(leaf, local.clone(), persistent=key in keys)
            slots[key] = (holder, leaf)
        self.rank.weights = RankWeights(
            tuple(keys), aliases, {k: tuple(originals[k].shape) for k in keys}, specs,
            {key: slots[reg] for key, reg in aliases.items() if reg in slots}, unloaded, experts=frozenset(experts),
            ep=ep)
        self.train(model.training)
        mp = compiled.config.mixed_precision  # [Note: mixed precision] in fxpar/runtime/precision.py
        self.rank.weights.grads = Grads(list(trainable(self).values()), main=mp is not None)
        if mp is not None and mp.loss_scale is not None:
            device = next((t.device for t in self.rank.weights.held().values()), torch.device("cpu"))
            self.rank.scaler = LossScaler(mp.loss_scale, device)
        self.rank.groups = mesh if pipeline else None
        self._planned = compiled  # the program pm.plan describes
        self.plan: Plan = self._make_plan(compiled)

    # ---- programs -----------------------------------------------------------------------------------------------
    @property
    def config(self):
        """The fxpar.Config this executable was compiled with."""
        return self.rank.programs.first.config

    @property
    def compiled(self) -> Compiled:
        """The compiler's record of the program for the current mode and the traced example's arguments: its
        graphs, partition, pipeline program and analysis (what `fxpar show` prints)."""
        first = self.rank.programs.first
        return self._program_for(first.traced.example_inputs, first.traced.with_loss)

    @property
    def _traced(self):
        return self.rank.programs.first.traced

    def _program_for(self, flat: list, with_loss: bool = False) -> Compiled:
        """The program for the current mode and these flat inputs: the model's own call, or (with_loss) the loss
        traced with the model, whose inputs end with the target's ([Note: the loss is traced] in fxpar/trace.py)."""
        return self.rank.programs.get(self.training, flat, self.rank.weights.live, self._buffer_values, with_loss)

    def _make_plan(self, program: Compiled) -> Plan:
        """The plan of `program` on this rank (pm.plan: of the program that ran last, or of the first)."""
        groups = self.rank.groups  # a pipeline rank reads the joint programs of its own chunks only
        joint = [(c.gm, self.rank.programs.runner(program, c.index).record) for c in program.partition.chunks
                 if isinstance(program.callables[c.index], JointRequest)
                 and (groups is None or c.index % groups.pp == groups.pp_rank)]
        return plan_of(program, self._weight_shards(), joint, self._dp_programs(program),
                       groups.dp if groups is not None else 1)

    def _dp_programs(self, program: Compiled) -> list:
        """The joint programs of this rank's chunks' last microbatches that reduce gradients over dp (pm.step's:
        fxpar/runtime/pipeline_executable.py)."""
        return []

    def _buffer_values(self) -> dict:
        """The buffers this rank holds now, by key (what a recompile's rewrites may rely on)."""
        return {k: holder._buffers[leaf] for k, (holder, leaf) in self.rank.weights.slots.items()
                if leaf in holder._buffers}

    def _check_weights(self, program: Compiled, chunks=None) -> None:
        """Raise if a weight's dtype, device or shape is not what `program` was compiled for (this rank's chunks:
        `chunks`, or all of them), or if a weight built on the meta device was never loaded."""
        self.rank.weights.check_loaded()
        for chunk in program.partition.chunks if chunks is None else chunks:
            check_state(self.rank.weights.live, program.expected_state[chunk.index])

    def _flatten_inputs(self, args, kwargs) -> list:
        """The call's user inputs, flattened and checked against the traced example (structure and shapes)."""
        example, want = self.rank.programs.example(with_loss=False)
        flat, spec = self._traced.flatten(args, kwargs)
        if spec != want:
            raise ValueError(f"fxpar: {describe_mismatch((example, want), args, kwargs)}. The parallel program was "
                             "traced with the example's arguments. Fix: call with the same arguments as "
                             "example_args/example_kwargs, or parallelize again with a matching example.")
        self._traced.check_shapes(flat, example=example)
        return flat

    def _chunk_inputs(self, chunk, flat_user: list, received: list = (), program: Compiled | None = None) -> list:
        """The values of `chunk`'s placeholders: this rank's weights, constants, user inputs, received values."""
        constants = (program or self.rank.programs.first).traced.constants
        return resolve_inputs(chunk.inputs, self.rank.weights.live, constants, flat_user, received)

    def _graph_inputs(self, flat_user: list) -> list:
        """The inputs of the whole (unpartitioned) graph of the current program."""
        program = self._program_for(flat_user)
        return self._chunk_inputs(program.partition.chunks[0], flat_user, program=program)

    def forward(self, *args, **kwargs):
        with preserve_global_state():
            flat = self._flatten_inputs(args, kwargs)
            program = self._program_for(flat)
            self._check_weights(program)
            chunk = program.partition.chunks[0]
            out = self.rank.programs.runner(program, 0)(*self._chunk_inputs(chunk, flat, program=program))
            return pytree.tree_unflatten(list(out), program.traced.out_spec)

    # ---- weights ------------------------------------------------------------------------------------------------
    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        """Load the original model's state (full tensors under its keys: each is sharded to this rank) or this
        rank's own (local shapes). Tied keys load once; keys another pipeline stage holds are skipped. The model's
        own spelling of its state (its load pre-hooks: [Note: state-dict hooks] in fxpar/runtime/weights.py) is taken
        too."""
        if self.rank.spelling is not None and not set(state_dict) <= set(self.rank.weights.aliases):
            state_dict = from_model_spelling(self.rank.spelling, state_dict)
        return load_full_or_local(self, state_dict, strict, assign)

    def manual_seed(self, seed: int) -> None:
        """Restart this rank's random streams from `seed` ([Note: random streams] in passes/tensor_parallel/rng.py);
        call it with the same seed on every rank."""
        self.rank.streams.manual_seed(seed)

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False):
        """torch.nn.utils.clip_grad_norm_ over the whole (p, t, d) model: every gradient counted once (sharded
        parts summed over tp, replicated and tied weights once); returns the total norm. Call it after step()
        (which all-reduces over dp) or a backward of pm(x), before the optimizer step. Collective."""
        return clip_grad_norm_(self, max_norm, norm_type, error_if_nonfinite)

    def optimizer(self, optimizer_cls, **kwargs):
        """An optimizer of `optimizer_cls` (any torch.optim class) over this rank's parameters; with mixed
        precision, over their fp32 main copies; with Config(zero=1), Megatron's distributed optimizer over the dp
        group (fxpar/runtime/optim.py, fxpar/runtime/zero.py). Make it before the first step()."""
        self.rank.weights.check_loaded("would copy garbage into the optimizer's main parameters")
        config = self.config
        if not config.zero:
            if config.mixed_precision is None:
                return optimizer_cls(self.parameters(), **kwargs)
            return MainParamsOptimizer(self, optimizer_cls, **kwargs)
        if self.rank.groups is None:
            raise ValueError("fxpar: Config(zero=1) reduce-scatters the gradients inside step(): parallelize with a "
                             "loss_fn and a mesh, and train with pm.step(...)")
        from fxpar.runtime.zero import DistributedOptimizer

        self.rank.zero = DistributedOptimizer(self, optimizer_cls, **kwargs)
        return self.rank.zero

    def check_replicas(self, grads: bool = False) -> None:
        """Raise fxpar.runtime.replicas.ReplicaError unless every replicated weight is identical wherever it is held."""
        check_replicas(self, grads)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """What model.state_dict() of the unmodified model returns: full tensors under its keys, tied keys included,
        in the model's own spelling (its state-dict hooks run: [Note: state-dict hooks]). Collective over the tp
        group (and the pp group of a pipeline: every rank receives the whole dict)."""
        full = self._full_tensors()
        return full if self.rank.spelling is None else to_model_spelling(self.rank.spelling, full)

    @torch.no_grad()
    def _full_tensors(self) -> dict[str, torch.Tensor]:
        """Full tensors under their parameter and buffer keys, tied keys included (collective over the tp group).

        On a pipeline stage, only the keys the stage holds."""
        full, w = {}, self.rank.weights
        for key in w.held_keys():
            reg = w.aliases[key]
            if reg not in full:
                local = w.live[key].detach()
                spec = w.specs.get(reg)
                full[reg] = unshard(self.rank.comm.all_gather(local), spec) if spec else local.clone()
                if reg in w.experts:
                    full[reg] = all_experts(full[reg], w.ep)
            full[key] = full[reg]
        return full

    def _weight_shards(self) -> list[WeightShard]:
        w = self.rank.weights

        def placement(key: str) -> str:
            tp = str(w.spec(key)) if w.spec(key) else "R"
            return f"{tp}, experts S(0) over ep={w.ep.size}" if w.expert(key) else tp

        # another pipeline stage's keys are its own
        return [WeightShard(key, w.shapes[key], placement(key), tuple(w.live[key].shape)) for key in w.held_keys()]


def call_inputs(pm: ParallelModule, args, kwargs) -> tuple[list, list]:
    """(the call's flat user inputs, checked against the example; the whole graph's inputs on this rank): what
    fxpar.verify runs the rewritten graph on."""
    flat = pm._flatten_inputs(args, kwargs)
    return flat, pm._graph_inputs(flat)


def full_tensors(pm: ParallelModule) -> dict[str, torch.Tensor]:
    """Full tensors under their parameter and buffer keys, tied keys included, without the model's state-dict hooks
    (pm.full_state_dict spells them as the model does). Collective over tp (and pp)."""
    return pm._full_tensors()
