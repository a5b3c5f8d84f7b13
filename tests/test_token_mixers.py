"""Depthwise causal conv1d token mixers (the hybrid and state-space layers' short convolution): a depthwise conv is
channel-wise, so it shards on channels between a column- and a row-parallel GEMM, its weight and bias by channel;
exact at t=2 and t=4. A conv that mixes channels stays replicated and the plan says why."""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from fxpar.api import build
from fxpar.passes.sharding.comm_audit import per_layer
from fxpar.passes.tensor_parallel.collectives import TPComm
from tests.models import Stack, sgd_gaps
from tests.threaded import on_tp_ranks

D, C, K, SEQ = 32, 64, 4, 8


class ConvMixer(nn.Module):
    """in_proj -> (u, z); u through a causal depthwise conv over the tokens; silu(u) * silu(z) -> out_proj."""

    def __init__(self, groups: int = C):
        super().__init__()
        self.norm, self.inp, self.out = nn.LayerNorm(D), nn.Linear(D, 2 * C), nn.Linear(C, D)
        self.conv = nn.Conv1d(C, C, K, groups=groups, padding=K - 1)

    def forward(self, x):
        u, z = self.inp(self.norm(x)).chunk(2, dim=-1)
        u = self.conv(u.transpose(1, 2))[..., : x.shape[1]].transpose(1, 2)  # causal: the first L outputs
        return x + self.out(F.silu(u) * F.silu(z))


def _x():
    return torch.randn(2, SEQ, D, generator=torch.Generator().manual_seed(0))


def test_the_conv_shards_on_channels_at_two_and_two():
    torch.manual_seed(0)
    plan = build(Stack(ConvMixer), TPComm(rank=0, size=2), (_x(),)).plan
    weights = {w.key: (w.placement, w.local_shape) for w in plan.weights}
    assert weights["layers.0.conv.weight"] == ("S(0)", (C // 2, 1, K)), weights
    assert weights["layers.0.conv.bias"] == ("S(0)", (C // 2,)), weights
    assert per_layer(plan.comm) == (1.0, 1.0) and not plan.replicated, plan.region_table()


@pytest.mark.parametrize("t", [2, 4])
def test_exact(t):
    torch.manual_seed(0)
    model, x = Stack(ConvMixer), _x()

    def measure(pm, reference):
        share = sum(p.numel() for p in pm.parameters()) / sum(p.numel() for p in reference.parameters())
        return (*sgd_gaps(pm, reference, (x,)), share)

    for fwd, params, share in on_tp_ranks(model, (x,), measure, tp=t):
        assert fwd <= 1e-5 and params <= 1e-5, (fwd, params)
        assert share < 1 / t + 0.05, share


def test_a_conv_that_mixes_channels_stays_replicated_and_says_why():
    torch.manual_seed(0)
    plan = build(Stack(lambda: ConvMixer(groups=1)), TPComm(rank=0, size=2), (_x(),)).plan
    assert any("not depthwise (groups 1 of 64 channels)" in r.reason for r in plan.regions), plan.region_table()
