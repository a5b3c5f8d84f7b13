"""Compute time of one microbatch through one layer (and through the LM head) on one tensor-parallel rank.

Glossary: b microbatch, s sequence, h hidden, a heads, f feed-forward hidden, t tensor-parallel degree,
e bytes per element of the compute dtype, (m, n, k) a GEMM [m, k] x [k, n] -> [m, n].

Kernel time model (the "achievable GEMM rate that depends on GEMM shape"):
  T_gemm = overhead + max(2 m n k / (peak x gemm_efficiency),  e (mk + kn + mn) / (HBM x memory_efficiency))
a roofline plus a fixed per-kernel cost. Large projection GEMMs run at the sustained GEMM rate; the
attention GEMMs (k = h/a = 64..128) have arithmetic intensity near or under the ridge point and run
slower; small GEMMs pay the fixed overhead. Elementwise kernels (LayerNorm, softmax, dropout, GeLU,
residual adds, layout copies) are bandwidth-bound: T = overhead + bytes / (HBM x memory_efficiency).
The kernel list is Megatron's fused one (fused scale-mask-softmax, bias+GeLU, bias+dropout+add).
Overlap assumption: kernels on one device run back to back, never concurrently.
"""
from __future__ import annotations

from dataclasses import dataclass

from .cluster import Cluster
from .shape import ModelShape


@dataclass(frozen=True)
class Gemm:
    """One (batched) GEMM [m, k] x [k, n] -> [m, n], repeated `batch` times."""

    name: str
    m: int
    n: int
    k: int
    batch: int = 1

    def __post_init__(self):
        if min(self.m, self.n, self.k, self.batch) < 1:
            raise ValueError(f"GEMM {self.name}: dims must be >= 1, got m={self.m} n={self.n} k={self.k} "
                             f"batch={self.batch}")

    @property
    def flops(self) -> float:
        """2 m n k per GEMM (one multiply-add = 2 FLOPs), times batch."""
        return 2.0 * self.batch * self.m * self.n * self.k

    def backward(self) -> tuple["Gemm", "Gemm"]:
        """The two backward GEMMs: dX = dY W^T is (m, k, n); dW = X^T dY is (k, n, m)."""
        return (Gemm(self.name + ".dgrad", self.m, self.k, self.n, self.batch),
                Gemm(self.name + ".wgrad", self.k, self.n, self.m, self.batch))


@dataclass(frozen=True)
class PassSeconds:
    """Compute seconds of one microbatch: forward, backward, and the attention-core part of forward."""

    forward: float
    backward: float
    attention_forward: float = 0.0


def gemm_seconds(gemm: Gemm, cluster: Cluster) -> float:
    """overhead + max(compute-bound time, memory-bound time); see the module docstring."""
    moved = cluster.dtype_bytes * gemm.batch * (gemm.m * gemm.k + gemm.k * gemm.n + gemm.m * gemm.n)
    return cluster.kernel_overhead + max(gemm.flops / cluster.gemm_flops, moved / cluster.stream_bandwidth)


def elementwise_seconds(nbytes: float, kernels: int, cluster: Cluster) -> float:
    """`kernels` bandwidth-bound kernels moving `nbytes` in total."""
    return kernels * cluster.kernel_overhead + nbytes / cluster.stream_bandwidth


def expert_split(t: int, ep: int) -> int:
    """How many ways each expert's columns are split: over tp, with or without expert parallelism (fxpar's expert
    tensor parallelism is tp; ep splits the experts themselves)."""
    return t


def layer_gemms(shape: ModelShape, b: int, t: int, ep: int = 1) -> tuple[list[Gemm], list[Gemm]]:
    """Forward GEMMs of one layer on one tensor-parallel rank: (projections, attention core).

    QKV and fc1 are column-parallel (output split by t), proj and fc2 row-parallel (input split by t);
    the attention core runs a/t heads of [s, h/a] x [h/a, s] and [s, s] x [s, h/a]. With experts, fc1 and fc2
    are the router (replicated) and the experts' gate|up and down GEMMs over the k b s rows routed to this rank's
    experts (the mean: with ep ranks each holds E/ep experts and receives k b s of the group's ep k b s rows), each
    expert's columns split over t (`expert_split`).
    """
    s, h, f, a, hd = shape.seq, shape.hidden, shape.ffn_hidden, shape.heads, shape.head_dim
    rows = b * s
    if shape.moe:
        te, fe = expert_split(t, ep), shape.expert_ffn
        mlp = [Gemm("router", rows, shape.experts, h), Gemm("experts_gate_up", rows * shape.top_k, 2 * fe // te, h),
               Gemm("experts_down", rows * shape.top_k, h, fe // te)]
    else:
        mlp = [Gemm("fc1", rows, f // t, h), Gemm("fc2", rows, h, f // t)]
    projections = [Gemm("qkv", rows, 3 * h // t, h), Gemm("proj", rows, h, h // t), *mlp]
    heads = b * a // t
    core = [Gemm("scores", s, s, hd, heads), Gemm("context", s, hd, s, heads)]
    return projections, core


def layer_elementwise_bytes(shape: ModelShape, b: int, t: int, e: int, ep: int = 1) -> tuple[float, float]:
    """Bytes read + written by one layer's forward elementwise kernels: (dense part, attention core part).

    Replicated on every tp rank (no sequence parallelism), [b, s, h] each:
      2 LayerNorms (read + write: 2e), 2 bias+dropout+residual (read 2, write 1, 1-byte mask: 3e + 1).
    Split by t: QKV and context re-layouts (read + write 3 + 1 tensors: 8e), bias+GeLU on [b, s, f] (2e).
    Attention core, [b, a/t, s, s]: scale+mask+softmax (2e), dropout (2e + 1).
    Experts instead of bias+GeLU: the gated activation on [k b s, f_e] split as the experts are (read 2, write 1:
    3e), and the rows gathered in expert order, weighted and summed back per token ([k b s, h]: 4e).
    """
    s, h, f, a = shape.seq, shape.hidden, shape.ffn_hidden, shape.heads
    bsh = b * s * h
    replicated = (2 * 2 * e + 2 * (3 * e + 1)) * bsh
    split = (8 * e * bsh + 2 * e * b * s * f) / t
    if shape.moe:
        k = shape.top_k
        split = 8 * e * bsh / t + 3 * e * k * b * s * shape.expert_ffn / expert_split(t, ep)
        replicated += 4 * e * k * bsh
    attention = (4 * e + 1) * b * a * s * s / t
    return replicated + split, attention


ELEMENTWISE_KERNELS_DENSE = 7  # LN1, QKV re-layout, context re-layout, bias-dropout-add x2, LN2, bias+GeLU
ELEMENTWISE_KERNELS_ATTENTION = 2  # fused scale-mask-softmax, dropout


def layer_seconds(shape: ModelShape, b: int, t: int, cluster: Cluster, ep: int = 1) -> PassSeconds:
    """Compute time of one layer, one microbatch, one tp rank (communication excluded).

    Backward = dgrad + wgrad GEMMs of every forward GEMM, and twice the forward elementwise traffic
    (read the saved input and the incoming gradient, write the outgoing gradient).
    """
    projections, core = layer_gemms(shape, b, t, ep)
    dense_bytes, attention_bytes = layer_elementwise_bytes(shape, b, t, cluster.dtype_bytes, ep)
    dense_ew = elementwise_seconds(dense_bytes, ELEMENTWISE_KERNELS_DENSE, cluster)
    attention_ew = elementwise_seconds(attention_bytes, ELEMENTWISE_KERNELS_ATTENTION, cluster)
    attention = sum(gemm_seconds(g, cluster) for g in core) + attention_ew
    forward = sum(gemm_seconds(g, cluster) for g in projections) + dense_ew + attention
    backward = sum(gemm_seconds(bg, cluster) for g in projections + core for bg in g.backward())
    backward += 2 * (dense_ew + attention_ew)
    return PassSeconds(forward, backward, attention)


def head_seconds(shape: ModelShape, b: int, t: int, cluster: Cluster) -> PassSeconds:
    """Compute time of the final LayerNorm, the vocab-parallel LM head and the cross-entropy.

    Logits [b s, V/t] in the compute dtype; the cross-entropy reads them and keeps an fp32 copy
    (forward: read e + write 4 + read 4 bytes per logit); backward: twice that.
    """
    e, s, h, V = cluster.dtype_bytes, shape.seq, shape.hidden, shape.vocab
    logits = Gemm("logits", b * s, -(-V // t), h)
    loss_bytes = 2 * e * b * s * h + (e + 8) * b * s * V / t
    loss = elementwise_seconds(loss_bytes, 3, cluster)
    forward = gemm_seconds(logits, cluster) + loss
    backward = sum(gemm_seconds(g, cluster) for g in logits.backward()) + 2 * loss
    return PassSeconds(forward, backward)
