"""Memory per GPU: weights, gradients and optimizer states, plus activations (Korthikanti et al. 2022).

Glossary: s sequence, b microbatch, h hidden, a heads, t tensor-parallel degree, V vocabulary,
e bytes per element of the compute dtype.

Activations stored per layer per microbatch (Korthikanti et al. 2022, arXiv 2205.05198, Table 2, tensor
parallelism without sequence parallelism, e = 2 with 1-byte dropout masks):
  no recomputation         s b h (10 + 24/t + 5 a s / (h t))      (t = 1: s b h (34 + 5 a s / h))
  selective recomputation  s b h (10 + 24/t)                       (attention core recomputed)
  full recomputation       2 s b h                                 (only the layer input is kept)
Full recomputation also needs one layer's complete activations while it recomputes (a working set).
For another dtype size the formulas are scaled by e / 2.

Weights, gradients and optimizer states (Megatron-LM's accounting, no distributed optimizer):
  fp16 mixed precision  20 bytes per parameter: fp16 weight 2 + fp16 gradient 2 + fp32 main weight 4 +
                        fp32 main gradient 4 + Adam m and v 4 + 4
  fp32 training         16 bytes per parameter: weight, gradient, m, v at 4 each
"""
from __future__ import annotations

from dataclasses import dataclass

from .cluster import GIB, Cluster
from .flops import check_recompute, layer_parameters
from .pipeline import chunks_in_flight
from .shape import ModelShape



def state_bytes_per_param(e: int) -> int:
    """20 for 2-byte (mixed precision) training, 16 for fp32; see the module docstring."""
    return 20 if e <= 2 else 16

LOGIT_BYTES_FP32 = 4  # the cross-entropy keeps an fp32 copy of the logits


@dataclass(frozen=True)
class MemoryBreakdown:
    """Bytes per GPU on the most loaded stage."""

    states: float
    activations: float
    logits: float
    reserved: float
    stage: int

    @property
    def total(self) -> float:
        """states + activations + logits + reserved."""
        return self.states + self.activations + self.logits + self.reserved

    @property
    def gib(self) -> float:
        """total in GiB."""
        return self.total / GIB


def activation_bytes_per_layer(shape: ModelShape, b: int, t: int, recompute: str, e: int = 2) -> float:
    """Korthikanti et al. 2022 Table 2 (no sequence parallelism), scaled by e / 2; see the module docstring."""
    s, h, a = shape.seq, shape.hidden, shape.heads
    sbh = s * b * h * e / 2
    if check_recompute(recompute) == "full":
        return 2 * sbh
    if recompute == "selective":
        return sbh * (10 + 24 / t)
    return sbh * (10 + 24 / t + 5 * a * s / (h * t))


def stage_parameters(shape: ModelShape, stage_layers: tuple[int, ...], stage: int, t: int) -> float:
    """Parameters held by one GPU of `stage`: its layers / t, plus the word embedding / t on the first and
    last stage (tied: the last stage keeps a copy) and the position embedding on the first stage."""
    p = len(stage_layers)
    params = stage_layers[stage] * layer_parameters(shape) / t
    if stage == 0:
        params += shape.vocab * shape.hidden / t + shape.seq * shape.hidden
    if stage == p - 1 and p > 1:
        params += shape.vocab * shape.hidden / t
    return params


def stage_memory(shape: ModelShape, stage_layers: tuple[int, ...], stage: int, *, t: int, b: int, m: int,
                 v: int, schedule: str, recompute: str, cluster: Cluster) -> MemoryBreakdown:
    """Peak bytes on one GPU of `stage`.

    activations = per-layer bytes x layers on the stage x (chunks in flight / v), the in-flight count from
    the schedule (`pipeline.chunks_in_flight`), plus the recompute working set; logits only on the last stage.
    """
    e, p = cluster.dtype_bytes, len(stage_layers)
    per_layer = activation_bytes_per_layer(shape, b, t, recompute, e)
    in_flight = chunks_in_flight(schedule, p, m, v, stage)
    activations = per_layer * stage_layers[stage] * in_flight / v
    if recompute == "full":
        activations += activation_bytes_per_layer(shape, b, t, "none", e)
    logits = 0.0
    if stage == p - 1:
        logits = (e + LOGIT_BYTES_FP32) * b * shape.seq * shape.vocab / t
    states = state_bytes_per_param(e) * stage_parameters(shape, stage_layers, stage, t)
    return MemoryBreakdown(states, activations, logits, cluster.reserved_bytes, stage)


def memory_per_gpu(shape: ModelShape, stage_layers: tuple[int, ...], *, t: int, b: int, m: int, v: int,
                   schedule: str, recompute: str, cluster: Cluster) -> MemoryBreakdown:
    """The most loaded stage's `MemoryBreakdown`: the first stage (most microbatches in flight, and at least
    as many layers as any middle stage, see `pipeline.split_layers`) or the last (logits, LM head)."""
    stages = sorted({0, len(stage_layers) - 1})
    return max((stage_memory(shape, stage_layers, i, t=t, b=b, m=m, v=v, schedule=schedule,
                             recompute=recompute, cluster=cluster) for i in stages), key=lambda mb: mb.total)
