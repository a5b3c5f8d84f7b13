"""The compiler driver: trace -> analysis -> the ordered rewrite passes -> a per-rank graph.

Reading PASSES tells the whole compiler. Each pass is `gm -> gm`; the driver logs it, checks a GraphModule came
back, and re-raises any error with the pass's name and the passes that ran before it.
"""
from __future__ import annotations

import copy
import functools
import logging
from dataclasses import dataclass

from torch.fx import GraphModule

from fxpar.config import Config
from fxpar.passes.analysis import Analysis, analyze
from fxpar.passes.fusion import fusion_pass, placeholder_values
from fxpar.passes.ops import TPComm
from fxpar.passes.placements import Shard
from fxpar.passes.recompute import recompute_pass
from fxpar.passes.tp import tensor_parallel_pass
from fxpar.passes.vocab import vocab_analysis
from fxpar.trace import Traced

log = logging.getLogger("fxpar")


class PassError(RuntimeError):
    pass


def _keep_graph(gm: GraphModule, into: dict) -> GraphModule:
    """Not a rewrite: keeps a copy of the graph as it is now (sharing gm's submodules) and returns gm."""
    into["graph"] = GraphModule(gm, copy.deepcopy(gm.graph))
    return gm


def passes_for(analysis: Analysis, comm: TPComm, config: Config, values: dict, kept: dict) -> list:
    """The rewrite passes, in order. (Partition into pipeline chunks follows, in fxpar/pipeline.py.)"""
    passes = [
        ("tensor_parallel", functools.partial(tensor_parallel_pass, analysis=analysis, comm=comm)),
        ("keep_tp_graph", functools.partial(_keep_graph, into=kept)),  # what verify compares node by node
    ]
    if config.fuse:
        passes.append(("fuse", functools.partial(fusion_pass, values=values)))
    passes.append(("recompute", functools.partial(recompute_pass, mode=config.recompute)))
    return passes


def run_passes(gm: GraphModule, passes) -> GraphModule:
    done = []
    for name, fn in passes:
        log.debug("fxpar pass %s", name)
        try:
            out = fn(gm)
        except Exception as e:
            raise PassError(f"fxpar pass {name!r} failed (after {done or 'no passes'}): {e}") from e
        if not isinstance(out, GraphModule):
            raise PassError(f"fxpar pass {name!r} returned {type(out).__name__}, not a GraphModule")
        gm = out
        done.append(name)
    return gm


@dataclass
class Compiled:
    traced: Traced
    reference: GraphModule  # the traced graph before any rewrite (for verify)
    gm: GraphModule
    analysis: Analysis
    specs: dict[str, Shard]  # state_dict key -> how it is sharded
    tp_graph: GraphModule  # the graph right after the tensor-parallel pass (for verify)


def compile_tp(traced: Traced, comm: TPComm, config: Config, buffers: dict) -> Compiled:
    """Analyze and rewrite `traced` for this rank's tensor-parallel group.

    buffers: the model's buffers by key; the fusion pass reads their values to prove a mask causal."""
    reference = copy.deepcopy(traced.gm)
    params = traced.param_nodes()
    analysis = vocab_analysis(traced.gm, analyze(traced.gm, comm.size, params), params)
    key_of = {name: key for name, _, key in traced.inputs}
    specs = {key_of[n.name]: s for n, s in analysis.param_specs.items()}
    values = placeholder_values(traced.inputs, buffers, traced.constants)
    kept: dict = {}
    gm = run_passes(traced.gm, passes_for(analysis, comm, config, values, kept))
    return Compiled(traced, reference, gm, analysis, specs, kept["graph"])
