"""Benchmark: one tensor-parallel train step (forward, backward, SGD step) of a Llama-shaped model at t=2, two ways.

    fxpar    fxpar.parallelize of an unmodified Hugging Face LlamaForCausalLM (grouped-query attention, SwiGLU,
             RMSNorm, rotary embeddings), built from a config in code
    DTensor  torch.distributed.tensor.parallel.parallelize_module with the plan Hugging Face ships for Llama
             (`base_model_tp_plan`: q/k/v and gate/up column-wise, o and down row-wise), the plan a user of
             torch's tensor parallelism would write; Hugging Face's attention reshapes with -1 heads, so it runs on
             the local heads unpatched

Both start from the same full model; before timing, each one's loss and every local gradient are checked against
the single-process model (within 1e-5). Then they run interleaved for R rounds of S steps (common.time_rounds); the
table shows the median step time and the median per-round ratio.

Run (2 ranks over gloo, 1 thread each):
    .venv/bin/python benchmarks/llama_step.py
    .venv/bin/python benchmarks/llama_step.py --layers 4 --hidden 512 --rounds 20
"""
from __future__ import annotations

import argparse
import copy
import statistics

import torch
import torch.distributed as dist
import torch.nn.functional as F

if __package__:
    from benchmarks import common
else:
    import common

TOL = 1e-5
VARIANTS = ("fxpar", "DTensor")


class Logits(torch.nn.Module):
    """The causal LM's logits (what the loss reads), without the KV cache."""

    def __init__(self, lm):
        super().__init__()
        self.lm = lm

    def forward(self, ids):
        return self.lm(input_ids=ids, use_cache=False).logits


def llama(args) -> Logits:
    import transformers

    transformers.logging.set_verbosity_error()
    config = transformers.LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, num_hidden_layers=args.layers,
                                      num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
                                      intermediate_size=args.intermediate, max_position_embeddings=args.seq)
    config._attn_implementation = "sdpa"
    return Logits(transformers.LlamaForCausalLM(config))


def loss_fn(logits, target):
    return F.cross_entropy(logits.flatten(0, 1), target.flatten())


def dtensor_llama(model: Logits, t: int) -> tuple[Logits, dict]:
    """Hugging Face's tensor-parallel plan for Llama applied with parallelize_module; key -> the dim each weight is
    split on (what its local gradient is a block of)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = init_device_mesh("cpu", (t,))
    styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
    plan = {f"lm.model.{k}": styles[v]() for k, v in model.lm.config.base_model_tp_plan.items() if v in styles}
    parallelize_module(model, mesh, plan)
    dims = {}
    for key, _ in model.named_parameters():
        for pattern, style in plan.items():
            if _matches(key.rsplit(".", 1)[0], pattern):
                dims[key] = (0 if isinstance(style, ColwiseParallel) else 1) if key.endswith("weight") else 0
    return model, dims


def _matches(name: str, pattern: str) -> bool:
    import fnmatch

    return fnmatch.fnmatch(name, pattern)


def _check(name, model, expected, ids, target, ref_loss: float, ref_grads: dict) -> tuple[float, float]:
    loss = loss_fn(model(ids), target)
    loss.backward()
    grad_err = 0.0
    for key, p in model.named_parameters():
        got = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
        want = expected(key, ref_grads[key])
        if got.shape != want.shape:
            raise AssertionError(f"{name}: gradient of {key} has shape {tuple(got.shape)}, expected {tuple(want.shape)}")
        grad_err = max(grad_err, (got - want).abs().max().item())
    model.zero_grad(set_to_none=True)
    return abs(loss.item() - ref_loss), grad_err


def run_rank(args) -> dict:
    import fxpar
    from fxpar.passes.ir.placements import local_shard

    rank, t = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = llama(args)
    ids = torch.randint(0, args.vocab, (args.batch, args.seq))
    target = torch.roll(ids, -1, dims=1)
    pm = fxpar.parallelize(copy.deepcopy(model), fxpar.init_mesh(tp=t), example_args=(ids,))
    dt, dims = dtensor_llama(copy.deepcopy(model), t)
    models = {"fxpar": pm, "DTensor": dt}
    expected = {
        "fxpar": lambda k, g: local_shard(g, pm.rank.specs[k], rank, t) if k in pm.rank.specs else g,
        "DTensor": lambda k, g: g.chunk(t, dims[k])[rank] if k in dims else g,
    }
    ref_loss = loss_fn(model(ids), target)
    ref_loss.backward()
    ref_grads = {k: p.grad for k, p in model.named_parameters()}
    err = torch.tensor([e for name in VARIANTS for e in _check(name, models[name], expected[name], ids, target,
                                                               ref_loss.item(), ref_grads)], dtype=torch.float64)
    dist.all_reduce(err, op=dist.ReduceOp.MAX)
    errors = {name: (err[2 * i].item(), err[2 * i + 1].item()) for i, name in enumerate(VARIANTS)}
    bad = {n: e for n, e in errors.items() if max(e) > TOL}
    if bad:
        raise AssertionError(f"not exact (max |loss err|, |grad err| per variant, tolerance {TOL}): {bad}")
    steps = {name: common.sgd_step(models[name].parameters(), lambda m=models[name]: loss_fn(m(ids), target).backward())
             for name in VARIANTS}
    timed = common.time_rounds(steps, args.rounds, args.steps, args.warmup, barrier=True, reduce=dist.ReduceOp.MAX)
    return {"times": timed["times"], "cpu": timed["cpu"], "errors": errors,
            "config": {k: getattr(args, k) for k in ("layers", "hidden", "heads", "kv_heads", "intermediate", "seq",
                                                     "batch", "vocab", "rounds", "steps")} | {"t": t}}


def format_table(result: dict) -> str:
    from tabulate import tabulate

    rows = []
    for name in VARIANTS:
        ratio, q1, q3 = common.paired_ratio(result["times"], name, "DTensor")
        cpu = common.paired_ratio(result["cpu"], name, "DTensor")[0]
        loss_err, grad_err = result["errors"][name]
        rows.append([name, statistics.median(result["times"][name]) * 1e3, ratio, f"{q1:.3f}-{q3:.3f}", cpu,
                     f"{loss_err:.1e}", f"{grad_err:.1e}"])
    c = result["config"]
    head = (f"t={c['t']} train step (fwd+bwd+SGD), HF Llama layers={c['layers']} hidden={c['hidden']} "
            f"heads={c['heads']} kv_heads={c['kv_heads']} intermediate={c['intermediate']} seq={c['seq']} "
            f"batch={c['batch']} vocab={c['vocab']}; gloo, 1 thread/rank; {c['rounds']} interleaved rounds x "
            f"{c['steps']} steps; ratios are medians of per-round ratios")
    return head + "\n" + tabulate(rows, headers=["variant", "median ms", "vs DTensor", "(IQR)", "CPU vs DTensor",
                                                 "loss err", "max grad err"],
                                    floatfmt=(None, ".1f", ".3f", None, ".3f"))


def _parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--intermediate", type=int, default=704)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--timeout", type=float, default=300.0)
    return p.parse_args(argv)


def main(argv=None) -> dict:
    return common.launch_and_print(run_rank, _parse(argv), format_table)


if __name__ == "__main__":
    main()
