"""pm.clip_grad_norm_: torch's global-norm clipping over the whole (p, t, d) model. The returned norm equals
torch.nn.utils.clip_grad_norm_ on the unmodified model, and the parameters after the clipped SGD step equal its
(within 1e-5), for norms 2 and inf, at t=2, p=2 (the example GPT ties its embedding and head across the stages)
and d=2."""
from __future__ import annotations

import copy

import pytest
import torch

from tests import models
from tests.harness import module_pool

pool2 = module_pool(2)
TOL = 1e-5


def _loss(out, target):
    return torch.nn.functional.cross_entropy(models.first_tensor(out).flatten(0, 1), target.flatten())


def _clipped_step(name, p, t, d, norm_type, max_norm):
    """(|norm - torch's norm|, torch's norm, max parameter gap after the clipped SGD step)."""
    import fxpar

    model, args, kwargs = models.build(name)
    reference = copy.deepcopy(model)
    m = 2
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, models.VOCAB, (args[0].shape[0] * d * m, args[0].shape[1]), generator=g)
    target = torch.randint(0, models.VOCAB, ids.shape, generator=g)
    pm = fxpar.parallelize(model, fxpar.init_mesh(tp=t, pp=p, dp=d), example_args=args, example_kwargs=kwargs,
                           loss_fn=_loss, config=fxpar.Config(microbatches=m))
    pm.step(ids, target=target, **kwargs)
    norm = pm.clip_grad_norm_(max_norm, norm_type=norm_type)
    _loss(reference(ids, **kwargs), target).backward()
    want = torch.nn.utils.clip_grad_norm_(reference.parameters(), max_norm, norm_type=norm_type)
    torch.optim.SGD(pm.parameters(), lr=0.5).step()
    torch.optim.SGD(reference.parameters(), lr=0.5).step()
    pm.check_replicas()  # the clipped replicas stayed identical
    full, ref = pm.full_state_dict(), reference.state_dict()
    return abs(norm.item() - want.item()), want.item(), max((full[k] - ref[k]).abs().max().item() for k in ref)


@pytest.mark.parametrize("p,t,d", [(1, 2, 1), (2, 1, 1), (1, 1, 2)])
@pytest.mark.parametrize("norm_type", [2.0, float("inf")])
def test_global_norm_equals_torch_and_the_step_is_exact(pool2, p, t, d, norm_type):
    for gap, want, state_gap in pool2.run(_clipped_step, "gpt", p, t, d, norm_type, 0.05):
        assert want > 0.05  # the clip is active
        assert gap <= TOL * max(1.0, want) and state_gap <= TOL, (gap, want, state_gap)


@pytest.mark.parametrize("norm_type", [2.0, float("inf")])
def test_whole_parts_are_counted_once(pool2, norm_type):
    """One K/V head in a fused projection: every tp rank holds the K and V rows whole ([Note: whole parts])."""
    for gap, want, state_gap in pool2.run(_clipped_step, "starcoder_mqa", 1, 2, 1, norm_type, 0.05):
        assert want > 0.05
        assert gap <= TOL * max(1.0, want) and state_gap <= TOL, (gap, want, state_gap)


def test_a_large_max_norm_changes_nothing(pool2):
    for gap, want, state_gap in pool2.run(_clipped_step, "llama", 1, 2, 1, 2.0, 1e6):
        assert gap <= TOL * max(1.0, want) and state_gap <= TOL


def test_bad_norm_type_is_refused():
    from fxpar.runtime.clip import clip_grad_norm_

    with pytest.raises(ValueError, match="norm_type must be positive or inf, got -1.0"):
        clip_grad_norm_(None, 1.0, norm_type=-1)
