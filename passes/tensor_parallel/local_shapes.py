"""Local shapes: after the tensor-parallel rewrite, give every node this rank's value metadata.

The traced graph's meta["val"] holds global shapes, and the nodes the tensor-parallel pass inserted hold none. This
pass builds one fake tensor per placeholder (the weights that `specs` shards get their local shape, everything else
keeps its traced shape and dtype) and propagates them through the rewritten graph with FakeTensorProp: the
collectives compute shapes only on fake tensors (passes/tensor_parallel/collectives.py), so nothing is communicated.
Afterwards every node's meta["val"] is the fake tensor this rank computes, and no later stage re-propagates.
"""
from __future__ import annotations

import warnings

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx import GraphModule
from torch.fx.node import map_aggregate
from torch.fx.passes.fake_tensor_prop import FakeTensorProp

from fxpar.passes.ir.meta import input_of, placeholders
from fxpar.passes.ir.placements import Shard


def local_fake_inputs(gm: GraphModule, specs: dict[str, Shard], t: int, mode: FakeTensorMode,
                      meta_to: torch.device | None = None) -> list:
    """One fake tensor per placeholder of gm: its traced shape, with a sharded weight's dim divided by t; a value
    traced on the meta device is placed on `meta_to` (where given)."""
    out = []
    for n in placeholders(gm):
        v = n.meta.get("val")
        if not isinstance(v, torch.Tensor):
            out.append(v)  # a non-tensor input (an int, a flag) is passed as traced
            continue
        shape = list(v.shape)
        spec = specs.get(input_of(n).key) if input_of(n).is_state else None
        if spec is not None:
            shape[spec.dim] = spec.local_size(t)
        device = meta_to if meta_to is not None and v.device.type == "meta" else v.device
        with mode:
            out.append(torch.empty(shape, dtype=v.dtype, device=device))
    return out


def input_device(gm: GraphModule) -> torch.device:
    """The device of the model's first tensor input (the CPU if it has none): where its weights live."""
    return next((v.device for n in placeholders(gm) if not input_of(n).is_state
                 for v in [n.meta.get("val")] if isinstance(v, torch.Tensor)), torch.device("cpu"))


def meta_state_device(gm: GraphModule) -> torch.device | None:
    """Where weights traced on the meta device are to be placed: the inputs' device; None when no weight is on
    meta, or the inputs are on meta too (a simulated rank: nothing is placed)."""
    device = input_device(gm)
    if device.type == "meta":
        return None
    state = [n.meta.get("val") for n in placeholders(gm) if input_of(n).is_state]
    return device if any(isinstance(v, torch.Tensor) and v.is_meta for v in state) else None


def place_meta_state_pass(gm: GraphModule, device: torch.device) -> GraphModule:
    """A model built on the meta device (each rank materializes only its shards later, fxpar/checkpoint/dcp.py): its
    weights' traced values are placed on `device` and every node's value re-propagated, so the program is the one
    the materialized weights run (an op's device argument that the trace recorded as meta becomes `device` too).
    Returns gm."""
    def place(a):
        return device if isinstance(a, torch.device) and a.type == "meta" else a

    for n in gm.graph.nodes:
        if n.op == "call_function":
            n.args, n.kwargs = map_aggregate(n.args, place), map_aggregate(n.kwargs, place)
    gm.recompile()
    return _propagate(gm, {}, 1, device)


def local_shapes_pass(gm: GraphModule, specs: dict[str, Shard], t: int) -> GraphModule:
    """Set every node's meta["val"] to this rank's fake value (see the module docstring); returns gm."""
    return _propagate(gm, specs, t, None)


def _propagate(gm: GraphModule, specs: dict[str, Shard], t: int, meta_to: torch.device | None) -> GraphModule:
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    inputs = local_fake_inputs(gm, specs, t, mode, meta_to)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        FakeTensorProp(gm, mode).propagate(*inputs)
    for n in gm.graph.nodes:
        n.meta.pop("tensor_meta", None)  # export's global shapes; "val" is the one record now
    return gm
