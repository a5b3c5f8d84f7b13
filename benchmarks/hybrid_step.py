"""Benchmark: one p=2 x t=2 train step of the example GPT (4 ranks), fxpar against torch's own hybrid: pipelining
(Schedule1F1B) over stages that DTensor splits tensor-parallel, as torchtitan composes them.

    fxpar  fxpar.parallelize(model, init_mesh(pp=2, tp=2)), 1F1B over m microbatches: nothing to edit
    torch pp + DTensor
           torch.distributed.pipelining over 2 hand-built stage modules (benchmarks/pp_step.py StageModule, the
           layers of fxpar's chunks), each block split by parallelize_module with tp_step.py's hand edits
           (head-interleaved c_attn, the attention forward patched for local heads), the embedding and the LM
           head vocab-parallel

Before timing, one step of each is checked against the single-process model on the whole batch: the loss, and every
gradient this rank holds (a DTensor's whole gradient, c_attn's in the head-interleaved order it was split in),
within 1e-5. Then they run interleaved for R rounds of S steps; the table shows the median step time and the
median per-round fxpar/torch ratio. Four ranks share this machine's cores: compare within a round only.

Run (4 ranks over gloo, 1 thread each):
    .venv/bin/python benchmarks/hybrid_step.py
    .venv/bin/python benchmarks/hybrid_step.py --rounds 12 --layers 8
"""
from __future__ import annotations

import argparse
import copy
import statistics
import types

import torch
import torch.distributed as dist

if __package__:
    from benchmarks import common
    from benchmarks.pp_step import StageModule
    from benchmarks.tp_step import _head_interleaved, dtensor_block
else:
    import common
    from pp_step import StageModule
    from tp_step import _head_interleaved, dtensor_block

from gpt import GPT, GPTConfig, loss_fn  # noqa: E402

VARIANTS = ("fxpar", "torch pp + DTensor")
TOL = 1e-5


def torch_hybrid(model: GPT, layers_of_stage: list[tuple[int, ...]], microbatches: int, p: int, t: int):
    """This rank's stage of `model`, tensor-parallel over DTensor, in torch's Schedule1F1B over the pp group."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = init_device_mesh("cpu", (p, t), mesh_dim_names=("pp", "tp"))
    stage = mesh.get_local_rank("pp")
    module = StageModule(model, layers_of_stage[stage], stage == 0, stage == p - 1)
    for block in module.h.values():
        dtensor_block(block, mesh["tp"], t)
    ends = {"wte": RowwiseParallel(input_layouts=Replicate()), "lm_head": ColwiseParallel(output_layouts=Replicate())}
    parallelize_module(module, mesh["tp"], {k: v for k, v in ends.items() if hasattr(module, k)})
    schedule = Schedule1F1B(PipelineStage(module, stage, p, torch.device("cpu"), group=mesh.get_group("pp")),
                            microbatches, loss_fn=loss_fn)
    return types.SimpleNamespace(module=module, schedule=schedule, first=stage == 0, last=stage == p - 1,
                                 pp_group=mesh.get_group("pp"), t=t)


def _torch_step(h, ids, target):
    losses: list = []
    h.schedule.step(*((ids,) if h.first else ()), target=target if h.last else None,
                    losses=losses if h.last else None)
    return torch.stack(losses).mean() if h.last else torch.zeros(())


def _check_torch(h, ids, target, ref_loss: float, ref_grads: dict) -> tuple[float, float]:
    loss = _torch_step(h, ids, target)
    dist.all_reduce(loss, group=h.pp_group)
    err = 0.0
    for key, q in h.module.named_parameters():
        got = q.grad.full_tensor() if hasattr(q.grad, "full_tensor") else q.grad
        want = ref_grads[key]
        if key.endswith(("attn.c_attn.weight", "attn.c_attn.bias")):
            want = _head_interleaved(want, h.t)
        err = max(err, (got - want).abs().max().item())
    h.module.zero_grad(set_to_none=True)
    return abs(loss.item() - ref_loss), err


def _check_fxpar(pm, ids, target, ref_loss: float, ref_grads: dict) -> tuple[float, float]:
    from fxpar.passes.ir.placements import local_shard

    loss = pm.step(ids, target=target)
    err = 0.0
    for key, q in pm.named_parameters():
        want = ref_grads[key]
        if key in pm.rank.specs:
            want = local_shard(want, pm.rank.specs[key], pm.rank.comm.rank, pm.rank.comm.size)
        err = max(err, (q.grad - want).abs().max().item())
    pm.zero_grad(set_to_none=True)
    return abs(loss.item() - ref_loss), err


def run_rank(args) -> dict:
    import fxpar

    p, t = 2, dist.get_world_size() // 2
    cfg = GPTConfig(vocab=args.vocab, seq=args.seq, layers=args.layers, hidden=args.hidden, heads=args.heads,
                    attention="sdpa", tied=False)  # torch's pipelining has no tied-weight handling
    torch.manual_seed(0)
    model = GPT(cfg)
    ids = torch.randint(0, cfg.vocab, (args.batch, cfg.seq))
    target = torch.roll(ids, -1, dims=1)
    m = args.microbatches
    pm = fxpar.parallelize(copy.deepcopy(model), fxpar.init_mesh(pp=p, tp=t), example_args=(ids[:args.batch // m],),
                           loss_fn=loss_fn, config=fxpar.Config(microbatches=m, schedule="1f1b"))
    h = torch_hybrid(copy.deepcopy(model), [c.layers for c in pm.compiled.partition.chunks], m, p, t)
    ref_loss = loss_fn(model(ids), target)
    ref_loss.backward()
    ref_grads = {k: q.grad for k, q in model.named_parameters()}
    errors = [*_check_fxpar(pm, ids, target, ref_loss.item(), ref_grads),
              *_check_torch(h, ids, target, ref_loss.item(), ref_grads)]
    err = torch.tensor(errors, dtype=torch.float64)
    dist.all_reduce(err, op=dist.ReduceOp.MAX)
    errors = {"fxpar": (err[0].item(), err[1].item()), VARIANTS[1]: (err[2].item(), err[3].item())}
    bad = {n: e for n, e in errors.items() if max(e) > TOL}
    if bad:
        raise AssertionError(f"not exact (max |loss err|, |grad err| per variant, tolerance {TOL}): {bad}")
    steps = {"fxpar": common.sgd_step(pm.parameters(), lambda: pm.step(ids, target=target)),
             VARIANTS[1]: common.sgd_step(h.module.parameters(), lambda: _torch_step(h, ids, target))}
    timed = common.time_rounds(steps, args.rounds, args.steps, args.warmup, barrier=True, reduce=dist.ReduceOp.MAX)
    return {"times": timed["times"], "cpu": timed["cpu"], "errors": errors,
            "config": dict(vars(cfg)) | {"batch": args.batch, "m": m, "p": p, "t": t, "rounds": args.rounds}}


def format_table(result: dict) -> str:
    from tabulate import tabulate

    rows = []
    for name in VARIANTS:
        ratio, q1, q3 = common.paired_ratio(result["times"], name, VARIANTS[1])
        loss_err, grad_err = result["errors"][name]
        rows.append([name, statistics.median(result["times"][name]) * 1e3, ratio, f"{q1:.3f}-{q3:.3f}",
                     f"{loss_err:.1e}", f"{grad_err:.1e}"])
    c = result["config"]
    head = (f"p={c['p']} x t={c['t']} train step (1F1B over m={c['m']} + SGD), GPT layers={c['layers']} "
            f"hidden={c['hidden']} seq={c['seq']} batch={c['batch']} vocab={c['vocab']}; gloo, 4 ranks of 1 thread "
            f"on this machine's cores; {c['rounds']} interleaved rounds; ratio: median per-round fxpar/torch")
    return head + "\n" + tabulate(rows, headers=["variant", "median ms", "fxpar/torch", "(IQR)", "loss err",
                                                 "max grad err"], floatfmt=(None, ".1f", ".3f"))


def _parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--steps", type=int, default=1)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--nproc", type=int, default=4)
    p.add_argument("--timeout", type=float, default=600.0)
    return p.parse_args(argv)


def main(argv=None) -> dict:
    return common.launch_and_print(run_rank, _parse(argv), format_table)


if __name__ == "__main__":
    main()
