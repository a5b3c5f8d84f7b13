"""Benchmark: one tensor-parallel train step (forward, backward, SGD step) of the example GPT at t=2, three ways.

    fxpar         fxpar.parallelize of the unmodified examples/gpt.py GPT
    hand-written  benchmarks/megatron_gpt.py: Megatron's ColumnParallel/RowParallel layers and f/g, written by hand
    DTensor       torch.distributed.tensor.parallel.parallelize_module with Colwise/Rowwise plans

All three start from the same full model; before timing, each one's loss and every local gradient are checked against
the single-process model (within 1e-5). Then the variants run interleaved (ABC, BCA, CAB, ... so none always goes
first) for R rounds of S steps; a sample is the max over ranks of one round's mean step time. The table shows the
median of the R samples, and each ratio as the median over rounds of the ratio within the round (the variants of a
round ran back to back, so drifting load from other processes on the machine mostly cancels), with its quartiles.
The min column is the least disturbed round, a lower bound on a quiet machine; CPU ms is the median CPU time per
step of the busier rank (time.process_time: it leaves out time spent waiting for the other rank or for a core, so it
is the steadier number when other processes load the machine).

What DTensor needs from the user (the pain point fxpar removes), done by `dtensor_gpt` below:
  * the fused c_attn: a plain Colwise split gives rank 0 all of Q and half of K, so its rows are first reordered
    head-interleaved by hand, so that rank r's block is [Q heads of r | K heads of r | V heads of r];
  * the attention forward is patched: it splits c_attn's output by the full hidden size C and views it with the full
    head count, both wrong on a local shard; the patch sets the head count to the local heads (heads/t) and splits
    the local output in three;
  * the tied LM head is tied again by hand after parallelize_module, which gives the embedding and the LM head
    separate sharded copies of the one weight.

Run (2 ranks over gloo, 1 thread each; prints a table):
    .venv/bin/python benchmarks/tp_step.py                  # spawns 2 ranks itself (FileStore, no port)
    torchrun --standalone --nproc-per-node 2 benchmarks/tp_step.py
    .venv/bin/python benchmarks/tp_step.py --rounds 30 --layers 8 --hidden 512
"""
from __future__ import annotations

import argparse
import copy
import statistics
import types

import torch
import torch.distributed as dist
import torch.nn.functional as F

if __package__:  # imported as benchmarks.tp_step (the tests)
    from benchmarks import common
else:  # run as a script: benchmarks/ is sys.path[0]
    import common

from gpt import GPT, GPTConfig, loss_fn  # noqa: E402
from megatron_gpt import MegatronGPT, shard  # noqa: E402

VARIANTS = ("fxpar", "hand-written", "DTensor")
TOL = 1e-5


# ---- the three tensor-parallel models --------------------------------------------------------------------------

def fxpar_gpt(model: GPT, ids: torch.Tensor, t: int):
    """The unmodified GPT through fxpar: nothing to edit."""
    import fxpar

    return fxpar.parallelize(model, fxpar.init_mesh(tp=t), example_args=(ids,))


def _head_interleaved(full: torch.Tensor, t: int) -> torch.Tensor:
    """Reorder c_attn's rows [Q | K | V] so that a plain split into t blocks gives rank r [Q_r | K_r | V_r]."""
    parts = [p.chunk(t, dim=0) for p in full.chunk(3, dim=0)]
    return torch.cat([parts[i][r] for r in range(t) for i in range(3)], dim=0)


def _local_attention_forward(self, x):
    """examples/gpt.py Attention.forward, edited for local shards: split c_attn's output in 3, local head count."""
    B, T, _ = x.shape
    q, k, v = self.c_attn(x).chunk(3, dim=2)  # each (B, T, C/t); the original splits by the full C
    hd = q.shape[-1] // self.heads  # self.heads was set to heads/t
    q = q.view(B, T, self.heads, hd).transpose(1, 2)  # (B, nh/t, T, hd)
    k = k.view(B, T, self.heads, hd).transpose(1, 2)
    v = v.view(B, T, self.heads, hd).transpose(1, 2)
    if self.attention == "sdpa":
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    else:
        att = (q @ k.transpose(-2, -1)) * (1.0 / hd ** 0.5)
        att = att.masked_fill(self.mask[:, :, :T, :T] == 0, float("-inf"))
        y = self.attn_drop(F.softmax(att, dim=-1)) @ v
    y = y.transpose(1, 2).contiguous().view(B, T, -1)  # (B, T, C/t)
    return self.c_proj(y)


def dtensor_block(block, mesh, t: int) -> None:
    """One GPT block split over `mesh` (1-D, size t) by DTensor, with the hand edits of the module docstring."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    attn = block.attn
    with torch.no_grad():
        for p in (attn.c_attn.weight, attn.c_attn.bias):
            p.copy_(_head_interleaved(p, t))
    attn.heads //= t
    attn.forward = types.MethodType(_local_attention_forward, attn)
    parallelize_module(block, mesh, {
        "attn.c_attn": ColwiseParallel(), "attn.c_proj": RowwiseParallel(),
        "mlp.c_fc": ColwiseParallel(), "mlp.c_proj": RowwiseParallel(),
    })


def dtensor_gpt(model: GPT, t: int):
    """The same GPT through torch's DTensor TP, with the hand edits listed in the module docstring."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = init_device_mesh("cpu", (t,), mesh_dim_names=("tp",))
    for block in model.h:
        dtensor_block(block, mesh, t)
    parallelize_module(model, mesh, {
        "wte": RowwiseParallel(input_layouts=Replicate()),  # vocab-parallel embedding, all-reduced
        "lm_head": ColwiseParallel(output_layouts=Replicate()),  # vocab-parallel logits, all-gathered
    })
    if model.cfg.tied:
        model.lm_head.weight = model.wte.weight  # parallelize_module untied them
    return model


# ---- exactness ---------------------------------------------------------------------------------------------------

def _local(x) -> torch.Tensor:
    return x.to_local() if hasattr(x, "to_local") else x


def _check(name: str, tp, expected_shard, ids, target, ref_loss: float, ref_grads: dict) -> tuple[float, float]:
    """Max |loss - reference| and max |local gradient - the reference gradient's block| on this rank."""
    loss = loss_fn(tp(ids), target)
    loss.backward()
    grad_err = 0.0
    for key, p in tp.named_parameters():
        if p.grad is None:
            raise AssertionError(f"{name}: parameter {key} got no gradient")
        want = expected_shard(key, ref_grads[key])
        got = _local(p.grad)
        if got.shape != want.shape:
            raise AssertionError(f"{name}: gradient of {key} has shape {tuple(got.shape)}, expected {tuple(want.shape)}")
        grad_err = max(grad_err, (got - want).abs().max().item())
    tp.zero_grad(set_to_none=True)
    return abs(loss.item() - ref_loss), grad_err


# ---- one rank --------------------------------------------------------------------------------------------------

def run_rank(cfg: GPTConfig, batch: int, rounds: int, steps: int, warmup: int, check: bool = True) -> dict:
    """Build, check and time the three variants on this rank (a gloo group of size t must exist). Returns, on every
    rank, {"times" and "cpu": {variant: [wall / CPU seconds per step, one per round, max over ranks]},
    "errors": {variant: (max |loss error|, max |gradient error|) over ranks}, "config": {...}}."""
    from fxpar.passes.ir.placements import local_shard

    rank, t = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = GPT(cfg)
    ids = torch.randint(0, cfg.vocab, (batch, cfg.seq))
    target = torch.roll(ids, -1, dims=1)

    pm = fxpar_gpt(copy.deepcopy(model), ids, t)
    models = {
        "fxpar": pm,
        "hand-written": MegatronGPT.from_full(model, rank, t, group=pm.rank.comm.group),  # fxpar's gloo group
        "DTensor": dtensor_gpt(copy.deepcopy(model), t),
    }
    expected = {
        "fxpar": lambda k, g: local_shard(g, pm.rank.specs[k], rank, t) if k in pm.rank.specs else g,
        "hand-written": lambda k, g: shard(k, g, cfg, rank, t),
        "DTensor": lambda k, g: shard(k, g, cfg, rank, t),  # the same layout, via the head-interleaved c_attn
    }
    errors = {}
    if check:
        ref_loss = loss_fn(model(ids), target)
        ref_loss.backward()
        ref_grads = {k: p.grad for k, p in model.named_parameters()}
        for name in VARIANTS:
            errors[name] = _check(name, models[name], expected[name], ids, target, ref_loss.item(), ref_grads)
        err = torch.tensor([e for name in VARIANTS for e in errors[name]], dtype=torch.float64)
        dist.all_reduce(err, op=dist.ReduceOp.MAX)
        errors = {name: (err[2 * i].item(), err[2 * i + 1].item()) for i, name in enumerate(VARIANTS)}

    step_fns = {name: train_step(models[name], ids, target) for name in VARIANTS}
    timed = common.time_rounds(step_fns, rounds, steps, warmup, barrier=True,
                               reduce=dist.ReduceOp.MAX)  # a step is as slow as its slowest rank
    return {"times": timed["times"], "cpu": timed["cpu"], "errors": errors,
            "config": dict(vars(cfg)) | {"batch": batch, "t": t, "rounds": rounds, "steps": steps}}


def train_step(model, ids, target, lr: float = 1e-3):
    """One train step of `model` (forward, the GPT's loss, backward, SGD) as a function of nothing, for the timer."""
    opt = torch.optim.SGD(model.parameters(), lr=lr)

    def step():
        opt.zero_grad(set_to_none=True)
        loss_fn(model(ids), target).backward()
        opt.step()

    return step


# ---- report ------------------------------------------------------------------------------------------------------

def format_table(result: dict) -> str:
    from tabulate import tabulate

    rows = []
    for name in VARIANTS:
        vs_hand, q1, q3 = common.paired_ratio(result["times"], name, "hand-written")
        vs_dtensor = common.paired_ratio(result["times"], name, "DTensor")[0]
        loss_err, grad_err = result["errors"].get(name, (float("nan"), float("nan")))
        rows.append([name, statistics.median(result["times"][name]) * 1e3, min(result["times"][name]) * 1e3,
                     statistics.median(result["cpu"][name]) * 1e3, vs_hand, f"{q1:.3f}-{q3:.3f}", vs_dtensor,
                     f"{loss_err:.1e}", f"{grad_err:.1e}"])
    c = result["config"]
    head = (f"t={c['t']} train step (fwd+bwd+SGD), GPT layers={c['layers']} hidden={c['hidden']} heads={c['heads']} "
            f"seq={c['seq']} batch={c['batch']} vocab={c['vocab']} attention={c['attention']}; gloo, 1 thread/rank; "
            f"{c['rounds']} interleaved rounds x {c['steps']} steps; ratios are medians of per-round ratios")
    return head + "\n" + tabulate(
        rows, headers=["variant", "median ms", "min ms", "CPU ms", "vs hand-written", "(IQR)", "vs DTensor",
                       "loss err", "max grad err"], floatfmt=(None, ".1f", ".1f", ".1f", ".3f", None, ".3f"))


def _parse(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--attention", default="sdpa", choices=["sdpa", "explicit"])
    p.add_argument("--rounds", type=int, default=20, help="interleaved rounds; the table shows medians over them")
    p.add_argument("--steps", type=int, default=2, help="train steps per variant per round")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps per variant first")
    p.add_argument("--nproc", type=int, default=2, help="ranks to spawn (the tensor-parallel degree t)")
    p.add_argument("--timeout", type=float, default=300.0, help="process-group timeout in seconds")
    return p.parse_args(argv)


def _run(args) -> dict:
    cfg = GPTConfig(vocab=args.vocab, seq=args.seq, layers=args.layers, hidden=args.hidden, heads=args.heads,
                    attention=args.attention)
    result = run_rank(cfg, args.batch, args.rounds, args.steps, args.warmup)
    bad = {n: e for n, e in result["errors"].items() if max(e) > TOL}
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
