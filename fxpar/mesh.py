"""The device mesh: dims ("pp", "dp", "tp"), tp varying fastest, as in Megatron's tp-dp-pp rank order.

With expert parallelism (`init_mesh(ep=E)`) the data-parallel dim is itself split as Megatron-Core splits it:
dp = edp * ep, ep varying fastest, so the mesh's dims are ("pp", "edp", "ep", "tp") and "dp" is their flattening.
The E ranks of an ep group hold different experts and see different tokens; the edp ranks of an expert-data-parallel
group hold the same experts, and reduce those experts' gradients among themselves.
"""
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
EP_MESH_DIMS = ("pp", "edp", "ep", "tp")
DEFAULT_TIMEOUT = timedelta(seconds=float(os.environ.get("FXPAR_TIMEOUT_S", "300")))


def init_mesh(tp: int = 1, pp: int = 1, dp: int = 1, ep: int = 1) -> DeviceMesh:
    """A (pp, dp, tp) DeviceMesh over the default process group, created from torchrun's environment if needed;
    with ep > 1, a (pp, edp, ep, tp) one whose "dp" is edp and ep flattened (ep must divide dp)."""
    for name, v in (("tp", tp), ("pp", pp), ("dp", dp), ("ep", ep)):
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
    if dp % ep:
        raise ValueError(
            f"init_mesh: ep={ep} must divide dp={dp}: the experts are split over ep ranks drawn from the data-parallel "
            f"ranks (dp = {dp} = expert-data-parallel * ep). Choose an ep among {_divisors(dp)}.")
    device = "cuda" if dist.get_backend() == "nccl" else "cpu"
    if ep == 1:
        return init_device_mesh(device, (pp, dp, tp), mesh_dim_names=MESH_DIMS)
    mesh = init_device_mesh(device, (pp, dp // ep, ep, tp), mesh_dim_names=EP_MESH_DIMS)
    mesh["edp", "ep"]._flatten("dp")
    return mesh


def _divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


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
    ep: int = 1  # expert-parallel ranks: the dp ranks whose experts differ (1: every dp rank holds every expert)
    ep_rank: int = 0
    ep_group: object = None
    edp_group: object = None  # the dp ranks that hold this rank's experts (its gradients are reduced over them)

    @property
    def edp(self) -> int:
        return self.dp // self.ep

    @property
    def comm(self) -> TPComm:
        """This rank's tensor-parallel context."""
        return TPComm(rank=self.tp_rank, size=self.tp, group=self.tp_group)

    @property
    def dp_comm(self) -> TPComm:
        """This rank's data-parallel context (the loss's batch statistics are all-reduced over it)."""
        return TPComm(rank=self.dp_rank, size=self.dp, group=self.dp_group)

    @property
    def ep_comm(self) -> TPComm:
        """This rank's expert-parallel context (the same record as tp's: a rank, a size, a group)."""
        return TPComm(rank=self.ep_rank, size=self.ep, group=self.ep_group)

    def global_rank(self, pp: int, dp: int, tp: int) -> int:
        return self.ranks[pp][dp][tp]


def decode_mesh(mesh: DeviceMesh | None) -> Groups | None:
    """A mesh from init_mesh as this rank's Groups; None without a mesh or a process group."""
    if mesh is None or not dist.is_initialized():
        return None
    if tuple(mesh.mesh_dim_names) == EP_MESH_DIMS:
        p, edp, e, t = mesh.mesh.shape
        pp_rank, edp_rank, ep_rank, tp_rank = (mesh.get_local_rank(d) for d in EP_MESH_DIMS)
        dp_rank, d, ep_parts = edp_rank * e + ep_rank, edp * e, (e, ep_rank, mesh.get_group("ep"),
                                                                   mesh.get_group("edp"))
        ranks, dp_group = mesh.mesh.reshape(p, d, t).tolist(), mesh.get_group("dp")
    else:
        pp_rank, dp_rank, tp_rank = (mesh.get_local_rank(d) for d in MESH_DIMS)
        p, d, t = mesh.mesh.shape
        ranks, dp_group, ep_parts = mesh.mesh.tolist(), mesh.get_group("dp"), (1, 0, None, mesh.get_group("dp"))
    return Groups(pp_rank, p, tp_rank, t, d, dp_rank, [ranks[q][dp_rank][tp_rank] for q in range(p)],
                  mesh.get_group("tp"), dp_group, mesh.get_group("pp"), torch.device(mesh.device_type),
                  ranks, *ep_parts)


def tp_comm(mesh: DeviceMesh | None) -> TPComm:
    """This rank's tensor-parallel context from a (pp, dp, tp) mesh (one rank without one)."""
    groups = decode_mesh(mesh)
    return TPComm(rank=0, size=1) if groups is None else groups.comm


def check_mesh(mesh: DeviceMesh) -> None:
    names = tuple(mesh.mesh_dim_names or ())
    if names not in (MESH_DIMS, EP_MESH_DIMS):
        raise ValueError(
            f"fxpar needs a DeviceMesh with dim names {MESH_DIMS} (or {EP_MESH_DIMS} with expert parallelism), got "
            f"{names}; build it with fxpar.init_mesh"
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
