"""Dropout in a joint program: its noise is a program input, drawn before each call on the op's random stream.

[Note: random inputs]
    A random op on one of fxpar's streams ([Note: random streams] in passes/tensor_parallel/rng.py) switches the
    generator in Python at run time, which a traced program would do once, while tracing. A dropout's randomness is
    all in its noise, though: on the CPU aten.dropout multiplies its input by `empty_like(x).bernoulli_(1 - p)
    .div_(1 - p)`, and the fused bias-dropout-add draws the same noise (passes/ir/kernels.py). So the program takes
    that noise as an input and computes `x * noise` (the fused op: `residual + (y + bias) * noise`), whose backward
    is `grad * noise`; before each call the runtime draws every noise on its op's stream, in graph order, with the
    same ops (NoiseDraw.draw). The masks are the eager executable's, drawn in the same order from the same states,
    and a recomputed region reads the same input. Other random ops, and dropout off the CPU (where aten.dropout is
    the fused native_dropout kernel), keep the eager executable (passes/joint/export.py check_joint says which).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.fx import GraphModule, Node

from fxpar.passes.ir import kernels
from fxpar.passes.ir.meta import FXPAR_RANDOM

aten = torch.ops.aten
FXPAR_NOISE = "fxpar_noise"  # meta of a program's noise placeholder: its NoiseDraw


@dataclass(frozen=True)
class NoiseDraw:
    """The noise of one dropout: drawn on `stream`, of the layout aten.dropout gives it (empty_like its input)."""

    stream: str
    p: float
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device

    def draw(self, streams) -> torch.Tensor:
        like = torch.empty_strided(self.shape, self.stride, dtype=self.dtype, device="meta")
        with streams.fork(self.stream):
            return torch.empty_like(like, device=self.device).bernoulli_(1 - self.p).div_(1 - self.p)

    def fake(self, mode) -> torch.Tensor:
        """Its value in a fake mode (the expected call of a program)."""
        with mode:
            return torch.empty_strided(self.shape, self.stride, dtype=self.dtype, device=self.device)


def dropout_input(op, args, kwargs) -> tuple[Node, float] | None:
    """(the value dropout is applied to, p) of a call of `op` whose randomness is a noise input, else None: aten.dropout
    and the fused bias-dropout-add, in training, with 0 < p < 1, on the CPU."""
    if op is aten.dropout.default:
        x, p, train = args[0], args[1], args[2] if len(args) > 2 else kwargs.get("train", True)
    elif op is kernels.bias_dropout_add:
        x, p, train = args[0], args[3], args[4]
    else:
        return None
    value = x.meta.get("val") if isinstance(x, Node) else None
    if not train or not 0 < p < 1 or not isinstance(value, torch.Tensor) or value.device.type != "cpu":
        return None
    return x, float(p)


def random_op(gm: GraphModule, n: Node):
    """The op of a random call on a stream (a ForkedRandom module: passes/tensor_parallel/rng.py)."""
    return gm.get_submodule(n.target).op


def noise_draws(gm: GraphModule) -> list[NoiseDraw]:
    """The noise of every random call of a chunk graph, in graph order (each must take one: check_joint)."""
    out = []
    for n in gm.graph.nodes:
        if FXPAR_RANDOM not in n.meta:
            continue
        x, p = dropout_input(random_op(gm, n), n.args, n.kwargs)
        value = _noised(random_op(gm, n), n, x)
        out.append(NoiseDraw(n.meta[FXPAR_RANDOM], p, tuple(value.shape), tuple(value.stride()), value.dtype,
                             value.device))
    return out


def _noised(op, n: Node, x: Node) -> torch.Tensor:
    """The fake value the noise multiplies: the dropout's input, or the fused op's y + bias."""
    if op is kernels.bias_dropout_add:
        bias = n.args[1].meta["val"]
        return torch.empty_like(x.meta["val"] + bias)
    return x.meta["val"]


def noise_inputs(gm: GraphModule) -> GraphModule:
    """Each random call of `gm` as its computation with the noise as a new placeholder, after the others, in graph
    order ([Note: random inputs]); gm itself is rewritten and returned."""
    draws = iter(noise_draws(gm))
    last = gm.graph.find_nodes(op="placeholder")[-1]
    for n in [n for n in gm.graph.nodes if FXPAR_RANDOM in n.meta]:
        op, draw = random_op(gm, n), next(draws)
        with gm.graph.inserting_after(last):
            last = gm.graph.placeholder(f"{n.name}_noise")
        last.meta[FXPAR_NOISE] = draw
        meta = {k: v for k, v in n.meta.items() if k not in (FXPAR_RANDOM, "val")}
        with gm.graph.inserting_before(n):
            if op is aten.dropout.default:
                out = _call(gm, aten.mul.Tensor, (n.args[0], last), meta)
            else:
                y, bias, residual = n.args[:3]
                residual_first = n.args[5] if len(n.args) > 5 else n.kwargs.get("residual_first", True)
                dropped = _call(gm, aten.mul.Tensor, (_call(gm, aten.add.Tensor, (y, bias), meta), last), meta)
                out = _call(gm, aten.add.Tensor, (residual, dropped) if residual_first else (dropped, residual), meta)
        out.meta["val"] = n.meta.get("val")
        n.replace_all_uses_with(out)
        module = n.target
        gm.graph.erase_node(n)
        gm.delete_submodule(module)
    gm.graph.lint()
    gm.recompile()
    return gm


def _call(gm: GraphModule, target, args, meta: dict) -> Node:
    node = gm.graph.call_function(target, args)
    node.meta.update(meta)
    return node
