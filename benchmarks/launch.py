"""Run a benchmark on every rank: under torchrun when its environment is set, else on ranks spawned here.

`launch(run, args)` calls `run(args)` on each rank inside a gloo process group (FileStore in a temporary directory,
never a fixed port; one thread per rank) and returns rank 0's result ({} on other torchrun ranks).
"""
from __future__ import annotations

import os
import pickle
import tempfile
from datetime import timedelta

import torch
import torch.distributed as dist


def _spawned(rank: int, run, args, store_dir: str) -> None:
    torch.set_num_threads(1)
    store = dist.FileStore(os.path.join(store_dir, "store"), args.nproc)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=args.nproc,
                            timeout=timedelta(seconds=args.timeout))
    try:
        result = run(args)
        if rank == 0:
            with open(os.path.join(store_dir, "result.pkl"), "wb") as f:
                pickle.dump(result, f)
    finally:
        dist.destroy_process_group()


def launch(run, args) -> dict:
    """run: a module-level function of args (it travels to spawned ranks by reference); args needs .nproc, .timeout."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # under torchrun
        torch.set_num_threads(1)
        dist.init_process_group("gloo", timeout=timedelta(seconds=args.timeout))
        try:
            result = run(args)
        finally:
            dist.destroy_process_group()
        return result if int(os.environ["RANK"]) == 0 else {}
    import torch.multiprocessing as mp

    saved = {k: os.environ.get(k) for k in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
    os.environ.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")  # inherited by the spawned ranks
    try:
        with tempfile.TemporaryDirectory(prefix="fxpar-bench-") as store_dir:
            mp.spawn(_spawned, args=(run, args, store_dir), nprocs=args.nproc, join=True)
            with open(os.path.join(store_dir, "result.pkl"), "rb") as f:
                return pickle.load(f)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
