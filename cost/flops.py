"""Parameters (Eq. 2), FLOPs per iteration (Eq. 3) and end-to-end training time (Eq. 4) of PTD-P.

Glossary (Narayanan et al. 2021, "PTD-P"): l layers, h hidden, a heads, s sequence, V vocabulary,
B global batch, f feed-forward hidden (4h), P parameters, T training tokens, n GPUs,
X achieved FLOP/s per GPU. A FLOP here is one multiply or one add (a multiply-add counts 2).

Recomputation modes (Korthikanti et al. 2022, arXiv 2205.05198):
  "none"       every activation the backward pass needs is kept: 3 passes (forward, 2x backward)
  "selective"  the attention core (QK^T, softmax, dropout, attention over V) is recomputed
  "full"       each layer's forward is recomputed during the backward pass: 4 passes over the layers
"""
from __future__ import annotations

from .shape import ModelShape

RECOMPUTE_MODES = ("none", "selective", "full")


def check_recompute(recompute: str) -> str:
    """Return `recompute` if it is a known mode, else raise ValueError naming the choices."""
    if recompute not in RECOMPUTE_MODES:
        raise ValueError(f"recompute must be one of {', '.join(RECOMPUTE_MODES)}; got {recompute!r}")
    return recompute


def layer_parameters(shape: ModelShape) -> int:
    """Weights of one Transformer layer: 4h^2 + 2hf (QKV, proj, fc1, fc2) + 9h + f (biases, 2 LayerNorms).

    With f = 4h this is 12h^2 + 13h, the per-layer part of Eq. 2. With experts the MLP (2hf + f + h) is the router
    (hE) and the experts (`expert_parameters`).
    """
    h, f = shape.hidden, shape.ffn_hidden
    if shape.moe:
        return 4 * h * h + 8 * h + h * shape.experts + expert_parameters(shape)
    return 4 * h * h + 2 * h * f + 9 * h + f


def expert_parameters(shape: ModelShape) -> int:
    """Weights of one layer's routed experts: E gated MLPs of 3 h f_e (0 for a dense layer). Expert parallelism
    splits these over ep ranks."""
    return shape.experts * 3 * shape.hidden * shape.expert_ffn


def mlp_forward_flops_per_token(shape: ModelShape) -> float:
    """Forward FLOPs of one token through the MLP: 4hf dense; with experts the router (2hE) and k gated experts
    (6 h f_e each)."""
    h = shape.hidden
    if shape.moe:
        return 2.0 * h * shape.experts + shape.top_k * 6.0 * h * shape.expert_ffn
    return 4.0 * h * shape.ffn_hidden


def parameters(shape: ModelShape) -> int:
    """Eq. 2: P = 12 l h^2 (1 + 13/(12h) + (V+s)/(12 l h)) = l(12h^2 + 13h) + (V + s) h.

    Counts the token embedding once (tied with the LM head) and the position embedding; the final
    LayerNorm (2h) is left out, as in the paper.
    """
    return shape.layers * layer_parameters(shape) + (shape.vocab + shape.seq) * shape.hidden


def layer_forward_flops(shape: ModelShape, sequences: int) -> float:
    """Forward FLOPs of one layer over `sequences` sequences: 2bs(4h^2 + 2hf) + 4bs^2h.

    With f = 4h: 24 b s h^2 (1 + s/(6h)). The 4bs^2h term is the attention core (QK^T and attention
    over V); it is the part that selective recomputation runs twice.
    """
    b, s, h = sequences, shape.seq, shape.hidden
    return b * s * (8.0 * h * h + mlp_forward_flops_per_token(shape)) + attention_core_flops(shape, sequences)


def attention_core_flops(shape: ModelShape, sequences: int) -> float:
    """Forward FLOPs of QK^T and attention-over-V in one layer: 2 GEMMs of 2 b s^2 h each."""
    return 4.0 * sequences * shape.seq * shape.seq * shape.hidden


def logits_forward_flops(shape: ModelShape, sequences: int) -> float:
    """Forward FLOPs of the LM head (logit layer): 2 b s h V."""
    return 2.0 * sequences * shape.seq * shape.hidden * shape.vocab


def layer_passes(recompute: str) -> float:
    """Forward-pass equivalents spent per layer: 3 (forward + backward at 2x), 4 with full recomputation."""
    return 4.0 if check_recompute(recompute) == "full" else 3.0


def flops_per_iteration(shape: ModelShape, recompute: str = "full") -> float:
    """Eq. 3: F = 96 B s l h^2 (1 + s/(6h) + V/(16 l h)) with full recomputation.

    Without recomputation the layers take 3 passes instead of 4: F = 72 B s l h^2 (1 + s/(6h) + V/(12 l h)).
    Selective recomputation adds one more attention core per layer: 4 B s^2 h l. The LM head is never
    recomputed (3 passes). Computed from the per-layer terms so that f != 4h works too; with f = 4h it
    equals the closed form exactly (see `flops_eq3_closed_form`).
    """
    B, l = shape.batch, shape.layers
    total = layer_passes(recompute) * l * layer_forward_flops(shape, B)
    if recompute == "selective":
        total += l * attention_core_flops(shape, B)
    return total + 3.0 * logits_forward_flops(shape, B)


def flops_eq3_closed_form(shape: ModelShape, recompute: str = "full") -> float:
    """Eq. 3 as printed (f = 4h): 96 B s l h^2 (1 + s/(6h) + V/(16 l h)), or the 72-coefficient form."""
    B, s, l, h, V = shape.batch, shape.seq, shape.layers, shape.hidden, shape.vocab
    if check_recompute(recompute) == "full":
        return 96.0 * B * s * l * h * h * (1 + s / (6 * h) + V / (16 * l * h))
    base = 72.0 * B * s * l * h * h * (1 + s / (6 * h) + V / (12 * l * h))
    return base + (4.0 * B * s * s * h * l if recompute == "selective" else 0.0)


def training_seconds(tokens: float, params: float, gpus: int, flops_per_gpu: float) -> float:
    """Eq. 4: end-to-end training time T_e2e ~= 8 T P / (n X), in seconds.

    8 = 2 (multiply-add) x 4 passes (forward, recomputed forward, 2x backward) per parameter per token;
    the attention and logit terms of Eq. 3 are neglected (they are small for large h).
    """
    if tokens <= 0 or params <= 0 or gpus < 1 or flops_per_gpu <= 0:
        raise ValueError(f"training_seconds needs positive tokens, params, gpus and FLOP/s; got "
                         f"tokens={tokens}, params={params}, gpus={gpus}, flops_per_gpu={flops_per_gpu}")
    return 8.0 * tokens * params / (gpus * flops_per_gpu)


def training_days(tokens: float, params: float, gpus: int, flops_per_gpu: float) -> float:
    """Eq. 4 in days (86400 s)."""
    return training_seconds(tokens, params, gpus, flops_per_gpu) / 86400.0
