"""Random streams with Megatron's semantics, and the pass that puts every random op of a rank's graph on one.

[Note: random streams]
    A dropout mask drawn in a replicated part of the model (the residual stream, the logits) must be the same on
    every tp rank, or the replicas drift apart; a mask drawn inside a sharded region (attention probabilities of
    this rank's heads, an MLP's hidden shard) must differ between tp ranks, or every rank drops the same positions of
    different heads. Megatron keeps two streams for this (its CUDA RNG tracker): the default one, shared by the tp
    group, and the model-parallel one, offset by the tp rank. fxpar does the same, from one user seed:

        replicated   seeded by (seed, pp rank, dp rank): the same on every rank of a tp group
        sharded      seeded by (seed, pp rank, dp rank, tp rank): different on every rank

    pp and dp ranks get distinct, reproducible streams. The user's own generator (torch.manual_seed, per rank or
    not) is never drawn from: every random op of the graph (ATen ops tagged nondeterministic_seeded, and the fused
    bias-dropout-add) runs on its stream, chosen by its placement, so results do not depend on per-rank seeds.

A stream is a saved generator state. `RandomStreams.fork(name)` sets the device's default generator to the stream,
runs the op, stores the advanced state back and restores the default generator, as Megatron's tracker does. The
states are data (`get_states`/`set_states`): checkpointed regions replay them when they recompute, and checkpoints
save them.
"""
from __future__ import annotations

import contextlib

import torch
import torch.nn as nn
from torch.fx import GraphModule, Node

from fxpar.passes.ir import kernels
from fxpar.passes.ir.meta import FXPAR_PLACEMENT, FXPAR_RANDOM, copy_meta
from fxpar.passes.ir.placements import Shard

REPLICATED, SHARDED = "replicated", "sharded"
_MIX = (1_000_003, 7_919, 104_729, 15_485_863)


def stream_seeds(seed: int, tp_rank: int, pp_rank: int, dp_rank: int) -> dict[str, int]:
    """The seed of each stream ([Note: random streams]); deterministic and distinct per (pp, dp[, tp])."""
    base = (seed * _MIX[0] + pp_rank * _MIX[1] + dp_rank * _MIX[2]) % 2**62
    return {REPLICATED: base, SHARDED: (base + (tp_rank + 1) * _MIX[3]) % 2**62}


class RandomStreams:
    """The random-state tracker of one rank: a generator state per stream, for one device type."""

    def __init__(self, seed: int, tp_rank: int = 0, pp_rank: int = 0, dp_rank: int = 0, device: str = "cpu"):
        self.ranks, self.device = (tp_rank, pp_rank, dp_rank), torch.device(device)
        self.manual_seed(seed)

    def manual_seed(self, seed: int) -> None:
        """Restart every stream from `seed` (the same seed on every rank gives Megatron's semantics)."""
        self.seed = int(seed)
        self.states = {}
        for name, s in stream_seeds(self.seed, *self.ranks).items():
            g = torch.Generator(self.device)
            g.manual_seed(s)
            self.states[name] = g.get_state()

    def get_states(self) -> dict[str, torch.Tensor]:
        return {name: state.clone() for name, state in self.states.items()}

    def set_states(self, states: dict[str, torch.Tensor]) -> None:
        self.states = {name: state.clone() for name, state in states.items()}

    def _get(self) -> torch.Tensor:
        return torch.cuda.get_rng_state(self.device) if self.device.type == "cuda" else torch.get_rng_state()

    def _set(self, state: torch.Tensor) -> None:
        if self.device.type == "cuda":
            torch.cuda.set_rng_state(state, self.device)
        else:
            torch.set_rng_state(state)

    @contextlib.contextmanager
    def fork(self, name: str):
        """Run the body on stream `name`; the default generator is left as it was."""
        saved = self._get()
        self._set(self.states[name])
        try:
            yield
        finally:
            self.states[name] = self._get()
            self._set(saved)


class ForkedRandom(nn.Module):
    """Calls one random op on its stream: the graph calls it as `self.rng_<i>(*args)`."""

    def __init__(self, streams: RandomStreams, stream: str, op):
        super().__init__()
        self.streams, self.stream, self.op = streams, stream, op

    def forward(self, *args, **kwargs):
        with self.streams.fork(self.stream):
            return self.op(*args, **kwargs)


def draws(n: Node) -> bool:
    """A call that draws random numbers, unless its arguments say it cannot (p = 0, or not training)."""
    if n.op != "call_function":
        return False
    if n.target is kernels.bias_dropout_add:
        return bool(n.args[4]) and n.args[3] > 0
    tags = getattr(n.target, "tags", ())
    if torch.Tag.nondeterministic_seeded not in tags:
        return False
    if n.target is torch.ops.aten.dropout.default:
        return bool(n.args[2]) and n.args[1] > 0
    if n.target is torch.ops.aten.scaled_dot_product_attention.default:
        return (n.kwargs.get("dropout_p", n.args[4] if len(n.args) > 4 else 0.0) or 0.0) > 0
    return True


def _stream_of(n: Node) -> str:
    p = n.meta.get(FXPAR_PLACEMENT)
    sharded = isinstance(p, Shard) or (isinstance(p, tuple) and any(isinstance(x, Shard) for x in p))
    return SHARDED if sharded else REPLICATED


def random_streams_pass(gm: GraphModule, streams: RandomStreams) -> GraphModule:
    """Put every random call of gm on its stream ([Note: random streams]); returns gm (untouched if none draws).

    Pattern: a call_function that draws random numbers becomes call_module(ForkedRandom(op)) with the same args.
    Safe: the op, its arguments and its outputs are unchanged; only the generator state it draws from is chosen."""
    changed = 0
    for n in list(gm.graph.nodes):
        if not draws(n):
            continue
        stream = _stream_of(n)
        name = f"rng_{changed}"
        while hasattr(gm, name):
            name = f"rng_{changed}_{len(name)}"
        gm.add_submodule(name, ForkedRandom(streams, stream, n.target))
        with gm.graph.inserting_before(n):
            call = gm.graph.call_module(name, n.args, n.kwargs)
        copy_meta(n, call, keys=tuple(n.meta))
        call.meta[FXPAR_RANDOM] = stream
        n.replace_all_uses_with(call)
        gm.graph.erase_node(n)
        changed += 1
    if changed:
        gm.graph.lint()
        gm.recompile()
    return gm


def streams_in(module: nn.Module) -> list[RandomStreams]:
    """The distinct RandomStreams that the ForkedRandom calls inside `module` draw from."""
    found = {}
    for m in module.modules():
        if isinstance(m, ForkedRandom):
            found[id(m.streams)] = m.streams
    return list(found.values())
