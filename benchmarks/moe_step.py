"""Benchmark: one AdamW train step of a Hugging Face Mixtral on 2 ranks, its experts split four ways.

    dp=2                 init_mesh(dp=2): every rank holds every expert (and its Adam state), its own half of the batch
    dp=2 ep=2 alltoall   init_mesh(dp=2, ep=2), Config(ep_dispatch="alltoall"): each rank holds half the experts; rows
                         sent to their experts' rank by all-to-all (passes/experts/)
    dp=2 ep=2 allgather  the same, rows all-gathered and results reduce-scattered
    tp=2                 init_mesh(tp=2): today's tensor-parallel experts (every expert's columns split), the whole
                         batch on both ranks

Every variant steps the same global batch from the same model, and their losses over the warm-up steps must agree
(within 1e-5). The variants then run interleaved for R rounds (common.time_rounds); the table shows the median step
time, the median per-round ratio against dp=2, and each rank's expert bytes: the expert weights it holds and their
Adam moments, read from the module and the optimizer.

Run (2 ranks over gloo, 1 thread each):
    .venv/bin/python benchmarks/moe_step.py
    .venv/bin/python benchmarks/moe_step.py --experts 16 --rounds 10
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

VARIANTS = ("dp=2", "dp=2 ep=2 alltoall", "dp=2 ep=2 allgather", "tp=2")
TOL = 1e-5


def _mixtral(args):
    from transformers import MixtralConfig, MixtralForCausalLM

    config = MixtralConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.ffn,
                           num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=args.heads,
                           num_local_experts=args.experts, num_experts_per_tok=args.top_k,
                           max_position_embeddings=args.seq, use_cache=False)
    torch.manual_seed(0)
    return MixtralForCausalLM(config).train()


def _loss(out, target):
    return torch.nn.functional.cross_entropy(out.logits.flatten(0, 1), target.flatten())


def run_rank(args) -> dict:
    import fxpar

    model = _mixtral(args)
    n = dist.get_world_size()
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, args.vocab, (args.batch * n, args.seq), generator=g)
    target = torch.roll(ids, -1, dims=1)
    kwargs = {"use_cache": False}
    setups = {"dp=2": (dict(dp=n), {}), "dp=2 ep=2 alltoall": (dict(dp=n, ep=n), dict(ep_dispatch="alltoall")),
              "dp=2 ep=2 allgather": (dict(dp=n, ep=n), dict(ep_dispatch="allgather")), "tp=2": (dict(tp=n), {})}
    steps, losses, experts = {}, {}, {}
    for name in VARIANTS:
        mesh_kw, config = setups[name]
        rows = ids[:args.batch] if "dp" in mesh_kw else ids
        pm = fxpar.parallelize(copy.deepcopy(model), fxpar.init_mesh(**mesh_kw), example_args=(rows,),
                               example_kwargs=kwargs, loss_fn=_loss, config=fxpar.Config(**config))
        opt = pm.optimizer(torch.optim.AdamW, lr=1e-4)
        steps[name] = common.pm_step(pm, opt, ids, target=target, **kwargs)
        losses[name] = [steps[name]() for _ in range(max(args.warmup, 1))]
        held = {p for k, p in pm.named_parameters() if ".experts." in k}
        experts[name] = sum(p.numel() * p.element_size() for p in held) + sum(
            t.numel() * t.element_size() for p, s in opt.state.items() if p in held for t in s.values() if t.dim())
    gap = max(abs(a - b) / abs(b) for name in VARIANTS for a, b in zip(losses[name], losses["dp=2"]))
    timed = common.time_rounds(steps, args.rounds, 1, 0, barrier=True, reduce=dist.ReduceOp.MAX)
    return {"times": timed["times"], "gap": gap, "experts": experts, "config": vars(args) | {"n": n}}


def format_table(result: dict) -> str:
    from tabulate import tabulate

    rows = common.ratio_rows(result["times"], "dp=2", result["experts"])
    c = result["config"]
    head = (f"Mixtral AdamW train step on {c['n']} ranks: layers={c['layers']} hidden={c['hidden']} "
            f"experts={c['experts']} top-{c['top_k']} ffn={c['ffn']} seq={c['seq']} batch={c['batch']}/dp rank "
            f"vocab={c['vocab']}; gloo, 1 thread/rank; {c['rounds']} interleaved rounds; losses agree within "
            f"{result['gap']:.1e} (relative)")
    return head + "\n" + tabulate(rows, headers=["experts", "median ms", "vs dp=2", "(IQR)",
                                                 "expert weights + Adam MiB/rank"],
                                  floatfmt=(None, ".1f", ".3f", None, ".2f"))


def _parse(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--ffn", type=int, default=512)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--timeout", type=float, default=300.0)
    return p.parse_args(argv)


def _run(args) -> dict:
    result = run_rank(args)
    if result["gap"] > TOL:
        raise AssertionError(f"the variants' losses differ by {result['gap']} (relative; tolerance {TOL})")
    return result


def main(argv=None) -> dict:
    return common.launch_and_print(_run, _parse(argv), format_table)


if __name__ == "__main__":
    main()
