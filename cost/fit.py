"""Fit a measured machine's rates to the cost model's own formulas (used by `fxpar calibrate`).

Measured numbers go in; a Cluster whose formulas reproduce them comes out. Nothing here measures.

  fit_latency_bandwidth  seconds = latency + bytes / bandwidth, least squares on relative error, so that a
                         1 KiB and a 4 MiB message weigh alike (plain least squares lets the largest sizes
                         decide alone, and the small tensor-parallel messages get a wrong latency).
  fit_compute            gemm_efficiency and kernel_overhead such that compute.layer_seconds (forward +
                         backward of one layer on one rank of t) matches measured layer times at a ladder of sizes:
                         efficiency sets the large-size throughput, overhead the fixed cost per kernel.
"""
from __future__ import annotations

import dataclasses
import math

from .cluster import Cluster
from .compute import layer_seconds
from .shape import ModelShape


def fit_latency_bandwidth(sizes: list[float], seconds: list[float]) -> tuple[float, float]:
    """(latency >= 0, bandwidth) minimizing sum(((latency + size / bandwidth) - seconds) / seconds) ** 2.

    Raises ValueError with the data if time does not grow with size (bandwidth undefined).
    """
    if len(sizes) != len(seconds) or len(sizes) < 2:
        raise ValueError(f"need at least 2 (size, seconds) pairs of equal length; got {len(sizes)} and {len(seconds)}")
    if min(seconds) <= 0:
        raise ValueError(f"measured seconds must be > 0, got {seconds}")
    # weighted least squares, weight 1/y^2, of y = c0 + c1 x
    w = [1.0 / y ** 2 for y in seconds]
    sw = sum(w)
    mx = sum(wi * x for wi, x in zip(w, sizes)) / sw
    my = sum(wi * y for wi, y in zip(w, seconds)) / sw
    sxx = sum(wi * (x - mx) ** 2 for wi, x in zip(w, sizes))
    sxy = sum(wi * (x - mx) * (y - my) for wi, x, y in zip(w, sizes, seconds))
    if sxx == 0 or sxy <= 0:
        raise ValueError(f"cannot fit a bandwidth: time does not grow with size ({list(zip(sizes, seconds))})")
    slope = sxy / sxx
    intercept = my - slope * mx
    if intercept < 0:  # refit through the origin: latency 0
        slope = sum(wi * x * y for wi, x, y in zip(w, sizes, seconds)) / sum(wi * x * x for wi, x in zip(w, sizes))
        intercept = 0.0
    return intercept, 1.0 / slope


def _layer_step(shape: ModelShape, b: int, t: int, cluster: Cluster) -> float:
    one = layer_seconds(shape, b, t, cluster)
    return one.forward + one.backward


def fit_compute(samples: list[tuple[ModelShape, int, int, float]], cluster: Cluster,
                efficiencies: int = 200) -> tuple[Cluster, float]:
    """(cluster with fitted gemm_efficiency and kernel_overhead, rms relative error of the fit).

    samples: (shape, microbatch b, tensor-parallel t, measured seconds of one rank's forward + backward of one
    layer, communication excluded).
    For each efficiency on a log grid over (0.01, 1], the overhead has a closed form (the model is linear in
    it: every kernel pays it once); the pair with the least squared relative error wins.
    """
    if len(samples) < 2:
        raise ValueError(f"fit_compute needs >= 2 measured sizes, got {len(samples)}")
    measured = [y for *_, y in samples]
    best = None
    for i in range(efficiencies):
        eff = math.exp(math.log(0.01) * (1 - (i + 1) / efficiencies))
        base_cluster = dataclasses.replace(cluster, gemm_efficiency=eff, kernel_overhead=0.0)
        unit_cluster = dataclasses.replace(base_cluster, kernel_overhead=1.0)
        base = [_layer_step(s, b, t, base_cluster) for s, b, t, _ in samples]
        kernels = [_layer_step(s, b, t, unit_cluster) - z for (s, b, t, _), z in zip(samples, base)]
        num = sum(k * (y - z) / y ** 2 for k, y, z in zip(kernels, measured, base))
        den = sum(k * k / y ** 2 for k, y in zip(kernels, measured))
        overhead = max(0.0, num / den)
        err = sum(((z + overhead * k) / y - 1) ** 2 for k, y, z in zip(kernels, measured, base))
        if best is None or err < best[0]:
            best = (err, eff, overhead)
    err, eff, overhead = best
    fitted = dataclasses.replace(cluster, gemm_efficiency=eff, kernel_overhead=overhead)
    return fitted, math.sqrt(err / len(samples))
