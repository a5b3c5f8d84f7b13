"""passes/canonicalize.py: view_as spelled as a view; and models whose activations use it and binary min/max."""
from __future__ import annotations

import copy

import torch
import torch.nn as nn

from fxpar.passes.canonicalize import view_as_pass
from fxpar.trace import trace
from tests.models import sgd_gaps
from tests.threaded import on_tp_ranks

aten = torch.ops.aten
H, F = 8, 16


class Clipped(nn.Module):
    """Apertus's xIELU-like activation (a binary min) and a view_as back to the input's shape (Beam's attention)."""

    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(H, F), nn.Linear(F, H)
        self.cap = nn.Parameter(torch.tensor(0.5))

    def forward(self, x):
        h = self.up(x)
        h = torch.min(h, self.cap) + torch.max(h, -self.cap).sigmoid()
        h = h.view(-1, F).view_as(h)
        return x + self.down(h)


def test_view_as_becomes_a_view_of_the_traced_shape():
    model, x = Clipped(), torch.randn(2, 3, H)
    traced = trace(model, (x,))
    gm = torch.fx.GraphModule(traced.gm, copy.deepcopy(traced.gm.graph))
    view_as_pass(gm)
    targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert aten.view_as.default not in targets
    views = [n for n in gm.graph.nodes if n.target is aten.view.default]
    assert [2, 3, F] in [list(n.args[1]) for n in views]
    flat = [dict(model.named_parameters())[gi.key] if gi.kind == "parameter" else x for gi in traced.inputs]
    assert torch.equal(gm(*flat)[0], traced.gm(*flat)[0])


def test_binary_min_max_and_view_as_keep_the_mlp_sharded():
    torch.manual_seed(0)
    x = torch.randn(2, 3, H)

    def measure(pm, reference):
        share = sum(p.numel() for p in pm.parameters()) / sum(p.numel() for p in reference.parameters())
        return (*sgd_gaps(pm, reference, (x,)), share)

    for fwd, params, share in on_tp_ranks(Clipped(), (x,), measure):
        assert fwd <= 1e-5 and params <= 1e-5 and share == (8 * 8 + 8 + 8 * 8 + 8 + 1) / (2 * 128 + 16 + 8 + 1)
