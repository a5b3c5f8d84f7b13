"""Public API: parallelize(model, mesh, example_args), its input checks, and the executable it returns.

`parallelize` checks its arguments (the one place user input is validated), runs the compiler
(fxpar/compiler.py: every stage, in one list) and wraps the compiled record in the rank's executable.
"""
from __future__ import annotations

import warnings

import torch
import torch.distributed as dist
import torch.nn as nn

from fxpar.compiler import Target, compile_model
from fxpar.config import Config
from fxpar.runtime.executable import ParallelModule
from fxpar.runtime.ownership import release
from fxpar.mesh import Groups, check_mesh, decode_mesh
from fxpar.passes.tensor_parallel.collectives import TPComm
from fxpar.passes.tensor_parallel.rng import RandomStreams
from fxpar.runtime.pipeline_executable import PipelineModule


def build(model: nn.Module, comm: TPComm | None, example_args: tuple, example_kwargs: dict | None = None,
          mesh=None, config: Config | None = None, loss_fn=None, pp: int = 1, traced=None,
          example_target=None, ep: int = 1) -> ParallelModule:
    """Compile `model` for the rank described by `comm` (None: the mesh's) and return its executable.

    With a mesh and a loss_fn, the result is a PipelineModule (train it with step()); otherwise a ParallelModule,
    and no mesh is needed (a simulated rank when comm has no group). `pp` is the pipeline size when there is no
    mesh (`fxpar show --pp`): the chunks, program and proof are made, and no PipelineModule; `ep` the expert-parallel
    size without a mesh (`fxpar show --ep`): ep rank 0's experts and their dispatch, simulated (nothing runs).
    traced: a trace of this model to reuse instead of tracing again (see compiler.compile_model).
    example_target: one microbatch's target; with a loss_fn, the loss is traced with the model now (else at the first
    step, from its target: [Note: the loss is traced] in fxpar/trace.py)."""
    config = config or Config()
    _check_meta_buffers(model)
    if config.mixed_precision is not None:  # in place, as Megatron's Float16Module ([Note: mixed precision])
        model.to(config.mixed_precision.param_dtype)
    groups = decode_mesh(mesh)  # the mesh, decoded once: what every part of the executable reads
    if comm is None:
        comm = groups.comm if groups is not None else TPComm(rank=0, size=1)
    pipelined = loss_fn is not None or pp > 1
    pp = groups.pp if groups is not None else pp
    streams = _streams(config, comm, groups, example_args)
    loss = (loss_fn, example_target) if loss_fn is not None and example_target is not None and traced is None \
        else None
    ep = groups.ep_comm if groups is not None else TPComm(rank=0, size=ep)
    if ep.size > 1:
        _check_expert_parallel(config, ep.size)
    dp = groups.dp_comm if groups is not None else TPComm(rank=0, size=1)
    compiled = compile_model(model, example_args, example_kwargs, Target(comm, pp, pipelined, streams, ep=ep, dp=dp),
                             config,
                             traced=traced, loss=loss)
    if loss_fn is not None and groups is not None:
        pm = PipelineModule(model, compiled, groups, loss_fn)
    else:
        pm = ParallelModule(model, compiled, mesh=groups)
    if ep.size > 1 and not compiled.experts.chains:
        warnings.warn(
            f"fxpar: found no experts to split over ep={ep.size} in {type(model).__name__}: every rank holds every "
            "expert. The plan says why each grouped GEMM was left as it is.", stacklevel=3)
    if comm.size > 1 and not pm.plan.sharded_regions:
        warnings.warn(
            f"fxpar: found nothing to shard in {type(model).__name__} at t={comm.size}; it runs replicated on "
            "every tp rank. The plan says why each GEMM was left replicated.",
            stacklevel=3,
        )
    return pm


def _check_expert_parallel(config: Config, ep: int) -> None:
    """What expert parallelism does not compose with yet: a clear error, not a silent difference."""
    other = [what for what, on in (
        ("Config(compile=True)", config.compile),
        ("Config(joint_graph=True)", bool(config.joint_graph))) if on]
    if other:
        raise ValueError(
            f"fxpar: expert parallelism (ep={ep}) does not run with {', '.join(other)} yet (compiled programs: "
            "the rows each rank's experts receive are known only at run time). Fix: use ep without compile, or ep=1 "
            "(the experts are then split the tensor-parallel way).")


def _check_meta_buffers(model: nn.Module) -> None:
    """A model built on the meta device is filled by a load of its state_dict; a buffer outside it cannot be."""
    persistent = set(model.state_dict(keep_vars=True))
    for name, buffer in model.named_buffers(remove_duplicate=False):
        if buffer.is_meta and name not in persistent:
            raise ValueError(
                f"fxpar.parallelize: buffer {name} {tuple(buffer.shape)} is on the meta device but is not in the "
                "model's state_dict (registered with persistent=False), so no checkpoint can fill it. Fix: build "
                "only the parameters on meta (buffers are small), or compute this buffer on a real device before "
                "parallelize.")


def _streams(config: Config, comm: TPComm, groups: Groups | None, example_args) -> RandomStreams:
    """This rank's random streams ([Note: random streams] in passes/tensor_parallel/rng.py), from one seed for every
    rank."""
    seed = config.seed
    if seed is None:
        seed = torch.initial_seed() % 2**62
        if groups is not None and dist.get_world_size() > 1:
            shared = torch.tensor([seed], dtype=torch.int64, device=groups.device)
            dist.broadcast(shared, src=0)
            seed = int(shared.item())
    pp_rank, dp_rank = (groups.pp_rank, groups.dp_rank) if groups is not None else (0, 0)
    device = next((x.device.type for x in example_args if isinstance(x, torch.Tensor)), "cpu")
    device = "cpu" if device == "meta" else device  # a rank simulated on meta (fxpar show) draws nothing
    return RandomStreams(seed, comm.rank, pp_rank, dp_rank, device if groups is None else groups.device.type)


def parallelize(model: nn.Module, mesh=None, example_args: tuple = (), example_kwargs: dict | None = None,
                loss_fn=None, config: Config | None = None, example_target=None, **kw):
    """Parallelize an unmodified model over `mesh` (a (pp, dp, tp) DeviceMesh from fxpar.init_mesh).

    Returns an nn.Module: calling it returns what `model` returns, replicated on every tp rank; its parameters are
    this rank's shards, and it owns the weights: `model`'s parameters are released, and using them raises an error
    that points here ([Note: one copy of the truth] in fxpar/runtime/ownership.py); `full_state_dict()` gathers them under the original keys; `plan` lists every decision.
    With `loss_fn(output, target)` it also trains with `pm.step(*global_batch, target=...)`, which runs the
    pipeline schedule of `config` (required when pp > 1) and the data-parallel gradient all-reduce. The loss is
    traced with the model (a cross-entropy over the vocabulary-parallel logits never gathers them); pass
    example_target (one microbatch's target) to trace it now, else the first step does.
    example_args are one microbatch's inputs.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"fxpar.parallelize: model must be an nn.Module, got {type(model).__name__}")
    if not isinstance(example_args, tuple):
        raise TypeError(f"fxpar.parallelize: example_args must be a tuple, got {type(example_args).__name__}")
    if example_kwargs is not None and not isinstance(example_kwargs, dict):
        raise TypeError(f"fxpar.parallelize: example_kwargs must be a dict, got {type(example_kwargs).__name__}")
    if mesh is not None:
        check_mesh(mesh)
    if kw:
        raise TypeError(f"fxpar.parallelize: unexpected arguments {sorted(kw)}")
    if config is not None and not isinstance(config, Config):
        raise TypeError(f"fxpar.parallelize: config must be an fxpar.Config, got {type(config).__name__}")
    pp = mesh.size(0) if mesh is not None else 1
    if pp > 1 and loss_fn is None:
        raise ValueError(
            f"fxpar.parallelize: the mesh has pp={pp} pipeline stages, which compute the loss on the last stage: "
            "pass loss_fn=fn, where fn(output, target) returns the scalar loss of one microbatch."
        )
    if loss_fn is not None and mesh is None:
        raise ValueError("fxpar.parallelize: loss_fn (training with step()) needs a mesh from fxpar.init_mesh")
    if loss_fn is not None and not callable(loss_fn):
        raise TypeError(f"fxpar.parallelize: loss_fn must be callable, got {type(loss_fn).__name__}")
    if example_target is not None and loss_fn is None:
        raise ValueError("fxpar.parallelize: example_target is the target of loss_fn; pass loss_fn too")
    pm = build(model, None, example_args, example_kwargs, mesh, config, loss_fn,
               example_target=example_target)
    release(model)  # [Note: one copy of the truth] in fxpar/runtime/ownership.py
    return pm
