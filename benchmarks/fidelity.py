"""Benchmark: the cost model's local fidelity. Measured fxpar step times of the example GPT over gloo on this machine
against fxpar.cost's predict_step_seconds on a cluster calibrated here (`fxpar calibrate`).

For each configuration (t, p, d, m) below, at world size t*p*d, the script times one train step: pm.step over the
global batch (the pipeline schedule's forwards and backwards, the tp all-reduces, the dp gradient all-reduce) plus
an Adam step, which is the optimizer the cost model prices. A sample is the max over ranks of one step; the
configurations of one world size run interleaved (rotated each round) in one process group; the table shows the
median over rounds. The prediction is predict_step_seconds for the same shape, global batch, (t, p, d), microbatch
b = B / (d m), schedule 1f1b and recompute "none" (fxpar's default; the cost model's default is "full").

Reported: per configuration measured and predicted seconds and |predicted - measured| / measured, then the
Spearman rank correlation of predicted against measured (average ranks for ties, written here, no scipy) and the
median absolute error.

How the local CPU is described to the cost model (nothing in the model is specific to it):
  * a "device" is a process with 1 thread; `fxpar calibrate --world W` measures, with all W processes busy at
    once, the GEMM peak, copy bandwidth, a Transformer layer's forward + backward at a ladder of sizes (fitted to
    the model's layer time: GEMM efficiency and per-op overhead), gloo all-reduce latency and bandwidth, and the
    ranks' drift between collectives (sync jitter). The model on that cluster is "predicted".
  * the rows of each world size use the cluster calibrated with W = max(world, 2): the rates of a device while as
    many devices share the machine. World sizes above the core count oversubscribe the CPU (4 ranks on 2 cores);
    those rows are flagged, and the summary is printed with and without them.

Run:
    .venv/bin/python benchmarks/fidelity.py                       # calibrates into a temporary folder first
    .venv/bin/python benchmarks/fidelity.py --clusters DIR        # reuse (or write) DIR/local-W.json
    .venv/bin/python benchmarks/fidelity.py --worlds 1 2 --rounds 10
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile

import torch
import torch.distributed as dist

if __package__:  # imported as benchmarks.fidelity (the tests)
    from benchmarks import common
else:  # run as a script: benchmarks/ is sys.path[0]
    import common

from gpt import GPT, GPTConfig, loss_fn  # noqa: E402

# (t, p, d, m) per world size t*p*d; m = microbatches per pipeline (per dp rank)
CONFIGS = {
    1: [(1, 1, 1, 1), (1, 1, 1, 2), (1, 1, 1, 4)],
    2: [(2, 1, 1, 1), (2, 1, 1, 4), (1, 2, 1, 2), (1, 2, 1, 4), (1, 1, 2, 1), (1, 1, 2, 2)],
    4: [(2, 2, 1, 2), (2, 2, 1, 4), (1, 2, 2, 2)],
}


def describe(c: tuple) -> str:
    t, p, d, m = c
    return f"t={t} p={p} d={d} m={m}"


# ---- measurement (one rank) -------------------------------------------------------------------------------------

def build(cfg: GPTConfig, batch: int, c: tuple):
    """(train step closure, this config's global ids) for config c on the current process group."""
    import fxpar

    t, p, d, m = c
    torch.manual_seed(0)
    model = GPT(cfg)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, cfg.vocab, (batch, cfg.seq), generator=g)
    target = torch.roll(ids, -1, dims=1)
    micro = batch // (d * m)
    pm = fxpar.parallelize(model, fxpar.init_mesh(tp=t, pp=p, dp=d), example_args=(ids[:micro],), loss_fn=loss_fn,
                           config=fxpar.Config(microbatches=m, schedule="1f1b"))
    opt = torch.optim.Adam(pm.parameters(), lr=1e-4)

    def step():
        opt.zero_grad(set_to_none=True)
        pm.step(ids, target=target)
        opt.step()

    return step


def run_rank(cfg: GPTConfig, batch: int, configs: list, rounds: int, warmup: int) -> dict:
    """Time every config of this world size, interleaved; returns {config: [seconds per round, max over ranks]}."""
    steps = {c: build(cfg, batch, c) for c in configs}
    timed = common.time_rounds(steps, rounds, warmup=warmup, barrier=True, reduce=dist.ReduceOp.MAX)
    return timed["times"]


def _measure_rank(args) -> dict:
    """One rank of a spawned world: the configs of its world size, timed."""
    return run_rank(gpt_config(args), args.batch, CONFIGS[dist.get_world_size()], args.rounds, args.warmup)


def measure(args, world: int) -> dict:
    """{config: [seconds per round]} of one spawned world."""
    return common.spawn(_measure_rank, args, nproc=world, timeout=300.0)


# ---- prediction and statistics -----------------------------------------------------------------------------------

def predict(cfg: GPTConfig, batch: int, c: tuple, cluster) -> tuple[float, dict]:
    """The cost model's seconds per step for config c, and its parts."""
    from fxpar.cost import ModelShape
    from fxpar.cost.step import ParallelConfig, estimate

    t, p, d, m = c
    shape = ModelShape(layers=cfg.layers, hidden=cfg.hidden, heads=cfg.heads, seq=cfg.seq, vocab=cfg.vocab,
                       batch=batch)
    b = batch // (d * m)
    est = estimate(shape, ParallelConfig(tp=t, pp=p, dp=d, microbatch=b, recompute="none", schedule="1f1b"), cluster)
    return est.seconds, est.parts  # est.seconds is predict_step_seconds for the same arguments


def ranks(xs: list[float]) -> list[float]:
    """1-based ranks of xs, ties sharing their average rank."""
    order = sorted(range(len(xs)), key=lambda i: xs[i])
    out = [0.0] * len(xs)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and xs[order[j + 1]] == xs[order[i]]:
            j += 1
        for k in range(i, j + 1):
            out[order[k]] = (i + j) / 2 + 1
        i = j + 1
    return out


def spearman(xs: list[float], ys: list[float]) -> float:
    """Spearman's rho: the Pearson correlation of the ranks (exact with ties)."""
    if len(xs) != len(ys) or len(xs) < 2:
        raise ValueError(f"spearman needs two equal-length lists of >= 2 values, got {len(xs)} and {len(ys)}")
    rx, ry = ranks(xs), ranks(ys)
    mx, my = statistics.fmean(rx), statistics.fmean(ry)
    sxy = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    sxx, syy = sum((a - mx) ** 2 for a in rx), sum((b - my) ** 2 for b in ry)
    return sxy / (sxx * syy) ** 0.5 if sxx and syy else float("nan")


def summary(rows: list[dict]) -> str:
    if len(rows) < 2:
        return f"{len(rows)} configuration(s): too few for a rank correlation"
    meas, pred = [r["measured"] for r in rows], [r["predicted"] for r in rows]
    errs = [abs(p - m) / m * 100 for p, m in zip(pred, meas)]
    ratio = statistics.median(p / m for p, m in zip(pred, meas))
    return (f"{len(rows)} configs: Spearman {spearman(pred, meas):.3f}, "
            f"median abs error {statistics.median(errs):.1f}%, median predicted/measured {ratio:.3f}")


def _rates(c) -> str:
    return (f"GEMM {c.peak_flops / 1e9:.1f} GFLOP/s x {c.gemm_efficiency:.2f} in a layer, copy "
            f"{c.memory_bandwidth / 1e9:.1f} GB/s, op overhead {c.kernel_overhead * 1e6:.1f} us, gloo latency "
            f"{c.intra_latency * 1e6:.0f} us/step, {c.intra_bandwidth / 1e9:.2f} GB/s, sync jitter "
            f"{c.sync_jitter * 100:.1f}%")


def format_table(rows: list[dict], cfg: GPTConfig, args, clusters: dict[int, list], load: tuple) -> str:
    from tabulate import tabulate

    table = [[r["config"], r["world"], r["measured"], r["predicted"],
              abs(r["predicted"] - r["measured"]) / r["measured"] * 100,
              " ".join(f"{k}={v * 1e3:.0f}" for k, v in r["parts"].items() if v),
              "oversubscribed" if r["oversubscribed"] else ""] for r in rows]
    head = (f"train step (pm.step + Adam) of GPT layers={cfg.layers} hidden={cfg.hidden} heads={cfg.heads} "
            f"seq={cfg.seq} vocab={cfg.vocab} attention={cfg.attention}, global batch {args.batch}; gloo, 1 "
            f"thread/rank, {os.cpu_count()} cores (load average {load[0]:.1f} at start, {load[1]:.1f} at end); "
            f"measured: median of {args.passes} passes x {args.rounds} interleaved rounds per world size; "
            f"predicted: median over the passes' calibrations.\n"
            + "\n".join(f"{w} rank(s), pass {k}: `fxpar calibrate --world {max(w, 2)}`: {_rates(c)}"
                        for w, cs in clusters.items() for k, c in enumerate(cs)))
    body = tabulate(table, headers=["config", "ranks", "measured s", "predicted s", "abs err %",
                                    "predicted parts (ms)", ""], floatfmt=(None, None, ".4f", ".4f", ".1f"))
    fitting = [r for r in rows if not r["oversubscribed"]]
    lines = [head, body, "all rows: " + summary(rows)]
    if len(fitting) < len(rows):
        lines.append("ranks <= cores: " + summary(fitting))
    return "\n".join(lines)


# ---- driver -----------------------------------------------------------------------------------------------------

def gpt_config(args) -> GPTConfig:
    return GPTConfig(vocab=args.vocab, seq=args.seq, layers=args.layers, hidden=args.hidden, heads=args.heads,
                     attention=args.attention)


def calibrated_cluster(path: str, world: int, quick: bool):
    """The cluster `fxpar calibrate --world world` writes to `path` (reused if it exists): the rates of a device
    while `world` devices share the machine."""
    from fxpar.cost.cluster import load_cluster

    if not os.path.exists(path):
        subprocess.run([sys.executable, "-m", "fxpar.cli.main", "calibrate", "--world", str(world), "--out", path]
                       + ["--quick"] * quick, check=True)
    return load_cluster(path)


def _parse(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--batch", type=int, default=8, help="global batch B (every config divides it)")
    p.add_argument("--attention", default="sdpa", choices=["sdpa", "explicit"])
    p.add_argument("--worlds", type=int, nargs="+", default=[1, 2, 4], choices=sorted(CONFIGS))
    p.add_argument("--rounds", type=int, default=8, help="interleaved rounds per world size per pass")
    p.add_argument("--passes", type=int, default=3, help="passes over the world sizes (so drift hits each alike)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps per config first")
    p.add_argument("--clusters", help="folder of calibrated local-W.json clusters, written there if missing and "
                                      "used for every pass (default: calibrate afresh right before each world "
                                      "of each pass)")
    p.add_argument("--quick-calibrate", action="store_true", help="calibrate with --quick")
    return p.parse_args(argv)


def main(argv=None) -> list[dict]:
    """Per pass and world size: `fxpar calibrate`, then the timed rounds right after it (a shared machine's speed
    drifts over minutes; a calibration predicts the steps of its own time). Medians over passes of both."""
    args = _parse(argv)
    cfg = gpt_config(args)
    os.environ.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")  # inherited by `fxpar calibrate` and the ranks
    start_load = os.getloadavg()[0]
    samples = {w: {c: [] for c in CONFIGS[w]} for w in args.worlds}
    predictions = {w: {c: [] for c in CONFIGS[w]} for w in args.worlds}
    clusters = {w: [] for w in args.worlds}
    with tempfile.TemporaryDirectory(prefix="fxpar-fidelity-") as tmp:
        for k in range(args.passes):
            for world in args.worlds:
                devices = max(world, 2)  # gloo needs two processes to calibrate; one rank runs as one of two
                name = f"local-{devices}.json" if args.clusters else f"local-{world}-pass{k}.json"
                cluster = calibrated_cluster(os.path.join(args.clusters or tmp, name), devices, args.quick_calibrate)
                clusters[world].append(cluster)
                for c, times in measure(args, world).items():
                    samples[world][c] += times
                    predictions[world][c].append(predict(cfg, args.batch, c, cluster))
    rows = []
    for world in args.worlds:
        for c, times in samples[world].items():
            seconds, parts = sorted(predictions[world][c], key=lambda sp: sp[0])[len(predictions[world][c]) // 2]
            rows.append({"config": describe(c), "world": world, "measured": statistics.median(times),
                         "samples": times, "predicted": seconds, "parts": parts,
                         "oversubscribed": world > (os.cpu_count() or 1)})
    print(format_table(rows, cfg, args, clusters, (start_load, os.getloadavg()[0])), flush=True)
    return rows


if __name__ == "__main__":
    main()
