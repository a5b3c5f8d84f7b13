"""The device mesh: dims ("pp", "dp", "tp"), tp varying fastest, as in Megatron's tp-dp-pp rank order."""
from __future__ import annotations

import os
import socket
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from fxpar.passes.tensor_parallel.collectives import TPComm

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


@dataclass
class Groups:
    """This rank's place in the (pp, dp, tp) mesh and the groups it talks in: the mesh, decoded once (decode_mesh)."""

    pp_rank: int
    pp: int
    tp_rank: int
    tp: int
    dp: int
    dp_rank: int
    global_rank_of_stage: list[int]  # pp rank -> global rank with this rank's dp and tp coordinates
    tp_group: object = None
    dp_group: object = None
    pp_group: object = None
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    ranks: list = field(default_factory=list)  # the mesh's (pp, dp, tp) array of global ranks, as nested lists

    @property
    def comm(self) -> TPComm:
        """This rank's tensor-parallel context."""
        return TPComm(rank=self.tp_rank, size=self.tp, group=self.tp_group)

    def global_rank(self, pp: int, dp: int, tp: int) -> int:
        return self.ranks[pp][dp][tp]


def decode_mesh(mesh: DeviceMesh | None) -> Groups | None:
    """A (pp, dp, tp) mesh from init_mesh as this rank's Groups; None without a mesh or a process group."""
    if mesh is None or not dist.is_initialized():
        return None
    pp_rank, dp_rank, tp_rank = (mesh.get_local_rank(d) for d in MESH_DIMS)
    p, d, t = mesh.mesh.shape
    ranks = mesh.mesh.tolist()
    return Groups(pp_rank, p, tp_rank, t, d, dp_rank, [ranks[q][dp_rank][tp_rank] for q in range(p)],
                  mesh.get_group("tp"), mesh.get_group("dp"), mesh.get_group("pp"), torch.device(mesh.device_type),
                  ranks)


def tp_comm(mesh: DeviceMesh | None) -> TPComm:
    """This rank's tensor-parallel context from a (pp, dp, tp) mesh (one rank without one)."""
    groups = decode_mesh(mesh)
    return TPComm(rank=0, size=1) if groups is None else groups.comm


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


def pipeline_crosses_hosts(ranks, hosts: list[str]) -> bool:
    """Whether scatter/gather pays on this mesh: some pipeline link joins two hosts while every tensor-parallel group
    stays on one. `ranks` is the mesh's (pp, dp, tp) array of global ranks (nested lists), hosts[r] global rank r's
    host. Scatter/gather sends 1/t of each boundary activation and all-gathers it over tp on arrival: a gain only
    where the pipeline link is the slower one (Narayanan et al. 2021, Sec. 4.1); on one host it only adds the
    all-gather."""
    pp, dp, tp = len(ranks), len(ranks[0]), len(ranks[0][0])
    tp_local = all(len({hosts[r] for r in ranks[p][d]}) == 1 for p in range(pp) for d in range(dp))
    crossing = any(hosts[ranks[p][d][t]] != hosts[ranks[p + 1][d][t]]
                   for p in range(pp - 1) for d in range(dp) for t in range(tp))
    return tp > 1 and tp_local and crossing


def scatter_gather_wanted(setting, groups: Groups) -> bool:
    """Config.scatter_gather resolved on this mesh: True or False as given; "auto" asks every rank its host
    (collective: every rank decides alike) and turns it on only where pipeline_crosses_hosts."""
    if setting != "auto":
        return bool(setting)
    if not dist.is_initialized() or groups.pp == 1 or groups.tp == 1:
        return False
    hosts = [None] * dist.get_world_size()
    dist.all_gather_object(hosts, socket.gethostname())
    return pipeline_crosses_hosts(groups.ranks, hosts)
