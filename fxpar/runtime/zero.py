"""The optimizer of a parallelized model: plain, or Megatron's distributed optimizer (ZeRO-1) over the dp group.

`pm.optimizer(torch.optim.AdamW, lr=...)` wraps any torch.optim class. Without `Config(zero=1)` it is that class
over the rank's own parameters. With it, each data-parallel rank owns 1/d of every parameter:

    gradients   reduce-scattered over dp in the step's buckets (the rank receives the mean of its pieces only), as
                soon as a bucket is final, overlapped with the rest of the backward (fxpar/runtime/interpreter.py
                GradBuckets)
    main        the rank's pieces, fp32 copies, are the tensors in the optimizer's param_groups: it steps 1/d of the
                parameters and keeps 1/d of the optimizer state (Adam's moments: 8 bytes/param become 8/d)
    parameters  after the optimizer's step, the updated pieces are all-gathered over dp, one collective per step

[Note: pieces]
    Parameter p (n elements, flattened) is cut into d pieces of ceil(n/d) elements, the last one padded: dp rank r
    owns piece r. Every dp rank cuts alike (the same stage and tp rank hold the same shapes), so a bucket laid out
    rank-major (piece 0 of each of its parameters, then piece 1, ...) is reduce-scattered into exactly the pieces
    each rank owns, and one all-gather of every rank's pieces rebuilds the parameters. Exact: a piece's gradient is
    the dp mean the all-reduce would give, and elementwise optimizers (SGD, Adam, AdamW, ...) step each element from
    its own gradient and state. Optimizers that couple elements across a tensor (LAMB's or LARS's per-tensor norms,
    Adafactor's factored moments) would see pieces, not tensors: they are refused.
    With expert parallelism a weight split over the experts' ranks is cut into edp = d/ep pieces instead, owned by
    the dp ranks that hold the same experts (its edp group), which reduce-scatter its gradient and all-gather it.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from fxpar.passes.ir.pieces import pieces, rank_major
from fxpar.runtime.optim import WrappedOptimizer, trainable

ELEMENTWISE = ("SGD", "Adam", "AdamW", "Adamax", "Adagrad", "RMSprop", "Adadelta", "NAdam", "RAdam", "ASGD", "Rprop")


class DistributedOptimizer(WrappedOptimizer):
    """Megatron's distributed optimizer over `pm`'s dp group (see the module docstring); use it like the torch
    optimizer it wraps: zero_grad(), then pm.step(...), optionally pm.clip_grad_norm_(...), then step()."""

    def __init__(self, pm, optimizer_cls, **kwargs):
        if optimizer_cls.__name__ not in ELEMENTWISE:
            raise ValueError(
                f"fxpar: Config(zero=1) steps each rank's 1/d pieces of the parameters, which is exact only for "
                f"elementwise optimizers ({', '.join(ELEMENTWISE)}); {optimizer_cls.__name__} is not one of them. "
                "Fix: use one of those, or Config(zero=0)."
            )
        g = pm.rank.groups
        self.d, self.r, self.group, self.grads_of = g.dp, g.dp_rank, g.dp_group, pm.rank.weights.grads
        params = trainable(pm)
        self.experts = {id(p) for k, p in params.items() if pm.rank.weights.expert(k)}  # cut over edp
        self.expert_split = (g.edp, g.dp_rank // g.ep, g.edp_group)
        self.main = {k: torch.nn.Parameter(self.piece(p, _at_least_fp32(p.detach().reshape(-1))))
                     for k, p in params.items()}
        super().__init__(pm, optimizer_cls, list(self.main.values()), **kwargs)
        self._key_of = {p: k for k, p in self.params.items()}
        dtypes = {p.dtype for p in self.params.values()}
        self._gather_dtype = dtypes.pop() if len(dtypes) == 1 else torch.float32  # bf16 parameters: gather bf16

    def split(self, p: torch.Tensor) -> tuple[int, int, object]:
        """(pieces, this rank's, the group that holds them) of parameter p: over dp, or over edp for an expert's."""
        return self.expert_split if id(p) in self.experts else (self.d, self.r, self.group)

    def piece(self, p: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        """This rank's piece of t, a tensor of parameter p's size (the parameter, a state, a mask)."""
        n, r, _ = self.split(p)
        return pieces(t.reshape(-1), n)[r].clone()

    # ---- what the step's buckets call ([Note: pieces]) ---------------------------------------------------------
    def layout(self, params: list[torch.Tensor]) -> torch.Tensor:
        """The rank-major flat gradient of a bucket of parameters (all dense, or all experts'), to reduce-scatter."""
        return rank_major([self.grads_of.get(p) for p in params], self.split(params[0])[0])

    def receive(self, params: list[torch.Tensor], mine: list[torch.Tensor]) -> None:
        """This rank's reduce-scattered piece of each parameter (sums over dp): their mean joins the main gradients,
        and the parameters' local gradients are freed."""
        for p, piece in zip(params, mine):
            main = self.main[self._key_of[p]]
            piece = piece.to(main.dtype) / self.d
            main.grad = piece if main.grad is None else main.grad + piece
            self.grads_of.set(p, None)

    # ---- the torch.optim interface -----------------------------------------------------------------------------
    def grads(self) -> dict[str, torch.Tensor]:
        """key -> this rank's main gradient pieces (what clipping measures and scales)."""
        return {k: m.grad for k, m in self.main.items() if m.grad is not None}

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params.values():
            self.grads_of.set(p, None)
        self.optimizer.zero_grad(set_to_none)

    @torch.no_grad()
    def step(self, closure=None) -> None:
        if closure is not None:
            raise ValueError("fxpar: the distributed optimizer takes no closure (pm.step computes the loss)")
        stray = [k for k, p in self.params.items() if self.grads_of.get(p) is not None]
        if stray:
            raise RuntimeError(f"fxpar: {stray[0]} has a gradient that pm.step() did not reduce-scatter (a backward "
                               "outside step()?). With Config(zero=1), compute gradients with pm.step().")
        if self._skip():
            return
        self.optimizer.step()
        params = list(self.params.values())
        for p, full in zip(params, self.gather(list(self.main.values()), params, self._gather_dtype)):
            p.copy_(full.to(p.dtype))

    def gather(self, mine: list[torch.Tensor], like: list[torch.Tensor], dtype: torch.dtype) -> list[torch.Tensor]:
        """This rank's pieces of tensors shaped like `like` (the parameters, or tensors of their sizes), all-gathered
        in one collective over dp (and one over edp for the experts', in `dtype`): the whole tensors ([Note:
        pieces]). The step rebuilds the parameters with it, checkpoints the state."""
        out = [None] * len(like)
        for expert in (False, True):
            at = [i for i, p in enumerate(like) if (id(p) in self.experts) == expert]
            if not at:
                continue
            n, _, group = self.split(like[at[0]])
            flat = torch.cat([mine[i].detach().reshape(-1) for i in at]).to(dtype)
            everyone = torch.empty(n * flat.numel(), dtype=flat.dtype, device=flat.device)
            if n > 1:
                dist.all_gather_single(everyone, flat, group=group)
            else:
                everyone.copy_(flat)
            rows, offset = everyone.view(n, -1), 0
            for i in at:
                out[i] = rows[:, offset:offset + mine[i].numel()].reshape(-1)[:like[i].numel()].view(like[i].shape)
                offset += mine[i].numel()
        return out


def _at_least_fp32(t: torch.Tensor) -> torch.Tensor:
    """fp32 main copies of low-precision parameters; a float64 parameter keeps float64 (a float64 run must not take
    fp32's rounding from its optimizer)."""
    return t.to(torch.promote_types(t.dtype, torch.float32))
