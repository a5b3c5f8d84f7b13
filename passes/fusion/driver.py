"""Fusion passes on the per-rank ATen graph: explicit attention -> SDPA, bias+dropout+residual-add, GeLU written out
-> aten.gelu, and (with selective recompute) bias+GeLU recomputed in backward.

Every pass matches a fixed pattern, checks the conditions under which the rewrite computes the same math, and leaves
anything else alone: a near miss (a mask of another shape, a scale that is a tensor, softmax over another dim) is no
match, never a guess. Each pass rewrites in place and returns the same GraphModule; it calls lint() and recompile()
only when something matched. Fused nodes carry node.meta[FXPAR_FUSED] = the fusion's name, for `fxpar show`.

    attention.py   attention_to_sdpa_pass
    dropout.py     identity_dropout_pass, bias_dropout_add_pass
    gelu.py        gelu_pass, bias_gelu_pass
    match.py       the matching helpers they share
"""
from __future__ import annotations

from typing import Mapping

import torch
from torch.fx import GraphModule

from fxpar.passes.fusion.attention import attention_to_sdpa_pass
from fxpar.passes.fusion.dropout import bias_dropout_add_pass, identity_dropout_pass
from fxpar.passes.fusion.gelu import bias_gelu_pass, gelu_pass
from fxpar.passes.ir.meta import FXPAR_FUSED, GraphInput

__all__ = ["FXPAR_FUSED", "attention_to_sdpa_pass", "bias_dropout_add_pass", "bias_gelu_pass", "fusion_pass",
           "gelu_pass", "identity_dropout_pass"]


def fusion_pass(gm: GraphModule, values: Mapping[GraphInput, torch.Tensor] | None = None,
                recompute_gelu: bool = False) -> GraphModule:
    """The fusions, in order: attention -> SDPA, dropouts that are identities removed, bias+dropout+add (it takes
    the second GEMM's bias first, so that bias+GeLU can fold a bias-free GEMM), then the GeLU: written-out GeLU ->
    aten.gelu, or with recompute_gelu (Config(recompute="selective")) bias+GeLU recomputed in backward and folded
    with the next GEMM. Returns gm, rewritten in place (untouched if nothing matched).

    values: the buffer and constant inputs' tensors (Traced.values), with which a mask is proven causal."""
    gm = identity_dropout_pass(attention_to_sdpa_pass(gm, values))
    gm = bias_dropout_add_pass(gm)
    return bias_gelu_pass(gm) if recompute_gelu else gelu_pass(gm)
