"""Mixed precision, Megatron's recipe: low-precision parameters and compute, fp32 main gradients and parameters.

    config = fxpar.Config(mixed_precision=fxpar.MixedPrecision(param_dtype=torch.bfloat16))
    pm = fxpar.parallelize(model, mesh, example_args, loss_fn=..., config=config)
    opt = pm.optimizer(torch.optim.AdamW, lr=...)      # steps fp32 main parameters

[Note: mixed precision]
    compute     parallelize casts the model to param_dtype in place (`model.to(param_dtype)`: floating parameters and
                buffers, as Megatron's Float16Module does) and traces it with its floating inputs cast to
                param_dtype and its floating outputs cast to fp32, so every GEMM runs on param_dtype operands and a
                loss traced with the model is computed in fp32 from the upcast logits (the vocab-parallel
                cross-entropy too). The same recipe on one process: `loss_fn(model.to(dtype)(x.to(dtype)).float(),
                y)`.
    gradients   each parameter's gradient is added, as soon as autograd has accumulated it, into an fp32 main
                gradient (Megatron's main_grad) and the parameter's own .grad is freed: over m microbatches the
                gradient accumulates in fp32 (Grads below). The data-parallel reduction runs on the main gradients,
                in reduce_dtype; clipping measures them.
    optimizer   pm.optimizer keeps fp32 main parameters, the tensors in its param_groups, whose .grad are the main
                gradients; after its step they are cast back into the param_dtype parameters (fxpar/runtime/optim.py).
                With Config(zero=1) only each rank's 1/d pieces have fp32 copies (fxpar/runtime/zero.py).
    fp16        fp16's 5 exponent bits flush small gradients to zero, so fp16 needs loss scaling: the loss's
                gradient is multiplied by the scale, the main gradients are unscaled after the backward, and a
                step whose gradients overflowed anywhere is skipped while the scale backs off (LossScaler, torch's
                GradScaler rule and kernels, with the overflow agreed by every rank). bf16 has fp32's range and
                needs none.
"""
from __future__ import annotations

import torch
import torch.distributed as dist


class Grads:
    """Where each trainable parameter's gradient is: its own .grad, or (mixed precision) its fp32 main gradient,
    which autograd's accumulation feeds through a post-accumulate hook ([Note: mixed precision]). The step's
    buckets, the tied-weight reduction, clipping and the optimizers read and write gradients through this."""

    def __init__(self, params: list[torch.nn.Parameter], main: bool):
        self.main = main
        self._grad: dict[torch.Tensor, torch.Tensor] = {}
        self._holder: dict[torch.Tensor, torch.Tensor] = {}  # param -> the fp32 main parameter whose .grad it is
        if main:
            for p in params:
                p.register_post_accumulate_grad_hook(self._accumulate)

    @torch.no_grad()
    def _accumulate(self, p: torch.Tensor) -> None:
        grad, p.grad = p.grad, None
        if grad is None:  # a backward that gave p no gradient (a dp bucket's: fxpar/runtime/buckets.py)
            return
        have = self.get(p)
        self.set(p, grad.to(torch.float32) if have is None else have.add_(grad))

    def get(self, p: torch.Tensor) -> torch.Tensor | None:
        if not self.main:
            return p.grad
        holder = self._holder.get(p)
        return holder.grad if holder is not None else self._grad.get(p)

    def set(self, p: torch.Tensor, value: torch.Tensor | None) -> None:
        if not self.main:
            p.grad = value
        elif p in self._holder:
            self._holder[p].grad = value
        elif value is None:
            self._grad.pop(p, None)
        else:
            self._grad[p] = value

    def attach(self, p: torch.Tensor, holder: torch.Tensor) -> None:
        """From now on p's main gradient is holder.grad (an fp32 main parameter of the optimizer)."""
        holder.grad = self._grad.pop(p, None)
        self._holder[p] = holder


class LossScaler:
    """Loss scaling for fp16 ([Note: mixed precision]): dynamic with torch.amp.GradScaler's defaults and kernels,
    or a fixed scale. `unscale` is collective over the default group, so every rank skips the same steps."""

    def __init__(self, scale: float | str, device: torch.device):
        self.dynamic = scale == "dynamic"
        self.scale = torch.full((), 2.0**16 if self.dynamic else float(scale), dtype=torch.float32, device=device)
        self._growth = torch.zeros((), dtype=torch.int32, device=device)
        self.found_inf = False

    @torch.no_grad()
    def unscale(self, grads: list[torch.Tensor]) -> bool:
        """Divide the main gradients by the scale; True (on every rank) when any rank's overflowed."""
        found = torch.zeros(1, dtype=torch.float32, device=self.scale.device)
        if grads:
            torch._amp_foreach_non_finite_check_and_unscale_(grads, found, self.scale.double().reciprocal().float())
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(found, op=dist.ReduceOp.MAX)
        if self.dynamic:  # halve on overflow, double after 2000 clean steps (GradScaler's rule)
            torch._amp_update_scale_(self.scale, self._growth, found, 2.0, 0.5, 2000)
        self.found_inf = bool(found.item())
        return self.found_inf
