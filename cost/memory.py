"""Memory per GPU: weights, gradients and optimizer states, plus activations (Korthikanti et al. 2022).

Glossary: s sequence, b microbatch, h hidden, a heads, t tensor-parallel degree, V vocabulary,
e bytes per element of the compute dtype.

Activations stored per layer per microbatch (Korthikanti et al. 2022, arXiv 2205.05198, Table 2, tensor
parallelism without sequence parallelism, e = 2 with 1-byte dropout masks):
  no recomputation         s b h (10 + 24/t + 5 a s / (h t))      (t = 1: s b h (34 + 5 a s / h))
  selective recomputation  s b h (10 + 24/t)                       (attention core recomputed)
  full recomputation       2 s b h                                 (only the layer input is kept)
With sequence parallelism (Table 2's last rows: the norms, dropouts and residual adds between the regions keep 1/t
of the tokens, and each region's input is saved as its sequence block):
  no recomputation         s b h (34 + 5 a s / h) / t
  selective recomputation  34 s b h / t
  full recomputation       2 s b h / t                             (the layer input's block)
Full recomputation also needs one layer's complete activations while it recomputes (a working set).
For another dtype size the formulas are scaled by e / 2.

Weights, gradients and optimizer states, bytes per parameter with Adam (m and v in fp32), in four parts:
weights and gradients on every data-parallel rank, main parameters (the fp32 copies the optimizer steps, with
their own gradient where that is not the gradient itself) and the optimizer's state. The distributed optimizer
(zero=1) holds the main parameters, their gradients and the state for 1/d of the parameters only:
  precision  weights  gradients        main (zero=0)                  state  total zero=0  zero=1
  fp32       4        4                0 (the weights are the main)   8      16            8 + 16/d
  bf16/fp16  2        4 (fp32 main)    4 (its .grad is the gradient)  8      18            6 + 16/d
  paper      2        2 (fp16)         4 + 4 (fp32 weight, gradient)  8      20            4 + 16/d
bf16/fp16 is fxpar's fxpar.MixedPrecision (gradients accumulate into fp32 main gradients); "paper" is Megatron-LM's
2021 fp16 recipe, the accounting behind the PTD-P paper's runs and the default on 2-byte clusters. With zero=1
fxpar steps fp32 copies of a rank's 1/d pieces with their own fp32 gradients: 4 + 4 + 8 = 16/d (Megatron-LM's
reuses a view of its gradient buffer: 12/d). The gradients are counted at their peak: every one is alive from
its first microbatch's backward until the step (zero=0) or until its bucket is reduce-scattered after the last
microbatch's backward (zero=1). `fxpar.runtime.optim.state_bytes(pm, optimizer)` measures the same four parts.

Logits on the last stage: b s V/t in the compute dtype plus the cross-entropy's fp32 copy, (e + 4) b s V / t, when
the loss is vocab-parallel; a loss that needs the whole vocabulary also holds the gathered logits and their fp32
copy, (e + 4) b s V more.
"""
from __future__ import annotations

from dataclasses import dataclass

from .cluster import GIB, Cluster
from .compute import expert_split
from .flops import check_recompute, expert_parameters, layer_parameters
from .bubble import chunks_in_flight
from .shape import ModelShape

# precision: bytes per parameter of (weights, gradients, main parameters at zero=0, optimizer state)
STATE_BYTES = {"fp32": (4, 4, 0, 8), "bf16": (2, 4, 4, 8), "fp16": (2, 4, 4, 8), "paper": (2, 2, 8, 8)}
PRECISIONS = tuple(STATE_BYTES)
ZERO_MAIN_BYTES = 8  # with zero=1: an fp32 copy of each piece and its fp32 gradient


def default_precision(e: int) -> str:
    """The precision a cluster of `e`-byte elements is planned with: the paper's fp16 recipe, else fp32."""
    return "paper" if e <= 2 else "fp32"


def state_bytes(precision: str, zero: int = 0, d: int = 1) -> dict[str, float]:
    """Bytes per parameter on one rank of {"weights", "gradients", "main", "optimizer"}; see the module docstring."""
    if precision not in STATE_BYTES:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    weights, gradients, main, optimizer = STATE_BYTES[precision]
    if zero:
        main, optimizer = ZERO_MAIN_BYTES / d, optimizer / d
    return {"weights": weights, "gradients": gradients, "main": main, "optimizer": optimizer}


def state_bytes_per_param(precision: str, zero: int = 0, d: int = 1) -> float:
    """The sum of `state_bytes`: 16 for fp32, 18 for bf16, 20 for the paper's fp16 recipe (zero=0)."""
    return sum(state_bytes(precision, zero, d).values())


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


def activation_bytes_per_layer(shape: ModelShape, b: int, t: int, recompute: str, e: int = 2,
                               sequence_parallel: bool = False) -> float:
    """Korthikanti et al. 2022 Table 2, scaled by e / 2; see the module docstring."""
    s, h, a = shape.seq, shape.hidden, shape.heads
    sbh = s * b * h * e / 2
    if sequence_parallel:
        return {"full": 2 * sbh, "selective": 34 * sbh, "none": sbh * (34 + 5 * a * s / h)}[
            check_recompute(recompute)] / t
    if check_recompute(recompute) == "full":
        return 2 * sbh
    if recompute == "selective":
        return sbh * (10 + 24 / t)
    return sbh * (10 + 24 / t + 5 * a * s / (h * t))


def stage_parameters(shape: ModelShape, stage_layers: tuple[int, ...], stage: int, t: int, ep: int = 1) -> float:
    """Parameters held by one GPU of `stage`: its layers / t, plus the word embedding / t on the first and
    last stage (tied: the last stage keeps a copy) and the position embedding on the first stage. A layer's
    experts are split over tp without expert parallelism and over the ep ranks with it (each expert whole)."""
    p = len(stage_layers)
    experts = expert_parameters(shape)
    per_layer = (layer_parameters(shape) - experts) / t + experts / (ep * expert_split(t, ep))
    params = stage_layers[stage] * per_layer
    if stage == 0:
        params += shape.vocab * shape.hidden / t + shape.seq * shape.hidden
    if stage == p - 1 and p > 1:
        params += shape.vocab * shape.hidden / t
    return params


def stage_memory(shape: ModelShape, stage_layers: tuple[int, ...], stage: int, *, t: int, b: int, m: int,
                 v: int, schedule: str, recompute: str, cluster: Cluster, precision: str = "", zero: int = 0,
                 d: int = 1, vocab_parallel_loss: bool = True, sequence_parallel: bool = False,
                 ep: int = 1) -> MemoryBreakdown:
    """Peak bytes on one GPU of `stage`.

    activations = per-layer bytes x layers on the stage x (chunks in flight / v), the in-flight count from
    the schedule (`pipeline.chunks_in_flight`), plus the recompute working set; logits only on the last stage.
    precision "" is `default_precision(cluster.dtype_bytes)`.
    """
    e, p = cluster.dtype_bytes, len(stage_layers)
    per_layer = activation_bytes_per_layer(shape, b, t, recompute, e, sequence_parallel)
    in_flight = chunks_in_flight(schedule, p, m, v, stage)
    activations = per_layer * stage_layers[stage] * in_flight / v
    if recompute == "full":
        activations += activation_bytes_per_layer(shape, b, t, "none", e, sequence_parallel)
    logits = 0.0
    if stage == p - 1:
        logits = (e + LOGIT_BYTES_FP32) * b * shape.seq * shape.vocab * (1 / t + (not vocab_parallel_loss))
    per_param = state_bytes_per_param(precision or default_precision(e), zero, d)
    states = per_param * stage_parameters(shape, stage_layers, stage, t, ep)
    return MemoryBreakdown(states, activations, logits, cluster.reserved_bytes, stage)


def memory_per_gpu(shape: ModelShape, stage_layers: tuple[int, ...], *, t: int, b: int, m: int, v: int,
                   schedule: str, recompute: str, cluster: Cluster, precision: str = "", zero: int = 0, d: int = 1,
                   vocab_parallel_loss: bool = True, sequence_parallel: bool = False, ep: int = 1) -> MemoryBreakdown:
    """The most loaded stage's `MemoryBreakdown`: the first stage (most microbatches in flight, and at least
    as many layers as any middle stage, see `pipeline.split_layers`) or the last (logits, LM head)."""
    stages = sorted({0, len(stage_layers) - 1})
    return max((stage_memory(shape, stage_layers, i, t=t, b=b, m=m, v=v, schedule=schedule, recompute=recompute,
                             cluster=cluster, precision=precision, zero=zero, d=d,
                             vocab_parallel_loss=vocab_parallel_loss, sequence_parallel=sequence_parallel, ep=ep)
                for i in stages), key=lambda mb: mb.total)
