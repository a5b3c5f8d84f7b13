"""Benchmark: Config(compile=True) against eager, one t=2 train step of the example GPT, beside torch.compile of the
unparallelized model.

    fxpar eager       fxpar.parallelize at t=2, the default Config
    fxpar compile     the same with Config(compile=True): each chunk's joint program (passes/joint/), overlapped,
                      through inductor, wherever it applies; with dropout in training, torch.compile of each chunk
                      (the plan says which)
    fxpar torch.compile   Config(compile=True, joint_graph=False): each chunk's graph through torch.compile
    torch eager       the unmodified model on one rank's process (the same model each rank, no communication)
    torch.compile     torch.compile(model) of the unmodified model, likewise

Dynamo's graph breaks and graphs are counted on rank 0 for each compiled variant (fxpar's: 0 breaks, one graph).

A step is forward, cross-entropy, backward and an SGD step. Every variant's loss and gradients are first checked
against the unmodified model (within 1e-5); with --dropout P > 0 they are not (fxpar draws its masks from its own
random streams, not from the process's generator: tests/test_dropout.py checks those). The first call of each variant is timed on its own (`first call s`:
building, tracing, inductor's code generation with a fresh cache, and the first step); then the variants run
interleaved for R rounds (common.time_rounds) and the table shows the median step time and the median per-round
ratio to fxpar eager.

Run (2 ranks over gloo, 1 thread each):
    .venv/bin/python benchmarks/compile_step.py
    .venv/bin/python benchmarks/compile_step.py --layers 4 --hidden 256 --seq 256 --rounds 10
    .venv/bin/python benchmarks/compile_step.py --pp     # fxpar at p=2 (1F1B, m=4), the rest as above
    .venv/bin/python benchmarks/compile_step.py --attention sdpa   # torch's eager step runs SDPA too
    .venv/bin/python benchmarks/compile_step.py --dropout 0.1      # dropout on: fxpar compile falls back

The example GPT writes its attention out (softmax of masked scores): fxpar's eager step already runs it as one SDPA
kernel (passes/fusion/attention.py), torch's eager step does not, so torch.compile has more to fuse on its side.
With --attention sdpa both eager steps start from the same attention kernel.
"""
from __future__ import annotations

import argparse
import copy
import os
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

if __package__:
    from benchmarks import common
else:
    import common

from gpt import GPT, GPTConfig  # noqa: E402

VARIANTS = ("fxpar eager", "fxpar compile", "fxpar torch.compile", "torch eager", "torch.compile")
TOL = 1e-5


def _loss(out, ids):
    return F.cross_entropy(out.flatten(0, 1), torch.roll(ids, -1, dims=1).flatten())


def _grads(module) -> dict:
    """Gradients by parameter name (torch.compile's wrapper prefix `_orig_mod.` dropped)."""
    return {n.removeprefix("_orig_mod."): p.grad.detach().clone() for n, p in module.named_parameters()
            if p.grad is not None}


def _error(model, ref_loss, ref_grads, ids, full_grads=None) -> float:
    """|loss gap| and the largest gradient gap of one forward and backward (full_grads: how to read full gradients)."""
    model.zero_grad(set_to_none=True)
    loss = _loss(model(ids), ids)
    loss.backward()
    grads = full_grads() if full_grads else _grads(model)
    gap = max((grads[k] - ref_grads[k]).abs().max().item() for k in grads)
    return max(abs(loss.item() - ref_loss), gap)


def run_rank(cfg: GPTConfig, batch: int, rounds: int, steps: int, warmup: int, pp: bool = False,
             microbatches: int = 4) -> dict:
    import fxpar

    torch.manual_seed(0)
    model = GPT(cfg).train()
    ids = torch.randint(0, cfg.vocab, (batch, cfg.seq))
    ref = copy.deepcopy(model)
    ref_loss = _loss(ref(ids), ids)
    ref_loss.backward()
    ref_grads = _grads(ref)
    mesh = fxpar.init_mesh(**{"pp" if pp else "tp": dist.get_world_size()})
    from torch._dynamo.utils import counters

    models, compile_s, breaks, joint = {}, {}, {}, {}
    for name in VARIANTS:
        counters.clear()
        start = time.perf_counter()
        if name.startswith("fxpar") and pp:  # 1F1B over `microbatches`, the loss in the last chunk
            config = fxpar.Config(compile=name != "fxpar eager", joint_graph=_joint(name),
                                  microbatches=microbatches, schedule="1f1b")
            models[name] = fxpar.parallelize(copy.deepcopy(model), mesh, example_args=(ids[:batch // microbatches],),
                                             loss_fn=_pp_loss, config=config)
        elif name.startswith("fxpar"):
            config = fxpar.Config(compile=name != "fxpar eager", joint_graph=_joint(name))
            models[name] = fxpar.parallelize(copy.deepcopy(model), mesh, example_args=(ids,), config=config)
        else:
            models[name] = copy.deepcopy(model)
            if name == "torch.compile":
                models[name] = torch.compile(models[name])
        if name.startswith("fxpar") and pp:
            error = _pp_error(models[name], ref_loss.item(), ref_grads, ids)
        else:
            full = _full_grads(models[name]) if name.startswith("fxpar") else None
            error = _error(models[name], ref_loss.item(), ref_grads, ids, full)
        compile_s[name] = time.perf_counter() - start
        breaks[name] = (sum(counters["graph_break"].values()), counters["stats"]["unique_graphs"])
        if name.startswith("fxpar"):
            joint[name] = models[name].compiled.joint.on
        if error > TOL and cfg.dropout == 0:
            raise AssertionError(f"{name}: not exact, gap {error:.2e} > {TOL}")
    steppers = {n: (_pp_step(m, ids) if pp and n.startswith("fxpar") else _step(m, ids)) for n, m in models.items()}
    timed = common.time_rounds(steppers, rounds, steps, warmup, barrier=True,
                               reduce=dist.ReduceOp.MAX)
    return {"times": timed["times"], "compile_s": compile_s, "breaks": breaks, "joint": joint,
            "config": dict(vars(cfg)) | {"batch": batch, "rounds": rounds,
                                         ("p" if pp else "t"): dist.get_world_size()}}


def _joint(name: str) -> bool | None:
    """Config.joint_graph of a variant: the default (None) but for `fxpar torch.compile`."""
    return False if name == "fxpar torch.compile" else None


def _pp_loss(out, target):
    return F.cross_entropy(out.flatten(0, 1), target.flatten())


def _pp_error(pm, ref_loss: float, ref_grads: dict, ids) -> float:
    """|loss gap| and the largest gradient gap of this pipeline rank's parameters, one pm.step on the whole batch."""
    pm.zero_grad(set_to_none=True)
    loss = pm.step(ids, target=torch.roll(ids, -1, dims=1))
    gap = max((p.grad - ref_grads[k]).abs().max().item() for k, p in pm.named_parameters())
    return max(abs(loss.item() - ref_loss), gap)


def _pp_step(pm, ids):
    opt, target = torch.optim.SGD(pm.parameters(), lr=1e-3), torch.roll(ids, -1, dims=1)

    def step():
        opt.zero_grad(set_to_none=True)
        pm.step(ids, target=target)
        opt.step()

    return step


def _full_grads(pm):
    """Full gradients of a ParallelModule under the original keys (each sharded gradient unsharded over tp)."""
    from fxpar.passes.ir.placements import unshard

    def read() -> dict:
        out = {}
        for key, p in pm.named_parameters():
            spec = pm.rank.specs.get(key)
            out[key] = unshard(pm.rank.comm.all_gather(p.grad.detach()), spec) if spec else p.grad.detach().clone()
        return out

    return read


def _step(model, ids):
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)

    def step():
        opt.zero_grad(set_to_none=True)
        _loss(model(ids), ids).backward()
        opt.step()

    return step


def format_table(result: dict) -> str:
    from tabulate import tabulate

    rows = []
    for name in VARIANTS:
        ratio, q1, q3 = common.paired_ratio(result["times"], name, "fxpar eager")
        breaks, graphs = result["breaks"][name]
        eager = {"fxpar compile": "fxpar eager", "fxpar torch.compile": "fxpar eager",
                 "torch.compile": "torch eager"}.get(name)
        own = "-"
        if eager:  # the compiled step against its own eager step, paired per round
            r, a, b = common.paired_ratio(result["times"], name, eager)
            own = f"{r:.3f} ({a:.3f}-{b:.3f})"
        rows.append([name, statistics.median(result["times"][name]) * 1e3, ratio, f"{q1:.3f}-{q3:.3f}", own,
                     result["compile_s"][name], "joint program (AOT, no dynamo)" if result["joint"].get(name) else
                     f"{breaks} / {graphs}" if "compile" in name else "-"])
    c = result["config"]
    where = f"t={c['t']}" if "t" in c else f"p={c['p']} (1F1B, m=4)"
    head = (f"train step, GPT layers={c['layers']} hidden={c['hidden']} seq={c['seq']} batch={c['batch']} "
            f"vocab={c['vocab']} attention={c.get('attention', 'explicit')} dropout={c.get('dropout', 0.0)}; fxpar "
            f"at {where}, torch on each rank's own process; gloo, 1 thread/rank; "
            f"{c['rounds']} interleaved rounds; ratio: median per-round ratio to fxpar eager; first call s: build, "
            "compile and the first step; graph breaks / graphs: dynamo's, on this rank")
    return head + "\n" + tabulate(rows, headers=["variant", "median ms", "vs fxpar eager", "(IQR)",
                                                "vs its eager (IQR)", "first call s", "graph breaks / graphs or how"],
                                  floatfmt=(None, ".1f", ".3f", None, None, ".1f", None))


def _parse(argv):
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
    p.add_argument("--warm-cache", action="store_true", help="reuse inductor's on-disk cache (default: a fresh one)")
    p.add_argument("--pp", action="store_true", help="fxpar at p=nproc (1F1B over 4 microbatches), not t=nproc")
    p.add_argument("--dropout", type=float, default=0.0, help="the GPT's dropout (> 0: not checked, see above)")
    p.add_argument("--attention", default="explicit", choices=["explicit", "in_graph", "sdpa"],
                   help="the GPT's attention (explicit: fxpar's eager step already runs it as SDPA, torch's does not)")
    return p.parse_args(argv)


def _run(args) -> dict:
    if not args.warm_cache:  # a cold inductor cache per rank: `first call s` includes the whole compile
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="fxpar-inductor-")
    cfg = GPTConfig(vocab=args.vocab, seq=args.seq, layers=args.layers, hidden=args.hidden, heads=args.heads,
                    attention=args.attention, dropout=args.dropout)
    return run_rank(cfg, args.batch, args.rounds, args.steps, args.warmup, pp=args.pp)


def main(argv=None) -> dict:
    return common.launch_and_print(_run, _parse(argv), format_table)


if __name__ == "__main__":
    main()
