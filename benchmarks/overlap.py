"""Benchmark: the joint programs (Config(joint_graph=True)) and each overlap pass on them, one t=2 train step of the
example GPT over gloo.

    fxpar eager        fxpar.parallelize at t=2, the default Config (f and g as autograd functions)
    joint              Config(joint_graph=True): each chunk as its joint forward+backward program
    joint early        ... with the early_collectives pass (each collective issued as soon as its input exists)
    joint late         ... with the late_waits pass (each wait right before its first reader)
    joint early+late   ... with both

With --dp, one d=2 train step (pm.step) instead, whose data-parallel buckets are reduced by the runtime (after the
chunk's backward) or, with the dp_buckets pass, by the backward program itself:

    fxpar eager        the default executable: the runtime's buckets
    joint              the joint programs, no pass: the runtime's buckets
    joint early+late   both program passes: the runtime's buckets
    joint dp_buckets   the buckets in the backward program, alone (each waited for where it is issued)
    joint all          the default: both passes and the buckets in the program, each issued as soon as its last
                       gradient exists and waited for at the end of the backward

A step is forward, cross-entropy, backward and an SGD step. Every variant's loss and gradients are first checked
against the unmodified model (within 1e-5); then the variants run interleaved for R rounds (common.time_rounds) and
the table shows the median step time and the median per-round ratio to `joint` (the same program, not reordered).

Run (2 ranks over gloo, 1 thread each):
    .venv/bin/python benchmarks/overlap.py
    .venv/bin/python benchmarks/overlap.py --layers 4 --hidden 512 --seq 256 --rounds 15
    .venv/bin/python benchmarks/overlap.py --dp --bucket-mb 2
"""
from __future__ import annotations

import argparse
import copy
import statistics

import torch
import torch.distributed as dist

if __package__:
    from benchmarks import common
    from benchmarks.compile_step import TOL, _error, _full_grads, _grads, _loss, _step
else:
    import common
    from compile_step import TOL, _error, _full_grads, _grads, _loss, _step

from gpt import GPT, GPTConfig  # noqa: E402

VARIANTS = {
    "fxpar eager": {},
    "joint": {"joint_graph": True, "overlap": ()},
    "joint early": {"joint_graph": True, "overlap": ("early_collectives",)},
    "joint late": {"joint_graph": True, "overlap": ("late_waits",)},
    "joint early+late": {"joint_graph": True, "overlap": ("early_collectives", "late_waits")},
}
DP_VARIANTS = {
    "fxpar eager": {},
    "joint": {"joint_graph": True, "overlap": ()},
    "joint early+late": {"joint_graph": True, "overlap": ("early_collectives", "late_waits")},
    "joint dp_buckets": {"joint_graph": True, "overlap": ("dp_buckets",)},
    "joint all": {"joint_graph": True},  # the default
}


def run_rank(args) -> dict:
    import fxpar

    cfg = GPTConfig(vocab=args.vocab, seq=args.seq, layers=args.layers, hidden=args.hidden, heads=args.heads)
    torch.manual_seed(0)
    model = GPT(cfg).train()
    ids = torch.randint(0, cfg.vocab, (args.batch, cfg.seq))
    ref = copy.deepcopy(model)
    ref_loss = _loss(ref(ids), ids)
    ref_loss.backward()
    ref_grads = _grads(ref)
    if args.dp:
        return _run_dp(args, cfg, model, ids, ref_loss.item(), ref_grads)
    mesh = fxpar.init_mesh(tp=dist.get_world_size())
    models = {}
    for name, config in VARIANTS.items():
        models[name] = fxpar.parallelize(copy.deepcopy(model), mesh, example_args=(ids,),
                                         config=fxpar.Config(**config))
        error = _error(models[name], ref_loss.item(), ref_grads, ids, _full_grads(models[name]))
        if error > TOL:
            raise AssertionError(f"{name}: not exact, gap {error:.2e} > {TOL}")
    timed = common.time_rounds({n: _step(m, ids) for n, m in models.items()}, args.rounds, args.steps, args.warmup,
                               barrier=True, reduce=dist.ReduceOp.MAX)
    return {"times": timed["times"], "cpu": timed["cpu"],
            "config": dict(vars(cfg)) | {"batch": args.batch, "rounds": args.rounds, "t": dist.get_world_size()}}


def _run_dp(args, cfg, model, ids, ref_loss: float, ref_grads: dict) -> dict:
    """--dp: each variant's pm.step at d = the world size over the whole batch, checked against the model's."""
    import fxpar

    mesh, steps = fxpar.init_mesh(dp=dist.get_world_size()), {}
    for name, config in DP_VARIANTS.items():
        pm = fxpar.parallelize(copy.deepcopy(model), mesh, example_args=(ids[:len(ids) // dist.get_world_size()],),
                               loss_fn=_loss, config=fxpar.Config(bucket_mb=args.bucket_mb, **config))
        pm.zero_grad(set_to_none=True)
        loss = pm.step(ids, target=ids).item()
        error = max([abs(loss - ref_loss)] + [(p.grad - ref_grads[k]).abs().max().item()
                                              for k, p in pm.named_parameters()])
        if error > TOL:
            raise AssertionError(f"{name}: not exact, gap {error:.2e} > {TOL}")
        steps[name] = _dp_step(pm, ids)
    timed = common.time_rounds(steps, args.rounds, args.steps, args.warmup, barrier=True, reduce=dist.ReduceOp.MAX)
    return {"times": timed["times"], "cpu": timed["cpu"], "variants": list(DP_VARIANTS),
            "config": dict(vars(cfg)) | {"batch": args.batch, "rounds": args.rounds, "d": dist.get_world_size(),
                                               "bucket_mb": args.bucket_mb}}


def _dp_step(pm, ids):
    opt = torch.optim.SGD(pm.parameters(), lr=1e-3)

    def step():
        opt.zero_grad(set_to_none=True)
        pm.step(ids, target=ids)
        opt.step()

    return step


def format_table(result: dict) -> str:
    from tabulate import tabulate

    rows = []
    for name in result.get("variants", VARIANTS):
        ratio, q1, q3 = common.paired_ratio(result["times"], name, "joint")
        cpu, _, _ = common.paired_ratio(result["cpu"], name, "joint")
        rows.append([name, statistics.median(result["times"][name]) * 1e3, ratio, f"{q1:.3f}-{q3:.3f}", cpu])
    c = result["config"]
    mesh = f"t={c['t']}" if "t" in c else f"d={c['d']} (buckets of {c['bucket_mb']} MB)"
    head = (f"train step, GPT layers={c['layers']} hidden={c['hidden']} seq={c['seq']} batch={c['batch']} "
            f"vocab={c['vocab']}; {mesh} over gloo, 1 thread/rank; {c['rounds']} interleaved rounds; ratio: "
            "median per-round ratio to `joint` (wall; CPU: process time)")
    return head + "\n" + tabulate(rows, headers=["variant", "median ms", "vs joint", "(IQR)", "CPU vs joint"],
                                  floatfmt=(None, ".1f", ".3f", None, ".3f"))


def _parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--timeout", type=float, default=900.0)
    p.add_argument("--dp", action="store_true", help="a d=2 pm.step: the dp buckets in the program or not")
    p.add_argument("--bucket-mb", type=float, default=2.0, help="with --dp: Config.bucket_mb")
    return p.parse_args(argv)


def main(argv=None) -> dict:
    return common.launch_and_print(run_rank, _parse(argv), format_table)


if __name__ == "__main__":
    main()
