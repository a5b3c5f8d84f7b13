"""Inputs that alias at trace time ([Note: inputs are traced distinct] in fxpar/trace.py): the same tensor passed
twice, views and slices of one tensor, a target that is the input. Each is traced as distinct values, so a later
call whose inputs differ (or alias where the example's did not) is exact: forward, and every parameter after SGD
steps, within 1e-5 of the unmodified model in fp32.
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from tests import models
from tests.harness import module_pool

pool2 = module_pool(2)
pool4 = module_pool(4)
TOL = 1e-5
STEPS = 3


def _batch(seed: int, rows: int = models.BATCH) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, models.VOCAB, (rows, models.SEQ), generator=g)


def _sgd(params):
    """SGD: a step is lr times the gradient, so every gradient is checked at fp32's rounding. Not AdamW: its first
    step, lr * g / (|g| + eps), has slope lr / eps at g = 0, which turns the last bit of a summation order on a
    near-zero gradient into 1e-5 of a weight (1.5e-5 on an AVX2 CPU), and aliasing is no question of the optimizer."""
    return torch.optim.SGD(params, lr=0.5)


def _state_gap(pm, reference) -> float:
    full, want = pm.full_state_dict(), reference.state_dict()
    return max(((full[k] - want[k]).abs().max() / max(1.0, want[k].abs().max().item())).item() for k in want)


def _hf_labels(name: str, pp: int, traced_alias: bool):
    """A Hugging Face causal LM trained through its own loss (`labels=`, shifted inside the model). traced_alias:
    traced with labels=input_ids (the same tensor), stepped with labels that differ; else traced with distinct
    labels and stepped with labels=input_ids."""
    import fxpar

    model, (ids,), kwargs = models.build(name)
    reference = copy.deepcopy(model)
    labels = ids if traced_alias else _batch(7)
    pm = fxpar.parallelize(model, fxpar.init_mesh(tp=2, pp=pp), example_args=(ids,),
                           example_kwargs={**kwargs, "labels": labels}, loss_fn=lambda out, _: out.loss,
                           config=fxpar.Config(microbatches=2 * pp))
    opt, ref_opt = pm.optimizer(_sgd), _sgd(reference.parameters())
    loss_gap = 0.0
    for step in range(STEPS):
        x = _batch(10 + step, models.BATCH * 2 * pp)
        if traced_alias:
            y = _batch(20 + step, x.shape[0])
            y[:, :2] = -100  # a prompt masked out of the loss, as fine-tuning does
        else:
            y = x  # Hugging Face's own convention: the model shifts the labels itself
        before = (x.clone(), y.clone())
        opt.zero_grad(), ref_opt.zero_grad()
        loss = pm.step(x, target=None, **kwargs, labels=y)
        want = reference(x, **kwargs, labels=y).loss
        want.backward()
        opt.step(), ref_opt.step()
        loss_gap = max(loss_gap, abs(loss.item() - want.item()))
        assert torch.equal(x, before[0]) and torch.equal(y, before[1]), "the program wrote its inputs"
    return loss_gap, _state_gap(pm, reference)


@pytest.mark.parametrize("traced_alias", [True, False], ids=["traced-aliased", "called-aliased"])
def test_hf_labels_alias_the_inputs_t2(pool2, traced_alias):
    for loss_gap, state_gap in pool2.run(_hf_labels, "llama", 1, traced_alias):
        assert loss_gap <= TOL and state_gap <= TOL, (loss_gap, state_gap)


def test_hf_labels_alias_the_inputs_p2_t2(pool4):
    for loss_gap, state_gap in pool4.run(_hf_labels, "llama", 2, True):
        assert loss_gap <= TOL and state_gap <= TOL, (loss_gap, state_gap)


def _lm_loss(out, target):
    return F.cross_entropy(models.first_tensor(out).flatten(0, 1), target.flatten())


def _example_target(name: str, pp: int, spelling: str):
    """example_target aliasing the example input: the same tensor, or a view of the same storage."""
    import fxpar

    model, (ids,), kwargs = models.build(name)
    reference = copy.deepcopy(model)
    wide = torch.cat([ids, _batch(3)[:, :1]], dim=1)  # (b, s + 1): inputs and next tokens are views of it
    example, example_target = {"same": (ids, ids), "shifted": (wide[:, :-1], wide[:, 1:])}[spelling]
    pm = fxpar.parallelize(model, fxpar.init_mesh(tp=2, pp=pp), example_args=(example,), example_kwargs=kwargs,
                           loss_fn=_lm_loss, example_target=example_target,
                           config=fxpar.Config(microbatches=2 * pp))
    opt, ref_opt = pm.optimizer(_sgd), _sgd(reference.parameters())
    loss_gap = 0.0
    for step in range(STEPS):
        x, y = _batch(30 + step, models.BATCH * 2 * pp), _batch(40 + step, models.BATCH * 2 * pp)
        opt.zero_grad(), ref_opt.zero_grad()
        loss = pm.step(x, target=y, **kwargs)
        want = _lm_loss(reference(x, **kwargs), y)
        want.backward()
        opt.step(), ref_opt.step()
        loss_gap = max(loss_gap, abs(loss.item() - want.item()))
    return loss_gap, _state_gap(pm, reference)


@pytest.mark.parametrize("spelling", ["same", "shifted"])
def test_example_target_aliases_the_input_t2(pool2, spelling):
    for loss_gap, state_gap in pool2.run(_example_target, "gpt", 1, spelling):
        assert loss_gap <= TOL and state_gap <= TOL, (loss_gap, state_gap)


def test_example_target_aliases_the_input_p2_t2(pool4):
    for loss_gap, state_gap in pool4.run(_example_target, "gpt", 2, "same"):
        assert loss_gap <= TOL and state_gap <= TOL, (loss_gap, state_gap)


class TwoInputs(nn.Module):
    """An MLP over `a` gated by a projection of `b` (b read through its own GEMM), plus a nested input."""

    def __init__(self, h: int = 16):
        super().__init__()
        self.up, self.down, self.gate = nn.Linear(h, 4 * h), nn.Linear(4 * h, h), nn.Linear(h, h)

    def forward(self, a, b, extra):
        y = self.down(F.gelu(self.up(a))) * torch.sigmoid(self.gate(b))
        return y + extra["bias"].mean()


def _spellings(scale: float = 1.0):
    base = torch.randn(2, 8, 32, generator=torch.Generator().manual_seed(0)) * scale
    x = base[..., :16]
    return {  # name -> (a, b, extra) of the trace
        "distinct": (x.clone(), base[..., 16:].clone(), {"bias": base[..., 8:24].clone()}),
        "same": (x, x, {"bias": x}),
        "slices": (x, base[..., 16:], {"bias": base[..., 8:24]}),  # overlapping both
        "transposed view": (x, x.transpose(0, 1).transpose(0, 1), {"bias": x[:, :, :]}),
    }


def _plain(traced: str, called: str):
    """TwoInputs at t=2, traced with one aliasing of its inputs and called with another; SGD steps."""
    import fxpar

    torch.manual_seed(0)
    model = TwoInputs()
    reference = copy.deepcopy(model)
    a, b, extra = _spellings()[traced]
    pm = fxpar.parallelize(model, fxpar.init_mesh(tp=2), example_args=(a, b), example_kwargs={"extra": extra})
    opt, ref_opt = pm.optimizer(_sgd), _sgd(reference.parameters())
    fwd = 0.0
    for step in range(STEPS):
        a, b, extra = _spellings(1.0 + step)[called]
        got, want = pm(a, b, extra=extra), reference(a, b, extra)
        fwd = max(fwd, (got - want).abs().max().item())
        opt.zero_grad(), ref_opt.zero_grad()
        got.square().mean().backward(), want.square().mean().backward()
        opt.step(), ref_opt.step()
    return fwd, _state_gap(pm, reference), bool(pm.plan.sharded_regions)


@pytest.mark.parametrize("traced,called", [("same", "distinct"), ("slices", "distinct"),
                                           ("transposed view", "slices"), ("distinct", "same")])
def test_plain_model_traced_and_called_with_other_aliasing(pool2, traced, called):
    for fwd, state_gap, sharded in pool2.run(_plain, traced, called):
        assert sharded and fwd <= TOL and state_gap <= TOL, (fwd, state_gap)


def test_distinct_inputs_keeps_shape_strides_and_value():
    """The copies: only what shares storage with an earlier input (or a parameter) is copied, strides kept."""
    from fxpar.trace import distinct_inputs

    x = torch.arange(12.0).view(3, 4)
    args, kwargs = distinct_inputs(((x, x[:, 1:], x.t(), x[0].expand(5, 4)), {"y": x}))
    assert args[0] is x  # the first user of a storage is traced as it is
    for got, want in zip((*args[1:], kwargs["y"]), (x[:, 1:], x.t(), x[0].expand(5, 4), x)):
        assert got.untyped_storage()._cdata != x.untyped_storage()._cdata and torch.equal(got, want)
    assert args[1].stride() == (4, 1) and args[2].stride() == (1, 4)  # a slice and a transpose keep their strides
    lin = nn.Linear(3, 4)
    _, kw = distinct_inputs(((), {"w": lin.weight.detach()}), lin)
    assert kw["w"].untyped_storage()._cdata != lin.weight.untyped_storage()._cdata  # aliases a parameter


def test_a_tensor_without_storage_is_left_as_it_is():
    from fxpar.trace import distinct_inputs

    sparse = torch.eye(3).to_sparse()
    args, _ = distinct_inputs(((sparse, sparse, 1.5), {}))
    assert args[0] is sparse and args[1] is sparse and args[2] == 1.5
