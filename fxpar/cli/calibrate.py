"""`fxpar calibrate`: measure this machine as one node of `world` fp32 CPU "devices" (processes over gloo).

Every measurement runs in all `world` processes at once, as the ranks of a training step do: a process shares
the cores, the memory bus and the loopback network with its peers, so a rate measured alone would be too high.

  1. peak GEMM rate: fp32 matmul of a few square shapes (the Cluster's peak_flops), and copy bandwidth;
  2. a Pre-LN Transformer layer (causal SDPA, GeLU MLP), forward + backward at a ladder of sizes, whole and as
     one rank's share of a tensor-parallel layer, fitted to the cost model's own layer time
     (fxpar.cost.fit.fit_compute): gemm_efficiency is the fraction of the peak the layer's GEMM mix sustains,
     kernel_overhead the fixed cost of one op (dispatch, autograd, launch);
  3. gloo all-reduce at sizes 1 KiB .. 4 MiB (32 MiB without --quick), back to back, mean time per size
     (a step pays every slow call, not the median one); fitted to the ring formula (fxpar.cost.comm.ring_seconds)
     for latency and bandwidth, on relative error;
  4. synchronization jitter: a 1 KiB all-reduce after 2 ms and after 32 ms of the same GEMMs on every rank;
     the extra wait per second of compute is how far ranks drift apart (cost.cluster: sync_jitter).

The result is a Cluster named "local" with gpus_per_node = world; its memory per device is RAM / world.
"""
from __future__ import annotations

import json
import os
import statistics
import tempfile
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from fxpar.cost.cluster import GIB, Cluster
from fxpar.cost.fit import fit_compute, fit_latency_bandwidth
from fxpar.cost.shape import ModelShape

GEMM_SHAPES = ((512, 512, 512), (1024, 1024, 1024), (2048, 512, 1024))
GEMM_SHAPES_QUICK = ((256, 256, 256), (512, 512, 512))
# (b, s, h, a, t): overhead-bound to throughput-bound, whole layers and one rank's share of a t-way one
LAYER_SIZES = ((1, 16, 32, 2, 1), (2, 64, 64, 4, 1), (2, 128, 128, 8, 1), (4, 128, 256, 8, 1), (4, 128, 512, 8, 1),
               (2, 128, 128, 8, 2), (4, 128, 256, 8, 2), (4, 128, 256, 8, 4))
LAYER_SIZES_QUICK = ((1, 16, 32, 2, 1), (2, 128, 128, 8, 1), (4, 128, 256, 8, 1), (4, 128, 256, 8, 2))
ALLREDUCE_BYTES = tuple(2 ** k for k in range(10, 26, 3))  # 1 KiB .. 32 MiB
ALLREDUCE_BYTES_QUICK = tuple(2 ** k for k in range(10, 23, 3))  # 1 KiB .. 4 MiB
SYNC_SECONDS = (2e-3, 32e-3)  # compute between two all-reduces, for the jitter
MIN_SAMPLE_SECONDS = 2e-3  # a sample repeats a short function until it lasts this long


def median_seconds(fn, reps: int, warmup: int = 2) -> float:
    """Median wall time of fn() over `reps` runs after `warmup` untimed runs."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def interleaved(fns: dict, rounds: int, reduce=statistics.median, before=None, repeat: bool = True) -> dict:
    """{name: seconds per call of fns[name]}, reduced over `rounds` rounds that each time every function once.

    Round-robin, so a slow spell of a shared machine hits every function alike instead of one of them. With
    `repeat`, a short function is repeated within its sample to last MIN_SAMPLE_SECONDS (collectives must not:
    every rank has to call them equally often). `before()` runs untimed before each sample.
    """
    repeats = {}
    for name, fn in fns.items():
        once = median_seconds(fn, 3, warmup=1)
        repeats[name] = max(1, min(100, round(MIN_SAMPLE_SECONDS / max(once, 1e-7)))) if repeat else 1
    samples = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            if before is not None:
                before()
            start = time.perf_counter()
            for _ in range(repeats[name]):
                fn()
            samples[name].append((time.perf_counter() - start) / repeats[name])
    return {name: reduce(times) for name, times in samples.items()}


class Layer(nn.Module):
    """GPT-2's Pre-LN block: x + proj(causal SDPA(qkv(LN x))), then x + fc2(GeLU(fc1(LN x))).

    With tp = t > 1 it is the compute of one rank of a t-way tensor-parallel layer, without the all-reduces:
    a / t heads, qkv and fc1 with 1/t of their outputs, proj and fc2 with 1/t of their inputs.
    """

    def __init__(self, hidden: int, heads: int, tp: int = 1):
        super().__init__()
        self.heads, self.head_dim = heads // tp, hidden // heads
        inner = self.heads * self.head_dim
        self.ln1, self.ln2 = nn.LayerNorm(hidden), nn.LayerNorm(hidden)
        self.qkv, self.proj = nn.Linear(hidden, 3 * inner), nn.Linear(inner, hidden)
        self.fc1, self.fc2 = nn.Linear(hidden, 4 * hidden // tp), nn.Linear(4 * hidden // tp, hidden)

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, s, 3, self.heads, self.head_dim).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, -1)
        x = x + self.proj(y)
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


def layer_step(b: int, s: int, h: int, a: int, t: int = 1):
    """A closure running one forward + backward of Layer(h, a, t) on a [b, s, h] input."""
    torch.manual_seed(0)
    layer, x = Layer(h, a, t), torch.randn(b, s, h, requires_grad=True)

    def step():
        layer(x).sum().backward()

    return step


def measure_compute(quick: bool) -> dict:
    """GEMM peak, copy bandwidth and the layer ladder, timed interleaved (see `interleaved`).

    Returns {"peak_flops": best GEMM rate over the shapes, "memory_bandwidth": bytes/s of a 16 or 64 MiB copy,
    "layers": [[b, s, h, a, t], seconds of one rank's forward + backward]}.
    """
    fns, flops = {}, {}
    for m, n, k in GEMM_SHAPES_QUICK if quick else GEMM_SHAPES:
        x, w = torch.randn(m, k), torch.randn(k, n)
        fns[("gemm", m, n, k)] = lambda x=x, w=w: torch.matmul(x, w)
        flops[("gemm", m, n, k)] = 2.0 * m * n * k
    src = torch.ones((2 ** 22) if quick else (2 ** 24))
    dst = torch.empty_like(src)
    fns["copy"] = lambda: dst.copy_(src)
    sizes = LAYER_SIZES_QUICK if quick else LAYER_SIZES
    for size in sizes:
        fns[size] = layer_step(*size)
    seconds = interleaved(fns, 5 if quick else 15)
    return {"peak_flops": max(f / seconds[name] for name, f in flops.items()),
            "memory_bandwidth": 2.0 * src.numel() * 4 / seconds["copy"],
            "layers": [[list(size), seconds[size]] for size in sizes]}


def measure_comm(quick: bool, group=None) -> dict:
    """gloo all-reduce seconds per size, and the synchronization drift. Means, not medians: a step pays every
    slow call. Returns {"allreduce": [[bytes, seconds]], "sync": [[seconds of compute, seconds of the wait]]}.

    The drift: all ranks run the same GEMMs for SYNC_SECONDS, then all-reduce 1 KiB; how much longer that takes
    after the longer stretch of compute is how far the ranks drift apart (cost.cluster: sync_jitter).
    """
    sizes = ALLREDUCE_BYTES_QUICK if quick else ALLREDUCE_BYTES
    tensors = {n: torch.ones(n // 4) for n in sizes}
    dist.barrier(group)
    seconds = interleaved({n: (lambda x=x: dist.all_reduce(x, group=group)) for n, x in tensors.items()},
                          10 if quick else 40, reduce=statistics.fmean, before=lambda: dist.barrier(group),
                          repeat=False)
    a, b = torch.randn(128, 128), torch.randn(128, 128)
    per_gemm = median_seconds(lambda: torch.matmul(a, b), 20)
    small = torch.ones(256)
    sync = {c: ([], []) for c in SYNC_SECONDS}
    dist.barrier(group)
    for _ in range(10 if quick else 40):
        for c in SYNC_SECONDS:
            start = time.perf_counter()
            for _ in range(max(1, round(c / per_gemm))):
                torch.matmul(a, b)
            mid = time.perf_counter()
            dist.all_reduce(small, group=group)
            sync[c][0].append(mid - start)
            sync[c][1].append(time.perf_counter() - mid)
    return {"allreduce": [[n, seconds[n]] for n in sizes],
            "sync": [[statistics.fmean(busy), statistics.fmean(wait)] for busy, wait in sync.values()]}


def _worker(rank: int, world: int, store_dir: str, quick: bool, threads: int, out: str) -> None:
    """One device: every measurement, at the same time as its peers; rank 0 writes the means over ranks."""
    torch.set_num_threads(threads)
    store = dist.FileStore(os.path.join(store_dir, "store"), world)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=300))
    try:
        dist.barrier()
        mine = measure_compute(quick)
        mine.update(measure_comm(quick))
        every = [None] * world
        dist.all_gather_object(every, mine)
        if rank == 0:
            Path(out).write_text(json.dumps(mean_over_ranks(every)))
    finally:
        dist.destroy_process_group()


def mean_over_ranks(results: list):
    """The element-wise mean of equally shaped nested dicts / lists of numbers."""
    first = results[0]
    if isinstance(first, dict):
        return {k: mean_over_ranks([r[k] for r in results]) for k in first}
    if isinstance(first, list):
        return [mean_over_ranks([r[i] for r in results]) for i in range(len(first))]
    return statistics.fmean(results)


def measure(world: int, threads: int, quick: bool) -> dict:
    """The raw measurements of `world` spawned processes (means over ranks): see _worker."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory(prefix="fxpar-calibrate-") as tmp:
        out = os.path.join(tmp, "result.json")
        mp.spawn(_worker, args=(world, tmp, quick, threads, out), nprocs=world, join=True)
        return json.loads(Path(out).read_text())


def fit(raw: dict, world: int, threads: int, quick: bool) -> tuple[Cluster, float]:
    """(Cluster "local" fitted to the raw measurements, rms relative error of the layer fit).

    A ring all-reduce takes 2(n-1) a + 2(n-1)/n S / B (cost.comm.ring_seconds); fitting seconds = c0 + S / c1
    gives a = c0 / (2(n-1)) and B = c1 2(n-1) / n, so that the cost model's formula reproduces the measurement.
    """
    sizes, allreduce_seconds = zip(*raw["allreduce"])
    intercept, slope_bandwidth = fit_latency_bandwidth(list(sizes), list(allreduce_seconds))
    steps = 2 * (world - 1)
    latency, bandwidth = intercept / steps, slope_bandwidth * steps / world
    (short, short_wait), (long, long_wait) = raw["sync"]
    jitter = max(0.0, (long_wait - short_wait) / (long - short))
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    base = Cluster(name="local", peak_flops=raw["peak_flops"], memory_bytes=ram / world,
                   memory_bandwidth=raw["memory_bandwidth"], gpus_per_node=world, intra_bandwidth=bandwidth,
                   intra_latency=latency, inter_bandwidth=bandwidth, inter_latency=latency, gemm_efficiency=1.0,
                   memory_efficiency=1.0, link_efficiency=1.0, sync_jitter=jitter, reserved_bytes=0.5 * GIB,
                   dtype_bytes=4,
                   description=f"this machine: {world} processes x {threads} thread(s), fp32 on CPU, gloo "
                               f"(measured by fxpar calibrate{' --quick' if quick else ''}, all processes at once)")
    samples = []
    for size, layer_seconds in raw["layers"]:
        b, s, h, a, t = map(round, size)
        samples.append((ModelShape(layers=1, hidden=h, heads=a, seq=s, vocab=1, batch=b), b, t, layer_seconds))
    return fit_compute(samples, base)


def calibrate(world: int = 2, threads: int = 1, quick: bool = False) -> tuple[Cluster, float, dict]:
    """Measure this machine (see the module docstring).

    Returns (cluster, rms relative error of the layer fit, the raw measurements the cluster was fitted to).
    """
    if world < 2:
        raise ValueError(f"--world must be >= 2 (gloo latency and bandwidth need two processes), got {world}")
    raw = measure(world, threads, quick)
    cluster, layer_error = fit(raw, world, threads, quick)
    return cluster, layer_error, raw
