"""Benchmark: one pipeline-parallel train step (forward, backward, SGD step) of the example GPT at p=2, fxpar against
torch.distributed.pipelining on the same model, split and schedule.

    fxpar 1f1b           fxpar.parallelize of the unmodified examples/gpt.py GPT, Config(schedule="1f1b")
    torch 1f1b           torch.distributed.pipelining Schedule1F1B over 2 hand-built stage modules
    fxpar interleaved    fxpar with schedule="interleaved-1f1b", v=2 chunks per rank
    torch interleaved    ScheduleInterleaved1F1B over 4 hand-built stage modules, 2 per rank

Same model, same split: the torch stages take exactly the layers of fxpar's chunks (`pm.compiled.partition`), the embeddings
on the first stage, ln_f and the LM head on the last. Every model is untied (GPTConfig(tied=False)): torch's
pipelining has no tied-weight handling, so a tied LM head would need a hand-written all-reduce there only.

Before timing, one step of each variant is checked against the single-process model on the full batch (the loss
and every gradient this rank holds), and fxpar's gradients against torch's, all within 1e-5. The timed step is the
schedule plus SGD; fxpar's pm.step also all-reduces the batch loss to every rank (its API), torch's does not.
Then the variants run interleaved (rotated each round, so none always goes first) for R rounds of S steps; a sample
is the max over ranks of one round's mean step time (and, less sensitive to other load on the machine, the CPU time
of all ranks together). The table shows the median of the R samples, and the fxpar/torch ratio as the median over
rounds of the ratio within the round (the pair ran back to back, so drifting load from other processes on the
machine mostly cancels), with quartiles.

Run (2 ranks over gloo, 1 thread each; prints a table):
    .venv/bin/python benchmarks/pp_step.py                  # spawns 2 ranks itself (FileStore, no port)
    torchrun --standalone --nproc-per-node 2 benchmarks/pp_step.py
    .venv/bin/python benchmarks/pp_step.py --rounds 20 --layers 8 --hidden 256
"""
from __future__ import annotations

import argparse
import copy
import statistics

import torch
import torch.distributed as dist
import torch.nn as nn

if __package__:  # imported as benchmarks.pp_step (the tests)
    from benchmarks import common
else:  # run as a script: benchmarks/ is sys.path[0]
    import common

from gpt import GPT, GPTConfig, loss_fn  # noqa: E402

SCHEDULES = {"1f1b": 1, "interleaved": 2}  # schedule -> chunks per rank v
VARIANTS = tuple(f"{impl} {s}" for s in SCHEDULES for impl in ("fxpar", "torch"))
TOL = 1e-5


# ---- the torch.distributed.pipelining peer ----------------------------------------------------------------------

class StageModule(nn.Module):
    """Layers `layers` of `model` (and the embeddings on the first stage, ln_f + LM head on the last), under the
    model's own parameter names ("h.3.attn.c_attn.weight"), so gradients compare key by key."""

    def __init__(self, model: GPT, layers: tuple[int, ...], first: bool, last: bool):
        super().__init__()
        self.first, self.last = first, last
        if first:
            self.wte, self.wpe = model.wte, model.wpe
        self.h = nn.ModuleDict({str(i): model.h[i] for i in layers})
        if last:
            self.ln_f, self.lm_head = model.ln_f, model.lm_head

    def forward(self, x):
        if self.first:  # x: token ids (b, s)
            x = self.wte(x) + self.wpe(torch.arange(x.shape[1], device=x.device))  # (b, s, h)
        for block in self.h.values():
            x = block(x)
        return self.lm_head(self.ln_f(x)) if self.last else x  # (b, s, V) or (b, s, h)


class TorchPipeline:
    """This rank's stages of `model` split as `layers_of_stage`, run by torch's Schedule1F1B or
    ScheduleInterleaved1F1B; `step(ids, target)` has the signature of fxpar's."""

    def __init__(self, model: GPT, layers_of_stage: list[tuple[int, ...]], microbatches: int):
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleInterleaved1F1B

        rank, p = dist.get_rank(), dist.get_world_size()
        k = len(layers_of_stage)
        mine = [i for i in range(k) if i % p == rank]  # stage i on rank i mod p, as fxpar's chunks
        self.modules = [StageModule(model, layers_of_stage[i], i == 0, i == k - 1) for i in mine]
        stages = [PipelineStage(mod, i, k, torch.device("cpu")) for mod, i in zip(self.modules, mine)]
        if k == p:
            self.schedule = Schedule1F1B(stages[0], microbatches, loss_fn=loss_fn)
        else:
            self.schedule = ScheduleInterleaved1F1B(stages, microbatches, loss_fn=loss_fn)
        self.first, self.last = 0 in mine, k - 1 in mine

    def parameters(self):
        return [q for mod in self.modules for q in mod.parameters()]

    def named_parameters(self):
        return [kv for mod in self.modules for kv in mod.named_parameters()]

    def step(self, ids, target) -> torch.Tensor:
        losses: list = []
        self.schedule.step(*((ids,) if self.first else ()), target=target if self.last else None,
                           losses=losses if self.last else None)
        loss = torch.stack(losses).mean() if self.last else torch.zeros(())  # each microbatch's mean loss
        dist.all_reduce(loss)  # as fxpar's step: the batch loss on every rank (checks only, not timed)
        return loss


def fxpar_pipeline(model: GPT, ids: torch.Tensor, v: int, microbatches: int):
    import fxpar

    config = fxpar.Config(microbatches=microbatches, virtual_stages=v,
                          schedule="interleaved-1f1b" if v > 1 else "1f1b")
    return fxpar.parallelize(model, fxpar.init_mesh(pp=dist.get_world_size()),
                             example_args=(ids[: ids.shape[0] // microbatches],), loss_fn=loss_fn, config=config)


# ---- exactness ---------------------------------------------------------------------------------------------------

def _check(name: str, pipe, ids, target, ref_loss: float, ref_grads: dict) -> tuple[float, float, dict]:
    """(|loss - reference|, max |gradient - reference| over this rank's parameters, {key: gradient} checked)."""
    loss = pipe.step(ids, target=target)
    grad_err, grads = 0.0, {}
    for key, q in pipe.named_parameters():
        if q.grad is None:
            raise AssertionError(f"{name}: parameter {key} got no gradient")
        grad_err = max(grad_err, (q.grad - ref_grads[key]).abs().max().item())
        grads[key] = q.grad
    for q in pipe.parameters():
        q.grad = None
    return abs(loss.item() - ref_loss), grad_err, grads


def _peer_error(fx: dict, pt: dict, sched: str) -> float:
    """Max |fxpar gradient - torch gradient| on this rank; both must hold the same keys (the same split)."""
    if set(fx) != set(pt):
        raise AssertionError(f"{sched}: fxpar holds {sorted(set(fx) - set(pt))} and torch {sorted(set(pt) - set(fx))} "
                             "on this rank only; the torch stages should take fxpar's split")
    return max((fx[k] - pt[k]).abs().max().item() for k in fx)


# ---- one rank --------------------------------------------------------------------------------------------------

def run_rank(cfg: GPTConfig, batch: int, microbatches: int, rounds: int, steps: int, warmup: int) -> dict:
    """Build, check and time the four variants on this rank (a gloo group of size p must exist). Returns, on every
    rank, {"times": {variant: [seconds per step, per round, max over ranks]}, "errors": {variant: (loss, grad)}}."""
    torch.manual_seed(0)
    model = GPT(cfg)
    ids = torch.randint(0, cfg.vocab, (batch, cfg.seq))
    target = torch.roll(ids, -1, dims=1)

    pipes = {}
    for sched, v in SCHEDULES.items():
        pm = fxpar_pipeline(copy.deepcopy(model), ids, v, microbatches)
        layers = [c.layers for c in pm.compiled.partition.chunks]  # the same split for the torch peer
        pipes[f"fxpar {sched}"] = pm
        pipes[f"torch {sched}"] = TorchPipeline(copy.deepcopy(model), layers, microbatches)

    ref_loss = loss_fn(model(ids), target)
    ref_loss.backward()
    ref_grads = {k: q.grad for k, q in model.named_parameters()}
    errors, grads = {}, {}
    for name in VARIANTS:
        *errors[name], grads[name] = _check(name, pipes[name], ids, target, ref_loss.item(), ref_grads)
    peer = [_peer_error(grads[f"fxpar {s}"], grads[f"torch {s}"], s) for s in SCHEDULES]
    err = torch.tensor([e for name in VARIANTS for e in errors[name]] + peer, dtype=torch.float64)
    dist.all_reduce(err, op=dist.ReduceOp.MAX)
    errors = {name: (err[2 * i].item(), err[2 * i + 1].item()) for i, name in enumerate(VARIANTS)}
    peer = {s: err[2 * len(VARIANTS) + i].item() for i, s in enumerate(SCHEDULES)}
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, {name: set(g) for name, g in grads.items()})
    for name in VARIANTS:
        missing = set(ref_grads) - set().union(*(c[name] for c in everyone))
        if missing:
            raise AssertionError(f"{name}: no rank holds the gradients of {sorted(missing)}")

    step_fns = {name: _train_step(pipes[name], ids, target) for name in VARIANTS}
    # wall: a step is as slow as its slowest rank; CPU: the seconds of all ranks (gloo's threads included), the
    # work less the waiting
    timed = common.time_rounds(step_fns, rounds, steps, warmup, barrier=True, reduce=dist.ReduceOp.MAX,
                               reduce_cpu=dist.ReduceOp.SUM)
    return {"times": timed["times"], "errors": errors, "peer": peer, "cpu": timed["cpu"],
            "config": dict(vars(cfg)) | {"batch": batch, "m": microbatches, "p": dist.get_world_size(),
                                         "rounds": rounds, "steps": steps}}


def _train_step(pipe, ids, target, lr: float = 1e-3):
    """One timed train step: the schedule (forward + backward of every microbatch), then SGD. The torch peer's
    step() ends with a loss all-reduce for the checks; the timed step calls the schedule directly instead."""
    opt = torch.optim.SGD(pipe.parameters(), lr=lr)
    if isinstance(pipe, TorchPipeline):
        def run():
            pipe.schedule.step(*((ids,) if pipe.first else ()), target=target if pipe.last else None)
    else:
        def run():
            pipe.step(ids, target=target)

    def step():
        opt.zero_grad(set_to_none=True)
        run()
        opt.step()

    return step


# ---- report ------------------------------------------------------------------------------------------------------

def format_table(result: dict) -> str:
    from tabulate import tabulate

    rows = []
    for name in VARIANTS:
        impl, sched = name.split(" ", 1)
        ratio, iqr, cpu_ratio = None, "", None
        if impl == "fxpar":
            ratio, q1, q3 = common.paired_ratio(result["times"], name, f"torch {sched}")
            iqr = f"{q1:.3f}-{q3:.3f}"
            cpu_ratio = common.paired_ratio(result["cpu"], name, f"torch {sched}")[0]
        loss_err, grad_err = result["errors"][name]
        rows.append([name, SCHEDULES[sched], statistics.median(result["times"][name]) * 1e3, ratio, iqr,
                     statistics.median(result["cpu"][name]) * 1e3, cpu_ratio, f"{loss_err:.1e}", f"{grad_err:.1e}",
                     f"{result['peer'][sched]:.1e}" if impl == "fxpar" else ""])
    c = result["config"]
    head = (f"p={c['p']} train step (pipeline fwd+bwd over m={c['m']} microbatches + SGD), GPT layers={c['layers']} "
            f"hidden={c['hidden']} heads={c['heads']} seq={c['seq']} global batch={c['batch']} vocab={c['vocab']} "
            f"attention={c['attention']} tied={c['tied']}; gloo, 1 thread/rank; {c['rounds']} interleaved rounds x "
            f"{c['steps']} steps; ratio = median of per-round fxpar/torch ratios; "
            "CPU ms = process CPU time of both ranks")
    return head + "\n" + tabulate(
        rows, headers=["variant", "v", "median ms", "fxpar/torch", "(IQR)", "CPU ms", "CPU fxpar/torch",
                     "loss err", "max grad err", "grad fxpar-torch"],
        floatfmt=(None, None, ".1f", ".3f", None, ".1f", ".3f"))


def _parse(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--batch", type=int, default=16, help="global batch, split into --microbatches")
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--attention", default="sdpa", choices=["sdpa", "explicit"])
    p.add_argument("--rounds", type=int, default=10, help="interleaved rounds; the table shows medians over them")
    p.add_argument("--steps", type=int, default=1, help="train steps per variant per round")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps per variant first")
    p.add_argument("--nproc", type=int, default=2, help="ranks to spawn (the pipeline degree p)")
    p.add_argument("--timeout", type=float, default=300.0, help="process-group timeout in seconds")
    return p.parse_args(argv)


def _run(args) -> dict:
    cfg = GPTConfig(vocab=args.vocab, seq=args.seq, layers=args.layers, hidden=args.hidden, heads=args.heads,
                    attention=args.attention, tied=False)
    result = run_rank(cfg, args.batch, args.microbatches, args.rounds, args.steps, args.warmup)
    bad = {n: e for n, e in result["errors"].items() if max(e) > TOL}
    bad.update({f"fxpar {s} vs torch {s}": e for s, e in result["peer"].items() if e > TOL})
    if bad:
        raise AssertionError(f"not exact (max |loss err|, |grad err| per variant, tolerance {TOL}): {bad}")
    return result


def main(argv=None) -> dict:
    """Run the benchmark, print its table, and return the result (rank 0's; {} on other torchrun ranks)."""
    args = _parse(argv)
    result = common.launch(_run, args)
    if not result:
        return {}  # a torchrun rank other than 0
    print(format_table(result), flush=True)
    return result


if __name__ == "__main__":
    main()
