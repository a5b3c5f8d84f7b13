"""Mixed precision's settings and casts, which Config and the trace read; the recipe itself is
[Note: mixed precision] in fxpar/runtime/precision.py, which holds the main gradients and the loss scaler."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.utils._pytree as pytree

LOW = (torch.bfloat16, torch.float16)
REDUCE = (torch.float32, torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class MixedPrecision:
    param_dtype: torch.dtype = torch.bfloat16  # parameters, activations and GEMMs
    reduce_dtype: torch.dtype = torch.float32  # the data-parallel gradient reduction
    loss_scale: float | str | None = None  # fp16: "dynamic" (or a fixed scale); bf16 needs none

    def __post_init__(self):
        if self.param_dtype not in LOW:
            raise ValueError(f"MixedPrecision.param_dtype must be torch.bfloat16 or torch.float16, got "
                             f"{self.param_dtype!r} (without mixed precision, leave Config.mixed_precision=None)")
        if self.reduce_dtype not in REDUCE:
            raise ValueError(f"MixedPrecision.reduce_dtype must be one of {REDUCE}, got {self.reduce_dtype!r}")
        scale = self.loss_scale
        if scale is not None and scale != "dynamic" and (isinstance(scale, bool) or not isinstance(scale, (int, float))
                                                          or not scale > 0):
            raise ValueError(f"MixedPrecision.loss_scale must be 'dynamic', a positive number or None, got {scale!r}")
        if self.param_dtype == torch.float16 and scale is None:
            raise ValueError(
                "fxpar: MixedPrecision(param_dtype=torch.float16) needs loss scaling: fp16's 5 exponent bits flush "
                "gradients below 6e-8 to zero. Fix: MixedPrecision(param_dtype=torch.float16, loss_scale='dynamic'), "
                "or param_dtype=torch.bfloat16 (fp32's range, no scaling needed)."
            )


def cast_inputs(tree, dtype: torch.dtype):
    """Floating tensors of a call's inputs in `dtype` (integer ids, masks of bools stay)."""
    return pytree.tree_map(lambda x: x.to(dtype) if isinstance(x, torch.Tensor) and x.is_floating_point() else x,
                           tree)


def cast_outputs(tree):
    """Floating tensors of a model's outputs in fp32 (what the loss and the caller see)."""
    return cast_inputs(tree, torch.float32)
