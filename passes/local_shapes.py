"""Local shapes: after the tensor-parallel rewrite, give every node this rank's value metadata.

The traced graph's meta["val"] holds global shapes, and the nodes the tensor-parallel pass inserted hold none. This
pass builds one fake tensor per placeholder (the weights that `specs` shards get their local shape, everything else
keeps its traced shape and dtype) and propagates them through the rewritten graph with FakeTensorProp: the
collectives compute shapes only on fake tensors (passes/ops.py), so nothing is communicated. Afterwards every node's
meta["val"] is the fake tensor this rank computes, and no later stage re-propagates.
"""
from __future__ import annotations

import warnings

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx import GraphModule
from torch.fx.passes.fake_tensor_prop import FakeTensorProp

from .meta import input_of, placeholders
from .placements import Shard


def local_fake_inputs(gm: GraphModule, specs: dict[str, Shard], t: int, mode: FakeTensorMode) -> list:
    """One fake tensor per placeholder of gm: its traced shape, with a sharded weight's dim divided by t."""
    out = []
    for n in placeholders(gm):
        v = n.meta.get("val")
        if not isinstance(v, torch.Tensor):
            out.append(v)  # a non-tensor input (an int, a flag) is passed as traced
            continue
        shape = list(v.shape)
        spec = specs.get(input_of(n).key) if input_of(n).is_state else None
        if spec is not None:
            shape[spec.dim] //= t
        with mode:
            out.append(torch.empty(shape, dtype=v.dtype, device=v.device))
    return out


def local_shapes_pass(gm: GraphModule, specs: dict[str, Shard], t: int) -> GraphModule:
    """Set every node's meta["val"] to this rank's fake value (see the module docstring); returns gm."""
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    inputs = local_fake_inputs(gm, specs, t, mode)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        FakeTensorProp(gm, mode).propagate(*inputs)
    for n in gm.graph.nodes:
        n.meta.pop("tensor_meta", None)  # export's global shapes; "val" is the one record now
    return gm
