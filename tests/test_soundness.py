"""One regression test per class of soundness hazard: each small model comes out exact (forward, and every
parameter after an SGD step, within 1e-5 in fp32), or is refused with a message that names what and where.

    1 pipeline boundaries that carry a sharded value          6 custom autograd Functions and tensor hooks
    2 a sharded weight with another use                        7 stale or unchecked state (loading, token bounds)
    3 mode, non-tensor arguments and buffer values             8 state the executable drops, replicas that drift
    4 dropout randomness (tests/test_dropout.py)               9 rules that read an argument by position
    5 overlapping regions, unchecked seeds, crashing rules
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
from torch.library import custom_op

from tests import models
from tests.harness import module_pool
from tests.models import step_gaps
from tests.soundness_models import BUILDERS, Branchy, CausalBuffer, tiny_lm

pool2 = module_pool(2)
pool4 = module_pool(4)
TOL = 1e-5


_errors = models.sgd_gaps


def _tp_exact(name: str):
    import fxpar

    model, args, kwargs = BUILDERS[name]()
    reference = copy.deepcopy(model)
    pm = fxpar.parallelize(model, fxpar.init_mesh(tp=2), example_args=args, example_kwargs=kwargs)
    return (*_errors(pm, reference, args, kwargs), str(pm.plan))


@pytest.mark.parametrize("name", ["bias_regularized", "shared_bias", "weight_read_twice", "per_head_linear",
                                  "addmm_activation", "var_statistics", "residual_scores", "hidden_is_vocab",
                                  "in_place_scan"])
def test_hazardous_models_are_exact_at_t2(pool2, name):
    for fwd, params, _ in pool2.run(_tp_exact, name):
        assert fwd <= TOL and params <= TOL, (name, fwd, params)


def _hf_exact(name: str):
    import fxpar

    model, args, kwargs = models.build(name)
    reference = copy.deepcopy(model)
    try:
        pm = fxpar.parallelize(model, fxpar.init_mesh(tp=2), example_args=args, example_kwargs=kwargs)
    except Exception as e:
        return type(e).__name__, str(e)
    fwd, params = _errors(pm, reference, args, kwargs)
    return fwd, params, len(pm.plan.sharded_regions)


def test_gemma4_unified_text_is_exact(pool2):
    for fwd, params, regions in pool2.run(_hf_exact, "gemma4_unified_text"):
        assert fwd <= TOL and params <= TOL and regions >= 2, (fwd, params, regions)


def test_recurrent_gemma_is_refused_for_its_custom_autograd_function(pool2):
    """Its RG-LRU takes sqrt through SqrtBoundDerivative, whose backward a trace would drop. (With that Function
    replaced by torch.sqrt the model is exact: its in-place scan is tests.soundness_models.InPlaceScan.)"""
    for kind, message in pool2.run(_hf_exact, "recurrent_gemma"):
        assert kind == "TraceError" and "custom autograd.Function SqrtBoundDerivative" in message, message
        assert "modeling_recurrent_gemma.py:" in message and "Fix:" in message, message


def test_the_plan_names_the_other_use(pool2):
    _, _, plan = pool2.run(_tp_exact, "weight_read_twice")[0]
    assert "weight p_fc1_weight is also read by mean (module <root>)" in plan
    _, _, plan = pool2.run(_tp_exact, "bias_regularized")[0]
    assert "f + 1 g" in plan  # the MLP stays sharded: its bias is scattered at the GEMM instead


def _pipeline_exact(name: str, scatter_gather: bool):
    """(p, t) = (2, 2): 3 SGD steps of fxpar's step() against full-batch single-process training."""
    import fxpar

    model, args, kwargs = BUILDERS[name]()
    reference = copy.deepcopy(model)

    def loss_fn(out, target):
        return (out - target).pow(2).mean()

    x = torch.randn(4 * args[0].shape[0], *args[0].shape[1:], generator=torch.Generator().manual_seed(3))
    target = torch.randn(*x.shape[:-1], out_dim(model, args), generator=torch.Generator().manual_seed(4))
    config = fxpar.Config(microbatches=4, scatter_gather=scatter_gather)
    pm = fxpar.parallelize(model, fxpar.init_mesh(tp=2, pp=2), example_args=args, loss_fn=loss_fn, config=config)
    crossing = [str(b) for c in pm.compiled.partition.chunks for b in c.boundary_out]
    return (*step_gaps(pm, reference, x, target, loss_fn, steps=3), crossing)


def out_dim(model, args) -> int:
    with torch.no_grad():
        return model(*args).shape[-1]


@pytest.mark.parametrize("scatter_gather", [True, False])
def test_a_sharded_value_crossing_a_pipeline_boundary(pool4, scatter_gather):
    """Class 1: attention scores sharded over heads cross the stage boundary; with scatter/gather on, only the
    replicated residual is split, the scores go from tp rank i to tp rank i."""
    for loss_err, state_err, crossing in pool4.run(_pipeline_exact, "residual_scores", scatter_gather):
        assert loss_err <= TOL and state_err <= TOL, (loss_err, state_err)
    assert any(": S(1" in b for b in crossing), crossing  # a head-sharded boundary value really crossed


def _modes_and_arguments():
    """Class 3: train/eval and non-tensor arguments are part of the program."""
    import fxpar

    torch.manual_seed(0)
    model = Branchy(p=0.5)
    x = torch.randn(2, 8, 16)
    traced = {"scale": 2.0, "double": False}
    pm = fxpar.parallelize(copy.deepcopy(model), fxpar.init_mesh(tp=2), example_args=(x,), example_kwargs=traced)
    out = {}
    pm.eval(), model.eval()
    out["eval"] = (pm(x, **traced) - model(x)).abs().max().item()
    out["scale"] = (pm(x, double=False, scale=3.0) - model(x, scale=3.0)).abs().max().item()  # any kwarg order
    out["branch"] = (pm(x, scale=2.0, double=True) - model(x, double=True)).abs().max().item()
    try:
        pm(x)
    except ValueError as e:
        out["missing"] = str(e)
    pm.train()
    a, b = pm(x, **traced), pm(x, **traced)
    out["train_draws"] = (a - b).abs().max().item()  # dropout active: two calls draw different masks
    torch.manual_seed(0)
    model2 = Branchy(p=0.5).eval()  # traced in eval mode, trained later
    pm2 = fxpar.parallelize(copy.deepcopy(model2), fxpar.init_mesh(tp=2), example_args=(x,))
    out["eval_traced"] = (pm2(x) - model2(x)).abs().max().item()
    pm2.train()
    out["eval_traced_then_train"] = (pm2(x) - model2(x)).abs().max().item()
    return out


def test_mode_and_arguments_are_part_of_the_program(pool2):
    for out in pool2.run(_modes_and_arguments):
        assert out["eval"] <= TOL and out["scale"] <= TOL and out["branch"] <= TOL, out
        assert out["train_draws"] > 0 and out["eval_traced"] <= TOL and out["eval_traced_then_train"] > 0, out
        assert "argument scale (traced as 2.0) is missing from the call" in out["missing"], out


def _buffer_changes():
    """Class 3: a mask proven causal at compile time is changed afterwards; the program is re-proven."""
    import fxpar

    torch.manual_seed(0)
    model = CausalBuffer()
    x = torch.randn(2, 8, 16)
    pm = fxpar.parallelize(copy.deepcopy(model), fxpar.init_mesh(tp=2), example_args=(x,))
    fused = "scaled_dot_product_attention" in pm.compiled.callables[0].code
    with torch.no_grad():
        for m in (model, pm):
            m.get_buffer("mask").fill_(1.0)  # no mask at all now
    return fused, (pm(x) - model(x)).abs().max().item(), "scaled_dot_product_attention" in pm.compiled.callables[0].code


def test_a_buffer_a_rewrite_relied_on_is_checked(pool2):
    for fused, err, fused_after in pool2.run(_buffer_changes):
        assert fused and not fused_after and err <= TOL, (fused, err, fused_after)


def _state_loading():
    """Class 7: load_state_dict with full tensors (copy and assign), wrong shapes, out-of-range token ids."""
    import fxpar

    model, (ids,), _ = tiny_lm()
    other, _, _ = tiny_lm()
    with torch.no_grad():
        for p in other.parameters():
            p.add_(torch.randn_like(p))
    pm = fxpar.parallelize(copy.deepcopy(model), fxpar.init_mesh(tp=2), example_args=(ids,))
    out = {}
    pm.load_state_dict(other.state_dict())
    want = other(ids)  # large logits (perturbed weights): compared relative to their size
    out["copy"] = ((pm(ids) - want).abs().max() / want.abs().max()).item()
    pm.load_state_dict(model.state_dict(), assign=True)
    out["assign"] = (pm(ids) - model(ids)).abs().max().item()
    pm.load_state_dict(pm.state_dict())  # this rank's own shards round-trip
    out["local"] = (pm(ids) - model(ids)).abs().max().item()
    try:
        pm.load_state_dict({"mlp.fc1.weight": torch.zeros(3, 3)}, strict=False)
    except ValueError as e:
        out["shape_error"] = str(e)
    try:
        pm(torch.full_like(ids, 40))
    except IndexError as e:
        out["index_error"] = str(e)
    return out


def test_state_loading_and_token_bounds(pool2):
    for out in pool2.run(_state_loading):
        assert out["copy"] <= TOL and out["assign"] <= TOL and out["local"] <= TOL, out
        assert "mlp.fc1.weight has shape (3, 3); expected the full (64, 16) or this rank's shard (32, 16)" in \
            out["shape_error"]
        assert "token id 40 is out of range for the vocabulary of 32" in out["index_error"]


def _loss_fn_model_called_directly(name: str):
    """Class 8: with loss_fn at pp=1, pm(x) still runs every chunk (no state dropped)."""
    import fxpar

    model, args, kwargs = models.build(name)
    reference = copy.deepcopy(model)
    pm = fxpar.parallelize(model, fxpar.init_mesh(tp=2), example_args=args, example_kwargs=kwargs,
                           loss_fn=lambda out, t: out.logits.sum())
    return (models.first_tensor(pm(*args, **kwargs)) - models.first_tensor(reference(*args, **kwargs))).abs().max()


@pytest.mark.parametrize("name", ["llama", "qwen2"])
def test_pm_call_after_a_loss_fn_build(pool2, name):
    assert max(pool2.run(_loss_fn_model_called_directly, name)).item() <= TOL


def _perturbed_replica():
    import torch.distributed as dist

    import fxpar
    from fxpar.runtime.replicas import ReplicaError

    model, args, kwargs = models.build("gpt")
    pm = fxpar.parallelize(model, fxpar.init_mesh(tp=2), example_args=args)
    pm.check_replicas(grads=True)  # identical after building
    if dist.get_rank() == 1:
        with torch.no_grad():
            pm.get_parameter("h.0.ln_1.weight")[3] += 1e-6
    try:
        pm.check_replicas()
    except ReplicaError as e:
        return str(e)
    return "no error"


def test_check_replicas_catches_a_perturbed_replica(pool2):
    for message in pool2.run(_perturbed_replica):
        assert "replicas of weight h.0.ln_1.weight differ" in message and "global ranks [1]" in message, message
        gap = float(message.split("max |difference| ")[1].split(")")[0])
        assert 5e-7 < gap < 2e-6, message


def _step_without_a_traced_kwarg():
    import fxpar

    model, args, kwargs = models.build("llama")
    pm = fxpar.parallelize(model, fxpar.init_mesh(tp=2), example_args=args, example_kwargs=kwargs,
                           loss_fn=lambda out, t: out.logits.sum())
    try:
        pm.step(args[0], target=None)
    except ValueError as e:
        return str(e)
    return "no error"


def test_a_call_missing_a_traced_argument_names_it(pool2):
    for message in pool2.run(_step_without_a_traced_kwarg):
        assert "argument use_cache (traced as False) is missing from the call" in message, message


# ------------------------------------------------------------------------------------------- one process
class GradReversal(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return -grad


class Reversed(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 16)

    def forward(self, x):
        return GradReversal.apply(self.fc(x))


class Hooked(Reversed):
    def forward(self, x):
        y = self.fc(x)
        y.register_hook(lambda g: g * 2)
        return y


@pytest.mark.parametrize("model,needle", [(Reversed(), "custom autograd.Function GradReversal"),
                                          (Hooked(), "tensor.register_hook")])
def test_autograd_a_trace_would_drop_is_refused(model, needle):
    from fxpar.api import build
    from fxpar.passes.tensor_parallel.collectives import TPComm
    from fxpar.trace import TraceError

    with pytest.raises(TraceError, match=rf"{needle}.*test_soundness.py:\d+.*gradients would silently differ"):
        build(model, TPComm(0, 2), (torch.randn(2, 16),))


@custom_op("fxpar_test::reversed_scale", mutates_args=())
def reversed_scale(x: torch.Tensor) -> torch.Tensor:
    return x * 2


@reversed_scale.register_fake
def _(x):
    return torch.empty_like(x)


reversed_scale.register_autograd(lambda ctx, grad: -grad, setup_context=lambda ctx, inputs, output: None)


class LibraryOp(Reversed):
    """A registered custom op with its own backward (-grad, not the forward's 2): one node in the trace that runs
    its registered backward, as transformers' grouped_mm (Mixtral's experts) does."""

    def forward(self, x):
        return reversed_scale(self.fc(x))


def test_a_registered_custom_op_keeps_its_backward():
    from fxpar.api import build
    from fxpar.passes.tensor_parallel.collectives import TPComm

    model, x = LibraryOp(), torch.randn(2, 16)
    reference = copy.deepcopy(model)
    pm = build(model, TPComm(0, 1), (x,))
    assert any("reversed_scale" in str(n.target) for n in pm.compiled.callables[0].graph.nodes)
    pm(x).sum().backward()
    reference(x).sum().backward()
    assert torch.equal(pm.get_parameter("fc.bias").grad, reference.fc.bias.grad)
    assert reference.fc.bias.grad.sum() < 0  # the registered backward ran, not the forward's derivative


class FailsInNoGrad(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x, idx):
        with torch.no_grad():
            scale = x[idx].sum()  # an out-of-range idx fails here, inside the no_grad region
        return self.fc(x) * scale


def test_a_failing_call_leaks_no_grad_mode():
    from fxpar.api import build
    from fxpar.passes.tensor_parallel.collectives import TPComm

    pm = build(FailsInNoGrad(), TPComm(0, 1), (torch.randn(3, 4), torch.tensor([0, 1])))
    with pytest.raises(IndexError):
        pm(torch.randn(3, 4), torch.tensor([0, 7]))
    assert torch.is_grad_enabled()
