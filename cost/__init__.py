"""cost: the analytical cost model and planner (pure math; imports nothing from fxpar or passes)."""
from .cluster import Cluster, builtin_clusters, get_cluster, load_cluster, save_cluster
from .flops import flops_per_iteration, parameters, training_days
from .pipeline import bubble_fraction
from .planner import PlanResult, SearchSpace, plan
from .shape import ModelShape
from .step import ParallelConfig, StepEstimate, estimate, predict_step_seconds

__all__ = ["Cluster", "ModelShape", "ParallelConfig", "PlanResult", "SearchSpace", "StepEstimate",
           "bubble_fraction", "builtin_clusters", "estimate", "flops_per_iteration", "get_cluster",
           "load_cluster", "parameters", "plan", "predict_step_seconds", "save_cluster", "training_days"]
