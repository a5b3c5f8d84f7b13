"""The compiler: every stage of fxpar, in one ordered list.

Reading STAGES tells the whole compiler. Each stage is a named function of the Compiled record that returns one
product, which the driver (fxpar/stages.py run_stages) stores on the record under the stage's field; later stages
read earlier products, and `parallelize`, `fxpar show`, `verify` and the executables only consume the finished
record. The driver logs each stage, and re-raises any error with the stage's name and the stages that ran before
it: bad input (ValueError, TraceError) keeps its type, anything else becomes a PassError. A chunk's joint program
is compiled by the same driver from PROGRAM_STAGES (fxpar/programs.py), at its first call of each signature.

The traced program (`traced.gm`) is never rewritten: `working_copy` makes the copy (`gm`) that the graph
passes rewrite in place, `keep_tp_graph` snapshots it for verify, and the partition copies the nodes of each chunk
into graphs of its own. Stages hand each other typed metadata (passes/ir/meta.py), never node names.
"""
from __future__ import annotations

import copy
import dataclasses
import logging
import os
from dataclasses import dataclass, field
from typing import Callable, ClassVar

import torch
import torch.nn as nn
import torch.utils._pytree as pytree
from torch.fx import GraphModule

from fxpar.config import Config
from fxpar.passes.sharding.analysis import Analysis, analyze, check_divisible, weight_specs
from fxpar.passes.frontend.canonicalize import (cross_entropy_pass, drop_metadata_asserts_pass, fresh_in_place_pass,
                                                merge_aliases_pass, view_as_pass)
from fxpar.passes.fusion.driver import (attention_to_sdpa_pass, bias_dropout_add_pass, bias_gelu_pass, gelu_pass,
                                        identity_dropout_pass)
from fxpar.passes.frontend.context_regions import inline_context_pass
from fxpar.passes.experts.find import Experts, find_experts
from fxpar.passes.experts.expert_parallel import expert_keys, expert_parallel_pass
from fxpar.passes.frontend.gemm_forms import gemm_forms_pass
from fxpar.passes.data_parallel.batch_statistics import (BatchStatistics, batch_statistics_pass,
                                                         find_batch_statistics)
from fxpar.passes.frontend.token_count import LossNormalization, loss_normalization
from fxpar.passes.frontend.unfuse import parts as unfuse_parts
from fxpar.passes.frontend.unfuse import unfuse
from fxpar.passes.joint.dp_buckets import grad_order
from fxpar.passes.joint.export import DEFAULT_OVERLAP, check_joint
from fxpar.passes.joint.random_inputs import dropout_input
from fxpar.passes.tensor_parallel.local_shapes import (input_device, local_shapes_pass, meta_state_device,
                                                       place_meta_state_pass)
from fxpar.passes.pipeline.lower import Program, lower_program
from fxpar.passes.tensor_parallel.merge_comm import merge_comm_pass
from fxpar.passes.ir.meta import (BUFFER, FXPAR_ASSUMES, FXPAR_INPUT, PARAMETER, STATE_KINDS, GraphInput, input_of,
                                  module_path, param_nodes, placeholders)
from fxpar.passes.tensor_parallel.collectives import TPComm
from fxpar.passes.pipeline.partition import Partition, partition_pass, whole_graph
from fxpar.passes.ir.placements import Shard
from fxpar.passes.pipeline.proofs import prove
from fxpar.passes.tensor_parallel.in_place import in_place_pass
from fxpar.passes.fusion.recompute import recompute_pass
from fxpar.passes.tensor_parallel.rng import RandomStreams, draws, random_streams_pass
from fxpar.passes.pipeline.schedules import build_schedule
from fxpar.passes.pipeline.simulate import SimResult
from fxpar.passes.tensor_parallel.rewrite import tensor_parallel_pass
from fxpar.passes.sharding.vocab_analysis import vocab_analysis
from fxpar.passes.sharding.sequence_analysis import SequenceAnalysis, sequence_analysis
from fxpar.passes.tensor_parallel.sequence_parallel import gathered_gemms_pass, sequence_parallel_pass
from fxpar.programs import JointRequest
from fxpar.stages import run_stages
from fxpar.trace import Traced, trace

log = logging.getLogger("fxpar")


@dataclass
class Target:
    """Where the program runs: this rank of its tensor-parallel group, and the pipeline around it."""

    comm: TPComm  # rank and size of the tp group (group=None simulates the rank: shapes only)
    pp: int = 1  # pipeline ranks
    pipelined: bool = False  # trained with step() over a pipeline schedule (a loss_fn was given)
    streams: RandomStreams | None = None  # this rank's random streams (passes/tensor_parallel/rng.py); None: seed 0
    chunk_layers: tuple | None = None  # pin the layers of each chunk (a recompile keeps the first one's cut)
    ep: TPComm = field(default_factory=lambda: TPComm(rank=0, size=1))  # the expert-parallel group (init_mesh(ep=E))
    dp: TPComm = field(default_factory=lambda: TPComm(rank=0, size=1))  # the data-parallel group (batch statistics)

    def __post_init__(self):
        if self.streams is None:
            self.streams = RandomStreams(0, self.comm.rank)


@dataclass(frozen=True)
class JointChoice:
    """Whether the chunks run as their joint programs (Config.joint_graph; with compile, where it applies), and why."""

    on: bool
    why: str = ""  # the plan's line (empty: the user chose)


@dataclass
class Compiled:
    """Everything the compiler made for one rank, product by product (see STAGES)."""

    model: nn.Module
    example_args: tuple
    example_kwargs: dict
    target: Target
    config: Config
    loss: tuple | None = None  # (loss_fn, example target): trace the loss with the model ([Note: the loss is traced])
    traced: Traced | None = None  # trace: the unmodified program, the reference
    normalization: LossNormalization | None = None  # how step() weights the microbatch losses (a traced loss only)
    statistics: BatchStatistics | None = None  # the loss's statistics over the batch's rows, made the whole batch's
    gm: GraphModule | None = None  # the working graph, as the graph passes leave it
    aliases: dict[str, str] | None = None  # every parameter and buffer key -> the key its tensor is registered under
    analysis: Analysis | None = None  # analyze: every node's placement, the regions of the plan
    sequence: SequenceAnalysis | None = None  # sequence_analysis: what runs on sequence blocks between regions
    tp_graph: GraphModule | None = None  # keep_tp_graph: the graph right after tensor parallelism (for verify)
    experts: Experts | None = None  # experts: the expert chains, and why other experts are not one
    partition: Partition | None = None  # the chunks (one chunk, the whole graph, without a pipeline)
    schedule: dict | None = None  # the compute schedule of every pp rank (pipelined only)
    program: Program | None = None  # the lowered schedule the runtime runs (pipelined only)
    proof: SimResult | None = None  # the replay that proved the program (pipelined only)
    callables: dict[int, Callable | JointRequest] | None = None  # chunk index -> what runs it, or its joint program
    buffers: dict | None = None  # buffer values the fusion may rely on (default: the model's)
    state_values: dict | None = None  # GraphInput -> the buffer or constant value a fusion may prove things from
    joint: JointChoice | None = None  # joint: whether the chunks run as their joint programs
    assumed: dict[GraphInput, torch.Tensor] = field(default_factory=dict)  # values a rewrite relied on (fusions)
    expected_state: dict | None = None  # chunk index -> key -> the fake value each weight was traced with
    done: list[str] = field(default_factory=list)
    dumped: dict[str, str] = field(default_factory=dict)  # product -> the code the driver last wrote to dump_dir
    dumped_products: ClassVar[tuple[str, ...]] = ("gm",)  # the graph products the driver dumps (fxpar/stages.py)
    what: ClassVar[str] = "compiler"  # how errors name the stages

    def dump_folder(self) -> str:
        """Config.dump_dir's folder for this rank: `rank<r>`, r its rank in the tp group."""
        return os.path.join(self.config.dump_dir, f"rank{self.target.comm.rank}")

    @property
    def specs(self) -> dict[str, Shard]:
        """state_dict key -> how this weight is sharded over tp (absent: replicated)."""
        return weight_specs(self.analysis)

    @property
    def expert_keys(self) -> set[str]:
        """state_dict keys split along their expert dim (0) over ep (empty without expert parallelism)."""
        return expert_keys(self.experts) if self.target.ep.size > 1 else set()

    @property
    def target_device(self) -> torch.device:
        """Where weights built on the meta device are materialized: where the inputs are (the CPU if none)."""
        return input_device(self.traced.gm)


# ---------------------------------------------------------------------------------------------------- the stages
def _trace(c: Compiled) -> Traced:
    return _export(c, c.example_args, c.example_kwargs, c.loss)


def _export(c: Compiled, args: tuple, kwargs: dict, loss: tuple | None) -> Traced:
    """torch.export's program of c.model on these inputs; weights built on the meta device are placed where the
    inputs are (see passes/tensor_parallel/local_shapes.py place_meta_state_pass)."""
    mp = c.config.mixed_precision
    traced = trace(c.model, args, kwargs, loss, mp.param_dtype if mp is not None else None)
    device = meta_state_device(traced.gm)
    if device is not None:
        place_meta_state_pass(traced.gm, device)
    return traced


def _normalization(c: Compiled) -> LossNormalization | None:
    """[Note: whole-batch semantics] in passes/frontend/token_count.py: a token-mean loss and what counts its
    valid targets, read from the unmodified program."""
    return loss_normalization(c.traced.gm) if c.traced.with_loss else None


def _statistics(c: Compiled) -> BatchStatistics | None:
    """[Note: batch statistics] in passes/data_parallel/batch_statistics.py: the loss traced again at dp times the rows,
    where it is not a token mean, to find the statistics over the batch's rows it reads nonlinearly."""
    d = c.target.dp.size
    if d == 1 or not c.traced.with_loss or c.loss is None or c.normalization.count is not None:
        return None

    def whole(x):  # d microbatches' rows together, as step() cuts every tensor input along dim 0
        return torch.cat([x] * d) if isinstance(x, torch.Tensor) and x.dim() else x

    loss_fn, target = c.loss
    note = ""
    try:
        traced = _export(c, pytree.tree_map(whole, c.example_args), pytree.tree_map(whole, c.example_kwargs),
                         (loss_fn, pytree.tree_map(whole, target)))
    except Exception as e:  # noqa: BLE001 - the model at d times the rows: anything it raises keeps the rank's own
        lines = str(e).splitlines() or [type(e).__name__]
        traced, note = None, lines[1].strip() if len(lines) > 1 and "export said" in lines[0] else lines[0]
    if traced is None or not traced.with_loss:
        return BatchStatistics(why=f"the loss does not trace at dp={d} times the rows ({note or traced.loss_note})")
    stats = find_batch_statistics(c.traced.gm, traced.gm)
    if stats is not None and not stats.why and (c.config.joint_graph or c.config.compile):
        stats.why = "the joint programs and compile do not run the all-reduces of batch statistics yet"
    return stats


def _batch_statistics(c: Compiled) -> GraphModule:
    return batch_statistics_pass(c.gm, c.statistics, c.target.dp)


def _working_copy(c: Compiled) -> GraphModule:
    """The working copy of the traced program, which the graph stages rewrite in place (its nodes keep their names
    and metadata)."""
    return GraphModule(c.traced.gm, copy.deepcopy(c.traced.gm.graph), class_name=c.traced.model_name or "Traced")


def _merge_aliases(c: Compiled) -> GraphModule:
    return merge_aliases_pass(c.gm, c.aliases)


def canonical_keys(model: nn.Module) -> dict[str, str]:
    """Every parameter and buffer key -> the first key of its tensor (the one the executable registers)."""
    first: dict[int, str] = {}
    out = {}
    for key, t in [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]:
        out[key] = first.setdefault(id(t), key)
    return out


def _unfuse(c: Compiled) -> GraphModule:
    """[Note: whole parts] A fused projection the analysis leaves replicated whose parts t cannot all split (one
    K/V head) is cut into one GEMM per part, where the cut one then shards (passes/frontend/unfuse.py)."""
    t = c.target.comm.size
    fused = [n for n in c.gm.graph.nodes if n.op == "call_function" and unfuse_parts(n)]
    if t == 1 or not fused:
        return c.gm
    left = {name for r in analyze(c.gm, t, param_nodes(c.gm)).regions for name in r.replicated}
    for gemm in [n for n in fused if n.name in left]:
        trial = copy.deepcopy(c.gm)
        cut = unfuse(trial, next(n for n in trial.graph.nodes if n.name == gemm.name))
        if cut and any(n.name in r.columns for n in cut for r in analyze(trial, t, param_nodes(trial)).regions):
            c.gm = trial
    return c.gm


def _analyze(c: Compiled) -> Analysis:
    return analyze(c.gm, c.target.comm.size, param_nodes(c.gm))


def _vocab(c: Compiled) -> Analysis:
    return vocab_analysis(c.gm, c.analysis, param_nodes(c.gm))


def _check_divisible(c: Compiled) -> None:
    check_divisible(c.analysis)


def _tensor_parallel(c: Compiled) -> GraphModule:
    return tensor_parallel_pass(c.gm, c.analysis, c.target.comm)


def _merge_comm(c: Compiled) -> GraphModule:
    return merge_comm_pass(c.gm, c.target.comm)


def _local_shapes(c: Compiled) -> GraphModule:
    return local_shapes_pass(c.gm, c.specs, c.target.comm.size) if c.analysis.decisions else c.gm


def _sequence_analysis(c: Compiled) -> SequenceAnalysis:
    if not c.config.sequence_parallel:
        return SequenceAnalysis(c.target.comm.size)
    return sequence_analysis(c.gm, c.target.comm.size, param_nodes(c.gm))


def _sequence_parallel(c: Compiled) -> GraphModule:
    return sequence_parallel_pass(c.gm, c.sequence, c.target.comm)


def _sequence_shapes(c: Compiled) -> GraphModule:
    """The placeholders hold this rank's shapes already (local_shapes): nothing more to shard on them."""
    return local_shapes_pass(c.gm, {}, c.target.comm.size) if c.sequence.applied else c.gm


def _keep_tp_graph(c: Compiled) -> GraphModule:
    return GraphModule(c.gm, copy.deepcopy(c.gm.graph), class_name="TensorParallel")


def _state_values(c: Compiled) -> dict[GraphInput, torch.Tensor]:
    """The buffer and constant values a fusion may prove something from (a mask causal)."""
    state = c.buffers if c.buffers is not None else dict(c.model.named_buffers(remove_duplicate=False))
    # a buffer built on the meta device has no value yet: nothing is proven from it (its mask stays unfused)
    return {gi: v for gi, v in c.traced.values(state).items() if not v.is_meta}


def _fusion(pass_fn: Callable[[GraphModule], GraphModule]) -> Callable[[Compiled], GraphModule]:
    """A fusion stage: pass_fn on the working graph, where Config.fuse is on."""
    return lambda c: pass_fn(c.gm) if c.config.fuse else c.gm


def _attention_to_sdpa(c: Compiled) -> GraphModule:
    return attention_to_sdpa_pass(c.gm, c.state_values, dropout=not c.joint.on) if c.config.fuse else c.gm


def _joint(c: Compiled) -> JointChoice:
    """Config.joint_graph as given; None: the joint programs with compile, unless a random op draws that a joint
    program cannot take as an input (all but a CPU dropout: passes/joint/export.py check_joint), where each chunk
    goes through torch.compile."""
    asked = c.config.joint_graph
    if asked is not None or not c.config.compile:
        return JointChoice(bool(asked))
    drawn = next((n for n in c.gm.graph.nodes if draws(n) and dropout_input(n.target, n.args, n.kwargs) is None),
                 None)
    if drawn is None:
        return JointChoice(True, "compile: each chunk's joint forward+backward program through inductor "
                                 "(Config(joint_graph=False): torch.compile of each chunk instead)")
    return JointChoice(False, f"compile: torch.compile of each chunk, not its joint program: node {drawn.name} "
                              f"({module_path(drawn) or 'the root module'}, {drawn.target}) draws random numbers in "
                              "training, which a joint program cannot take from fxpar's random streams yet (a CPU "
                              "dropout it can: passes/joint/random_inputs.py)")


def _gelu(c: Compiled) -> GraphModule:
    """GeLU written out -> aten.gelu; with Config(recompute="selective") bias+GeLU recomputed in backward."""
    if not c.config.fuse:
        return c.gm
    recompute = c.config.recompute == "selective" and not c.joint.on  # joint: the recompute tags it
    return bias_gelu_pass(c.gm) if recompute else gelu_pass(c.gm)


def _assumed(c: Compiled) -> dict[GraphInput, torch.Tensor]:
    """The values the fusions relied on, which the executable checks before each call."""
    used = {gi for n in c.gm.graph.nodes for gi in n.meta.get(FXPAR_ASSUMES, ())}
    return {gi: c.state_values[gi].detach().clone() for gi in used}


def _gathered_gemms(c: Compiled) -> GraphModule:
    return gathered_gemms_pass(c.gm, c.target.comm) if c.sequence.applied else c.gm


def _random_streams(c: Compiled) -> GraphModule:
    return random_streams_pass(c.gm, c.target.streams)


def _recompute(c: Compiled) -> GraphModule:
    # the joint program's partitioner recomputes tagged regions ([Note: recomputation in the joint program])
    return recompute_pass(c.gm, c.config.recompute, tag=c.joint.on)


def _in_place(c: Compiled) -> GraphModule:
    return in_place_pass(c.gm)


def _expert_parallel(c: Compiled) -> GraphModule:
    return expert_parallel_pass(c.gm, c.experts, c.target.ep, c.config.ep_dispatch)


def _partition(c: Compiled) -> Partition:
    if not c.target.pipelined:
        return whole_graph(c.gm)
    return partition_pass(c.gm, c.target.pp * c.config.virtual_stages, c.target.chunk_layers)


def _schedule(c: Compiled) -> dict | None:
    if not c.target.pipelined:
        return None
    return build_schedule(c.config.schedule, c.target.pp, c.config.microbatches, c.config.virtual_stages)


def _lower(c: Compiled) -> Program | None:
    if c.schedule is None:
        return None
    return lower_program(c.schedule, c.target.pp, c.config.virtual_stages, c.config.microbatches)


def _prove(c: Compiled) -> SimResult | None:
    return None if c.program is None else prove(c.program, c.partition.chunks)


def _compile(c: Compiled) -> dict[int, Callable]:
    if c.joint.on:  # made at the first call of each input signature (fxpar/programs.py)
        for chunk in c.partition.chunks:
            check_joint(chunk.gm)
        overlap = DEFAULT_OVERLAP if c.config.overlap is None else c.config.overlap
        min_cut = c.config.recompute != "none"
        return {chunk.index: JointRequest(chunk.index, c.config.compile, tuple(overlap), min_cut,
                                          grad_order(chunk.gm)) for chunk in c.partition.chunks}
    return {chunk.index: compile_graph(chunk.gm) if c.config.compile else chunk.gm for chunk in c.partition.chunks}


def _expected_state(c: Compiled) -> dict[int, dict[str, torch.Tensor]]:
    """Chunk index -> key -> the fake value (local shape, dtype, device) each weight was traced with."""
    out = {}
    for chunk in c.partition.chunks:
        out[chunk.index] = state = {}
        for n in placeholders(chunk.gm):
            gi = input_of(n)
            if gi.kind in STATE_KINDS and isinstance(n.meta.get("val"), torch.Tensor):
                state.setdefault(gi.key, n.meta["val"])
    return out


def compile_graph(gm: GraphModule, backend: str = "inductor", **options):
    """torch.compile(gm) (Config.compile, off by default): one compiled callable per graph chunk.

    Safe: torch.compile preserves semantics; the fused autograd Functions and checkpointed regions trace through
    dynamo. `backend="aot_eager"` skips code generation (tests)."""
    return torch.compile(gm, backend=backend, **options)


STAGES: tuple[tuple[str, str | None, Callable[[Compiled], object]], ...] = (
    # name             product (None: a check)   what it does
    ("trace", "traced", _trace),  # torch.export (non-strict): the ATen program, inputs typed
    ("normalization", "normalization", _normalization),  # a token-mean loss: what counts its valid targets
    ("statistics", "statistics", _statistics),  # the loss's statistics over the batch's rows, found
    ("working_copy", "gm", _working_copy),  # the graph the stages below rewrite; the trace stays the reference
    ("aliases", "aliases", lambda c: canonical_keys(c.model)),  # every state key -> the first key of its tensor
    ("merge_aliases", "gm", _merge_aliases),  # one placeholder per tensor: tied weights are one parameter
    ("context_regions", "gm", lambda c: inline_context_pass(c.gm)),  # autocast, no_grad bodies as ops
    ("drop_asserts", "gm", lambda c: drop_metadata_asserts_pass(c.gm)),  # metadata-only asserts
    ("view_as", "gm", lambda c: view_as_pass(c.gm)),  # view_as spelled as the view it is
    ("fresh_in_place", "gm", lambda c: fresh_in_place_pass(c.gm)),  # `a.add_(b)` on a fresh a nobody else reads
    ("cross_entropy", "gm", lambda c: cross_entropy_pass(c.gm)),  # log_softmax + nll as the cross-entropy it is
    ("gemm_forms", "gm", lambda c: gemm_forms_pass(c.gm)),  # every weight contraction as linear / mm / addmm
    ("unfuse", "gm", _unfuse),  # a fused projection with a part t cannot split (one K/V head): a GEMM per part
    ("analyze", "analysis", _analyze),  # placements and regions of column- then row-parallel GEMMs
    ("vocab", "analysis", _vocab),  # the vocab-parallel embedding, LM head and loss (passes/sharding/vocab_analysis.py)
    ("check_divisible", None, _check_divisible),  # every sharded size divides by t, or a clear error
    ("tensor_parallel", "gm", _tensor_parallel),  # f/g, local view shapes, vocab-parallel embedding and head
    ("merge_comm", "gm", _merge_comm),  # g moved past linear ops, two partial sums one g; f's of one value one f
    ("local_shapes", "gm", _local_shapes),  # this rank's fake value on every node
    ("sequence_analysis", "sequence", _sequence_analysis),  # the sequence dim; ops token-wise between regions
    ("sequence_parallel", "gm", _sequence_parallel),  # g -> reduce-scatter, f -> all-gather, ops on sequence blocks
    ("sequence_shapes", "gm", _sequence_shapes),  # this rank's fake values again, on sequence blocks
    ("keep_tp_graph", "tp_graph", _keep_tp_graph),  # snapshot for verify
    ("experts", "experts", lambda c: find_experts(c.gm)),  # the expert chains (passes/experts/find.py)
    ("expert_parallel", "gm", _expert_parallel),  # each chain on the rows of this rank's experts (init_mesh(ep=E))
    ("batch_statistics", "gm", _batch_statistics),  # those statistics all-reduced over dp: the whole batch's
    ("state_values", "state_values", _state_values),  # buffer values the fusions may prove masks from
    ("joint", "joint", _joint),  # the joint programs (Config.joint_graph; none: with compile, where they apply)
    ("attention_to_sdpa", "gm", _attention_to_sdpa),  # explicit attention -> SDPA (Config.fuse, as the three below)
    ("identity_dropout", "gm", _fusion(identity_dropout_pass)),  # a dropout that is an identity removed
    ("bias_dropout_add", "gm", _fusion(bias_dropout_add_pass)),  # bias + dropout + residual add, one op
    ("gelu", "gm", _gelu),  # GeLU written out -> aten.gelu (recompute="selective": bias+GeLU recomputed)
    ("assumed", "assumed", _assumed),  # the values the fusions relied on, checked before each call
    ("gathered_gemms", "gm", _gathered_gemms),  # an all-gather and the GEMMs it feeds, one op saving the block
    ("random_streams", "gm", _random_streams),  # every random op on its stream: replicated or sharded
    ("recompute", "gm", _recompute),  # checkpointed layers or attention cores (Config.recompute)
    ("in_place", "gm", _in_place),  # f and g all-reduce in place where nothing else reads the tensor
    ("partition", "partition", _partition),  # p*v chunks at layer boundaries (one chunk without a pipeline)
    ("schedule", "schedule", _schedule),  # GPipe / 1F1B / interleaved 1F1B compute actions per pp rank
    ("lower", "program", _lower),  # sends, early-posted receives, message tags
    ("prove", "proof", _prove),  # compute order, tags, matching, boundaries, no deadlock (passes/pipeline/proofs.py)
    ("compile", "callables", _compile),  # joint programs' requests (Config.joint_graph); torch.compile (Config.compile)
    ("expected_state", "expected_state", _expected_state),  # each chunk's weights as traced (the executable checks)
)


def compile_model(model: nn.Module, example_args: tuple, example_kwargs: dict | None, target: Target,
                  config: Config | None = None, buffers: dict | None = None, traced: Traced | None = None,
                  loss: tuple | None = None) -> Compiled:
    """Compile `model` for one rank: every stage of STAGES. The model itself is not modified.

    loss: (loss_fn, example target): the program is loss_fn(model(*args, **kwargs), target) where it can be traced
    so ([Note: the loss is traced] in fxpar/trace.py).
    buffers: the buffer values the rewrites may rely on (a recompile passes the executable's own).
    traced: the trace stage's product, made once for several ranks or targets of one model in one process (the
    threaded ranks of tests/fuzz.py): it must be `trace(model, example_args, example_kwargs)` of an equal model;
    the stages never rewrite it. Its inputs are checked against the model's state."""
    c = Compiled(model, tuple(example_args), dict(example_kwargs or {}), target, config or Config(), loss=loss,
                 buffers=buffers)
    if traced is None:
        return run_stages(c, STAGES)
    _check_trace_of(traced, model)
    c.traced = traced
    c.done.append("trace (given)")
    return run_stages(c, STAGES[1:])


def retarget(c: Compiled, model: nn.Module, pp: int, pipelined: bool = True) -> Compiled:
    """c's program for another pipeline size: the stages up to `recompute` do not depend on the pipeline, so their
    products are shared (the partition copies the nodes it takes, no later stage rewrites them) and only
    partition .. compile run again. model: the module the new executable reads its weights from (an equal one)."""
    first = [name for name, _, _ in STAGES].index("partition")
    _check_trace_of(c.traced, model)
    target = dataclasses.replace(c.target, pp=pp, pipelined=pipelined, chunk_layers=None)
    fresh = dataclasses.replace(c, model=model, target=target, partition=None, schedule=None, program=None,
                                proof=None, callables=None, expected_state=None,
                                done=c.done[:first] + ["(retargeted)"])
    return run_stages(fresh, STAGES[first:])


def _check_trace_of(traced: Traced, model: nn.Module) -> None:
    """Every parameter and buffer the trace reads exists in `model` with the traced shape."""
    state = dict(model.named_parameters(remove_duplicate=False)) | dict(model.named_buffers(remove_duplicate=False))
    for n in traced.gm.graph.find_nodes(op="placeholder"):
        gi = n.meta[FXPAR_INPUT]
        if gi.kind not in (PARAMETER, BUFFER):
            continue
        t, want = state.get(gi.key), tuple(n.meta["val"].shape)
        if t is None or tuple(t.shape) != want:
            got = "missing from the model" if t is None else f"{tuple(t.shape)} in the model"
            raise ValueError(f"fxpar: the given trace is not of this {type(model).__name__}: its {gi.kind} {gi.key} "
                             f"was traced as {want} and is {got}. Fix: trace this model (or pass traced=None).")
