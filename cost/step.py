"""Time per training iteration of a GPT on a cluster, for one (p, t, d, b, v) configuration.

Glossary (PTD-P): t tensor-parallel, p pipeline-parallel, d data-parallel degree; b microbatch;
m = B / (d b) microbatches per pipeline; v chunks per device; e bytes per element.

Rank layout (Megatron's): tensor-parallel ranks are adjacent (inside a node when t <= GPUs per node),
then data-parallel, then pipeline stages, so a pipeline crosses nodes when t d p > GPUs per node; then
every boundary is priced at the inter-node link (the slowest boundary sets the pace).

Iteration time:
  T = (m + (p-1)/v) x T_stage  +  T_dp  +  T_tied  +  T_optimizer  +  T_sync
  T_stage  = one microbatch through the heaviest stage: its layers' forward, backward and recomputation,
             their tensor-parallel all-reduces (and, with expert parallelism, each MoE layer's four all-to-alls:
             dispatch and combine, forward and backward), the LM head on the last stage, and 2 v pipeline sends.
Expert parallelism (ep ranks among the d, adjacent as Megatron-Core places them): each rank holds E/ep of every
layer's experts (each split over t as without ep: fxpar's expert tensor parallelism is t), and reduces their
gradients over the d/ep ranks that hold the same experts; the rest of the model over all d.
Overlap assumptions (Megatron-LM as of PTD-P, 2021):
  - tensor-parallel all-reduces block the compute that needs their result: no overlap;
  - pipeline sends and receives are blocking (batched isend/irecv): on the critical path, no overlap;
  - the data-parallel gradient all-reduce runs after the pipeline flush: no overlap with backward;
  - the tied-embedding gradient all-reduce (first <-> last stage) and the optimizer step follow it;
  - the bubble (p-1)/v x T_stage is idle time; stages are taken as equal to the heaviest one.
Synchronization assumption: between two collectives (or a send and its receive) the ranks compute the same
amount of work C and drift apart by sync_jitter x C; the collective waits for the last one. Summed over the
step that is T_sync = sync_jitter x (the rank's compute, m x stage compute), whatever the number of collectives,
and 0 on one device. sync_jitter is 0 on the GPU clusters and measured by `fxpar calibrate` on a shared CPU.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from .cluster import Cluster
from .comm import (allreduce_seconds, alltoall_seconds, ep_dispatch_elements, p2p_seconds, pp_boundary_elements,
                   ring_seconds)
from .compute import head_seconds, layer_seconds
from .flops import check_recompute, expert_parameters, flops_per_iteration
from .memory import (PRECISIONS, MemoryBreakdown, default_precision, memory_per_gpu, stage_parameters,
                     state_bytes_per_param)
from .bubble import bubble_fraction, check_schedule, default_schedule, split_layers
from .shape import ModelShape



def nearby_divisors(n: int, around: int, count: int = 2) -> list[int]:
    """The `count` divisors of n closest to `around` (ties: the smaller first), sorted."""
    divisors = [d for d in range(1, n + 1) if n % d == 0 and d != around]
    return sorted(sorted(divisors, key=lambda d: (abs(d - around), d))[:count])


@dataclass(frozen=True)
class ParallelConfig:
    """One point (t, p, d, b, v) of the search space, plus the recomputation mode and schedule.

    schedule "" means 1f1b for v = 1 and interleaved-1f1b for v > 1. precision (one of memory.PRECISIONS, ""
    for the cluster's default), zero (1: the distributed optimizer) and vocab_parallel_loss change the memory of
    the model states and the logits (cost/memory.py) and the optimizer step's time; with zero=1 the gradients
    are reduce-scattered and the parameters all-gathered, the bytes and ring steps of the all-reduce they replace.
    """

    tp: int
    pp: int = 1
    dp: int = 1
    microbatch: int = 1
    vpp: int = 1
    recompute: str = "full"
    schedule: str = ""
    scatter_gather: bool = True
    precision: str = ""
    zero: int = 0
    vocab_parallel_loss: bool = True
    sequence_parallel: bool = False  # activations between regions on 1/t of the tokens; the same bytes on the wire
    ep: int = 1  # expert-parallel ranks among the dp ones (a mixture of experts)

    def __post_init__(self):
        if self.precision and self.precision not in PRECISIONS:
            raise ValueError(f"ParallelConfig.precision must be one of {PRECISIONS} or '', got {self.precision!r}")
        if self.zero not in (0, 1):
            raise ValueError(f"ParallelConfig.zero must be 0 or 1, got {self.zero!r}")
        for name in ("tp", "pp", "dp", "microbatch", "vpp", "ep"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"ParallelConfig.{name} must be a positive int, got {value!r}")
        check_recompute(self.recompute)
        if not self.schedule:
            object.__setattr__(self, "schedule", default_schedule(self.vpp))
        if self.vpp > 1 and self.pp == 1:
            raise ValueError(f"vpp={self.vpp} needs pipeline parallelism (pp > 1); use vpp=1 with pp=1")
        if self.dp % self.ep:
            raise ValueError(f"ep={self.ep} must divide dp={self.dp}: the experts' ranks are drawn from the dp ones")

    @property
    def gpus(self) -> int:
        """t p d."""
        return self.tp * self.pp * self.dp

    def describe(self) -> str:
        """'t=8 p=16 d=15 b=1 v=3 interleaved-1f1b recompute=full'."""
        return (f"t={self.tp} p={self.pp} d={self.dp} b={self.microbatch} v={self.vpp} {self.schedule} "
                f"recompute={self.recompute}" + (" zero=1" if self.zero else "")
                + (" sequence-parallel" if self.sequence_parallel else "") + (f" ep={self.ep}" if self.ep > 1 else ""))


def check_config(shape: ModelShape, config: ParallelConfig) -> int:
    """Raise ValueError (constraint, numbers, nearby valid value) unless `config` fits `shape`; return m."""
    t, p, d, b, v = config.tp, config.pp, config.dp, config.microbatch, config.vpp
    if shape.heads % t:
        near = ", ".join(map(str, nearby_divisors(shape.heads, t)))
        raise ValueError(f"--tp {t}: heads {shape.heads} not divisible by {t}; nearby valid: {near}")
    if shape.ffn_hidden % t:
        near = ", ".join(map(str, nearby_divisors(shape.ffn_hidden, t)))
        raise ValueError(f"--tp {t}: ffn hidden {shape.ffn_hidden} not divisible by {t}; nearby valid: {near}")
    if config.ep > 1 and (not shape.moe or shape.experts % config.ep):
        why = "the model has no experts" if not shape.moe else f"experts {shape.experts} not divisible by {config.ep}"
        raise ValueError(f"--ep {config.ep}: {why}; nearby valid: --ep 1"
                         + (f" or one dividing both {shape.experts} and dp {d}" if shape.moe else ""))
    if shape.layers < p * v:
        raise ValueError(f"--pp {p} --vpp {v}: layers {shape.layers} < pp*vpp = {p * v}; nearby valid: "
                         f"vpp <= {max(1, shape.layers // p)} or pp <= {shape.layers // v}")
    if shape.batch % (d * b):
        per_pipeline = shape.batch // d if shape.batch % d == 0 else 0
        hint = (f"microbatch in {nearby_divisors(per_pipeline, b)}" if per_pipeline
                else f"dp dividing {shape.batch}, e.g. {', '.join(map(str, nearby_divisors(shape.batch, d)))}")
        raise ValueError(f"--batch {shape.batch} not divisible by dp*microbatch = {d}*{b} = {d * b}; "
                         f"nearby valid: {hint}")
    m = shape.batch // (d * b)
    check_schedule(config.schedule, p, m, v)
    return m


@dataclass(frozen=True)
class StepEstimate:
    """Predicted iteration of one configuration. `parts` splits `seconds` into its terms."""

    shape: ModelShape
    config: ParallelConfig
    cluster: str
    seconds: float
    flops: float
    peak_flops: float
    memory: MemoryBreakdown
    memory_capacity: float
    microbatches: int
    bubble: float
    stage_layers: tuple[int, ...]
    parts: dict = field(default_factory=dict, compare=False)
    precision: str = ""  # the one memory was counted with (the config's, or the cluster's default)

    @property
    def tflops_per_gpu(self) -> float:
        """Eq. 3 FLOPs (with the recomputation actually done) / (seconds x GPUs), in TFLOP/s."""
        return self.flops / (self.seconds * self.config.gpus) / 1e12

    @property
    def percent_of_peak(self) -> float:
        """tflops_per_gpu as a percentage of the device's peak."""
        return 100.0 * self.tflops_per_gpu * 1e12 / self.peak_flops

    @property
    def fits(self) -> bool:
        """Whether the most loaded GPU's memory fits the device."""
        return self.memory.total <= self.memory_capacity

    def as_dict(self) -> dict:
        """The JSON object `fxpar plan --json` prints."""
        c = self.config
        return {"tp": c.tp, "pp": c.pp, "dp": c.dp, "microbatch": c.microbatch, "vpp": c.vpp,
                "schedule": c.schedule, "recompute": c.recompute, "scatter_gather": c.scatter_gather,
                "precision": self.precision, "zero": c.zero, "vocab_parallel_loss": c.vocab_parallel_loss,
                "sequence_parallel": c.sequence_parallel, "ep": c.ep,
                "gpus": c.gpus, "cluster": self.cluster, "microbatches": self.microbatches,
                "tflops_per_gpu": self.tflops_per_gpu, "percent_of_peak": self.percent_of_peak,
                "seconds_per_iteration": self.seconds, "memory_gib_per_gpu": self.memory.gib,
                "memory_gib_capacity": self.memory_capacity / 2 ** 30, "bubble_fraction": self.bubble,
                "stage_layers": list(self.stage_layers), "parts_seconds": dict(self.parts)}


def _placement(config: ParallelConfig, gpn: int) -> tuple[int, int, bool]:
    """(tp ranks per node, dp ranks per node, pipeline crosses nodes) for Megatron's rank order."""
    t, d, p = config.tp, config.dp, config.pp
    tp_per_node = min(t, gpn)
    dp_per_node = 1
    if t * d <= gpn and gpn % (t * d) == 0:
        dp_per_node = d  # the whole data-parallel group sits in one node
    elif t < gpn:
        dp_per_node = max(g for g in range(1, min(d, gpn // t) + 1) if d % g == 0 and (gpn // t) % g == 0)
    return tp_per_node, dp_per_node, t * d * p > gpn


def optimizer_seconds(params: float, cluster: Cluster, precision: str = "", zero: int = 0, d: int = 1) -> float:
    """Adam step on one GPU's `params` parameters: bandwidth-bound, every state read and written once."""
    per_param = state_bytes_per_param(precision or default_precision(cluster.dtype_bytes), zero, d)
    return params * 2 * per_param / cluster.stream_bandwidth


def stage_microbatch_seconds(shape: ModelShape, config: ParallelConfig, cluster: Cluster) -> dict:
    """Per-microbatch seconds of one layer and of the head, split into compute and tensor-parallel comm."""
    t, b, e, ep = config.tp, config.microbatch, cluster.dtype_bytes, config.ep
    tp_per_node = min(t, cluster.gpus_per_node)
    tp_allreduce = allreduce_seconds(b * shape.seq * shape.hidden * e, t, tp_per_node, cluster)
    layer, head = layer_seconds(shape, b, t, cluster, ep), head_seconds(shape, b, t, cluster)
    dispatch = ep_dispatch_elements(b, shape.seq, shape.hidden, shape.top_k, ep) * e if shape.moe else 0.0
    layer_ep = 4 * alltoall_seconds(dispatch / 4, ep, t * ep > cluster.gpus_per_node, cluster)
    recompute = {"none": 0.0, "selective": layer.attention_forward, "full": layer.forward}[config.recompute]
    allreduces = 6 if config.recompute == "full" else 4  # see comm.tp_allreduce_elements
    return {"layer_compute": layer.forward + layer.backward + recompute,
            "layer_tp": allreduces * tp_allreduce + layer_ep,
            "head_compute": head.forward + head.backward,
            "head_tp": 2 * tp_allreduce}  # vocab-parallel embedding (forward), LM head input grad (backward)


def estimate(shape: ModelShape, config: ParallelConfig, cluster: Cluster, cache: dict | None = None) -> StepEstimate:
    """Predict one iteration; raises ValueError for a configuration that does not fit the shape.

    Memory is reported, not enforced: check `StepEstimate.fits`. `cache` (a dict the caller owns, e.g. the
    planner over one search) memoizes the per-microbatch layer times, which depend only on (t, b, recompute).
    """
    m = check_config(shape, config)
    t, p, d, b, v, e = config.tp, config.pp, config.dp, config.microbatch, config.vpp, cluster.dtype_bytes
    _, dp_per_node, pipeline_inter = _placement(config, cluster.gpus_per_node)
    key = (shape, cluster, t, b, config.recompute, config.ep)
    if cache is None or key not in cache:
        mb = stage_microbatch_seconds(shape, config, cluster)
        if cache is not None:
            cache[key] = mb
    else:
        mb = cache[key]
    layer_total = mb["layer_compute"] + mb["layer_tp"]
    head_total = mb["head_compute"] + mb["head_tp"]
    stages = split_layers(shape.layers, p, v, head_total / layer_total)
    heavy = max(range(p), key=lambda i: stages[i] + (head_total / layer_total if i == p - 1 else 0.0))
    with_head = heavy == p - 1
    stage_compute = stages[heavy] * mb["layer_compute"] + (mb["head_compute"] if with_head else 0.0)
    stage_tp = stages[heavy] * mb["layer_tp"] + (mb["head_tp"] if with_head else 0.0)
    p2p = 0.0
    if p > 1:
        sent = pp_boundary_elements(b, shape.seq, shape.hidden, t, config.scatter_gather) * e
        p2p = p2p_seconds(sent, pipeline_inter, cluster)
        if config.scatter_gather and t > 1:
            p2p += ring_seconds(b * shape.seq * shape.hidden * e, t, False, cluster, steps_factor=1)
        p2p *= 2 * v  # v chunks, forward activation and backward gradient
    stage = stage_compute + stage_tp + p2p
    bubble = bubble_fraction(config.schedule, p, m, v)
    params = max(stage_parameters(shape, stages, i, t, config.ep) for i in range(p))
    experts = max(stages) * expert_parameters(shape) / (config.ep * t) if config.ep > 1 else 0.0  # over d/ep
    edp_per_node = math.gcd(d // config.ep, max(1, dp_per_node // config.ep))
    parts = {"compute": m * stage_compute, "tp_comm": m * stage_tp, "p2p": m * p2p,
             "bubble": (p - 1) / v * stage,
             "dp_allreduce": allreduce_seconds((params - experts) * e, d, dp_per_node, cluster)
             + allreduce_seconds(experts * e, d // config.ep, edp_per_node, cluster),
             "tied_embedding": (allreduce_seconds(shape.vocab * shape.hidden / t * e, 2, 1 if pipeline_inter
                                                  else 2, cluster) if p > 1 else 0.0),
             "optimizer": optimizer_seconds(params, cluster, config.precision, config.zero, d),
             "sync_wait": cluster.sync_jitter * m * stage_compute if config.gpus > 1 else 0.0}
    memory = memory_per_gpu(shape, stages, t=t, b=b, m=m, v=v, schedule=config.schedule,
                            recompute=config.recompute, cluster=cluster, precision=config.precision, zero=config.zero,
                            d=d, vocab_parallel_loss=config.vocab_parallel_loss,
                            sequence_parallel=config.sequence_parallel, ep=config.ep)
    return StepEstimate(shape=shape, config=config, cluster=cluster.name, seconds=sum(parts.values()),
                        flops=flops_per_iteration(shape, config.recompute), peak_flops=cluster.peak_flops,
                        memory=memory, memory_capacity=cluster.memory_bytes, microbatches=m, bubble=bubble,
                        stage_layers=stages, parts=parts,
                        precision=config.precision or default_precision(cluster.dtype_bytes))


def predict_step_seconds(shape: ModelShape, tp: int, pp: int, dp: int, microbatch: int, vpp: int = 1, *,
                         cluster: Cluster, recompute: str = "full", schedule: str = "",
                         scatter_gather: bool = True) -> float:
    """Seconds per iteration of `shape` (its `batch` is the global batch B) at (tp, pp, dp, microbatch, vpp)."""
    config = ParallelConfig(tp=tp, pp=pp, dp=dp, microbatch=microbatch, vpp=vpp, recompute=recompute,
                            schedule=schedule, scatter_gather=scatter_gather)
    return estimate(shape, config, cluster).seconds
