"""A chunk's forward and backward as one FX graph: the joint program, every collective a node.

AOT autograd's joint export (torch._functorch.aot_autograd.aot_export_joint_with_descriptors) traces the chunk's
graph and its backward together, on fake tensors, while every collective fxpar placed is spelled as a c10d
functional op (`functional_collectives()` in passes/tensor_parallel/collectives.py): f's all-reduce and the scatter's
all-gather in backward become nodes of the graph like g's in forward. Torch's partitioner then splits the joint graph
into the forward and backward programs that run, eagerly or through inductor (Config.compile).

[Note: one program per input signature]
    The joint graph is specialized to which inputs need a gradient (a frozen weight, a received activation) and to
    the inputs' shapes and dtypes: the gradients it computes are those inputs'. The runtime therefore keeps one
    program per signature (fxpar/runtime/joint_runner.py) and asks the compiler for a new one (fxpar/programs.py
    PROGRAM_STAGES) the first time a call brings another, so a weight frozen after parallelize still gets no
    gradient and a received activation still gets one. The plan reads the program of the last call (before any
    call: that of every weight and received activation needing a gradient).

Every node of the chunk's graph is tagged (meta["custom"][FXPAR_NODE]) before the export; torch copies the tag onto
the joint nodes traced from it, backward ones included (by autograd's sequence numbers), which is how
passes/joint/comm_table.py knows which of fxpar's collectives each functional collective implements.
"""
from __future__ import annotations

import contextlib
import threading
from typing import Callable

import torch
from torch.fx import GraphModule
from torch._functorch.aot_autograd import (aot_compile_joint_with_descriptors, aot_export_joint_with_descriptors,
                                           make_boxed_func)
from torch._functorch.partitioners import default_partition, min_cut_rematerialization_partition
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.multiprocessing.reductions import StorageWeakRef

from fxpar.passes.ir.meta import BOUNDARY, FXPAR_NODE, FXPAR_RANDOM, PARAMETER, input_of, module_path
from fxpar.passes.joint.dp_buckets import FXPAR_DP
from fxpar.passes.joint.overlap import early_collectives, late_waits
from fxpar.passes.joint.random_inputs import dropout_input, random_op
from fxpar.passes.tensor_parallel.collectives import functional_collectives

FXPAR_COPY = "fxpar_output_copy"  # meta: a copy distinct_outputs made ([Note: an output that aliases])

# the passes on each program the partitioner cuts (forward and backward), in order (Config.overlap names them)
PROGRAM_PASSES = (
    ("early_collectives", early_collectives),  # the compute feeding the next collective first, then the collective
    ("late_waits", late_waits),  # each wait right before its first reader
)
# the dp gradient reduction in the last microbatch's backward program (passes/joint/dp_buckets.py): named beside
# the program passes, since with them it is what overlaps each bucket with the rest of the backward
DP_BUCKETS = "dp_buckets"
OVERLAP_NAMES = (*(name for name, _ in PROGRAM_PASSES), DP_BUCKETS)
# on by default with the joint graph: together the program passes pay on gloo, each alone does not; dp_buckets does
# not pay on gloo over 2 cores, where the reduction's thread competes with the compute it would hide
# (benchmarks/overlap.py --dp)
DEFAULT_OVERLAP = ("early_collectives", "late_waits")


def tag_nodes(gm: GraphModule) -> GraphModule:
    """Tag every node with its name (meta["custom"][FXPAR_NODE]), which torch copies onto the joint nodes traced
    from it: how comm_table.py knows which of fxpar's collectives each functional collective implements."""
    for n in gm.graph.nodes:
        n.meta["custom"] = {**n.meta.get("custom", {}), FXPAR_NODE: n.name}
    return gm


def export_joint(stack: contextlib.ExitStack, gm: GraphModule, inputs, mode: FakeTensorMode | None, compile: bool):
    """AOT autograd's joint forward+backward export of `gm` on fake tensors, every collective a c10d functional op;
    `stack` holds what the export set up until compile_joint has run."""
    mode = mode or FakeTensorMode(allow_non_fake_inputs=True)
    fakes = tuple(mode.from_tensor(x, static_shapes=True) if isinstance(x, torch.Tensor) and
                  not _is_fake_of(x, mode) else x for x in inputs)
    with mode, functional_collectives():
        return aot_export_joint_with_descriptors(stack, gm, fakes, decompositions=_decompositions(compile))


def compile_joint(exported, min_cut: bool, fw_compiler: Callable, bw_compiler: Callable) -> Callable:
    """Torch's partitioner cuts the exported joint graph into the forward and backward programs and hands each to
    its compiler; returns what runs them. min_cut: what backward keeps is torch's min-cut choice on the joint
    graph, which recomputes the regions that Config.recompute tagged ([Note: recomputation in the joint program] in
    passes/fusion/recompute.py); else everything backward reads is saved."""
    return aot_compile_joint_with_descriptors(
        exported, partition_fn=min_cut_rematerialization_partition if min_cut else default_partition,
        fw_compiler=fw_compiler, bw_compiler=bw_compiler)


def dead_code(gm: GraphModule) -> GraphModule:
    """The partitioner leaves forward GEMMs it copied into backward for nothing: 2 per layer."""
    if gm.graph.eliminate_dead_code():
        gm.recompile()
    return gm


# AOT autograd's tracing state (functionalization levels, torch.fx.traceback's current node) is per process: ranks
# that are threads of one process (torch's threaded process group, tests/fuzz.py) trace their programs one at a
# time. Tracing runs no collective, so no rank waits on another while holding it; a caller that runs other FX
# passes beside a trace in another thread holds it around them too.
TRACING = threading.RLock()


def check_joint(gm: GraphModule) -> None:
    """Raise where a chunk cannot run as a joint program yet: a random op on one of fxpar's streams switches the
    generator in Python at run time ([Note: random streams] in passes/tensor_parallel/rng.py), which a traced
    program would do only once, while tracing. A CPU dropout's noise is a program input instead ([Note: random
    inputs] in passes/joint/random_inputs.py); any other random op is refused."""
    for n in gm.graph.nodes:
        if FXPAR_RANDOM in n.meta and dropout_input(random_op(gm, n), n.args, n.kwargs) is None:
            raise ValueError(
                f"fxpar: Config(joint_graph=True) cannot run this random op on fxpar's random streams yet: node "
                f"{n.name} ({module_path(n) or 'the root module'}, on the {n.meta[FXPAR_RANDOM]} stream, "
                f"{random_op(gm, n)}) draws in training; a joint program takes only a CPU dropout's noise as an "
                "input. Fix: train this model with joint_graph=False (or None), or without that op in training.")


def distinct_outputs(gm: GraphModule) -> GraphModule:
    """Copy each output of the chunk graph that is a view, or shares memory with an input or another output.

    [Note: an output that aliases]
        AOT autograd returns such an output by replaying its view outside the compiled function, so its gradient
        reaches the base without passing through the ops between: f's backward all-reduce, for one, when f's output
        (a view of its input) leaves a pipeline chunk beside its input. A copy is an output of its own, whose
        gradient flows through the program's backward. tests/fuzz.py found it (a chunk sending f(x) and x)."""
    output = gm.graph.find_nodes(op="output")[0]
    seen = {StorageWeakRef(v.untyped_storage()) for n in gm.graph.find_nodes(op="placeholder")
            if isinstance(v := n.meta.get("val"), torch.Tensor)}
    changed = False

    def distinct(a):
        nonlocal changed
        v = a.meta.get("val")
        if not isinstance(v, torch.Tensor) or a.meta.get(FXPAR_COPY):
            return a
        storage = StorageWeakRef(v.untyped_storage())
        if v._is_view() or storage in seen:
            with gm.graph.inserting_before(output):
                a = gm.graph.call_function(torch.ops.aten.clone.default, (a,))
            a.meta.update(val=v, **{FXPAR_COPY: True})
            changed = True
        seen.add(storage)
        return a

    output.args = torch.fx.node.map_arg(output.args, distinct)
    if changed:
        gm.recompile()
    return gm


def expected_inputs(gm: GraphModule, mode: FakeTensorMode) -> list:
    """Fake inputs of a training call of `gm` in `mode`: every weight and every received floating activation needs a
    gradient (the runtime's received values: fxpar/runtime/interpreter.py)."""
    with mode:
        return [_like(n.meta["val"], _needs_grad(n)) if isinstance(n.meta["val"], torch.Tensor) else n.meta["val"]
                for n in gm.graph.find_nodes(op="placeholder")]


def _needs_grad(placeholder) -> bool:
    value = placeholder.meta["val"]
    if FXPAR_DP in placeholder.meta:  # a dp bucket's handle receives the reduced gradient; the accumulated ones none
        return placeholder.meta[FXPAR_DP] == "handle"
    return input_of(placeholder).kind in (PARAMETER, BOUNDARY) and value.is_floating_point()


def _like(value: torch.Tensor, requires_grad: bool) -> torch.Tensor:
    return torch.empty_strided(value.shape, value.stride(), dtype=value.dtype,
                               device=value.device).requires_grad_(requires_grad)


def _is_fake_of(x: torch.Tensor, mode: FakeTensorMode) -> bool:
    return getattr(x, "fake_mode", None) is mode


def as_traced(gm: GraphModule, example_inputs):
    """Run a program as traced: its generated code (not an fx.Interpreter, which would set torch.fx.traceback's
    process-wide current node on every op)."""
    return make_boxed_func(gm.forward)


def _decompositions(compile: bool) -> dict | None:
    """Inductor lowers the ops its own decomposition table leaves (compile); run as traced, the ops stay whole."""
    if not compile:
        return None
    from torch._inductor.decomposition import select_decomp_table

    return select_decomp_table()


def inductor():
    from torch._inductor.compile_fx import compile_fx_inner

    return compile_fx_inner


EMPTY = GraphModule(torch.nn.Module(), torch.fx.Graph())  # the backward of a program nothing differentiates
