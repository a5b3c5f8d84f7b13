"""Whole-batch semantics for token losses ([Note: whole-batch semantics] in passes/frontend/token_count.py).

A mean over valid targets (`ignore_index=-100`) is normalized by the global batch's count of valid targets, over
microbatches and dp slices, so that step() equals one process on the whole batch even when the counts are uneven
(instruction tuning, packed sequences) and a microbatch has no valid target at all. Tested in float64 with AdamW
(no rounding for AdamW's lr/eps slope to amplify), on the example GPT with F.cross_entropy(..., ignore_index=-100)
and a Hugging Face model with labels=, at m=2 under t=2 (the vocab-parallel cross-entropy), d=2, p=2 x m=4 and
t=2 x d=2; and what is not a token mean keeps the microbatch mean, said in the plan and once at the first step."""
from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn.functional as F

from tests import models
from tests.models import float64_stays
from tests.harness import module_pool

pool2 = module_pool(2)
pool4 = module_pool(4)
TOL = 1e-10  # float64: a wrong normalization is off by far more (the report's relative gradient norm: 1.11)


def _gpt_ce(out, target):
    return F.cross_entropy(out.flatten(0, 1), target.flatten(), ignore_index=-100)


def _uneven_labels(ids: torch.Tensor, pieces: int) -> torch.Tensor:
    """A copy of ids with -100s whose count differs per piece (of `pieces` equal row blocks): the first piece
    mostly ignored, the second (where there is one) all ignored, the rest a fresh random share each."""
    g = torch.Generator().manual_seed(5)
    labels = ids.clone()
    for i, block in enumerate(labels.chunk(pieces)):
        share = (0.9, 1.0)[i] if i < 2 else float(torch.rand((), generator=g)) * 0.6
        block.masked_fill_(torch.rand(block.shape, generator=g) < share, -100)
    labels[-1, -1] = int(ids[-1, -1])  # at least one valid target in the whole batch
    return labels


def _train(name, p, t, d, m, steps=3):
    """(largest loss gap, largest parameter gap after `steps` AdamW steps, the plan's loss line)."""
    with float64_stays():
        return _train_float64(name, p, t, d, m, steps)


def _train_float64(name, p, t, d, m, steps):
    import fxpar

    torch.set_default_dtype(torch.float64)
    try:
        model, args, kwargs = models.build(name)
    finally:
        torch.set_default_dtype(torch.float32)
    model.double()
    reference = copy.deepcopy(model)
    rows = args[0].shape[0]
    ids = torch.randint(0, models.VOCAB, (rows * d * m, args[0].shape[1]), generator=torch.Generator().manual_seed(3))
    labels = _uneven_labels(ids, d * m)
    if name == "gpt":
        loss_fn, batch, example = _gpt_ce, {}, {"example_target": labels[:rows]}
        target, run_ref = labels, (lambda: _gpt_ce(reference(ids), labels))
    else:  # the model's own loss: labels are a model input
        loss_fn, kwargs = (lambda out, _: out.loss), {**kwargs, "labels": args[0]}
        batch, example, target = {"use_cache": False, "labels": labels}, {}, None
        run_ref = lambda: reference(ids, use_cache=False, labels=labels).loss  # noqa: E731
    config = fxpar.Config(microbatches=m, schedule="1f1b" if p > 1 else "gpipe")
    pm = fxpar.parallelize(model, fxpar.init_mesh(tp=t, pp=p, dp=d), example_args=args, example_kwargs=kwargs,
                           loss_fn=loss_fn, config=config, **example)
    opt = pm.optimizer(torch.optim.AdamW, lr=1e-2)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    loss_gap = 0.0
    for _ in range(steps):
        opt.zero_grad(), ref_opt.zero_grad()
        got = pm.step(ids, target=target, **batch)
        want = run_ref()
        want.backward()
        opt.step(), ref_opt.step()
        loss_gap = max(loss_gap, abs(got.item() - want.item()))
    full, ref = pm.full_state_dict(), reference.state_dict()
    return loss_gap, max((full[k] - ref[k]).abs().max().item() for k in ref), pm.plan.loss


MESHES = {"t2 m2": (1, 2, 1, 2), "d2": (1, 1, 2, 1), "p2 m4": (2, 1, 1, 4)}


@pytest.mark.gloo
@pytest.mark.parametrize("name", ["gpt", "mistral"])
@pytest.mark.parametrize("mesh", sorted(MESHES))
def test_uneven_ignored_targets_train_as_the_whole_batch(pool2, name, mesh):
    for loss_gap, state_gap, plan in pool2.run(_train, name, *MESHES[mesh]):
        assert loss_gap <= TOL and state_gap <= TOL, (loss_gap, state_gap)
        assert plan.startswith("a mean over valid targets (cross_entropy_loss"), plan


@pytest.mark.gloo
@pytest.mark.parametrize("name", ["gpt", "mistral"])
def test_uneven_ignored_targets_at_t2_d2(pool4, name):
    for loss_gap, state_gap, _ in pool4.run(_train, name, 1, 2, 2, 2):
        assert loss_gap <= TOL and state_gap <= TOL, (loss_gap, state_gap)


def _mean_of_squares(out, target):
    return (out.float() - target).pow(2).mean()


def _not_a_token_mean():
    """A loss fxpar cannot prove a token mean keeps the microbatch mean: said in the plan and warned once."""
    import fxpar

    model, args, _ = models.build("gpt")
    target = torch.randn(args[0].shape[0] * 2, args[0].shape[1], models.VOCAB)
    pm = fxpar.parallelize(model, fxpar.init_mesh(tp=2), example_args=args, loss_fn=_mean_of_squares,
                           config=fxpar.Config(microbatches=2), example_target=target[: args[0].shape[0]])
    ids = torch.cat([args[0], args[0]])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        pm.step(ids, target=target)
        pm.step(ids, target=target)
    said = [str(w.message) for w in caught if "weighted equally" in str(w.message)]
    return pm.plan.loss, said


@pytest.mark.gloo
def test_a_loss_that_is_not_a_token_mean_keeps_the_microbatch_mean_and_says_so(pool2):
    for plan, said in pool2.run(_not_a_token_mean):
        assert "not proven a token mean: the loss ends in mean" in plan, plan
        assert len(said) == 1 and "m=2" in said[0], said


# ---- the analysis, in one process ---------------------------------------------------------------------------------
def _traced(loss_fn, target):
    from fxpar.trace import trace

    model, args, _ = models.build("gpt")
    return trace(model, args, None, loss=(loss_fn, target)), args


SPELLINGS = {
    "cross_entropy": (lambda o, y: F.cross_entropy(o.flatten(0, 1), y.flatten()), True),
    "shifted, smoothed, scaled": (lambda o, y: 2.0 * F.cross_entropy(o[:, :-1].flatten(0, 1), y[:, 1:].flatten(),
                                                                     label_smoothing=0.1), True),
    "log_softmax + nll_loss in fp32": (lambda o, y: F.nll_loss(F.log_softmax(o.float(), -1).flatten(0, 1),
                                                               y.flatten()), True),
    "sum reduction": (lambda o, y: F.cross_entropy(o.flatten(0, 1), y.flatten(), reduction="sum"), False),
    "class weights": (lambda o, y: F.cross_entropy(o.flatten(0, 1), y.flatten(),
                                                   weight=torch.linspace(0.5, 1.5, o.shape[-1])), True),
    "class weights from a parameter": (lambda o, y: F.cross_entropy(o.flatten(0, 1), y.flatten(),
                                                                    weight=o[0, 0].detach().exp()), False),
    "target from the logits": (lambda o, y: F.cross_entropy(o.flatten(0, 1), o.argmax(-1).flatten()), False),
    "target with a random mask": (lambda o, y: F.cross_entropy(
        o.flatten(0, 1), y.masked_fill(torch.rand(y.shape) < 0.5, -100).flatten()), False),
}


@pytest.mark.parametrize("spelling", sorted(SPELLINGS))
def test_what_is_proven_a_token_mean(spelling):
    from fxpar.passes.frontend.token_count import loss_normalization

    loss_fn, proven = SPELLINGS[spelling]
    ids = models.build("gpt")[1][0]
    target = ids.masked_fill(torch.arange(ids.numel()).view(ids.shape) % 3 == 0, -100)
    traced, args = _traced(loss_fn, target)
    norm = loss_normalization(traced.gm)
    assert (norm.count is not None) == proven, norm.line()
    if proven:
        valid = target[:, 1:] if "shifted" in spelling else target
        weight = torch.linspace(0.5, 1.5, models.VOCAB) if "weights" in spelling else torch.ones(models.VOCAB)
        want = weight[valid.clamp(min=0)][valid != -100].double().sum().item()
        assert norm.count([*args, target]) == pytest.approx(want, rel=1e-12)


def _written_through_a_view(o, y):
    t = y.clone()
    flat = t.view(-1)  # the loss reads this view; the write below goes to t
    t.masked_fill_(t == 5, -100)
    return F.cross_entropy(o.flatten(0, 1), flat)


def _written_then_read(o, y):
    t = y.clone()
    t.masked_fill_(t == 5, -100)
    return F.cross_entropy(o.flatten(0, 1), t.flatten())


def test_a_target_written_in_place_is_counted_with_the_write_or_not_proven():
    """A write the loss reads through its result is part of the count; one it reads through an earlier view is
    not something the count can run in order: not proven (the microbatch mean, said in the plan)."""
    from fxpar.passes.frontend.token_count import loss_normalization

    ids = models.build("gpt")[1][0]
    ids = ids.masked_fill(ids % 4 == 0, 5)
    norm = loss_normalization(_traced(_written_through_a_view, ids)[0].gm)
    assert norm.count is None and "writes into it in place" in norm.why, norm.line()
    traced, args = _traced(_written_then_read, ids)
    norm = loss_normalization(traced.gm)
    assert norm.count([*args, ids]) == int((ids != 5).sum())
