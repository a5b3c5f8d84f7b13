"""Functional all-reduces in place where nothing else can see the buffer, for programs run as traced.

`_c10d_functional.all_reduce(x)` copies x and reduces the copy; the default executable all-reduces in place
(passes/tensor_parallel/in_place.py). In a program run without inductor (which reinplaces on its own), an
all-reduce becomes `all_reduce_(x)` when x is a buffer no one else reads: x, and every view it was made through, has
this one reader, and the chain ends at an op that returns fresh memory (a GEMM), not at a program input or a view of
a value something else reads. The wait and everything after it read the same values.
"""
from __future__ import annotations

import torch
from torch.fx import GraphModule, Node

from fxpar.passes.ir.op_families import returns_view

_ALL_REDUCE = torch.ops._c10d_functional.all_reduce.default
_ALL_REDUCE_ = torch.ops._c10d_functional.all_reduce_.default


def in_place_collectives(gm: GraphModule) -> int:
    """Rewrite every all-reduce whose input only it can see as the in-place one; returns how many."""
    done = 0
    for n in gm.graph.find_nodes(op="call_function", target=_ALL_REDUCE):
        if _private(n.args[0]):
            n.target = _ALL_REDUCE_
            done += 1
    if done:
        gm.recompile()
    return done


def _private(x: Node) -> bool:
    """x's memory is read through x alone: a one-reader chain of views back to an op that made fresh memory."""
    while True:
        if len(x.users) != 1 or x.op != "call_function" or not isinstance(x.target, torch._ops.OpOverload):
            return False
        if not returns_view(x.target):
            return True
        x = x.args[0]
