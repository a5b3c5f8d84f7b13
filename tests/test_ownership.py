"""One copy of the truth ([Note: one copy of the truth] in fxpar/runtime/ownership.py): after parallelize, the
parallel module owns the weights. Using the model's parameters raises an error that points to the parallel
module (calling it, loading into it, reading its state, editing a weight in place, moving it), their memory is
freed, and the parallel module goes on working: loads into it reach training, and a program for another mode is
compiled from the consumed model."""
from __future__ import annotations

import copy

import pytest
import torch

from tests import models

ONWARD = "handed to fxpar.parallelize"


@pytest.fixture
def consumed():
    """(model after parallelize, its parallel module, an unmodified copy made before, example args)."""
    import fxpar

    model, args, _ = models.build("gpt")
    reference = copy.deepcopy(model)
    kept = model.lm_head.weight  # a reference the user kept (an optimizer made before parallelize would)
    pm = fxpar.parallelize(model, None, example_args=args)
    return model, pm, reference, args, kept


USES = {
    "call": lambda m, args: m(*args),
    "load_state_dict": lambda m, args: m.load_state_dict(models.build("gpt")[0].state_dict()),
    "load_state_dict assign": lambda m, args: m.load_state_dict(models.build("gpt")[0].state_dict(), assign=True),
    "a submodule's load_state_dict": lambda m, args: m.h[0].load_state_dict(models.build("gpt")[0].h[0].state_dict(),
                                                                           assign=True),
    "state_dict": lambda m, args: m.state_dict(),
    "an in-place edit": lambda m, args: m.ln_f.weight.data.mul_(2),
    "an in-place edit under no_grad": lambda m, args: torch.no_grad().__enter__() or m.ln_f.weight.fill_(1.0),
    "to": lambda m, args: m.to(torch.float64),
    "deepcopy": lambda m, args: copy.deepcopy(m),
}


@pytest.mark.parametrize("use", sorted(USES))
def test_using_the_model_after_parallelize_raises_and_points_to_pm(consumed, use):
    model, pm, _, args, _ = consumed
    try:
        with pytest.raises(RuntimeError, match=ONWARD) as e:
            USES[use](model, args)
    finally:
        torch.set_grad_enabled(True)
    assert "pm.load_state_dict" in str(e.value) and "copy.deepcopy(model) before parallelize" in str(e.value)


def test_the_model_keeps_its_metadata_and_frees_its_memory(consumed):
    model, _, reference, _, kept = consumed
    assert sum(p.numel() for p in model.parameters()) == sum(p.numel() for p in reference.parameters())
    assert [p.shape for p in model.parameters()] == [p.shape for p in reference.parameters()]
    assert all(p.is_meta for p in model.parameters())
    assert kept.numel() == 0  # the tensor itself is freed, even where the caller kept a reference
    assert model.lm_head.weight is model.wte.weight  # ties stay ties
    assert "owned by pm" in repr(model.wte.weight)


def test_the_parallel_module_is_the_truth(consumed):
    """Both ways round: what is loaded into pm is what runs, and pm recompiles for eval from the consumed model."""
    model, pm, reference, args, _ = consumed
    pretrained, _, _ = models.build("gpt")
    with torch.no_grad():
        for p in pretrained.parameters():
            p.mul_(1.5)
    pm.load_state_dict(pretrained.state_dict())
    assert torch.allclose(pm(*args), pretrained(*args), atol=1e-6, rtol=0)
    pm.eval(), pretrained.eval()  # a program of its own, traced from the consumed model
    assert torch.allclose(pm(*args), pretrained(*args), atol=1e-6, rtol=0)
    full = pm.full_state_dict()
    assert all(torch.equal(full[k], v) for k, v in pretrained.state_dict().items())


def test_a_failed_parallelize_leaves_the_model_as_it_was():
    import fxpar

    model, args, _ = models.build("gpt")
    with pytest.raises(TypeError):
        fxpar.parallelize(model, None, example_args=args, config="not a Config")
    assert not any(p.is_meta for p in model.parameters())
    model(*args)


def test_verify_runs_the_original_program_on_pm_s_weights_when_the_model_was_consumed(consumed):
    import fxpar

    model, pm, _, args, _ = consumed
    assert fxpar.verify(model, pm, args) <= 1e-5
