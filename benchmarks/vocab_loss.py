"""Benchmark: the vocab-parallel cross-entropy against the gathered logits, one t=2 train step of the example GPT.

    vocab-parallel  loss_fn = F.cross_entropy, traced with the model: the logits stay sharded, the ranks all-reduce
                    per-token values (passes/tensor_parallel/vocab_kernels.py)
    gathered        the same loss spelled with class weights of ones (no vocab-parallel rule: the plan says so), so
                    the logits are all-gathered on every rank and the cross-entropy runs on the full vocabulary

Both are checked against the single-process loss first (within 1e-5). The variants then run interleaved for R rounds
(common.time_rounds); the table shows the median step time, the median per-round ratio, and the bytes each step
moves for the loss, counted at the dispatcher (every c10d collective's tensor bytes on rank 0).

Run (2 ranks over gloo, 1 thread each):
    .venv/bin/python benchmarks/vocab_loss.py                      # vocab 32768
    .venv/bin/python benchmarks/vocab_loss.py --vocab 50304 --rounds 10
"""
from __future__ import annotations

import argparse
import collections
import copy
import statistics

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

if __package__:
    from benchmarks import common
else:
    import common

from gpt import GPT, GPTConfig  # noqa: E402

VARIANTS = ("vocab-parallel", "gathered")
TOL = 1e-5


def _ce(logits, target):
    return F.cross_entropy(logits.flatten(0, 1), target.flatten())


def _ce_gathered(logits, target):
    weight = torch.ones(logits.shape[-1], dtype=logits.dtype)  # the same loss, without a vocab-parallel rule
    return F.cross_entropy(logits.flatten(0, 1), target.flatten(), weight=weight)


class _Bytes(TorchDispatchMode):
    """Bytes of every tensor argument of the c10d collectives that reach the dispatcher, by collective."""

    def __init__(self):
        super().__init__()
        self.bytes = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "c10d":
            leaves = torch.utils._pytree.tree_leaves((args, kwargs))
            self.bytes[func.__name__.split(".")[0]] += sum(x.numel() * x.element_size() for x in leaves
                                                             if isinstance(x, torch.Tensor))
        return func(*args, **(kwargs or {}))


def run_rank(cfg: GPTConfig, batch: int, rounds: int, steps: int, warmup: int) -> dict:
    import fxpar

    torch.manual_seed(0)
    model = GPT(cfg)
    ids = torch.randint(0, cfg.vocab, (batch, cfg.seq))
    target = torch.roll(ids, -1, dims=1)
    ref = _ce(model(ids), target).item()
    mesh = fxpar.init_mesh(tp=dist.get_world_size())
    pms = {name: fxpar.parallelize(copy.deepcopy(model), mesh, example_args=(ids,), loss_fn=fn, example_target=target)
           for name, fn in zip(VARIANTS, (_ce, _ce_gathered))}
    errors, traffic, plans = {}, {}, {}
    for name, pm in pms.items():
        with _Bytes() as counted:
            errors[name] = abs(pm.step(ids, target=target).item() - ref)
        traffic[name], plans[name] = dict(counted.bytes), pm.plan.logits
    steps_fns = {name: _step(pm, ids, target) for name, pm in pms.items()}
    timed = common.time_rounds(steps_fns, rounds, steps, warmup, barrier=True, reduce=dist.ReduceOp.MAX)
    return {"times": timed["times"], "errors": errors, "bytes": traffic, "plans": plans,
            "config": dict(vars(cfg)) | {"batch": batch, "t": dist.get_world_size(), "rounds": rounds}}


def _step(pm, ids, target):
    opt = torch.optim.SGD(pm.parameters(), lr=1e-3)

    def step():
        opt.zero_grad(set_to_none=True)
        pm.step(ids, target=target)
        opt.step()

    return step


def format_table(result: dict) -> str:
    from tabulate import tabulate

    rows = []
    for name in VARIANTS:
        ratio, q1, q3 = common.paired_ratio(result["times"], name, "gathered")
        moved = result["bytes"][name]
        rows.append([name, statistics.median(result["times"][name]) * 1e3, ratio, f"{q1:.3f}-{q3:.3f}",
                     moved.get("allgather_", 0) / 2**20, moved.get("allreduce_", 0) / 2**20,
                     f"{result['errors'][name]:.1e}"])
    c = result["config"]
    head = (f"t={c['t']} train step, GPT layers={c['layers']} hidden={c['hidden']} seq={c['seq']} batch={c['batch']} "
            f"vocab={c['vocab']}; gloo, 1 thread/rank; {c['rounds']} interleaved rounds; ratio: median per-round "
            "ratio to gathered; MiB: tensor bytes per step through each collective on rank 0")
    return head + "\n" + tabulate(rows, headers=["loss", "median ms", "vs gathered", "(IQR)", "all-gather MiB",
                                                 "all-reduce MiB", "loss err"], floatfmt=(None, ".1f", ".3f"))


def _parse(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--vocab", type=int, default=32768)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--steps", type=int, default=1)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--timeout", type=float, default=300.0)
    return p.parse_args(argv)


def _run(args) -> dict:
    cfg = GPTConfig(vocab=args.vocab, seq=args.seq, layers=args.layers, hidden=args.hidden, heads=args.heads)
    result = run_rank(cfg, args.batch, args.rounds, args.steps, args.warmup)
    bad = {n: e for n, e in result["errors"].items() if e > TOL}
    if bad:
        raise AssertionError(f"not exact (|loss err| per variant, tolerance {TOL}): {bad}")
    return result


def main(argv=None) -> dict:
    return common.launch_and_print(_run, _parse(argv), format_table)


if __name__ == "__main__":
    main()
