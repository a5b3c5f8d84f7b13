"""Clusters as data: per-device peak rates, memory, and the links inside and between nodes.

Glossary:
  peak FLOP/s        dense tensor-core rate in the training dtype (fp16/bf16; fp32 for the local CPU)
  gemm efficiency    fraction of peak a large, well-shaped GEMM sustains (cuBLAS on real clocks)
  memory bandwidth   HBM bytes/s per device; elementwise kernels stream at `memory_efficiency` of it
  intra / inter      links inside a node (NVLink/NVSwitch) / between nodes (InfiniBand), in bytes/s per
                     device per direction, with a latency per message step. The inter-node figure is the
                     node's total NIC bandwidth divided by its devices: every device talks at once.
  link efficiency    fraction of link bandwidth NCCL collectives reach (bus bandwidth / link bandwidth)
  kernel overhead    fixed seconds per kernel: launch gap plus ramp-up and the partly idle last wave
  sync jitter        ranks that compute the same work drift apart by this fraction of it (OS noise, clock
                     and scheduling differences); a collective waits out the drift (see step.py)

Spec numbers are the vendors' published figures. The efficiencies are one set of assumptions shared by
every GPU cluster [Note: one calibration]:
  gemm_efficiency 0.7    sustained fraction of peak over Megatron's GEMM mix on power-capped GPUs. Best-case
                         microbenchmark shapes reach 0.8-0.86 on A100; 0.7 was set once, for PTD-P Table 1 as
                         a whole (the same number for every row and every cluster), never per row.
  memory_efficiency 0.8  streaming kernels reach about 80% of HBM bandwidth
  link_efficiency 0.8    NCCL bus bandwidth is about 80% of NVLink / InfiniBand link bandwidth
  kernel_overhead 5 us   launch gap plus ramp-up and tail of each kernel
  sync_jitter 0          GPUs of one job run in lockstep; the papers' numbers show no straggler term
`fxpar calibrate` writes a "local" cluster whose rates are measured: memory and link efficiencies are 1, the
GEMM efficiency and kernel overhead are fitted to a Transformer layer's measured time (cost.fit), and sync_jitter
is measured.
"""
from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from pathlib import Path

GIB = 1024 ** 3
DEFAULT_LOCAL_PATH = Path("~/.cache/fxpar/local.json")


@dataclass(frozen=True)
class Cluster:
    """One homogeneous cluster: nodes of `gpus_per_node` identical devices. Rates in SI units (s, bytes)."""

    name: str
    peak_flops: float
    memory_bytes: float
    memory_bandwidth: float
    gpus_per_node: int
    intra_bandwidth: float
    intra_latency: float
    inter_bandwidth: float
    inter_latency: float
    gemm_efficiency: float = 0.7
    memory_efficiency: float = 0.8
    link_efficiency: float = 0.8
    kernel_overhead: float = 5e-6
    sync_jitter: float = 0.0
    reserved_bytes: float = 2 * GIB
    dtype_bytes: int = 2
    description: str = ""

    def __post_init__(self):
        positive = ("peak_flops", "memory_bytes", "memory_bandwidth", "intra_bandwidth", "inter_bandwidth")
        for name in positive:
            if not getattr(self, name) > 0:
                raise ValueError(f"Cluster {self.name!r}: {name} must be > 0, got {getattr(self, name)!r}")
        for name in ("intra_latency", "inter_latency", "kernel_overhead", "sync_jitter", "reserved_bytes"):
            if getattr(self, name) < 0:
                raise ValueError(f"Cluster {self.name!r}: {name} must be >= 0, got {getattr(self, name)!r}")
        for name in ("gemm_efficiency", "memory_efficiency", "link_efficiency"):
            if not 0 < getattr(self, name) <= 1:
                raise ValueError(f"Cluster {self.name!r}: {name} must be in (0, 1], got {getattr(self, name)!r}")
        if not isinstance(self.gpus_per_node, int) or self.gpus_per_node < 1:
            raise ValueError(f"Cluster {self.name!r}: gpus_per_node must be a positive int, "
                             f"got {self.gpus_per_node!r}")
        if self.dtype_bytes not in (1, 2, 4, 8):
            raise ValueError(f"Cluster {self.name!r}: dtype_bytes must be 1, 2, 4 or 8, got {self.dtype_bytes!r}")

    @property
    def gemm_flops(self) -> float:
        """Sustained FLOP/s of a large GEMM: peak x gemm_efficiency."""
        return self.peak_flops * self.gemm_efficiency

    @property
    def stream_bandwidth(self) -> float:
        """Sustained bytes/s of an elementwise kernel: memory_bandwidth x memory_efficiency."""
        return self.memory_bandwidth * self.memory_efficiency

    def link(self, inter_node: bool) -> tuple[float, float]:
        """(latency seconds, achievable bytes/s per device) of the intra- or inter-node link."""
        if inter_node:
            return self.inter_latency, self.inter_bandwidth * self.link_efficiency
        return self.intra_latency, self.intra_bandwidth * self.link_efficiency

    def to_dict(self) -> dict:
        """Plain JSON-able dict (the format `fxpar calibrate` writes)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "Cluster":
        """Build from `to_dict` output; unknown keys are an error that names them."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown cluster keys {unknown}; known keys: {sorted(known)}")
        return cls(**data)


def builtin_clusters() -> dict[str, Cluster]:
    """The clusters of the papers, plus an H100 DGX. Keys are the names `--cluster` accepts."""
    selene = Cluster(
        name="selene", peak_flops=312e12, memory_bytes=80 * GIB, memory_bandwidth=2039e9, gpus_per_node=8,
        intra_bandwidth=300e9, intra_latency=3e-6, inter_bandwidth=200e9 / 8, inter_latency=6e-6,
        description="Selene: DGX A100 80GB, 8 GPUs/node, NVLink3 600 GB/s (300 per direction), "
                    "8x 200 Gb/s HDR InfiniBand per node, 312 TFLOP/s fp16")
    dgx2h = Cluster(
        name="dgx2h", peak_flops=125e12, memory_bytes=32 * GIB, memory_bandwidth=900e9, gpus_per_node=16,
        intra_bandwidth=150e9, intra_latency=3e-6, inter_bandwidth=100e9 / 16, inter_latency=6e-6,
        description="DGX-2H V100 32GB, 16 GPUs/node, NVSwitch 300 GB/s (150 per direction), "
                    "8x 100 Gb/s InfiniBand per node, 125 TFLOP/s fp16")
    h100 = Cluster(
        name="h100", peak_flops=989e12, memory_bytes=80 * GIB, memory_bandwidth=3350e9, gpus_per_node=8,
        intra_bandwidth=450e9, intra_latency=3e-6, inter_bandwidth=400e9 / 8, inter_latency=6e-6,
        description="DGX H100 80GB, 8 GPUs/node, NVLink4 900 GB/s (450 per direction), "
                    "8x 400 Gb/s NDR InfiniBand per node, 989 TFLOP/s bf16 dense")
    return {c.name: c for c in (selene, dgx2h, h100)}


ALIASES = {"a100": "selene", "dgx-a100": "selene", "v100": "dgx2h", "dgx-2h": "dgx2h", "h100-dgx": "h100"}


def load_cluster(path: str | os.PathLike) -> Cluster:
    """Read a cluster JSON file (as written by `fxpar calibrate`)."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise ValueError(f"cluster file {path} does not exist; run `fxpar calibrate --out {path}` first")
    return Cluster.from_dict(json.loads(path.read_text()))


def save_cluster(cluster: Cluster, path: str | os.PathLike) -> Path:
    """Write `cluster` as JSON, creating parent folders; returns the path written."""
    path = Path(path).expanduser()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(cluster.to_dict(), indent=2) + "\n")
    return path


def get_cluster(name_or_path: str) -> Cluster:
    """A built-in cluster by name or alias, "local" (~/.cache/fxpar/local.json), or a path to a JSON file."""
    builtins = builtin_clusters()
    key = ALIASES.get(name_or_path.lower(), name_or_path.lower())
    if key in builtins:
        return builtins[key]
    if key == "local":
        return load_cluster(DEFAULT_LOCAL_PATH)
    if name_or_path.endswith(".json") or Path(name_or_path).expanduser().is_file():
        return load_cluster(name_or_path)
    choices = sorted(builtins) + sorted(ALIASES) + ["local", "PATH.json"]
    raise ValueError(f"unknown cluster {name_or_path!r}; choose one of: {', '.join(choices)}")
