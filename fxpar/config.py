"""fxpar.Config: the options of parallelize() beyond the mesh, validated on construction."""
from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field, fields

import torch

from fxpar.cost.flops import RECOMPUTE_MODES
from fxpar.cost.bubble import SCHEDULES, check_schedule
from fxpar.passes.experts.dispatch import EP_DISPATCHERS
from fxpar.passes.joint.export import OVERLAP_NAMES
from fxpar.mixed_precision import MixedPrecision


def _option(default, help: str):
    """A field with its help text, which `fxpar check`, `fxpar show` and `fxpar plan` print for its flag
    (fxpar/cli/config_flags.py generates the flags from these fields)."""
    return field(default=default, metadata={"help": help})


@dataclass(frozen=True, kw_only=True)
class Config:
    microbatches: int = _option(1, "m: microbatches per pipeline flush")
    virtual_stages: int = _option(1, "v: model chunks per pipeline rank (the interleaved schedule)")
    schedule: str = _option("1f1b", f"the pipeline schedule: {', '.join(SCHEDULES)} (which (p, m, v) each runs: "
                                    "cost.bubble.check_schedule)")
    scatter_gather: bool | str = _option(
        "auto", "send 1/t of each boundary activation and all-gather it on arrival; auto: only where a pipeline link "
                "joins two hosts and tp stays on one (fxpar/mesh.py pipeline_crosses_hosts)")
    fuse: bool = _option(True, "explicit attention -> SDPA, bias+dropout+add, GeLU written out -> aten.gelu "
                               "(passes/fusion/driver.py)")
    sequence_parallel: bool = _option(
        False, "between the regions, norms, dropout and residual adds run on 1/t of the tokens: g -> reduce-scatter, "
               "f -> all-gather along the sequence (passes/sharding/sequence_analysis.py)")
    recompute: str = _option("none", f"{', '.join(RECOMPUTE_MODES)}; selective: attention cores and bias+GeLU "
                                     "recomputed in backward, full: whole layers")
    compile: bool = _option(False, "torch.compile each chunk")
    joint_graph: bool | None = _option(
        None, "each chunk runs as its joint forward+backward program, every collective a graph node (passes/joint/); "
              "none: with compile wherever it applies (not yet with dropout in training; the plan says which), "
              "else off")
    overlap: tuple[str, ...] | None = _option(
        None, "with joint_graph: the overlap passes by name (passes/joint/export.py OVERLAP_NAMES: early_collectives "
              "and late_waits on each program, dp_buckets: the dp reduction in the backward program); none: the "
              "first two")
    trace_dir: str | None = _option(None, "write each rank's Chrome trace (Perfetto) here")
    dump_dir: str | None = _option(None, "write each graph stage's graph, and its diff, here (fxpar/compiler.py)")
    bucket_mb: float = _option(25.0, "data-parallel gradient bucket size, in megabytes")
    seed: int | None = _option(None, "of the random streams (dropout); none: global rank 0's torch.initial_seed()")
    check_replicas_every: int = _option(0, "step() checks that replicated weights are identical every N steps "
                                           "(0: never)")
    zero: int = _option(0, "1: pm.optimizer is Megatron's distributed optimizer over dp (fxpar/runtime/zero.py); "
                           "0: a plain one")
    ep_dispatch: str = _option(
        "alltoall", "with init_mesh(ep=E), how the rows routed to an expert reach the rank that holds it: alltoall "
                    "(counts exchanged, each rank sends only those rows) or allgather (every rank's rows gathered, the "
                    "results reduce-scattered) (passes/experts/dispatch.py)")
    mixed_precision: MixedPrecision | None = _option(
        None, "low-precision compute with fp32 main gradients and parameters (fxpar/mixed_precision.py)")

    def __post_init__(self):
        if not isinstance(self.microbatches, int) or isinstance(self.microbatches, bool) or self.microbatches < 1:
            raise ValueError(f"Config.microbatches must be a positive int, got {self.microbatches!r}")
        if not isinstance(self.virtual_stages, int) or isinstance(self.virtual_stages, bool) or self.virtual_stages < 1:
            raise ValueError(f"Config.virtual_stages must be a positive int, got {self.virtual_stages!r}")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"Config.schedule must be one of {SCHEDULES}, got {self.schedule!r}")
        try:  # what can be told without the mesh (the compiler checks again with the real pp)
            check_schedule(self.schedule, 1, self.microbatches, self.virtual_stages)
        except ValueError as e:
            raise ValueError(f"Config: {e}") from None
        if not isinstance(self.scatter_gather, bool) and self.scatter_gather != "auto":
            raise ValueError(f"Config.scatter_gather must be True, False or 'auto', got {self.scatter_gather!r}")
        if self.recompute not in RECOMPUTE_MODES:
            raise ValueError(f"Config.recompute must be one of {RECOMPUTE_MODES}, got {self.recompute!r}")
        for flag in ("fuse", "sequence_parallel", "compile"):
            if not isinstance(getattr(self, flag), bool):
                raise ValueError(f"Config.{flag} must be True or False, got {getattr(self, flag)!r}")
        if self.joint_graph is not None and not isinstance(self.joint_graph, bool):
            raise ValueError(f"Config.joint_graph must be True, False or None (with compile, where it applies), got "
                             f"{self.joint_graph!r}")
        for folder in ("trace_dir", "dump_dir"):
            if getattr(self, folder) is not None and not isinstance(getattr(self, folder), (str, os.PathLike)):
                raise ValueError(f"Config.{folder} must be a folder path (str) or None, got {getattr(self, folder)!r}")
        object.__setattr__(self, "overlap", tuple(self.overlap) if isinstance(self.overlap, (list, tuple)) else
                           self.overlap)
        known = list(OVERLAP_NAMES)
        if self.overlap is not None and (not isinstance(self.overlap, tuple) or not set(self.overlap) <= set(known)):
            raise ValueError(f"Config.overlap must be None or a tuple of pass names from {known}, got "
                             f"{self.overlap!r}")
        if self.overlap and not (self.joint_graph or (self.joint_graph is None and self.compile)):
            raise ValueError(f"Config.overlap={self.overlap} reorders the joint programs: it needs joint_graph=True")
        if isinstance(self.bucket_mb, bool) or not isinstance(self.bucket_mb, (int, float)) or not self.bucket_mb > 0:
            raise ValueError(f"Config.bucket_mb must be a number > 0 (megabytes), got {self.bucket_mb!r}")
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool)):
            raise ValueError(f"Config.seed must be an int or None, got {self.seed!r}")
        if self.zero not in (0, 1) or isinstance(self.zero, bool):
            raise ValueError(f"Config.zero must be 0 (a plain optimizer) or 1 (optimizer state sharded over dp), got "
                             f"{self.zero!r}")
        if self.ep_dispatch not in EP_DISPATCHERS:
            raise ValueError(f"Config.ep_dispatch must be one of {EP_DISPATCHERS}, got {self.ep_dispatch!r}")
        if self.mixed_precision is not None and not isinstance(self.mixed_precision, MixedPrecision):
            raise ValueError(f"Config.mixed_precision must be an fxpar.MixedPrecision or None, got "
                             f"{self.mixed_precision!r}")
        if not isinstance(self.check_replicas_every, int) or isinstance(self.check_replicas_every, bool) or \
                self.check_replicas_every < 0:
            raise ValueError(f"Config.check_replicas_every must be an int >= 0, got {self.check_replicas_every!r}")

    @classmethod
    def from_dict(cls, d: dict) -> Config:
        """The Config a dict names, as `fxpar plan --json` prints it ("fxpar" -> "config"): its keys are Config's
        fields; mixed_precision is None or a dict of MixedPrecision's fields with dtypes by name ("bfloat16")."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"Config.from_dict: unknown keys {unknown}; the fields are {sorted(known)}")
        d = dict(d)
        mp = d.get("mixed_precision")
        if isinstance(mp, dict):
            d["mixed_precision"] = MixedPrecision(**{k: _dtype(v) if k.endswith("_dtype") else v
                                                     for k, v in mp.items()})
        return cls(**d)

    def to_dict(self) -> dict:
        """The inverse of from_dict: plain values only (JSON-serializable)."""
        out = asdict(self)
        if self.mixed_precision is not None:
            out["mixed_precision"] = {k: str(v).removeprefix("torch.") if isinstance(v, torch.dtype) else v
                                      for k, v in asdict(self.mixed_precision).items()}
        return out


def _dtype(name) -> torch.dtype:
    value = getattr(torch, name, None) if isinstance(name, str) else name
    if not isinstance(value, torch.dtype):
        raise ValueError(f"Config.from_dict: {name!r} is not a torch dtype name (e.g. 'bfloat16', 'float32')")
    return value
