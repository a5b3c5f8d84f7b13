"""Train the example GPT on real text with any (p, t, d, v): the Python standard library's own sources, as bytes.

    torchrun --nproc-per-node 4 examples/train_gpt.py --tp 2 --pp 2 --vpp 1
    fxpar run --nproc-per-node 4 examples/train_gpt.py --tp 2 --pp 2      (the same, through fxpar's wrapper)

d is what is left: world size / (t * p). The loss is traced with the model (the vocab-parallel cross-entropy at
t > 1: the logits are never gathered), the optimizer is AdamW through pm.optimizer (Megatron's distributed
optimizer with --zero 1), the gradients are clipped by their global norm (--clip), and the model computes in bf16
with fp32 main parameters and gradients (--precision). With --checkpoint DIR it saves every --save-every steps and
resumes from the newest complete checkpoint in DIR, so under `torchrun --max-restarts N` a run whose rank dies goes
on from its last checkpoint:

    torchrun --nproc-per-node 2 --max-restarts 1 examples/train_gpt.py --tp 2 --checkpoint ckpt --kill-at-step 7
"""
from __future__ import annotations

import argparse
import glob
import os
import resource
import signal
import sys
import sysconfig
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import fxpar  # noqa: E402
import fxpar.checkpoint.dcp  # noqa: E402
from gpt import GPT, GPTConfig, loss_fn  # noqa: E402


def stdlib_bytes(limit: int = 4 << 20) -> torch.Tensor:
    """Up to `limit` bytes of the standard library's .py files, in a fixed order (real text, already here)."""
    root = sysconfig.get_paths()["stdlib"]
    data, size = [], 0
    for path in sorted(glob.glob(os.path.join(root, "*.py"))):
        with open(path, "rb") as f:
            chunk = f.read()
        data.append(chunk)
        size += len(chunk)
        if size >= limit:
            break
    return torch.frombuffer(bytearray(b"".join(data)), dtype=torch.uint8).long()


def batches(text: torch.Tensor, batch: int, seq: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    while True:
        start = torch.randint(0, len(text) - seq - 1, (batch,), generator=g)
        window = torch.stack([text[s : s + seq + 1] for s in start.tolist()])
        yield window[:, :-1], window[:, 1:]


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--vpp", type=int, default=1)
    p.add_argument("--microbatches", type=int, default=None, help="default: 2*pp")
    p.add_argument("--schedule", default=None, help="default: interleaved-1f1b if vpp > 1, else 1f1b")
    p.add_argument("--batch", type=int, default=16, help="global batch (sequences)")
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--zero", type=int, default=1, choices=[0, 1], help="1: optimizer state sharded over dp")
    p.add_argument("--clip", type=float, default=1.0, help="max global gradient norm (0: no clipping)")
    p.add_argument("--precision", default="bf16", choices=["bf16", "fp16", "fp32"],
                   help="bf16/fp16: mixed precision with fp32 main parameters and gradients (fp16 with loss scaling)")
    p.add_argument("--trace-dir", default=None, help="write each rank's Chrome trace of the last step here")
    p.add_argument("--checkpoint", default=None, help="directory of checkpoints: resume from its latest, save into it")
    p.add_argument("--save-every", type=int, default=10, help="steps between checkpoints (with --checkpoint)")
    p.add_argument("--kill-at-step", type=int, default=None,
                   help="to try an elastic restart: the last rank SIGKILLs itself before this step, on the first "
                        "attempt only (torchrun --max-restarts 1 ... --checkpoint DIR)")
    return p.parse_args(argv)


def main(argv=None):
    args = parse(argv)
    torch.set_num_threads(1)
    if not dist.is_initialized():
        dist.init_process_group("gloo")
    world = dist.get_world_size()
    if world % (args.tp * args.pp):
        raise SystemExit(f"world size {world} is not divisible by tp*pp = {args.tp * args.pp}")
    dp = world // (args.tp * args.pp)
    m = args.microbatches or 2 * args.pp
    schedule = args.schedule or ("interleaved-1f1b" if args.vpp > 1 else "1f1b")
    if args.batch % (dp * m):
        raise SystemExit(f"--batch {args.batch} must be a multiple of dp*microbatches = {dp}*{m} = {dp * m}")
    mesh = fxpar.init_mesh(tp=args.tp, pp=args.pp, dp=dp)
    torch.manual_seed(0)
    cfg = GPTConfig(vocab=256, seq=args.seq, layers=args.layers, hidden=args.hidden, heads=args.heads)
    model = GPT(cfg)
    example = torch.zeros(args.batch // (dp * m), args.seq, dtype=torch.long)
    mixed = {"bf16": fxpar.MixedPrecision(torch.bfloat16),
             "fp16": fxpar.MixedPrecision(torch.float16, loss_scale="dynamic"), "fp32": None}[args.precision]
    config = fxpar.Config(microbatches=m, virtual_stages=args.vpp, schedule=schedule, trace_dir=args.trace_dir,
                          zero=args.zero, mixed_precision=mixed)
    pm = fxpar.parallelize(model, mesh, example_args=(example,), loss_fn=loss_fn, config=config,
                           example_target=example)
    opt = pm.optimizer(torch.optim.AdamW, lr=args.lr)
    data = batches(stdlib_bytes(), args.batch, args.seq, seed=0)
    rank0 = dist.get_rank() == 0
    first = 0
    latest = fxpar.checkpoint.dcp.latest(args.checkpoint) if args.checkpoint else None
    if latest:  # resume: weights, optimizer state, random streams; the data position is the step
        first = fxpar.load(latest, pm, optimizer=opt)["step"]
        for _ in range(first):
            next(data)
        if rank0:
            print(f"resumed from {latest} at step {first}", flush=True)
    if rank0:
        print(f"training on {world} ranks: p={args.pp} t={args.tp} d={dp} v={args.vpp} m={m} {schedule} "
              f"zero={args.zero} {args.precision}; logits: {pm.plan.logits or 'not sharded (t=1)'}", flush=True)
    bar = range(first, args.steps)
    if rank0:
        from tqdm import tqdm

        bar = tqdm(bar, desc="train", file=sys.stdout, mininterval=1.0)
    start = time.perf_counter()
    for step in bar:
        if step == args.kill_at_step and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0" \
                and dist.get_rank() == world - 1:
            os.kill(os.getpid(), signal.SIGKILL)
        x, y = next(data)
        opt.zero_grad()
        loss = pm.step(x, target=y)
        norm = pm.clip_grad_norm_(args.clip) if args.clip else torch.zeros(())
        opt.step()
        if rank0:
            rate = (step + 1) * args.batch * args.seq / (time.perf_counter() - start)
            bar.set_postfix(loss=f"{loss.item():.4f}", norm=f"{norm.item():.2f}", tok_s=f"{rate:.0f}")
            if step % 10 == 0 or step == args.steps - 1:
                bar.write(f"step {step:4d}  loss {loss.item():.4f}")
        if args.checkpoint and ((step + 1) % args.save_every == 0 or step == args.steps - 1):
            fxpar.save(os.path.join(args.checkpoint, f"step-{step + 1:06d}"), pm, optimizer=opt,
                       extra={"step": step + 1})
    if rank0 and args.steps > first:
        print(f"final loss {loss.item()!r}", flush=True)
    peak = torch.tensor([resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**10])  # MiB (Linux: KiB)
    peaks = [torch.zeros(1) for _ in range(world)]
    dist.all_gather(peaks, peak)
    if rank0:
        print("peak memory per rank (MiB): " + ", ".join(f"{p.item():.0f}" for p in peaks), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
