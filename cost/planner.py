"""Planner: enumerate the valid (p, t, d, b, v), predict each, rank by seconds per iteration.

Glossary (PTD-P): t tensor-parallel, p pipeline-parallel, d data-parallel degree, b microbatch,
v chunks per device, m = B / (d b) microbatches per pipeline, l layers, a heads, B global batch.

Rules (a candidate breaking one is rejected, and the reason counted with an example):
  t <= GPUs per node (by default), a % t == 0, t p d = GPUs, l >= p v (fxpar balances uneven layers, so
  l % (p v) == 0 is not required), B % (d b) == 0, interleaving needs m % p == 0, memory fits; with experts,
  ep divides d and E.
Paper rule (PTD-P takeaway 1): when no configuration with t p <= GPUs per node fits in memory, the model
does not fit in one node; then t = GPUs per node and the pipeline spans nodes.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from .cluster import GIB, Cluster
from .flops import RECOMPUTE_MODES, check_recompute
from .step import ParallelConfig, StepEstimate, estimate, nearby_divisors
from .shape import ModelShape

REASONS = {
    "tp_per_node": "tp > max tp (GPUs per node)",
    "heads": "heads % tp != 0",
    "layers": "layers < pp*vpp",
    "batch_dp": "batch % dp != 0",
    "interleave": "interleaved needs microbatches % pp == 0",
    "memory": "out of memory",
    "paper_rule": "paper rule: model needs more than one node, so tp = GPUs per node",
    "experts": "ep must divide dp",
}


def divisors(n: int) -> list[int]:
    """Divisors of n, ascending."""
    return [k for k in range(1, n + 1) if n % k == 0]


@dataclass(frozen=True)
class SearchSpace:
    """What to search. 0 means "search this knob"; a positive value pins it."""

    tp: int = 0
    pp: int = 0
    microbatch: int = 0
    vpp: int = 0
    max_tp: int = 0  # 0: the cluster's GPUs per node
    max_vpp: int = 8
    max_microbatch: int = 64
    recompute: tuple[str, ...] = RECOMPUTE_MODES
    scatter_gather: bool = True
    paper_rule: bool = True
    precision: str = ""  # memory.PRECISIONS, "" for the cluster's default
    zero: tuple[int, ...] = (0,)  # distributed optimizer settings searched (zero=1 only where d > 1)
    sequence_parallel: tuple[bool, ...] = (False,)  # settings searched (True only where t > 1)
    ep: int = 0  # expert-parallel ranks; 0: search them for a model with experts (1 for a dense one)

    def __post_init__(self):
        for name in ("tp", "pp", "microbatch", "vpp", "max_tp", "max_vpp", "max_microbatch", "ep"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 0:
                raise ValueError(f"SearchSpace.{name} must be an int >= 0 (0 = search), got {value!r}")
        if not self.recompute:
            raise ValueError("SearchSpace.recompute needs at least one mode")
        for mode in self.recompute:
            check_recompute(mode)
        if not self.sequence_parallel or any(not isinstance(s, bool) for s in self.sequence_parallel):
            raise ValueError(f"SearchSpace.sequence_parallel must be a non-empty tuple of bools, got "
                             f"{self.sequence_parallel!r}")
        if not self.zero or any(z not in (0, 1) for z in self.zero):
            raise ValueError(f"SearchSpace.zero must be a non-empty tuple of 0 and 1, got {self.zero!r}")
        ParallelConfig(tp=1, precision=self.precision)  # validates the precision


@dataclass(frozen=True)
class PlanResult:
    """Candidates that fit, fastest first, and the rejected ones as {reason: (count, example)}."""

    shape: ModelShape
    gpus: int
    cluster: str
    ranked: tuple[StepEstimate, ...]
    rejected: dict = field(default_factory=dict, compare=False)
    notes: tuple[str, ...] = ()

    @property
    def best(self) -> StepEstimate:
        """The fastest configuration that fits."""
        return self.ranked[0]


def check_pins(shape: ModelShape, gpus: int, space: SearchSpace) -> None:
    """Raise ValueError (constraint, numbers, nearby valid value) for pinned knobs that cannot work."""
    t, p, v = space.tp, space.pp, space.vpp
    if gpus < 1:
        raise ValueError(f"--gpus must be >= 1, got {gpus}")
    if t and shape.heads % t:
        near = ", ".join(map(str, nearby_divisors(shape.heads, t)))
        raise ValueError(f"--tp {t}: heads {shape.heads} not divisible by {t}; nearby valid: {near}")
    if t and gpus % (t * (p or 1)):
        near = ", ".join(map(str, nearby_divisors(gpus // (p or 1) if gpus % (p or 1) == 0 else gpus, t)))
        raise ValueError(f"--tp {t} --pp {p or 1}: gpus {gpus} not divisible by tp*pp = {t * (p or 1)}; "
                         f"nearby valid tp: {near}")
    if p and gpus % p:
        raise ValueError(f"--pp {p}: gpus {gpus} not divisible by {p}; nearby valid: "
                         f"{', '.join(map(str, nearby_divisors(gpus, p)))}")
    if p and shape.layers < p * (v or 1):
        raise ValueError(f"--pp {p} --vpp {v or 1}: layers {shape.layers} < pp*vpp = {p * (v or 1)}; nearby "
                         f"valid: vpp <= {max(1, shape.layers // p)} or pp <= {shape.layers // (v or 1)}")
    if v > 1 and p == 1:
        raise ValueError(f"--vpp {v} needs pipeline parallelism: --pp 1 runs one chunk; use --vpp 1 or --pp >= 2")
    if space.ep > 1 and (not shape.moe or shape.experts % space.ep):
        raise ValueError(f"--ep {space.ep}: " + (f"experts {shape.experts} not divisible by {space.ep}; nearby valid: "
                                                 f"{', '.join(map(str, nearby_divisors(shape.experts, space.ep)))}"
                                                 if shape.moe else "the model has no experts (--experts E)"))


def _eps(shape: ModelShape, d: int, space: SearchSpace) -> list[int]:
    """The ep values to try at d: the pinned one, or every divisor of both d and E."""
    if space.ep:
        return [space.ep]
    return [e for e in divisors(d) if shape.experts % e == 0] if shape.moe else [1]


def _candidates(shape: ModelShape, gpus: int, cluster: Cluster, space: SearchSpace):
    """Yield (reason, config) for every point of the space; reason is None when only memory is left to check."""
    max_tp = space.max_tp or cluster.gpus_per_node
    for t in [space.tp] if space.tp else divisors(gpus):
        if not space.tp and t > max_tp:
            yield "tp_per_node", ParallelConfig(tp=t)
            continue
        if shape.heads % t or shape.ffn_hidden % t:
            yield "heads", ParallelConfig(tp=t)
            continue
        for p in [space.pp] if space.pp else divisors(gpus // t):
            d = gpus // (t * p)
            if shape.layers < p:
                yield "layers", ParallelConfig(tp=t, pp=p, dp=d)
                continue
            if shape.batch % d:
                yield "batch_dp", ParallelConfig(tp=t, pp=p, dp=d)
                continue
            per_pipeline = shape.batch // d
            micro = [space.microbatch] if space.microbatch else [
                b for b in divisors(per_pipeline) if b <= space.max_microbatch]
            for b in micro:
                if per_pipeline % b:
                    yield "batch_dp", ParallelConfig(tp=t, pp=p, dp=d, microbatch=b)
                    continue
                m = per_pipeline // b
                for v in [space.vpp] if space.vpp else (range(1, space.max_vpp + 1) if p > 1 else [1]):
                    base = dict(tp=t, pp=p, dp=d, microbatch=b, vpp=v, scatter_gather=space.scatter_gather,
                                precision=space.precision)
                    if shape.layers < p * v:
                        yield "layers", ParallelConfig(**base)
                    elif v > 1 and m % p:
                        yield "interleave", ParallelConfig(**base)
                    else:
                        for mode in space.recompute:
                            for zero in sorted({z for z in space.zero if z == 0 or d > 1}) or [0]:
                                for sp in sorted({s for s in space.sequence_parallel if not s or t > 1}) or [False]:
                                    for ep in _eps(shape, d, space):
                                        if d % ep:
                                            yield "experts", ParallelConfig(**base)
                                            continue
                                        yield None, ParallelConfig(**base, recompute=mode, zero=zero,
                                                                   sequence_parallel=sp, ep=ep)


def plan(shape: ModelShape, gpus: int, cluster: Cluster, space: SearchSpace = SearchSpace()) -> PlanResult:
    """Search `space` for `shape` (its `batch` is the global batch) on `gpus` GPUs of `cluster`.

    Raises ValueError for pinned knobs that cannot work, and when nothing fits in memory (saying what the
    smallest configuration needs and what a GPU has).
    """
    check_pins(shape, gpus, space)
    rejected: dict[str, list] = {}
    fitting: list[StepEstimate] = []
    smallest: StepEstimate | None = None
    cache: dict = {}

    def reject(reason: str, example: str) -> None:
        entry = rejected.setdefault(REASONS[reason], [0, example])
        entry[0] += 1

    for reason, config in _candidates(shape, gpus, cluster, space):
        if reason:
            reject(reason, config.describe().split(" 1f1b")[0])
            continue
        est = estimate(shape, config, cluster, cache)
        if est.fits:
            fitting.append(est)
            continue
        reject("memory", f"{config.describe()}: {est.memory.gib:.1f} GiB > {cluster.memory_bytes / GIB:.1f} GiB")
        if smallest is None or est.memory.total < smallest.memory.total:
            smallest = est
    if not fitting:
        raise ValueError(_nothing_fits(shape, gpus, cluster, smallest, rejected))
    fitting, notes = _paper_rule(fitting, shape, cluster, space, reject)
    fitting.sort(key=lambda e: (e.seconds, e.memory.total))
    return PlanResult(shape=shape, gpus=gpus, cluster=cluster.name, ranked=tuple(fitting),
                      rejected={k: tuple(v) for k, v in rejected.items()}, notes=notes)


def _paper_rule(fitting, shape, cluster, space, reject):
    """Apply the paper rule (module docstring) unless tp is pinned or the rule is off."""
    gpn = cluster.gpus_per_node
    if not space.paper_rule or space.tp or any(e.config.tp * e.config.pp <= gpn for e in fitting):
        return fitting, ()
    node_tp = max((e.config.tp for e in fitting if e.config.tp <= gpn), default=0)
    if node_tp == 0:
        return fitting, ()
    kept = [e for e in fitting if e.config.tp == node_tp]
    for e in fitting:
        if e.config.tp != node_tp:
            reject("paper_rule", f"{e.config.describe()}: tp {e.config.tp} != {node_tp}")
    note = (f"{shape.describe()} does not fit in one node of {gpn} GPUs, so tp = {node_tp} and the pipeline "
            f"spans nodes (PTD-P takeaway 1; --no-paper-rule to search every tp)")
    return kept, (note,)


def _nothing_fits(shape, gpus, cluster, smallest, rejected) -> str:
    """The error text when no candidate fits."""
    if smallest is None:
        reasons = "; ".join(f"{reason}: {count} (e.g. {example})" for reason, (count, example) in rejected.items())
        return f"no valid configuration of {shape.describe()} on {gpus} GPUs: {reasons}"
    capacity = cluster.memory_bytes / GIB
    usable = cluster.memory_bytes - cluster.reserved_bytes
    model_parallel = smallest.config.tp * smallest.config.pp
    needed = -(-model_parallel * (smallest.memory.total - cluster.reserved_bytes) // usable)
    return (f"{shape.describe()} fits nowhere on {gpus} GPUs of {cluster.name}: the smallest configuration "
            f"({smallest.config.describe()}) needs {smallest.memory.gib:.1f} GiB per GPU, a GPU has "
            f"{capacity:.1f} GiB; the model needs tp*pp of about {int(needed)} GPUs or more")
