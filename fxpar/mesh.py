"""The device mesh: dims ("pp", "dp", "tp"), tp varying fastest, as in Megatron's tp-dp-pp rank order."""
from __future__ import annotations

import os
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

MESH_DIMS = ("pp", "dp", "tp")
DEFAULT_TIMEOUT = timedelta(seconds=float(os.environ.get("FXPAR_TIMEOUT_S", "300")))


def init_mesh(tp: int = 1, pp: int = 1, dp: int = 1) -> DeviceMesh:
    """A (pp, dp, tp) DeviceMesh over the default process group, created from torchrun's environment if needed."""
    for name, v in (("tp", tp), ("pp", pp), ("dp", dp)):
        if not isinstance(v, int) or v < 1:
            raise ValueError(f"init_mesh: {name}={v!r} must be a positive int")
    if not dist.is_initialized():
        if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
            raise RuntimeError(
                "init_mesh: no default process group and no torchrun environment (RANK, WORLD_SIZE). "
                "Launch with `torchrun --nproc-per-node N ...` or `fxpar run`, or call "
                "torch.distributed.init_process_group first."
            )
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        if backend == "nccl":  # each rank on its own GPU of the node, as torchrun numbers them
            local = os.environ.get("LOCAL_RANK", int(os.environ["RANK"]) % torch.cuda.device_count())
            torch.cuda.set_device(int(local))
        dist.init_process_group(backend, timeout=DEFAULT_TIMEOUT)
    world = dist.get_world_size()
    if pp * dp * tp != world:
        raise ValueError(
            f"init_mesh: pp*dp*tp = {pp}*{dp}*{tp} = {pp * dp * tp}, but the world size is {world}. "
            f"Choose degrees whose product is {world}, or launch {pp * dp * tp} processes."
        )
    device = "cuda" if dist.get_backend() == "nccl" else "cpu"
    return init_device_mesh(device, (pp, dp, tp), mesh_dim_names=MESH_DIMS)


def check_mesh(mesh: DeviceMesh) -> None:
    names = tuple(mesh.mesh_dim_names or ())
    if names != MESH_DIMS:
        raise ValueError(
            f"fxpar needs a DeviceMesh with dim names {MESH_DIMS}, got {names}; build it with fxpar.init_mesh"
        )
    if dist.is_initialized() and mesh.size() != dist.get_world_size():
        raise ValueError(
            f"mesh size {mesh.size()} ({dict(zip(names, mesh.mesh.shape))}) != world size {dist.get_world_size()}"
        )
