"""Helpers of the rule unit tests (tests/test_rules.py, tests/test_rules_compute.py): export a tiny graph, find its
nodes, and place them by hand."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
from torch.fx import GraphModule, Node

from fxpar.passes.ir.placements import Replicate, Shard
from fxpar.passes.sharding.rules import Ctx

aten = torch.ops.aten
R = Replicate()
MAX = 2**63 - 1  # the end of an open slice, as export writes it


@dataclass
class Graph:
    gm: GraphModule
    inputs: list[Node]  # user inputs, in order
    params: dict[str, Node]  # parameter name ("weight") -> placeholder

    def node(self, target, i: int = 0) -> Node:
        """The i-th call of `target` in graph order."""
        return [n for n in self.gm.graph.nodes if n.op == "call_function" and n.target == target][i]


class _Fn(nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, *xs):
        return self.fn(*xs)


def export(fn, *shapes) -> Graph:
    """The ATen graph of `fn` (a function or an nn.Module) on random inputs of these global shapes."""
    mod = fn if isinstance(fn, nn.Module) else _Fn(fn)
    ep = torch.export.export(mod, tuple(torch.randn(s) for s in shapes), strict=False)
    sig = ep.graph_signature
    nodes = {n.name: n for n in ep.graph_module.graph.nodes if n.op == "placeholder"}
    return Graph(ep.graph_module, [nodes[name] for name in sig.user_inputs],
                 {fqn: nodes[name] for name, fqn in sig.inputs_to_parameters.items()})


def ctx(placements: dict, t: int = 2, params=()) -> Ctx:
    return Ctx(dict(placements), t, set(params))


def S(dim: int, *parts: int, pre: int = 1) -> Shard:
    """Shard(dim, parts, pre), shorter: S(2, 32) is a plain split of a 32-wide dim 2; S(2, 32, 32, 32) is Q|K|V."""
    return Shard(dim, parts, pre)
