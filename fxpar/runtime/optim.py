"""pm.optimizer: a torch.optim optimizer over what a rank steps.

    no mixed precision, zero=0   the optimizer class itself, over the rank's parameters
    mixed precision, zero=0      MainParamsOptimizer: the class over fp32 main copies of the parameters, cast back
                                 after each step ([Note: mixed precision] in fxpar/runtime/precision.py)
    zero=1                       DistributedOptimizer (fxpar/runtime/zero.py): the class over fp32 main copies of this
    dp
                                 rank's 1/d pieces

The wrappers are torch.optim.Optimizer subclasses whose param_groups and state are the wrapped optimizer's, so
learning-rate schedulers and code that sets group["lr"] work unchanged.
"""
from __future__ import annotations

import torch


def trainable(pm) -> dict[str, torch.nn.Parameter]:
    """The parameters a rank steps, by key."""
    return {k: p for k, p in pm.rank.weights.held().items() if isinstance(p, torch.nn.Parameter) and p.requires_grad}


def state_bytes(pm, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """Bytes this rank holds of {"weights", "gradients", "main", "optimizer"}, the parts the cost model counts
    (cost/memory.py `state_bytes`): the trainable parameters, their gradients where they are now (the fp32 main
    gradients under mixed precision), the tensors the optimizer steps and their gradients where those are not
    already counted, and the optimizer's state tensors (moments; scalar step counters left out). Each storage is
    counted once (by address)."""
    seen: set[int] = set()

    def size(tensors) -> int:
        total = 0
        for t in tensors:
            if t is not None and t.numel() and t.data_ptr() not in seen:
                seen.add(t.data_ptr())
                total += t.numel() * t.element_size()
        return total

    params = list(trainable(pm).values())
    main = [t for group in optimizer.param_groups for t in group["params"]]
    return {"weights": size(params), "gradients": size(pm.rank.weights.grads.get(p) for p in params),
            "main": size(main) + size(t.grad for t in main),
            "optimizer": size(t for s in optimizer.state.values() for t in s.values()
                              if isinstance(t, torch.Tensor) and t.dim() > 0)}


class WrappedOptimizer(torch.optim.Optimizer):
    """An optimizer class stepping tensors that stand for the parameters (fp32 main copies, or pieces)."""

    def __init__(self, pm, optimizer_cls, main: list[torch.Tensor], **kwargs):  # no super().__init__: delegated
        self.pm, self.optimizer, self.params = pm, optimizer_cls(main, **kwargs), trainable(pm)

    @property
    def param_groups(self):
        return self.optimizer.param_groups

    @property
    def state(self):
        return self.optimizer.state

    @property
    def defaults(self):
        return self.optimizer.defaults

    def _skip(self) -> bool:
        """The step's gradients overflowed (fp16 loss scaling): every rank skips this optimizer step."""
        scaler = self.pm.rank.scaler
        return scaler is not None and scaler.found_inf

    def state_bytes(self) -> int:
        """Bytes of optimizer state this rank holds (the moments; step counters included)."""
        return sum(t.numel() * t.element_size() for s in self.optimizer.state.values() for t in s.values()
                   if isinstance(t, torch.Tensor))

    def state_dict(self):
        return self.optimizer.state_dict()

    def load_state_dict(self, state):
        self.optimizer.load_state_dict(state)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.optimizer!r})"


class MainParamsOptimizer(WrappedOptimizer):
    """The optimizer over fp32 main parameters whose .grad are the fp32 main gradients; each step casts them back
    into the low-precision parameters ([Note: mixed precision] in fxpar/runtime/precision.py)."""

    def __init__(self, pm, optimizer_cls, **kwargs):
        self.main = {k: torch.nn.Parameter(p.detach().to(torch.float32).clone()) for k, p in trainable(pm).items()}
        super().__init__(pm, optimizer_cls, list(self.main.values()), **kwargs)
        for k, p in self.params.items():
            pm.rank.weights.grads.attach(p, self.main[k])

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none)

    @torch.no_grad()
    def step(self, closure=None):
        if closure is not None:
            raise ValueError("fxpar: pm.optimizer takes no closure (pm.step computes the loss)")
        if self._skip():
            return
        self.optimizer.step()
        for k, p in self.params.items():
            p.copy_(self.main[k])
