"""Benchmark: one d=2 AdamW train step of the example GPT, the replicated optimizer against the distributed one.

    replicated   Config(zero=0): gradients all-reduced over dp, every rank steps all parameters (full Adam state)
    zero=1       Config(zero=1): gradients reduce-scattered, each rank steps its 1/d pieces (fp32 main copies and
                 1/d of the state), the pieces all-gathered (fxpar/runtime/zero.py)

Both start from the same model and must give the same losses over the warm-up steps (within 1e-5). The variants
then run interleaved for R rounds (common.time_rounds); the table shows the median step time, the median per-round
ratio, and each rank's optimizer-state bytes (Adam's moments) measured from the optimizer.

Run (2 ranks over gloo, 1 thread each):
    .venv/bin/python benchmarks/zero_step.py
    .venv/bin/python benchmarks/zero_step.py --hidden 512 --rounds 10
"""
from __future__ import annotations

import argparse
import copy

import torch
import torch.distributed as dist

if __package__:
    from benchmarks import common
else:
    import common

from gpt import GPT, GPTConfig, loss_fn  # noqa: E402

VARIANTS = ("replicated", "zero=1")
TOL = 1e-5


def run_rank(cfg: GPTConfig, batch: int, rounds: int, warmup: int) -> dict:
    import fxpar

    torch.manual_seed(0)
    model = GPT(cfg)
    d = dist.get_world_size()
    ids = torch.randint(0, cfg.vocab, (batch * d, cfg.seq))
    target = torch.roll(ids, -1, dims=1)
    mesh = fxpar.init_mesh(dp=d)
    steps, losses, state = {}, {}, {}
    for name, zero in zip(VARIANTS, (0, 1)):
        pm = fxpar.parallelize(copy.deepcopy(model), mesh, example_args=(ids[:batch],), loss_fn=loss_fn,
                               example_target=target[:batch], config=fxpar.Config(zero=zero))
        opt = pm.optimizer(torch.optim.AdamW, lr=1e-4)
        steps[name] = common.pm_step(pm, opt, ids, target=target)
        losses[name] = [steps[name]() for _ in range(max(warmup, 1))]
        state[name] = sum(t.numel() * t.element_size() for s in opt.state.values() for t in s.values() if t.dim())
    gap = max(abs(a - b) for a, b in zip(*losses.values()))
    timed = common.time_rounds(steps, rounds, 1, 0, barrier=True, reduce=dist.ReduceOp.MAX)
    return {"times": timed["times"], "gap": gap, "state": state,
            "config": dict(vars(cfg)) | {"batch": batch, "d": d, "rounds": rounds}}


def format_table(result: dict) -> str:
    from tabulate import tabulate

    rows = common.ratio_rows(result["times"], "replicated", result["state"])
    c = result["config"]
    head = (f"d={c['d']} AdamW train step, GPT layers={c['layers']} hidden={c['hidden']} seq={c['seq']} "
            f"batch={c['batch']}/rank vocab={c['vocab']}; gloo, 1 thread/rank; {c['rounds']} interleaved rounds; "
            f"losses of the two agree within {result['gap']:.1e}")
    return head + "\n" + tabulate(rows, headers=["optimizer", "median ms", "vs replicated", "(IQR)",
                                                 "Adam state MiB/rank"], floatfmt=(None, ".1f", ".3f", None, ".2f"))


def _parse(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--timeout", type=float, default=300.0)
    return p.parse_args(argv)


def _run(args) -> dict:
    cfg = GPTConfig(vocab=args.vocab, seq=args.seq, layers=args.layers, hidden=args.hidden, heads=args.heads)
    result = run_rank(cfg, args.batch, args.rounds, args.warmup)
    if result["gap"] > TOL:
        raise AssertionError(f"the two optimizers' losses differ by {result['gap']} (tolerance {TOL})")
    return result


def main(argv=None) -> dict:
    return common.launch_and_print(_run, _parse(argv), format_table)


if __name__ == "__main__":
    main()
