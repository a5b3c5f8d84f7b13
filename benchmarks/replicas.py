"""Benchmark: what `pm.check_replicas()` costs next to a tensor-parallel train step of the example GPT.

    step            forward, backward and an SGD step at t = --nproc
    step + check    the same, then pm.check_replicas(grads=True): a fingerprint of every replicated weight and
                    gradient, compared across the tp group (one all-gather per group)

Both run interleaved (rotated order each round) for R rounds of S steps on spawned gloo ranks; the table shows the
median step time and the median over rounds of the within-round ratio (step + check) / step.

Run:
    .venv/bin/python benchmarks/replicas.py                    # hidden 256, 4 layers, seq 128, batch 4, t=2
"""
from __future__ import annotations

import argparse

import torch

if __package__:
    from benchmarks import common
else:
    import common

from gpt import factory  # noqa: E402

import fxpar  # noqa: E402


def _run(args) -> dict:
    torch.manual_seed(0)
    model, (ids,) = factory(batch=args.batch, layers=args.layers, hidden=args.hidden, heads=args.heads, seq=args.seq,
                            vocab=args.vocab)
    pm = fxpar.parallelize(model, fxpar.init_mesh(tp=args.nproc), example_args=(ids,))
    opt = torch.optim.SGD(pm.parameters(), lr=1e-3)

    def step():
        opt.zero_grad()
        pm(ids).float().pow(2).mean().backward()
        opt.step()

    def step_and_check():
        step()
        pm.check_replicas(grads=True)

    replicated = sum(1 for k, _ in pm.named_parameters() if k not in pm.rank.specs)
    timed = common.time_rounds({"step": step, "step + check": step_and_check}, args.rounds, args.steps, args.warmup,
                               barrier=True, reduce=torch.distributed.ReduceOp.MAX)
    return timed | {"replicated": replicated, "total": sum(1 for _ in pm.parameters())}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--timeout", type=float, default=300.0)
    args = p.parse_args(argv)
    result = common.launch(_run, args)
    if not result:
        return result
    times = result["times"]
    ratio, q1, q3 = common.paired_ratio(times, "step + check", "step")
    base = sorted(times["step"])[len(times["step"]) // 2] * 1e3
    checked = sorted(times["step + check"])[len(times["step + check"]) // 2] * 1e3
    print(f"t={args.nproc}, {result['replicated']} of {result['total']} weights replicated")
    print(f"step          {base:8.2f} ms")
    print(f"step + check  {checked:8.2f} ms   ratio {ratio:.3f} (quartiles {q1:.3f}-{q3:.3f})")
    return result


if __name__ == "__main__":
    main()
