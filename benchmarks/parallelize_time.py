"""Benchmark: how long fxpar's parallelize() takes on GPT-2-small-shaped models of 12 and 48 layers.

parallelize() is build(): the compiler's stages (fxpar/compiler.py STAGES: trace with torch.export, then analysis,
the rewrite passes, partition, compile) -> this rank's ParallelModule (copies its shards of the weights) and the plan.
Here build runs for rank 0 of t=2 with no process group (TPComm(rank=0, size=2) simulates the rank), so it needs only
one process. The model is examples/gpt.py with GPT-2 small's dimensions (hidden 768, 12 heads, vocabulary 50257, which
t=2 does not divide: the vocabulary stays replicated, as the plan says; --vocab 50304 pads it as nanoGPT does).

Columns: trace = the trace stage alone; analysis+rewrite = the stages after it on that trace; build = the whole
build() (a fresh trace included), each the median of --repeats runs after one untimed warm-up (the first export in a
process pays one-time costs); every repeat builds each depth in turn, so that drifting load on the machine hits all
depths alike. Compile time should grow linearly with depth: the 48/12 row shows the ratios, ~4 when linear.

Run:
    .venv/bin/python benchmarks/parallelize_time.py
    .venv/bin/python benchmarks/parallelize_time.py --layers 12 48 --repeats 5 --device meta
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

if __package__:  # imported as benchmarks.parallelize_time (the tests)
    from benchmarks import common  # noqa: F401 (sets up sys.path)
else:  # run as a script: benchmarks/ is sys.path[0]
    import common  # noqa: F401 (sets up sys.path)

from gpt import GPT, GPTConfig  # noqa: E402


def _gpt(layers: int, args) -> tuple[GPT, torch.Tensor]:
    cfg = GPTConfig(vocab=args.vocab, seq=args.seq, layers=layers, hidden=args.hidden, heads=args.heads,
                    attention=args.attention)
    torch.manual_seed(0)
    with torch.device(args.device):
        return GPT(cfg), torch.zeros(args.batch, args.seq, dtype=torch.long)


def time_build_once(model, ids, t: int = 2) -> dict:
    """Seconds of the trace stage, the stages after it on that trace, and a whole build, for rank 0 of t
    (simulated)."""
    from fxpar.api import build
    from fxpar.compiler import STAGES, Compiled, Target, run_stages
    from fxpar.config import Config
    from fxpar.passes.tensor_parallel.collectives import TPComm

    comm = TPComm(rank=0, size=t)
    record = Compiled(model, (ids,), {}, Target(comm), Config())
    start = time.perf_counter()
    run_stages(record, STAGES[:1])
    mid = time.perf_counter()
    run_stages(record, STAGES[1:])
    end = time.perf_counter()
    pm = build(model, comm, (ids,))
    done = time.perf_counter()
    return {"trace": mid - start, "analysis+rewrite": end - mid, "build": done - end,
            "nodes": len(record.traced.gm.graph.nodes), "sharded regions": len(pm.plan.sharded_regions)}


def run(args) -> dict[int, dict]:
    """{layers: median timings} for each depth in args.layers. The depths are interleaved in every repeat, so that
    load drifting on the machine hits them alike; a warm-up build of a 1-layer model comes first."""
    torch.set_num_threads(args.threads)
    time_build_once(*_gpt(1, args))  # warm-up: imports and export's first-call costs
    models = {layers: _gpt(layers, args) for layers in args.layers}
    samples: dict[int, list[dict]] = {layers: [] for layers in args.layers}
    for _ in range(args.repeats):
        for layers, (model, ids) in models.items():
            samples[layers].append(time_build_once(model, ids))
    return {layers: {k: statistics.median(s[k] for s in runs) for k in runs[0]} for layers, runs in samples.items()}


def format_table(results: dict[int, dict], args) -> str:
    from tabulate import tabulate

    cols = ("trace", "analysis+rewrite", "build")
    rows = [[f"{L} layers", str(r["nodes"]), str(r["sharded regions"]), *(f"{r[c]:.3f}" for c in cols),
             f"{r['build'] / L * 1e3:.0f}"] for L, r in results.items()]
    depths = sorted(results)
    if len(depths) > 1:
        lo, hi = results[depths[0]], results[depths[-1]]
        rows.append([f"{depths[-1]}/{depths[0]} ratio", f"{hi['nodes'] / lo['nodes']:.2f}", "",
                     *(f"{hi[c] / lo[c]:.2f}" for c in cols), ""])
    head = (f"fxpar build (= parallelize) for rank 0 of t=2, GPT hidden={args.hidden} heads={args.heads} "
            f"vocab={args.vocab} seq={args.seq} batch={args.batch}, device={args.device}, {args.threads} thread(s); "
            f"seconds, median of {args.repeats}")
    return head + "\n" + tabulate(
        rows, headers=["model", "graph nodes", "sharded regions", "trace s", "analysis+rewrite s", "build s",
                       "build ms/layer"], disable_numparse=True, colalign=("left",) + ("right",) * 6)


def _parse(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, nargs="+", default=[12, 48])
    p.add_argument("--hidden", type=int, default=768)
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--vocab", type=int, default=50257)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--attention", default="sdpa", choices=["sdpa", "explicit"])
    p.add_argument("--device", default="cpu", choices=["cpu", "meta"],
                   help="where the model's weights live; meta skips allocating and copying them")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=1)
    return p.parse_args(argv)


def main(argv=None) -> dict[int, dict]:
    """Time the builds, print the table, return {layers: timings}."""
    args = _parse(argv)
    results = run(args)
    print(format_table(results, args), flush=True)
    return results


if __name__ == "__main__":
    main()
