"""pm.optimizer: a torch.optim optimizer over what a rank steps.

    no mixed precision, zero=0   the optimizer class itself, over the rank's parameters
    mixed precision, zero=0      MainParamsOptimizer: the class over fp32 main copies of the parameters, cast back
                                 after each step ([Note: mixed precision] in fxpar/precision.py)
    zero=1                       DistributedOptimizer (fxpar/zero.py): the class over fp32 main copies of this dp
                                 rank's 1/d pieces

The wrappers are torch.optim.Optimizer subclasses whose param_groups and state are the wrapped optimizer's, so
learning-rate schedulers and code that sets group["lr"] work unchanged.
"""
from __future__ import annotations

import torch


def trainable(pm) -> dict[str, torch.nn.Parameter]:
    """The parameters a rank steps, by key."""
    return {k: p for k, p in pm.held().items() if isinstance(p, torch.nn.Parameter) and p.requires_grad}


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
        scaler = self.pm.__dict__.get("_scaler")
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
    into the low-precision parameters ([Note: mixed precision] in fxpar/precision.py)."""

    def __init__(self, pm, optimizer_cls, **kwargs):
        self.main = {k: torch.nn.Parameter(p.detach().to(torch.float32).clone()) for k, p in trainable(pm).items()}
        super().__init__(pm, optimizer_cls, list(self.main.values()), **kwargs)
        for k, p in self.params.items():
            pm._grads.attach(p, self.main[k])

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
