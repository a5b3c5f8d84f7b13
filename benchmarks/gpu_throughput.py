"""Tokens/s and MFU on one GPU in bf16: fxpar's executable at t=1 (eager and compiled) against the unmodified model
(eager and torch.compile), a GPT of about 1B parameters.

    .venv/bin/python benchmarks/gpu_throughput.py                                         # ~1B GPT, H100 peak
    torchrun --standalone --nproc-per-node 1 benchmarks/gpu_throughput.py
    torchrun --standalone --nproc-per-node 1 benchmarks/gpu_throughput.py --peak-tflops 989 --batch 8

    fxpar eager      fxpar.parallelize(model, init_mesh(tp=1), loss_fn, Config(mixed_precision=MixedPrecision()))
                     (bf16 parameters and GEMMs, fp32 main parameters in pm.optimizer(AdamW))
    fxpar compile    the same with Config(compile=True, joint_graph=False): torch.compile of each chunk
    fxpar joint      the same with Config(joint_graph=True): the joint forward+backward program (passes/joint/)
    fxpar joint compile   the joint programs through inductor, Config(joint_graph=True, compile=True)
    torch eager      the unmodified model under torch.autocast(bfloat16), fp32 parameters, AdamW
    torch.compile    torch.compile of it, likewise

A step is forward, cross-entropy, backward and AdamW. Before timing, each variant's first loss is compared with the
fp32 model's (bf16 against fp32: within 2e-2 relative, a sanity check, not an exactness claim; exactness is fp32's,
in tests). Then each variant runs `--warmup` untimed steps and `--steps` timed ones (CUDA-synchronized), in turn,
for `--rounds` rounds; the table shows the median step time, tokens/s and MFU: model FLOPs per step (PTD-P's Eq. 3
without recomputation, cost/flops.py) over step time and the GPU's peak (`--peak-tflops`, default H100 SXM dense
bf16, 989). Without CUDA it runs a tiny configuration on the CPU (a dry run of the script itself).
"""
from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import fxpar  # noqa: E402
from cost.flops import flops_per_iteration  # noqa: E402
from cost.shape import ModelShape  # noqa: E402
from gpt import GPT, GPTConfig, loss_fn  # noqa: E402

VARIANTS = ("fxpar eager", "fxpar compile", "fxpar joint", "fxpar joint compile", "torch eager", "torch.compile")


def _variant(name: str, model, ids, target, device):
    """(step function, first loss) of one variant."""
    if name.startswith("fxpar"):
        config = fxpar.Config(mixed_precision=fxpar.MixedPrecision(), compile=name.endswith("compile"),
                              joint_graph="joint" in name)
        pm = fxpar.parallelize(copy.deepcopy(model), fxpar.init_mesh(tp=1), example_args=(ids,), loss_fn=loss_fn,
                               example_target=target, config=config)
        opt = pm.optimizer(torch.optim.AdamW, lr=1e-4)

        def step():
            opt.zero_grad()
            loss = pm.step(ids, target=target)
            opt.step()
            return loss
    else:
        module = copy.deepcopy(model)
        run = torch.compile(module) if name == "torch.compile" else module
        opt = torch.optim.AdamW(module.parameters(), lr=1e-4)

        def step():
            opt.zero_grad()
            with torch.autocast(device.type, dtype=torch.bfloat16):
                loss = loss_fn(run(ids), target)
            loss.backward()
            opt.step()
            return loss
    return step


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--vocab", type=int, default=50304)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--steps", type=int, default=5, help="timed steps per variant per round")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--peak-tflops", type=float, default=989.0, help="the GPU's dense bf16 peak (H100 SXM: 989)")
    args = p.parse_args(argv)
    mesh_ok = "WORLD_SIZE" in os.environ
    cuda = torch.cuda.is_available()
    if not cuda:  # a dry run on the CPU: the script's own paths, tiny sizes
        args.layers, args.hidden, args.heads, args.seq, args.vocab, args.batch = 2, 64, 4, 32, 256, 2
        args.steps, args.warmup, args.rounds = 1, 1, 1
    if not mesh_ok:  # run as a script: one rank, a file store (no port)
        store = dist.FileStore(tempfile.mktemp(prefix="fxpar-gpu-"), 1)
        dist.init_process_group("nccl" if cuda else "gloo", store=store, rank=0, world_size=1)
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    torch.manual_seed(0)
    cfg = GPTConfig(vocab=args.vocab, seq=args.seq, layers=args.layers, hidden=args.hidden, heads=args.heads,
                    attention="sdpa")
    model = GPT(cfg).to(device)
    ids = torch.randint(0, args.vocab, (args.batch, args.seq), device=device)
    target = torch.roll(ids, -1, dims=1)
    with torch.no_grad():
        fp32_loss = loss_fn(model(ids), target).item()
    steps, first = {}, {}
    for name in VARIANTS:
        steps[name] = _variant(name, model, ids, target, device)
        start = time.perf_counter()
        first[name] = (steps[name]().item(), time.perf_counter() - start)
        if abs(first[name][0] - fp32_loss) > 2e-2 * abs(fp32_loss):
            raise AssertionError(f"{name}: bf16 loss {first[name][0]:.4f} against fp32 {fp32_loss:.4f}")
    times = {name: [] for name in VARIANTS}
    for _ in range(args.rounds):
        for name in VARIANTS:
            for _ in range(args.warmup):
                steps[name]()
            _sync(device)
            start = time.perf_counter()
            for _ in range(args.steps):
                steps[name]()
            _sync(device)
            times[name].append((time.perf_counter() - start) / args.steps)
    shape = ModelShape(layers=args.layers, hidden=args.hidden, heads=args.heads, seq=args.seq, vocab=args.vocab,
                       batch=args.batch)
    flops = flops_per_iteration(shape, recompute="none")
    params = sum(q.numel() for q in model.parameters())
    from tabulate import tabulate

    rows = []
    for name in VARIANTS:
        t = statistics.median(times[name])
        rows.append([name, t * 1e3, args.batch * args.seq / t, flops / t / (args.peak_tflops * 1e12),
                     first[name][1], first[name][0]])
    print(f"{device} ({torch.cuda.get_device_name() if cuda else 'dry run'}), GPT {params / 1e9:.2f}B parameters "
          f"(layers={args.layers} hidden={args.hidden} seq={args.seq} vocab={args.vocab}), batch {args.batch}, bf16; "
          f"{args.rounds} rounds x {args.steps} steps; fp32 loss {fp32_loss:.4f}")
    print(tabulate(rows, headers=["variant", "median ms", "tokens/s", "MFU", "first step s", "first loss"],
                   floatfmt=(None, ".1f", ".0f", ".3f", ".1f", ".4f")))
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
