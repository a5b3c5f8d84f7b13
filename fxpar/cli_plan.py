"""`fxpar plan` (predict or search (p, t, d, b, v) for a GPT) and `fxpar calibrate` (measure this machine).

    fxpar plan --layers 96 --hidden 12288 --heads 96 --batch 1536 --gpus 1024 --cluster selene
    fxpar plan examples/gpt3_175b.py:factory --batch 1536 --gpus 1024 --tokens 300e9
    fxpar plan ... --tp 8 --pp 16 --json          # estimate that (t, p); b and v chosen unless given
    fxpar calibrate [--out ~/.cache/fxpar/local.json]  # then: fxpar plan ... --cluster local

Glossary: t tensor-, p pipeline-, d data-parallel degree; b microbatch; v chunks per device (interleaved).
The model behind the numbers is in fxpar.cost (module docstrings list every formula and overlap assumption).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

from tabulate import tabulate

from fxpar.cost.cluster import DEFAULT_LOCAL_PATH, GIB, Cluster, fit_latency_bandwidth, get_cluster
from fxpar.cost.flops import RECOMPUTE_MODES, flops_per_iteration, parameters, training_days
from fxpar.cost.planner import PlanResult, SearchSpace, plan
from fxpar.cost.shape import ModelShape

SHAPE_FLAGS = ("layers", "hidden", "heads", "seq", "vocab", "ffn")
PAPER_DEFAULTS = {"seq": 2048, "vocab": 51200}


def add_parser(subparsers) -> None:
    """Register `plan` and `calibrate` on the `fxpar` subparsers."""
    p = subparsers.add_parser("plan", help="predict or search the (p, t, d, b, v) of a GPT on a cluster",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("target", nargs="?", help="path/file.py:factory or module:factory, traced on the meta device")
    for flag in SHAPE_FLAGS:
        p.add_argument(f"--{flag}", type=int, help=f"model {flag} (overrides the traced value)")
    p.add_argument("--batch", type=int, required=True, help="global batch B, in sequences")
    p.add_argument("--gpus", type=int, required=True, help="number of GPUs n = t p d")
    p.add_argument("--cluster", default="selene", help="selene | dgx2h | h100 | local | PATH.json")
    for flag, what in (("tp", "tensor-parallel t"), ("pp", "pipeline-parallel p"),
                       ("microbatch", "microbatch b"), ("vpp", "chunks per device v")):
        p.add_argument(f"--{flag}", type=int, default=0, help=f"pin {what} (default: search)")
    p.add_argument("--recompute", choices=("auto",) + RECOMPUTE_MODES, default="auto",
                   help="activation recomputation (auto: search all)")
    p.add_argument("--max-tp", type=int, default=0, help="largest t searched (default: GPUs per node)")
    p.add_argument("--no-scatter-gather", action="store_true", help="pipeline sends the full b s h")
    p.add_argument("--no-paper-rule", action="store_true", help="do not force t = GPUs per node for big models")
    p.add_argument("--tokens", type=float, help="training tokens: add the Eq. 4 training-time estimate")
    p.add_argument("--top", type=int, default=10, help="rows of the table (default 10)")
    p.add_argument("--json", action="store_true", help="print the best configuration as one JSON object")
    p.set_defaults(func=run_plan)

    c = subparsers.add_parser("calibrate", help="measure this machine's GEMM rate and gloo latency/bandwidth")
    c.add_argument("--out", default=str(DEFAULT_LOCAL_PATH), help=f"JSON to write (default {DEFAULT_LOCAL_PATH})")
    c.add_argument("--world", type=int, default=2, help="processes (devices) per node (default 2)")
    c.add_argument("--threads", type=int, default=1, help="torch threads per process (default 1)")
    c.add_argument("--quick", action="store_true", help="fewer sizes and repeats (for tests)")
    c.set_defaults(func=run_calibrate)


def build_shape(args) -> ModelShape:
    """ModelShape from TARGET (traced on meta) and/or the shape flags; flags win."""
    values = {}
    if args.target:
        from fxpar.plan_target import shape_from_target  # imports torch.export only when needed
        traced = shape_from_target(args.target, args.batch)
        values = {"layers": traced.layers, "hidden": traced.hidden, "heads": traced.heads, "seq": traced.seq,
                  "vocab": traced.vocab, "ffn": traced.ffn_hidden}
    for flag in SHAPE_FLAGS:
        if getattr(args, flag) is not None:
            values[flag] = getattr(args, flag)
    missing = [f"--{flag}" for flag in ("layers", "hidden", "heads") if flag not in values]
    if missing:
        raise ValueError(f"give a TARGET or {', '.join(missing)} (--seq and --vocab default to 2048 and 51200)")
    for flag, default in PAPER_DEFAULTS.items():
        values.setdefault(flag, default)
    return ModelShape(layers=values["layers"], hidden=values["hidden"], heads=values["heads"], seq=values["seq"],
                      vocab=values["vocab"], batch=args.batch, ffn_hidden=values.get("ffn") or 0)


def run_plan(args) -> int:
    """Handler of `fxpar plan`: 0 on success, 2 with a one-line error on bad input."""
    try:
        shape = build_shape(args)
        cluster = get_cluster(args.cluster)
        space = SearchSpace(tp=args.tp, pp=args.pp, microbatch=args.microbatch, vpp=args.vpp,
                            max_tp=args.max_tp, scatter_gather=not args.no_scatter_gather,
                            recompute=RECOMPUTE_MODES if args.recompute == "auto" else (args.recompute,),
                            paper_rule=not args.no_paper_rule)
        result = plan(shape, args.gpus, cluster, space)
    except ValueError as e:
        print(f"fxpar plan: error: {e}", file=sys.stderr)
        return 2
    days = None
    if args.tokens:
        days = training_days(args.tokens, parameters(shape), args.gpus, eq4_flops_per_gpu(result))
    if args.json:
        print(json.dumps(plan_json(result, days)))
    else:
        print(format_plan(result, args.top, args.tokens, days))
    return 0


def eq4_flops_per_gpu(result: PlanResult) -> float:
    """X for Eq. 4. Its 8 T P counts 4 passes (full recomputation), so X is Eq. 3's full-recomputation FLOPs
    over the predicted iteration time, whatever recomputation the plan does: then 8 T P / (n X) is close to
    (T / (B s)) iterations x seconds per iteration (Eq. 4 drops the attention and logit terms)."""
    best = result.best
    return flops_per_iteration(result.shape, "full") / (best.seconds * best.config.gpus)


def plan_json(result: PlanResult, days: float | None) -> dict:
    """The best estimate's dict plus the shape, parameter count, candidate counts and Eq. 4 days."""
    out = result.best.as_dict()
    shape = result.shape
    out.update(layers=shape.layers, hidden=shape.hidden, heads=shape.heads, seq=shape.seq, vocab=shape.vocab,
               batch=shape.batch, ffn_hidden=shape.ffn_hidden, params=parameters(shape),
               candidates=len(result.ranked), rejected={k: v[0] for k, v in result.rejected.items()})
    if days is not None:
        out["training_days"] = days
    return out


def format_plan(result: PlanResult, top: int, tokens: float | None, days: float | None) -> str:
    """Header, the table of the `top` fastest configurations, notes, rejection counts, Eq. 4 estimate."""
    shape = result.shape
    params = parameters(shape)
    size = f"{params / 1e9:.2f}B" if params >= 1e9 else f"{params / 1e6:.2f}M"
    lines = [f"{shape.describe()}  P={size}  on {result.gpus} GPUs of {result.cluster}"]
    rows = [[e.config.tp, e.config.pp, e.config.dp, e.config.microbatch, e.config.vpp, e.config.schedule,
             e.config.recompute, f"{e.seconds:.4g}", f"{e.tflops_per_gpu:.4g}", f"{e.percent_of_peak:.1f}",
             f"{e.memory.gib:.1f}", f"{e.bubble:.3f}"] for e in result.ranked[:top]]
    headers = ["t", "p", "d", "b", "v", "schedule", "recompute", "s/iter", "TFLOP/s/GPU", "% peak", "GiB/GPU",
               "bubble"]
    lines.append(tabulate(rows, headers=headers, tablefmt="simple"))
    lines.append(f"{len(result.ranked)} configurations fit; TFLOP/s counts Eq. 3 with the recomputation done "
                 f"(72 B s l h^2 (...) without, 96 B s l h^2 (...) with full recomputation)")
    lines.extend(f"note: {note}" for note in result.notes)
    if result.rejected:
        lines.append("rejected:")
        lines.extend(f"  {reason}: {count} (e.g. {example})" for reason, (count, example) in result.rejected.items())
    if days is not None:
        best = result.best
        lines.append(f"training {tokens:.3g} tokens: {days:.1f} days (Eq. 4: 8 T P / (n X), X = "
                     f"{eq4_flops_per_gpu(result) / 1e12:.1f} TFLOP/s per GPU counted with full recomputation)")
    return "\n".join(lines)


def run_calibrate(args) -> int:
    """Handler of `fxpar calibrate`: measure, fit, write the JSON, print a summary."""
    from fxpar.cost.cluster import save_cluster

    if args.world < 2:
        print("fxpar calibrate: error: --world must be >= 2 (gloo latency and bandwidth need two processes)",
              file=sys.stderr)
        return 2
    cluster = calibrate(world=args.world, threads=args.threads, quick=args.quick)
    path = save_cluster(cluster, args.out)
    print(f"wrote {path}: GEMM {cluster.peak_flops / 1e9:.1f} GFLOP/s, memory {cluster.memory_bandwidth / 1e9:.1f} "
          f"GB/s, gloo latency {cluster.intra_latency * 1e6:.0f} us, bandwidth {cluster.intra_bandwidth / 1e9:.2f} "
          f"GB/s, kernel overhead {cluster.kernel_overhead * 1e6:.1f} us, "
          f"{cluster.memory_bytes / GIB:.1f} GiB per process")
    return 0


# ---- calibration of this machine ("local" cluster); torch is imported inside the functions ----------------

GEMM_SHAPES = ((512, 512, 512), (1024, 1024, 1024), (2048, 1024, 1024), (1024, 4096, 1024))
GEMM_SHAPES_QUICK = ((256, 256, 256), (512, 512, 512), (512, 1024, 512))
ALLREDUCE_BYTES = tuple(2 ** k for k in range(10, 26, 3))  # 1 KiB .. 32 MiB
ALLREDUCE_BYTES_QUICK = tuple(2 ** k for k in range(10, 23, 3))  # 1 KiB .. 4 MiB


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


def measure_gemm_flops(quick: bool) -> float:
    """Median over a few shapes of the fp32 torch.matmul rate, 2 m n k / seconds."""
    import torch

    rates = []
    for m, n, k in GEMM_SHAPES_QUICK if quick else GEMM_SHAPES:
        x, w = torch.randn(m, k), torch.randn(k, n)
        rates.append(2.0 * m * n * k / median_seconds(lambda: torch.matmul(x, w), 3 if quick else 7))
    return statistics.median(rates)


def measure_kernel_overhead(quick: bool) -> float:
    """Median time of a 16-element add: the fixed cost of one eager op."""
    import torch

    x = torch.ones(16)
    return median_seconds(lambda: torch.add(x, x), 50 if quick else 500, warmup=10)


def measure_memory_bandwidth(quick: bool) -> float:
    """Bytes read + written per second by copying a 64 MiB (quick: 16 MiB) fp32 tensor."""
    import torch

    src = torch.ones((2 ** 22) if quick else (2 ** 24))
    dst = torch.empty_like(src)
    return 2.0 * src.numel() * 4 / median_seconds(lambda: dst.copy_(src), 3 if quick else 9)


def gloo_worker(rank: int, world: int, store_dir: str, sizes: tuple, reps: int, threads: int, out: str) -> None:
    """One rank: all_reduce fp32 tensors of each size `reps` times; rank 0 writes the median seconds."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(threads)
    store = dist.FileStore(os.path.join(store_dir, "store"), world)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=120))
    try:
        medians = []
        for nbytes in sizes:
            x = torch.ones(nbytes // 4)
            dist.barrier()
            medians.append(median_seconds(lambda: dist.all_reduce(x), reps))
        if rank == 0:
            Path(out).write_text(json.dumps({"sizes": list(sizes), "seconds": medians}))
    finally:
        dist.destroy_process_group()


def measure_gloo(world: int, threads: int, quick: bool) -> tuple[float, float]:
    """(latency per ring step, bandwidth) of gloo all_reduce between `world` spawned processes.

    A ring all-reduce takes 2(n-1) a + 2(n-1)/n S / B (cost.comm.ring_seconds); fitting
    seconds = c0 + c1 S gives a = c0 / (2(n-1)) and B = 2(n-1) / (n c1), so that the cost model's own
    formula reproduces the measurement.
    """
    import torch.multiprocessing as mp

    sizes = ALLREDUCE_BYTES_QUICK if quick else ALLREDUCE_BYTES
    with tempfile.TemporaryDirectory(prefix="fxpar-calibrate-") as tmp:
        out = os.path.join(tmp, "result.json")
        mp.spawn(gloo_worker, args=(world, tmp, sizes, 5 if quick else 20, threads, out), nprocs=world, join=True)
        result = json.loads(Path(out).read_text())
    intercept, bandwidth_slope = fit_latency_bandwidth(result["sizes"], result["seconds"])
    steps = 2 * (world - 1)
    return intercept / steps, bandwidth_slope * steps / world


def calibrate(world: int = 2, threads: int = 1, quick: bool = False) -> Cluster:
    """Measure this machine and return it as a one-node Cluster of `world` fp32 "devices" (processes).

    Measured rates are achievable ones, so every efficiency is 1; memory per device is RAM / world.
    """
    import torch

    torch.set_num_threads(threads)
    latency, bandwidth = measure_gloo(world, threads, quick)
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return Cluster(name="local", peak_flops=measure_gemm_flops(quick), memory_bytes=ram / world,
                   memory_bandwidth=measure_memory_bandwidth(quick), gpus_per_node=world,
                   intra_bandwidth=bandwidth, intra_latency=latency, inter_bandwidth=bandwidth,
                   inter_latency=latency, gemm_efficiency=1.0, memory_efficiency=1.0, link_efficiency=1.0,
                   kernel_overhead=measure_kernel_overhead(quick), reserved_bytes=0.5 * GIB, dtype_bytes=4,
                   description=f"this machine: {world} processes x {threads} thread(s), fp32 on CPU, gloo "
                               f"(measured by fxpar calibrate{' --quick' if quick else ''})")
