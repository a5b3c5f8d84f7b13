"""Mixed precision, Megatron's recipe (fxpar/runtime/precision.py): bf16 (and fp16 with loss scaling) compute, fp32 main
gradients accumulated across microbatches, fp32 main parameters stepped by the optimizer, the dp reduction in
reduce_dtype; with tp, pp and the distributed optimizer.

The reference is the same recipe on one process: the model cast to bf16, the loss on its outputs cast to fp32,
each microbatch's bf16 gradients added into fp32 main gradients, AdamW on fp32 main parameters cast back after each
step. [Tolerance] bf16 keeps 8 significant bits (a rounding error of up to 2^-9 = 2e-3 relative per op): a
tensor-parallel row GEMM rounds its partial sums to bf16 before the all-reduce, a fused op sums in another order,
so single values differ from the reference's by about that much. The loss is a mean over every token, whose errors
average out; measured over 20 AdamW steps (lr 1e-3) the largest relative gap is below 1e-3 (see the test ids), and
the tests allow 2e-3. Against fp32 training the bf16 loss curve stays within 1% over the same 20 steps.
"""
from __future__ import annotations

import collections
import copy

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from tests import models
from tests.harness import module_pool

pool2 = module_pool(2)
REL = 2e-3  # see [Tolerance] in the module docstring
BAND = 1e-2  # bf16 vs fp32 loss curve, relative
GEMMS = {"mm", "addmm", "bmm", "baddbmm", "_scaled_dot_product_flash_attention_for_cpu",
         "_scaled_dot_product_efficient_attention", "_scaled_dot_product_flash_attention", "convolution"}


def _loss(out, target):
    return torch.nn.functional.cross_entropy(models.first_tensor(out).flatten(0, 1), target.flatten())


class _GemmDtypes(TorchDispatchMode):
    """Counts the GEMMs reaching the dispatcher by the dtype of their first floating operand."""

    def __init__(self):
        super().__init__()
        self.counts = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func._overloadpacket.__name__ in GEMMS:
            first = next(a for a in args if isinstance(a, torch.Tensor) and a.is_floating_point())
            self.counts[str(first.dtype)] += 1
        return func(*args, **(kwargs or {}))


class _Recipe:
    """The same recipe on one process (see the module docstring)."""

    def __init__(self, model, dtype, lr):
        from fxpar.mixed_precision import cast_outputs

        self.model, self.cast = copy.deepcopy(model).to(dtype), cast_outputs
        self.main = [p.detach().float().clone().requires_grad_() for p in self.model.parameters()]
        self.opt = torch.optim.AdamW(self.main, lr=lr)

    def step(self, micro, kwargs) -> float:
        self.opt.zero_grad()
        total = 0.0
        for x, y in micro:
            loss = _loss(self.cast(self.model(x, **kwargs)), y) / len(micro)
            loss.backward()
            total += loss.item()
            for main, p in zip(self.main, self.model.parameters()):
                main.grad = p.grad.float() if main.grad is None else main.grad + p.grad.float()
                p.grad = None
        self.opt.step()
        with torch.no_grad():
            for main, p in zip(self.main, self.model.parameters()):
                p.copy_(main)
        return total


def _train(name, p, t, d, zero=0, steps=20, dtype="bfloat16", reduce="float32", fp32_too=False, lr=1e-3, **options):
    """(max relative loss gap to the recipe, max relative gap to fp32 training, GEMM dtype counts, main dtypes);
    options: more Config fields."""
    import fxpar

    dtype, reduce = getattr(torch, dtype), getattr(torch, reduce)
    model, args, kwargs = models.build(name)
    fp32 = copy.deepcopy(model)
    recipe = _Recipe(model, dtype, lr)
    m = 2
    g = torch.Generator().manual_seed(4)
    ids = torch.randint(0, models.VOCAB, (args[0].shape[0] * d * m, args[0].shape[1]), generator=g)
    target = torch.randint(0, models.VOCAB, ids.shape, generator=g)
    mp = fxpar.MixedPrecision(dtype, reduce, loss_scale="dynamic" if dtype == torch.float16 else None)
    mesh = fxpar.init_mesh(tp=t, pp=p, dp=d)
    pm = fxpar.parallelize(model, mesh, example_args=args, example_kwargs=kwargs, loss_fn=_loss,
                           config=fxpar.Config(microbatches=m, zero=zero, mixed_precision=mp, **options))
    opt = pm.optimizer(torch.optim.AdamW, lr=lr)
    if fp32_too:
        pm32 = fxpar.parallelize(fp32, mesh, example_args=args, example_kwargs=kwargs, loss_fn=_loss,
                                 config=fxpar.Config(microbatches=m, zero=zero, **options))
        opt32 = pm32.optimizer(torch.optim.AdamW, lr=lr)
    micro = list(zip(ids.chunk(d * m), target.chunk(d * m)))
    gap = band = 0.0
    gemms = collections.Counter()
    for _ in range(steps):
        opt.zero_grad()
        with _GemmDtypes() as counted:
            loss = pm.step(ids, target=target, **kwargs).item()
        gemms.update(counted.counts)
        opt.step()
        want = recipe.step(micro, kwargs)
        gap = max(gap, abs(loss - want) / want)
        if fp32_too:
            opt32.zero_grad()
            loss32 = pm32.step(ids, target=target, **kwargs).item()
            opt32.step()
            band = max(band, abs(loss - loss32) / loss32)
    pm.check_replicas()
    mains = sorted({str(x.dtype) for group in opt.param_groups for x in group["params"]})
    return gap, band, dict(gemms), mains, sorted({str(x.dtype) for x in pm.parameters()})


@pytest.mark.parametrize("name,p,t,d,zero", [("gpt", 1, 2, 1, 0), ("llama", 1, 2, 1, 0), ("gpt", 2, 1, 1, 0),
                                             ("llama", 1, 1, 2, 1), ("gpt", 1, 1, 2, 0)])
def test_bf16_matches_the_recipe(pool2, name, p, t, d, zero):
    for gap, band, gemms, mains, params in pool2.run(_train, name, p, t, d, zero, fp32_too=name == "gpt"):
        assert gap < REL, gap
        assert band < BAND, band
        assert mains == ["torch.float32"] and params == ["torch.bfloat16"], (mains, params)
        bf16 = gemms.get("torch.bfloat16", 0)
        assert bf16 >= 0.9 * sum(gemms.values()), gemms


def test_fp16_with_dynamic_loss_scaling(pool2):
    for gap, _, gemms, mains, params in pool2.run(_train, "gpt", 1, 2, 1, steps=10, dtype="float16"):
        assert gap < REL, gap
        assert params == ["torch.float16"] and gemms.get("torch.float16", 0) >= 0.9 * sum(gemms.values()), gemms


def test_reduce_in_bf16_with_zero(pool2):
    for gap, *_ in pool2.run(_train, "llama", 1, 1, 2, 1, steps=10, reduce="bfloat16"):
        assert gap < REL, gap


def _main_grads(m=4):
    """pm's main gradients after one step of m microbatches, and the recipe's fp32 and bf16 sums of the same."""
    import fxpar

    model, args, kwargs = models.build("gpt")
    low = copy.deepcopy(model).to(torch.bfloat16)
    ids = torch.randint(0, models.VOCAB, (args[0].shape[0] * m, args[0].shape[1]))
    config = fxpar.Config(microbatches=m, fuse=False, mixed_precision=fxpar.MixedPrecision())
    pm = fxpar.parallelize(model, fxpar.init_mesh(dp=2), example_args=args, loss_fn=_loss, config=config)
    opt = pm.optimizer(torch.optim.SGD, lr=0.1)
    both = torch.cat([ids, ids])  # each dp rank steps the same m microbatches: the dp mean of equal sums is exact
    pm.step(both, target=both)
    fp32, bf16 = {}, {}
    from fxpar.mixed_precision import cast_outputs

    for x in ids.chunk(m):
        (_loss(cast_outputs(low(x)), x) / m).backward()
        for k, p in low.named_parameters():
            fp32[k] = p.grad.float() + fp32.get(k, 0)
            bf16[k] = p.grad + bf16.get(k, torch.zeros_like(p))
            p.grad = None
    got = dict(zip(dict(pm.named_parameters()), [x.grad for x in opt.param_groups[0]["params"]]))
    return ({k: g.dtype for k, g in got.items()}, max((got[k] - fp32[k]).abs().max().item() for k in got),
            max((got[k] - bf16[k].float()).abs().max().item() for k in got),
            all(p.grad is None for p in pm.parameters()))


def test_main_gradients_accumulate_in_fp32(pool2):
    for dtypes, to_fp32_sum, to_bf16_sum, freed in pool2.run(_main_grads):
        assert set(dtypes.values()) == {torch.float32}
        assert to_fp32_sum == 0.0, to_fp32_sum  # the same kernels, summed in fp32
        assert to_bf16_sum > 0.0  # a bf16 accumulation would round
        assert freed  # the bf16 parameters' own .grad are freed into the main gradients


def _overflow():
    """A fixed loss scale so large that every fp16 gradient overflows: each step is skipped on every rank."""
    import fxpar

    model, args, kwargs = models.build("gpt")
    mp = fxpar.MixedPrecision(torch.float16, loss_scale=2.0**100)
    pm = fxpar.parallelize(model, fxpar.init_mesh(tp=2), example_args=args, loss_fn=_loss,
                           config=fxpar.Config(mixed_precision=mp))
    opt = pm.optimizer(torch.optim.AdamW, lr=0.1)
    before = {k: v.clone() for k, v in pm.state_dict().items()}
    loss = pm.step(args[0], target=args[0])
    opt.step()
    same = all(torch.equal(before[k], v) for k, v in pm.state_dict().items())
    return torch.isfinite(loss).item(), pm.rank.scaler.found_inf, same


def test_fp16_overflow_skips_the_step(pool2):
    for finite, found, same in pool2.run(_overflow):
        assert finite and found and same


def _scheduler(zero):
    import fxpar

    model, args, kwargs = models.build("llama")
    pm = fxpar.parallelize(model, fxpar.init_mesh(dp=2), example_args=args, example_kwargs=kwargs, loss_fn=_loss,
                           config=fxpar.Config(zero=zero, mixed_precision=fxpar.MixedPrecision()))
    opt = pm.optimizer(torch.optim.AdamW, lr=1.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 0.5 ** step)
    ids = torch.cat([args[0]] * 2)
    for _ in range(2):
        opt.zero_grad()
        pm.step(ids, target=ids, **kwargs)
        opt.step()
        sched.step()
    return opt.param_groups[0]["lr"]


@pytest.mark.parametrize("zero", [0, 1])
def test_lr_scheduler_drives_pm_optimizer(pool2, zero):
    assert pool2.run(_scheduler, zero) == [0.25, 0.25]


def test_autocast_around_a_fused_gpt():
    """torch.autocast around a parallelized (fused) GPT: no dtype clash in the fused backward (bias+GeLU recomputed,
    as recompute="selective" fuses it), and the gradients within bf16 rounding of the unfused program's (which
    equal eager autocast's exactly)."""
    import fxpar
    from fxpar.passes.ir.meta import FXPAR_FUSED

    model, args, _ = models.build("gpt")
    grads = []
    for fuse in (True, False):
        config = fxpar.Config(fuse=fuse, recompute="selective" if fuse else "none")
        pm = fxpar.parallelize(copy.deepcopy(model), None, example_args=args, config=config)
        fused = {n.meta.get(FXPAR_FUSED) for n in pm.compiled.callables[0].graph.nodes}
        assert ("bias_gelu_linear" in fused) == fuse, fused
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = pm(*args)
        out.float().sin().sum().backward()
        grads.append({k: p.grad for k, p in pm.named_parameters()})
    with torch.autocast("cpu", dtype=torch.bfloat16):
        eager = model(*args)
    eager.float().sin().sum().backward()
    assert all(torch.equal(grads[1][k], p.grad) for k, p in model.named_parameters())
    for k, g in grads[0].items():
        scale = grads[1][k].abs().max().item()
        assert (g - grads[1][k]).abs().max().item() <= 2**-6 * scale, k  # a few bf16 roundings of the largest


@pytest.mark.parametrize("kwargs,message", [
    (dict(param_dtype=torch.float16), "needs loss scaling"),
    (dict(param_dtype=torch.float32), "bfloat16 or torch.float16"),
    (dict(reduce_dtype=torch.int8), "reduce_dtype"),
    (dict(loss_scale=-1.0), "loss_scale"),
])
def test_bad_mixed_precision_is_refused(kwargs, message):
    import fxpar

    with pytest.raises(ValueError, match=message):
        fxpar.MixedPrecision(**kwargs)
