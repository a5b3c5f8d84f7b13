"""Factories for tests/test_check.py (`fxpar check tests/check_targets.py:NAME`)."""
from __future__ import annotations

import torch
import torch.nn as nn

from tests import models


def llama_labels():
    """A Hugging Face Llama trained through its own loss, labels= the same tensor as input_ids (its convention)."""
    model, (ids,), kwargs = models.build("llama")
    return model, (ids,), {**kwargs, "labels": ids}


class _Reverse(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return -grad


class _Reversed(nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(16, 64), nn.Linear(64, 16)

    def forward(self, x):
        return self.down(_Reverse.apply(torch.relu(self.up(x))))


def refused():
    """A custom autograd.Function, whose backward a trace would drop: fxpar refuses it."""
    return _Reversed(), (torch.randn(2, 8, 16),)


def broken():
    """The example GPT with fxpar sabotaged in this rank: the row-parallel all-reduce g becomes the identity f."""
    import fxpar.passes.tp as tp
    from gpt import lm  # examples/ is on sys.path (tests/models.py)

    real = tp.call_comm
    tp.call_comm = lambda gm, kind, *a, **k: real(gm, "f" if kind == "g" else kind, *a, **k)
    return lm()
