"""A short GPU check, for a machine with CUDA: nccl, the vocab-parallel loss, the distributed optimizer, exactness.

    torchrun --standalone --nproc-per-node 2 benchmarks/gpu_check.py     # t=2 on 2 GPUs (or dp=2 with --dp)
    torchrun --standalone --nproc-per-node 1 benchmarks/gpu_check.py     # one GPU: nccl and the device paths

init_mesh picks nccl and sets each rank's GPU from LOCAL_RANK; the model is built on that GPU; 5 AdamW steps through
pm.step / pm.clip_grad_norm_ / pm.optimizer are compared with the same steps of the unmodified model on the same
GPU (fp32, TF32 off), and the script prints the largest loss and parameter differences and the step time. Without
CUDA it runs the same on the CPU over gloo (a dry run of the script itself).
"""
from __future__ import annotations

import argparse
import copy
import os
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import fxpar  # noqa: E402
from gpt import GPT, GPTConfig, loss_fn  # noqa: E402


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dp", action="store_true", help="data parallelism (zero=1) instead of tensor parallelism")
    p.add_argument("--steps", type=int, default=5)
    args = p.parse_args(argv)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    world = int(os.environ["WORLD_SIZE"])
    mesh = fxpar.init_mesh(dp=world) if args.dp else fxpar.init_mesh(tp=world)
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")  # cpu: a dry run
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab=32768, seq=256, layers=4, hidden=512, heads=8)).to(device)
    reference = copy.deepcopy(model)
    ids = torch.randint(0, 32768, (2 * world, 256), device=device)
    target = torch.roll(ids, -1, dims=1)
    rows = ids.shape[0] // world if args.dp else ids.shape[0]
    pm = fxpar.parallelize(model, mesh, example_args=(ids[:rows],), loss_fn=loss_fn, example_target=target[:rows],
                           config=fxpar.Config(zero=1 if args.dp else 0))
    opt, ref_opt = pm.optimizer(torch.optim.AdamW, lr=1e-4), torch.optim.AdamW(reference.parameters(), lr=1e-4)
    gap, start = 0.0, time.perf_counter()
    for _ in range(args.steps):
        opt.zero_grad(), ref_opt.zero_grad()
        loss = pm.step(ids, target=target)
        pm.clip_grad_norm_(1.0)
        opt.step()
        chunks = ids.chunk(world) if args.dp else [ids]
        want = sum(loss_fn(reference(x), y) for x, y in zip(chunks, target.chunk(len(chunks)))) / len(chunks)
        want.backward()
        torch.nn.utils.clip_grad_norm_(reference.parameters(), 1.0)
        ref_opt.step()
        gap = max(gap, abs(loss.item() - want.item()))
    if cuda:
        torch.cuda.synchronize()
    elapsed = (time.perf_counter() - start) / args.steps
    full, ref = pm.full_state_dict(), reference.state_dict()
    state_gap = max((full[k] - ref[k]).abs().max().item() for k in ref)
    if dist.get_rank() == 0:
        print(f"backend {dist.get_backend()}, {world} rank(s), {'dp (zero=1)' if args.dp else 'tp'}; "
              f"logits: {pm.plan.logits or '-'}\nmax loss gap {gap:.2e}, max parameter gap {state_gap:.2e}, "
              f"{elapsed * 1e3:.1f} ms per step (with the reference's)", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
