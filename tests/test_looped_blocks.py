"""Looped blocks (one layer list applied twice, each weight read by both applications: [Note: shared weights] in
passes/sharding/shared_weights.py), reduced to the two shapes the differential fuzzer ran into:

- under sequence parallelism, the replicated weights a layer reads on sequence blocks (its norm's, the bias added
  after g) enter through seq_weights, whose backward all-reduces their partial-sum gradients. With the first
  application under `torch.no_grad()`, one seq_weights before it ran without a gradient and the application that
  trains read its outputs: those weights lost the other ranks' tokens ([Note: seq_weights per grad-mode span] in
  passes/tensor_parallel/sequence_parallel.py; fuzz seeds 8880014, 8880023, 8880103, 8880161);
- attention scores carried from layer to layer (each layer adds the previous one's to its own) through both
  applications, at plain t=2: the carried scores are sharded by heads across every layer boundary.

Each is checked for the forward and every parameter after optimizer steps against the unmodified model."""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fxpar
from fxpar.api import build
from fxpar.passes.ir.meta import Comm, comm_kind
from fxpar.passes.tensor_parallel.collectives import TPComm
from tests.test_sequence_parallel import _exact, _gaps
from tests.threaded import on_tp_ranks

D, HEADS, SEQ = 16, 2, 8
HD = D // HEADS


class Block(nn.Module):
    """A pre-norm layer whose replicated weights (both norms', the row-parallel GEMMs' biases) are read on sequence
    blocks; `carry`: its attention scores add the previous layer's and are handed on."""

    def __init__(self, carry: bool):
        super().__init__()
        self.norm, self.norm2 = nn.LayerNorm(D), nn.LayerNorm(D)
        self.qkv, self.o = nn.Linear(D, 3 * D), nn.Linear(D, D)
        self.up, self.down = nn.Linear(D, 2 * D), nn.Linear(2 * D, D)
        self.carry = carry

    def forward(self, x, prev):
        b, s, _ = x.shape
        q, k, v = self.qkv(self.norm(x)).view(b, s, HEADS, 3 * HD).transpose(1, 2).split(HD, dim=-1)
        scores = q @ k.transpose(-2, -1) / HD ** 0.5 + (prev if self.carry else 0.0)
        causal = torch.ones(s, s, dtype=torch.bool).tril()
        y = scores.masked_fill(~causal, float("-inf")).softmax(-1) @ v
        x = x + self.o(y.transpose(1, 2).reshape(b, s, D))
        return x + self.down(F.gelu(self.up(self.norm2(x)))), scores


class Looped(nn.Module):
    """Two layers applied twice; with `no_grad`, the first application without a gradient (a recurrent-depth
    model's one-step gradient)."""

    def __init__(self, no_grad: bool = False, carry: bool = False):
        super().__init__()
        self.layers = nn.ModuleList(Block(carry) for _ in range(2))
        self.no_grad = no_grad

    def _apply(self, x, prev):
        for layer in self.layers:
            x, prev = layer(x, prev)
        return x, prev

    def forward(self, x):
        prev = torch.zeros(x.shape[0], HEADS, SEQ, SEQ)
        with torch.set_grad_enabled(not self.no_grad):
            h, prev = self._apply(x, prev)
        return self._apply(h + x, prev)[0]


def _model(**kw):
    torch.manual_seed(0)
    return Looped(**kw)


def _x():
    return torch.randn(2, SEQ, D, generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("carry", [False, True], ids=["plain", "carried_scores"])
@pytest.mark.parametrize("no_grad", [True, False], ids=["first_under_no_grad", "both_trained"])
def test_looped_block_on_sequence_blocks_is_exact(no_grad, carry):
    _exact(_model(no_grad=no_grad, carry=carry), (_x(),), {})


@pytest.mark.parametrize("no_grad", [True, False], ids=["first_under_no_grad", "both_trained"])
def test_every_seq_weights_runs_in_the_grad_mode_of_its_readers(no_grad):
    """A seq_weights and every op that reads its weights lie between the same grad-mode calls."""
    config = fxpar.Config(sequence_parallel=True, fuse=False)
    gm = build(_model(no_grad=no_grad), TPComm(rank=0, size=2), (_x(),), config=config).compiled.callables[0]
    span, spans = 0, {}
    for n in gm.graph.nodes:
        span += n.op == "call_function" and n.target is torch._C._set_grad_enabled
        spans[n] = span
    made = [n for n in gm.graph.nodes if comm_kind(n) == Comm.SEQ_WEIGHTS]
    assert made, gm.graph
    for f in made:
        readers = {r for out in f.users for r in out.users}
        assert {spans[r] for r in readers} == {spans[f]}, (f.name, sorted(r.name for r in readers))
    # one per layer and grad-mode span: one serves both applications where both train
    assert len(made) == (4 if no_grad else 2), [f.name for f in made]


@pytest.mark.parametrize("no_grad", [False, True], ids=["both_trained", "first_under_no_grad"])
def test_scores_carried_through_a_looped_block_are_exact_at_t2(no_grad):
    """The scores stay sharded by heads from layer to layer, through both applications (one region: nothing is
    replicated), and every parameter trains as the unmodified model's does."""
    model, x = _model(no_grad=no_grad, carry=True), _x()

    def measure(pm, reference):
        return (*_gaps(pm, reference, (x,), {}), pm.plan)

    for fwd, params, plan in on_tp_ranks(model, (x,), measure):
        assert not plan.replicated, plan.region_table()
        assert fwd < 1e-5 and params < 1e-5, (fwd, params)
