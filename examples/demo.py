"""The fxpar demo: parallelize the example GPT over 2 tensor-parallel ranks and prove it exact.

Run with `make demo`, which launches `torchrun --standalone --nproc-per-node 2 examples/demo.py` (gloo on CPU).
"""
import copy
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import fxpar  # noqa: E402
from gpt import factory, loss_fn  # noqa: E402


def main():
    torch.set_num_threads(1)
    mesh = fxpar.init_mesh(tp=dist.get_world_size() if dist.is_initialized() else int(os.environ["WORLD_SIZE"]))
    rank = dist.get_rank()
    model, (ids,) = factory(batch=4, seq=64, layers=4, hidden=64, heads=4)
    reference = copy.deepcopy(model)
    pm = fxpar.parallelize(model, mesh, example_args=(ids,))
    if rank == 0:
        print(pm.plan, flush=True)
    err = fxpar.verify(model, pm, (ids,))
    target = torch.roll(ids, -1, dims=1)
    opt, ref_opt = torch.optim.SGD(pm.parameters(), lr=0.1), torch.optim.SGD(reference.parameters(), lr=0.1)
    loss = loss_fn(pm(ids), target)
    ref_loss = loss_fn(reference(ids), target)
    loss.backward(), ref_loss.backward()
    opt.step(), ref_opt.step()
    full, ref_state = pm.full_state_dict(), reference.state_dict()
    param_err = max((full[k] - ref_state[k]).abs().max().item() for k in ref_state)
    if rank == 0:
        print(f"\nverify: every node matches the original (max relative error {err:.2e})")
        print(f"loss {loss.item():.6f} vs original {ref_loss.item():.6f}; "
              f"max parameter difference after one SGD step: {param_err:.2e}")
        assert abs(loss.item() - ref_loss.item()) < 1e-5 and param_err < 1e-5
        print("OK: the tensor-parallel model is exact.")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
