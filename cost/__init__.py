"""cost: the analytical cost model and planner (pure math; imports nothing from fxpar or passes).

    shape.py      a GPT's shape (l, h, a, s, V, ...)
    flops.py      FLOPs per iteration (the PTD-P formula), parameters, training days, recompute modes
    memory.py     bytes per GPU: weights, optimizer state, activations per schedule and recompute mode
    comm.py       the bytes and times of each collective and point-to-point transfer
    compute.py    GEMM and step compute times from a cluster's achieved rates
    bubble.py     pipeline schedules in closed form: bubble, microbatches in flight, layers per stage
    cluster.py    clusters as data (links, rates), built in or measured by `fxpar calibrate`
    fit.py        fitting a cluster's rates to measured steps
    step.py       one training step's time for a (p, t, d, b, v) configuration
    planner.py    the search over (p, t, d, b, v) under a memory limit
"""
from .bubble import bubble_fraction
from .cluster import Cluster, builtin_clusters, get_cluster, load_cluster, save_cluster
from .flops import flops_per_iteration, parameters, training_days
from .planner import PlanResult, SearchSpace, plan
from .shape import ModelShape
from .step import ParallelConfig, StepEstimate, estimate, predict_step_seconds

__all__ = ["Cluster", "ModelShape", "ParallelConfig", "PlanResult", "SearchSpace", "StepEstimate",
           "bubble_fraction", "builtin_clusters", "estimate", "flops_per_iteration", "get_cluster",
           "load_cluster", "parameters", "plan", "predict_step_seconds", "save_cluster", "training_days"]
