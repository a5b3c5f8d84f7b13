"""A chunk's joint program (Config.joint_graph), compiled by the driver that compiles the model: PROGRAM_STAGES.

The compiler's `compile` stage (fxpar/compiler.py) decides, per chunk, what its joint program is: a JointRequest
(data). The joint graph is specialized to its inputs' signature ([Note: one program per input signature] in
passes/joint/export.py), so the program itself is made at the first call of each signature: the runtime's cache
(fxpar/runtime/joint_runner.py) calls `compile_program`, which runs PROGRAM_STAGES on a ProgramRecord with the driver of
fxpar/stages.py: each stage logged, its graph written to Config.dump_dir (`rank<r>/chunk<i>_program<n>/`), an
error naming the stage and the stages before it. The chunk graph is read, never edited: the program rewrites a copy.

Torch's partitioner cuts the joint graph into the forward and backward programs inside its own compile call, and
hands each to a callback; the callback runs HALF_STAGES on that half (as `forward_<name>`, `backward_<name>`, in
the same record and by the same driver) and then compiles it.
"""
from __future__ import annotations

import contextlib
import copy
import os
from dataclasses import dataclass, field
from typing import Callable, ClassVar

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx import GraphModule

from fxpar.config import Config
from fxpar.passes.ir.pieces import DPReduce
from fxpar.passes.joint.dp_buckets import with_dp_buckets
from fxpar.passes.joint.export import (DP_BUCKETS, EMPTY, PROGRAM_PASSES, TRACING, as_traced, compile_joint,
                                       dead_code, distinct_outputs, expected_inputs, export_joint, inductor,
                                       tag_nodes)
from fxpar.passes.joint.random_inputs import NoiseDraw, noise_draws, noise_inputs
from fxpar.passes.joint.reinplace import in_place_collectives
from fxpar.passes.tensor_parallel.rng import RandomStreams, streams_in
from fxpar.stages import run_stages


@dataclass(frozen=True)
class DPBuckets:
    """The last microbatch's variant of a chunk's program: its weights reduced over dp in the backward program
    ([Note: dp buckets in the program] in passes/joint/dp_buckets.py)."""

    buckets: tuple[tuple[str, ...], ...]  # weight keys, bucket by bucket, in the order their gradients are final
    reduce: DPReduce
    has_acc: frozenset[str]  # the weights whose accumulated gradient enters the program


@dataclass(frozen=True)
class JointRequest:
    """What the compiler decided for a chunk's joint program; the program of each signature is made from it."""

    chunk: int  # the chunk's index
    compile: bool  # the forward and backward programs through inductor (Config.compile), else run as traced
    passes: tuple[str, ...]  # Config.overlap: PROGRAM_PASSES by name, and DP_BUCKETS
    min_cut: bool  # torch's min-cut partition, which recomputes the regions Config.recompute tagged
    grad_order: tuple[str, ...]  # the chunk's weights in the order their gradients are final (dp buckets')
    dp: DPBuckets | None = None  # the last microbatch's variant; None: the chunk's own program

    @property
    def dp_in_program(self) -> bool:
        """Whether the chunk's last microbatch reduces its weights' gradients over dp in its backward program."""
        return DP_BUCKETS in self.passes


@dataclass
class ProgramRecord:
    """One signature's joint program, product by product (see PROGRAM_STAGES)."""

    chunk_gm: GraphModule  # the partition's chunk graph: read, never edited
    request: JointRequest
    inputs: tuple  # the call's inputs (real, or fake in `mode`)
    config: Config
    rank: int  # in the tp group (the dump folder's)
    label: int  # the program's number among its chunk's (the dump folder's)
    mode: FakeTensorMode | None = None  # the fake inputs' mode (the expected signature); None: a new one
    gm: GraphModule | None = None  # the graph the program stages rewrite: a copy of the chunk's
    exported: object = None  # torch's joint export (aot_export_joint_with_descriptors)
    joint: GraphModule | None = None  # the joint forward+backward graph
    forward: GraphModule | None = None  # the programs torch's partitioner cut from it, after HALF_STAGES
    backward: GraphModule | None = None
    run: Callable | None = None  # what runs them: called like the chunk graph
    stack: contextlib.ExitStack | None = None  # what the export set up, held until the partition has run
    done: list[str] = field(default_factory=list)
    dumped: dict[str, str] = field(default_factory=dict)
    dumped_products: ClassVar[tuple[str, ...]] = ("gm", "joint", "forward", "backward")

    @property
    def what(self) -> str:
        return f"chunk {self.request.chunk} program"

    def dump_folder(self) -> str:
        return os.path.join(self.config.dump_dir, f"rank{self.rank}", f"chunk{self.request.chunk}_program{self.label}")


def _copy(r: ProgramRecord) -> GraphModule:
    return GraphModule(r.chunk_gm, copy.deepcopy(r.chunk_gm.graph), class_name=type(r.chunk_gm).__name__)


def _dp_buckets(r: ProgramRecord) -> GraphModule:
    return r.gm if r.request.dp is None else with_dp_buckets(r.gm, *_dp_arguments(r.request.dp))


def _dp_arguments(dp: DPBuckets) -> tuple:
    return [list(b) for b in dp.buckets], dp.reduce, {k: k in dp.has_acc for b in dp.buckets for k in b}


def _export(r: ProgramRecord):
    return export_joint(r.stack, r.gm, r.inputs, r.mode, r.request.compile)


def _partition(r: ProgramRecord) -> Callable:
    """Torch's partitioner; each half it cuts runs HALF_STAGES, then compiles (inductor, or as traced)."""
    compiler = inductor() if r.request.compile else as_traced

    def half(name: str):
        def compile_half(gm, example_inputs):
            setattr(r, name, gm)
            run_stages(r, tuple((f"{name}_{stage}", name, _on_half(name, fn)) for stage, fn in HALF_STAGES))
            return compiler(getattr(r, name), example_inputs)
        return compile_half

    run = compile_joint(r.exported, r.request.min_cut, half("forward"), half("backward"))
    if r.backward is None:  # nothing is differentiated
        r.backward = EMPTY
    return run


def _on_half(half: str, fn: Callable) -> Callable:
    return lambda r: fn(getattr(r, half), r.request)


def _reinplace(gm: GraphModule, request: JointRequest) -> GraphModule:
    if not request.compile:  # inductor reinplaces on its own
        in_place_collectives(gm)
    return gm


def _program_pass(name: str, program_pass: Callable) -> Callable:
    return lambda gm, request: program_pass(gm) if name in request.passes else gm


PROGRAM_STAGES = (
    # name              product     what it does
    ("copy", "gm", _copy),  # the program's own graph: the chunk's stays the partition's
    ("distinct_outputs", "gm", lambda r: distinct_outputs(r.gm)),  # [Note: an output that aliases]: copies
    ("dp_buckets", "gm", _dp_buckets),  # the last microbatch's variant: the weights' dp buckets, in backward
    ("noise_inputs", "gm", lambda r: noise_inputs(r.gm)),  # each dropout's noise an input ([Note: random inputs])
    ("tag_nodes", "gm", lambda r: tag_nodes(r.gm)),  # each node's name, which torch copies onto the joint nodes
    ("export", "exported", _export),  # AOT autograd's joint export, every collective a functional op
    ("joint", "joint", lambda r: r.exported.graph_module),  # the joint forward+backward graph
    ("partition", "run", _partition),  # torch's partitioner; HALF_STAGES on each half; the halves compiled
)

# on each of the forward and backward programs the partitioner cuts, in order
HALF_STAGES = (
    ("dead_code", lambda gm, request: dead_code(gm)),  # forward GEMMs the partitioner copied into backward
    ("reinplace", _reinplace),  # all-reduces in place where nothing else reads the buffer (run as traced)
    *((name, _program_pass(name, fn)) for name, fn in PROGRAM_PASSES),  # the overlap passes Config.overlap names
)


def signature(inputs) -> tuple:
    """What a joint program is specialized to: each input's shape, dtype and whether it needs a gradient ([Note:
    one program per input signature])."""
    return tuple((tuple(x.shape), x.dtype, x.requires_grad) if isinstance(x, torch.Tensor) else None
                 for x in inputs)


def compile_program(chunk_gm: GraphModule, request: JointRequest, inputs, config: Config, rank: int = 0,
                    label: int = 0, mode: FakeTensorMode | None = None) -> ProgramRecord:
    """The joint program of `chunk_gm` for the signature of `inputs`: PROGRAM_STAGES on a new record.

    Tracing holds passes/joint/export.py's TRACING lock (tracing state is per process)."""
    r = ProgramRecord(chunk_gm, request, tuple(inputs), config, rank, label, mode)
    with TRACING, contextlib.ExitStack() as stack:
        r.stack = stack
        run_stages(r, PROGRAM_STAGES)
    # what only the stages needed: the call's inputs (activations, weights), the export and its fake mode
    r.stack = r.inputs = r.exported = r.mode = None
    return r


def expected_call(chunk_gm: GraphModule, request: JointRequest) -> tuple[FakeTensorMode, list]:
    """(mode, fake inputs in it) of a training call of the program: every weight and received activation needs a
    gradient."""
    mode = FakeTensorMode()
    gm = chunk_gm if request.dp is None else with_dp_buckets(chunk_gm, *_dp_arguments(request.dp))
    return mode, [*expected_inputs(gm, mode), *(draw.fake(mode) for draw in noise_draws(chunk_gm))]


def noise_of(chunk_gm: GraphModule) -> tuple[RandomStreams | None, list[NoiseDraw]]:
    """(the streams, each dropout's noise) a call of the chunk's programs draws and appends to its inputs ([Note:
    random inputs] in passes/joint/random_inputs.py)."""
    streams = streams_in(chunk_gm)
    return (streams[0] if streams else None), noise_draws(chunk_gm)
