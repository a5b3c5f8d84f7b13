"""A block applied twice reads each weight in two GEMMs ([Note: shared weights] in passes/sharding/analysis.py):
a looped Transformer (the same layers run for several steps, as recurrent-depth and hierarchical-reasoning models
do), with its early steps under `torch.no_grad()` (inlined by passes/frontend/context_regions.py). Each application
is a Megatron layer over the same local shards: exact, 2 + 2 per application. A weight whose uses would shard it
unalike stays replicated, every use, and the plan says why."""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from expecttest import TestCase

from fxpar.api import build
from fxpar.passes.frontend.context_regions import inline_context_pass
from fxpar.passes.sharding.comm_audit import per_layer
from fxpar.passes.tensor_parallel.collectives import TPComm
from fxpar.trace import trace
from tests.golden import graph_text
from tests.models import gaps_and_share
from tests.threaded import on_tp_ranks

D, HEADS, SEQ = 32, 4, 8
HD = D // HEADS


class Layer(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm, self.norm2 = nn.LayerNorm(D), nn.LayerNorm(D)
        self.qkv, self.o = nn.Linear(D, 3 * D), nn.Linear(D, D)
        self.up, self.down = nn.Linear(D, 2 * D), nn.Linear(2 * D, D)

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = self.qkv(self.norm(x)).view(b, s, HEADS, 3 * HD).transpose(1, 2).split(HD, dim=-1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.o(y.transpose(1, 2).reshape(b, s, D))
        return x + self.down(F.gelu(self.up(self.norm2(x))))


class Looped(nn.Module):
    """Two layers run `steps` times over the hidden state; with `no_grad`, all steps but the last without a
    gradient (a hierarchical-reasoning model's one-step gradient)."""

    def __init__(self, steps: int = 2, no_grad: bool = False):
        super().__init__()
        self.layers = nn.ModuleList(Layer() for _ in range(2))
        self.steps, self.no_grad = steps, no_grad

    def _step(self, x):
        for layer in self.layers:
            x = layer(x)
        return x

    def forward(self, x):
        h = x
        with torch.set_grad_enabled(not self.no_grad):
            for _ in range(self.steps - 1):
                h = self._step(h + x)
        return self._step(h + x)


def _x():
    return torch.randn(2, SEQ, D, generator=torch.Generator().manual_seed(0))


def _model(**kw):
    torch.manual_seed(0)
    return Looped(**kw)


@pytest.mark.parametrize("no_grad", [False, True], ids=["looped", "no_grad"])
def test_every_application_shards_at_two_and_two(no_grad):
    plan = build(_model(no_grad=no_grad), TPComm(rank=0, size=2), (_x(),)).plan
    assert not plan.replicated, plan.region_table()
    weights = {w.key: w.placement for w in plan.weights}
    assert weights["layers.0.qkv.weight"].startswith("S(0") and weights["layers.1.down.weight"] == "S(1)", weights
    assert [c.calls for c in plan.comm if c.layer.startswith("layers.")] == [2, 2], plan.comm_table()
    assert per_layer(plan.comm) == (2.0, 2.0) and not plan.above_bound, plan.comm_table()


@pytest.mark.parametrize("no_grad,t", [(False, 2), (True, 2), (False, 4)])
def test_exact(no_grad, t):
    model, x = _model(steps=3, no_grad=no_grad), _x()
    for fwd, params, share in on_tp_ranks(model, (x,), gaps_and_share((x,)), tp=t):
        assert fwd <= 1e-5 and params <= 1e-5, (fwd, params)
        assert share < 1 / t + 0.05, share  # the norms' weights stay whole


class Unalike(nn.Module):
    """One square weight read column-parallel (by the input) and then row-parallel (by its output): its two uses
    would store it sharded on different dims."""

    def __init__(self):
        super().__init__()
        self.w = nn.Linear(D, D, bias=False)

    def forward(self, x):
        return x + self.w(F.gelu(self.w(x)))


def test_a_weight_its_uses_would_shard_unalike_stays_replicated():
    plan = build(Unalike(), TPComm(rank=0, size=2), (_x(),)).plan
    assert plan.replicated and not plan.sharded_regions, plan.region_table()
    assert "store it differently" in plan.regions[0].reason, plan.region_table()
    x = _x()
    torch.manual_seed(0)
    for fwd, params, share in on_tp_ranks(Unalike(), (x,), gaps_and_share((x,))):
        assert fwd <= 1e-5 and params <= 1e-5 and share == 1.0, (fwd, params, share)


def test_golden_a_grad_mode_region_inlined_between_its_mode_calls():
    class Region(nn.Module):
        def forward(self, x):
            with torch.no_grad():
                y = x.sin()
            return x * y

    gm = inline_context_pass(trace(Region(), (_x(),), {}).gm)
    TestCase().assertExpectedInline(graph_text(gm, placements=False), """\
is_grad_enabled = is_grad_enabled()
_set_grad_enabled = _set_grad_enabled(False)
sin_1 = sin.default(x)
_set_grad_enabled_1 = _set_grad_enabled(is_grad_enabled)
mul = mul.Tensor(x, sin_1)
""")


def test_pipeline_parallelism_refuses_a_looped_block_clearly():
    from fxpar.passes.pipeline.partition import partition_pass

    pm = build(_model(), TPComm(rank=0, size=1), (_x(),))
    with pytest.raises(ValueError, match=r"second application of its layer .* Fix: pp=1"):
        partition_pass(pm.compiled.callables[0], 2)
