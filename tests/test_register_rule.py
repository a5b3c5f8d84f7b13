"""Opaque kernels declared in one line (fxpar.register_rule, passes/sharding/rule_table.py): a torch.library custom op
with a fake and an autograd formula (what a Triton or C++ kernel registers) keeps its region replicated until
declared, and the plan names the op and the fix; declared "pointwise" or "tokenwise", its region is sharded and
exact (forward and every parameter after an SGD step, 1e-5 in fp32), the kernel's own backward running on each
rank's shard."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from tests.models import sgd_gaps
from tests.threaded import on_tp_ranks

H, FF, GROUPS = 16, 64, 8


@torch.library.custom_op("fxpar_test::swish", mutates_args=())
def swish(x: torch.Tensor) -> torch.Tensor:
    return x * torch.sigmoid(x)


@swish.register_fake
def _(x):
    return torch.empty_like(x)


def _swish_backward(ctx, grad):
    x, = ctx.saved_tensors
    s = torch.sigmoid(x)
    return grad * (s + x * s * (1 - s))


swish.register_autograd(_swish_backward, setup_context=lambda ctx, inputs, output: ctx.save_for_backward(inputs[0]))


@torch.library.custom_op("fxpar_test::group_norm", mutates_args=())
def group_norm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Each row over the last dim, RMS-normalized and scaled (a fused norm kernel's stand-in)."""
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * weight


@group_norm.register_fake
def _(x, weight):
    return torch.empty_like(x)


def _norm_backward(ctx, grad):
    x, weight = ctx.saved_tensors
    with torch.enable_grad():
        x_, w_ = x.detach().requires_grad_(), weight.detach().requires_grad_()
        y = x_ * torch.rsqrt(x_.pow(2).mean(-1, keepdim=True) + 1e-6) * w_
        gx, gw = torch.autograd.grad(y, (x_, w_), grad)
    return gx, gw


group_norm.register_autograd(_norm_backward, setup_context=lambda ctx, inputs, output: ctx.save_for_backward(*inputs))


class SwishMLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(H, FF), nn.Linear(FF, H)

    def forward(self, x):
        return x + self.down(torch.ops.fxpar_test.swish(self.up(x)))


class GroupNormMLP(SwishMLP):
    """The hidden features in 8 groups, each normalized over its 8 features by the kernel (groups shard over t)."""

    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(1 + 0.1 * torch.randn(FF // GROUPS))

    def forward(self, x):
        h = self.up(x)
        h = torch.ops.fxpar_test.group_norm(h.view(*h.shape[:-1], GROUPS, FF // GROUPS), self.scale)
        return x + self.down(torch.relu(h.flatten(-2)))


def _measure(pm, reference, x):
    fwd, params = sgd_gaps(pm, reference, (x,))
    share = sum(p.numel() for p in pm.parameters()) / sum(p.numel() for p in reference.parameters())
    return fwd, params, share, [r.reason for r in pm.plan.regions if r.reason]


@pytest.fixture
def declared():
    from fxpar.passes.sharding.rule_table import DECLARED

    yield
    for op in [op for op in DECLARED if op.namespace == "fxpar_test"]:
        del DECLARED[op]


def test_an_undeclared_kernel_stays_replicated_and_the_plan_names_the_fix(declared):
    torch.manual_seed(0)
    x = torch.randn(2, 4, H)
    for fwd, params, share, reasons in on_tp_ranks(SwishMLP(), (x,), lambda pm, ref: _measure(pm, ref, x)):
        assert fwd <= 1e-5 and params <= 1e-5 and share == 1.0, (fwd, params, share)
        assert any("no sharding rule for fxpar_test.swish.default" in r and
                   'fxpar.register_rule(torch.ops.fxpar_test.swish, "pointwise" or "tokenwise")' in r
                   for r in reasons), reasons


@pytest.mark.parametrize("cls, kind", [(SwishMLP, "pointwise"), (GroupNormMLP, "tokenwise")])
def test_a_kernel_declared_in_one_line_is_sharded_and_exact(declared, cls, kind):
    import fxpar

    fxpar.register_rule(torch.ops.fxpar_test.swish if cls is SwishMLP else torch.ops.fxpar_test.group_norm, kind)
    torch.manual_seed(0)
    x = torch.randn(2, 4, H)
    for fwd, params, share, reasons in on_tp_ranks(cls(), (x,), lambda pm, ref: _measure(pm, ref, x)):
        assert fwd <= 1e-5 and params <= 1e-5, (fwd, params)
        assert not reasons and share < 0.6, (share, reasons)  # up and down split; biases of down and scale whole


def test_a_tokenwise_kernel_over_the_sharded_dim_stays_replicated(declared):
    """Declared token-wise but fed the sharded features themselves as its last dim: refused, with the reason."""
    import fxpar

    fxpar.register_rule(torch.ops.fxpar_test.swish, "tokenwise")
    torch.manual_seed(0)
    x = torch.randn(2, 4, H)
    for _, _, share, reasons in on_tp_ranks(SwishMLP(), (x,), lambda pm, ref: _measure(pm, ref, x)):
        assert share == 1.0 and any("token-wise over the last dim, which is sharded" in r for r in reasons), reasons


def test_bad_declarations_are_refused_with_the_fix(declared):
    import fxpar

    with pytest.raises(ValueError, match=r"'rowwise' is not one of \['pointwise', 'tokenwise'\]"):
        fxpar.register_rule(torch.ops.fxpar_test.swish, "rowwise")
    with pytest.raises(TypeError, match=r"pass it as torch.ops.<namespace>.<name>"):
        fxpar.register_rule(swish, "pointwise")  # the Python function, not the op
    with pytest.raises(ValueError, match=r"aten.gelu.default has fxpar's own rule \(elementwise\)"):
        fxpar.register_rule(torch.ops.aten.gelu.default, "pointwise")
