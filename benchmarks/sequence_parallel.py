"""Benchmark: sequence parallelism, its memory and its step time, against tensor parallelism alone.

    memory  saved activation bytes per layer (saved-tensor hooks, weights left out; a model of 4 layers less one of
            2, halved), for t in --memory-t, with and without Config(sequence_parallel=True), without and with
            selective recompute; beside Korthikanti et al.'s formulas (2-byte activations, so doubled for fp32):
                tensor parallelism              sbh (10 + 24/t + 5as/(ht))     selective: sbh (10 + 24/t)
                + sequence parallelism          sbh (34 + 5as/h) / t           selective: sbh 34 / t
            The ranks are threads of one process (the bytes do not depend on timing).
    time    one train step (forward, backward, SGD) of the example GPT at t=2 over gloo, tensor parallelism alone vs
            with sequence parallelism, interleaved rounds (benchmarks/common.py); both checked exact first (without
            dropout: the memory table's dropout draws its masks from other streams than the unmodified model's).

Run:
    .venv/bin/python benchmarks/sequence_parallel.py                  # both parts; spawns 2 ranks (FileStore)
    .venv/bin/python benchmarks/sequence_parallel.py --rounds 30 --hidden 512 --seq 256
"""
from __future__ import annotations

import argparse
import copy
import statistics

import torch
import torch.distributed as dist

if __package__:  # imported as benchmarks.sequence_parallel (the tests)
    from benchmarks import common
    from benchmarks.tp_step import train_step
else:  # run as a script: benchmarks/ is sys.path[0]
    import common
    from tp_step import train_step

from gpt import GPT, GPTConfig, loss_fn  # noqa: E402

VARIANTS = ("tensor parallel", "+ sequence parallel")
TOL = 1e-5


# ---- memory ----------------------------------------------------------------------------------------------------

def formulas(s: int, b: int, h: int, a: int, t: int, selective: bool, bytes_per_value: int = 4) -> tuple[float, float]:
    """Korthikanti et al.'s bytes per layer (Table 2), for activations of `bytes_per_value` bytes: (tensor
    parallelism, with sequence parallelism)."""
    sbh, scale = s * b * h, bytes_per_value / 2
    attention = 0 if selective else 5 * a * s / h
    return sbh * (10 + 24 / t + attention / t) * scale, sbh * (34 + attention) / t * scale


def saved_per_layer(cfg: GPTConfig, batch: int, t: int, sequence_parallel: bool, recompute: str) -> float:
    """Saved activation bytes per layer on rank 0 (threads as ranks): 4 layers less 2, halved."""
    import fxpar
    from fxpar.runtime.measure import saved_activation_bytes
    from tests.threaded import on_tp_ranks

    def saved(pm, _, ids):
        return saved_activation_bytes(lambda: pm(ids), exclude=[*pm.parameters(), *pm.buffers()])[1]

    total = []
    for layers in (2, 4):
        torch.manual_seed(0)
        model = GPT(GPTConfig(**{**vars(cfg), "layers": layers}))
        ids = torch.randint(0, cfg.vocab, (batch, cfg.seq))
        config = fxpar.Config(sequence_parallel=sequence_parallel, recompute=recompute)
        total.append(on_tp_ranks(model, (ids,), lambda pm, ref: saved(pm, ref, ids), tp=t, config=config)[0])
    return (total[1] - total[0]) / 2


def memory_table(cfg: GPTConfig, batch: int, ts) -> str:
    from tabulate import tabulate

    rows = []
    for t in ts:
        for recompute in ("none", "selective"):
            tp, sp = (saved_per_layer(cfg, batch, t, on, recompute) for on in (False, True))
            f_tp, f_sp = formulas(cfg.seq, batch, cfg.hidden, cfg.heads, t, recompute == "selective")
            rows.append([t, recompute, tp / 1024, f_tp / 1024, sp / 1024, f_sp / 1024, sp / tp, f_sp / f_tp])
    head = (f"saved activation bytes per layer (KiB, fp32), GPT hidden={cfg.hidden} heads={cfg.heads} seq={cfg.seq} "
            f"batch={batch} dropout={cfg.dropout} attention={cfg.attention}")
    return head + "\n" + tabulate(rows, headers=["t", "recompute", "TP measured", "TP formula", "TP+SP measured",
                                                 "TP+SP formula", "SP/TP measured", "SP/TP formula"],
                                  floatfmt=(None, None, ".1f", ".1f", ".1f", ".1f", ".3f", ".3f"))


# ---- time ------------------------------------------------------------------------------------------------------

def run_rank(cfg: GPTConfig, batch: int, rounds: int, steps: int, warmup: int) -> dict:
    """Build, check and time both variants on this rank (a gloo group of size t must exist)."""
    import fxpar

    t = dist.get_world_size()
    torch.manual_seed(0)
    model = GPT(cfg)
    ids = torch.randint(0, cfg.vocab, (batch, cfg.seq))
    target = torch.roll(ids, -1, dims=1)
    ref_loss = loss_fn(model(ids), target).item()
    models, errors = {}, {}
    for name, sp in zip(VARIANTS, (False, True)):
        models[name] = fxpar.parallelize(copy.deepcopy(model), fxpar.init_mesh(tp=t), example_args=(ids,),
                                         config=fxpar.Config(sequence_parallel=sp))
        errors[name] = abs(loss_fn(models[name](ids), target).item() - ref_loss)
    step_fns = {name: train_step(models[name], ids, target) for name in VARIANTS}
    timed = common.time_rounds(step_fns, rounds, steps, warmup, barrier=True, reduce=dist.ReduceOp.MAX)
    return {"times": timed["times"], "cpu": timed["cpu"], "errors": errors,
            "config": dict(vars(cfg)) | {"batch": batch, "t": t, "rounds": rounds, "steps": steps}}


def time_table(result: dict) -> str:
    from tabulate import tabulate

    rows = []
    for name in VARIANTS:
        ratio, q1, q3 = common.paired_ratio(result["times"], name, VARIANTS[0])
        rows.append([name, statistics.median(result["times"][name]) * 1e3, min(result["times"][name]) * 1e3,
                     statistics.median(result["cpu"][name]) * 1e3, ratio, f"{q1:.3f}-{q3:.3f}",
                     f"{result['errors'][name]:.1e}"])
    c = result["config"]
    head = (f"t={c['t']} train step (fwd+bwd+SGD), GPT layers={c['layers']} hidden={c['hidden']} heads={c['heads']} "
            f"seq={c['seq']} batch={c['batch']}; gloo, 1 thread/rank; {c['rounds']} interleaved rounds x "
            f"{c['steps']} steps; the ratio is the median of per-round ratios")
    return head + "\n" + tabulate(rows, headers=["variant", "median ms", "min ms", "CPU ms", "vs TP", "(IQR)",
                                                 "loss err"], floatfmt=(None, ".1f", ".1f", ".1f", ".3f"))


def _parse(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--dropout", type=float, default=0.1, help="of the memory table's models (its masks are saved)")
    p.add_argument("--attention", default="sdpa", choices=["sdpa", "explicit"])
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--nproc", type=int, default=2, help="ranks to spawn for the step time (t)")
    p.add_argument("--timeout", type=float, default=300.0)
    p.add_argument("--memory-t", type=int, nargs="*", default=[2, 4], help="t values of the memory table")
    p.add_argument("--skip-time", action="store_true")
    return p.parse_args(argv)


def _config(args, dropout: float) -> GPTConfig:
    return GPTConfig(vocab=args.vocab, seq=args.seq, layers=args.layers, hidden=args.hidden, heads=args.heads,
                     dropout=dropout, attention=args.attention)


def _run(args) -> dict:
    result = run_rank(_config(args, 0.0), args.batch, args.rounds, args.steps, args.warmup)
    bad = {n: e for n, e in result["errors"].items() if e > TOL}
    if bad:
        raise AssertionError(f"not exact (|loss err| per variant, tolerance {TOL}): {bad}")
    return result


def main(argv=None) -> dict:
    args = _parse(argv)
    result = {}
    if args.memory_t:
        print(memory_table(_config(args, args.dropout), args.batch, args.memory_t), flush=True)
    if not args.skip_time:
        result = common.launch(_run, args)
        if result:
            print(time_table(result), flush=True)
    return result


if __name__ == "__main__":
    main()
