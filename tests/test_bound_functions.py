"""Every custom autograd.Function is seen, however `apply` is reached ([Note: every Function seen] in
fxpar/guard.py). A trace keeps a Function's forward only; training would then run on the derivative of the forward
instead of the Function's backward, so each way of binding `apply` is refused with the user's line."""
from __future__ import annotations

import functools
import sys

import pytest
import torch
import torch.nn as nn

from fxpar.api import build
from fxpar.passes.tensor_parallel.collectives import TPComm
from fxpar.trace import TraceError


class StraightThrough(torch.autograd.Function):
    """Round in the forward, pass the gradient through unchanged in the backward."""

    @staticmethod
    def forward(ctx, x):
        return torch.round(x)

    @staticmethod
    def backward(ctx, grad):
        return grad


straight_through = StraightThrough.apply  # bound at module level, before any trace


def _module_level(x):
    return straight_through(x)


def through_decorator(fn):
    @functools.wraps(fn)
    def wrapper(x):
        return StraightThrough.apply(fn(x))
    return wrapper


@through_decorator
def decorated_gelu(x):
    return torch.nn.functional.gelu(x)


HELPER = '''
import torch

def quantize(x, fn):
    return fn(x * 2.0) / 2.0
'''


class MLP(nn.Module):
    """A GEMM -> activation -> GEMM chain fxpar shards at t=2, with the activation given by `act`."""

    def __init__(self, act):
        super().__init__()
        self.up, self.down, self.act = nn.Linear(16, 32), nn.Linear(32, 16), act

    def forward(self, x):
        return self.down(self.act(self.up(x)))


def _helper_act(tmp_path, monkeypatch):
    (tmp_path / "fxpar_bound_helper.py").write_text(HELPER)
    monkeypatch.syspath_prepend(str(tmp_path))
    from fxpar_bound_helper import quantize

    return functools.partial(quantize, fn=StraightThrough.apply), r"fxpar_bound_helper.py:\d+ \(return fn"


WAYS = {
    "bound in __init__": lambda tmp, mp: (StraightThrough.apply, r"test_bound_functions.py:\d+ \(return self.down"),
    "bound at module level": lambda tmp, mp: (_module_level, r"test_bound_functions.py:\d+ \(return straight_through"),
    "functools.partial": lambda tmp, mp: (functools.partial(StraightThrough.apply),
                                          r"test_bound_functions.py:\d+ \(return self.down"),
    "a decorator": lambda tmp, mp: (decorated_gelu, r"\(return StraightThrough.apply\(fn\(x\)\)"),
    "a helper in another module": _helper_act,
}


@pytest.mark.parametrize("way", sorted(WAYS))
def test_each_way_of_reaching_apply_is_refused_with_the_users_line(way, tmp_path, monkeypatch):
    act, line = WAYS[way](tmp_path, monkeypatch)
    with pytest.raises(TraceError, match=r"custom autograd.Function StraightThrough at .*" + line):
        build(MLP(act), TPComm(0, 2), (torch.randn(4, 16),))


def test_a_registered_custom_ops_autograd_is_not_a_dropped_backward():
    """`torch.library.custom_op` + `register_autograd` stays one node with its registered backward: not refused."""
    lib = f"fxpar_bound_{id(sys.modules[__name__]) % 10**6}"

    @torch.library.custom_op(f"{lib}::scaled", mutates_args=())
    def scaled(x: torch.Tensor) -> torch.Tensor:
        return x * 3.0

    scaled.register_fake(lambda x: torch.empty_like(x))
    scaled.register_autograd(lambda ctx, grad: grad * 3.0)
    with pytest.warns(UserWarning, match="found nothing to shard"):  # an opaque op keeps its region replicated
        build(MLP(scaled), TPComm(0, 2), (torch.randn(4, 16),))


def test_the_patch_is_undone_after_a_refused_trace():
    with pytest.raises(TraceError):
        build(MLP(StraightThrough.apply), TPComm(0, 2), (torch.randn(4, 16),))
    assert "__init__" not in torch.autograd.function.BackwardCFunction.__dict__
    x = torch.randn(3, requires_grad=True)
    straight_through(x).sum().backward()  # the Function itself still runs, with its own backward
    assert torch.equal(x.grad, torch.ones(3))
