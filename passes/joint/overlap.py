"""Overlap by construction: reorder a program so each collective starts as soon as its input exists and is waited
for only where its result is first read; the compute that depends on neither runs in between.

A functional collective is two nodes: the start (`_c10d_functional.all_reduce`, ...: the transfer is launched,
asynchronously) and its `wait_tensor`. fxpar placed every collective itself, so nothing here is pattern matched:

    early_collectives  a list schedule that runs first the compute on the way to the next collective, then the
                       collective, so it is in flight as early as its input allows
    late_waits         each wait as late as its first reader: everything that does not read the result runs
                       before it

In a backward program that is Megatron's asynchronous column-parallel backward: f's all-reduce of the input gradient
dX = dY W is issued before the weight-gradient GEMM dW = dY^T X, which does not read it, and waited for where the
previous layer's backward reads dX. With the dp gradient buckets in the backward program (dp_buckets.py), each
bucket's all-reduce is issued as soon as its last gradient exists. Both keep the order of each group's collectives
(every rank of the group issues them in the same order; the tp and dp groups' may interleave, as every rank runs
the same program) and of every node with a side effect (random draws, asserts), so the program computes the same
values bit for bit. `overlaps(program)` says, per collective, which compute runs while it is in flight.
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass

import torch
from torch.fx import GraphModule, Node

from fxpar.cost.comm import ring_seconds
from fxpar.cost.compute import Gemm, elementwise_seconds, gemm_seconds
from fxpar.passes.ir.meta import FXPAR_NODE
from fxpar.passes.ir.op_families import WAIT as _WAIT
from fxpar.passes.ir.op_families import DECOMPOSED_GEMMS, collective_op, returns_view


def early_collectives(gm: GraphModule) -> GraphModule:
    """Reorder `gm` so the compute feeding the next collective runs first, and each collective right after it."""
    nodes = [n for n in gm.graph.nodes if n.op not in ("placeholder", "output", "get_attr")]
    feeds = _first_collective_fed(nodes)
    return _reorder(gm, nodes, lambda n: 0 if collective_op(n) else feeds.get(n, len(nodes)) + 1, lazy_waits=False)


def late_waits(gm: GraphModule) -> GraphModule:
    """Reorder `gm` so each wait runs only when nothing else is ready: right before its first reader."""
    nodes = [n for n in gm.graph.nodes if n.op not in ("placeholder", "output", "get_attr")]
    return _reorder(gm, nodes, lambda n: 0, lazy_waits=True)


def _first_collective_fed(nodes: list[Node]) -> dict[Node, int]:
    """For each node some collective start depends on, the position of the first such collective: the compute on
    the way to an earlier collective runs first (a dX before the dW GEMMs that only a later dp bucket reads)."""
    out: dict[Node, int] = {}
    for i, c in enumerate(nodes):
        if not collective_op(c):
            continue
        stack = [c]
        while stack:
            for a in stack.pop().all_input_nodes:
                if a not in out and a.op not in ("placeholder", "get_attr"):
                    out[a] = i
                    stack.append(a)
    return out


def _writes(n: Node) -> bool:
    schema = getattr(n.target, "_schema", None)
    return schema is not None and schema.is_mutable and n.target is not torch.ops._c10d_functional.all_reduce_.default


def _chain(n: Node) -> str | None:
    """The chain of nodes whose order must stay that n belongs to: a collective's group (every rank of it issues
    them in the same order), or the side effects (random draws, asserts); None for the rest."""
    if collective_op(n) is not None:
        return str(n.args[-1])  # the group's name, each functional collective's last argument
    return "side effects" if n.target is not _WAIT and n.is_impure() else None


def _reorder(gm: GraphModule, nodes: list[Node], rank, lazy_waits: bool) -> GraphModule:
    """A list schedule of `nodes`: among the ready ones, the lowest (rank, original position) first; with
    lazy_waits a wait only when no other node is ready. The collectives of each group keep their order, and so do
    the side effects. A program that
    writes into memory others may read (any mutating op but an in-place all-reduce of a private buffer,
    passes/joint/reinplace.py) is left as it is: its data edges alone would not order a read before the write."""
    if any(_writes(n) for n in nodes):
        return gm
    position = {n: i for i, n in enumerate(nodes)}
    deps = {n: {a for a in n.all_input_nodes if a in position} for n in nodes}
    previous = {}
    for n in nodes:  # each ordered node waits for the one before it in its chain
        chain = _chain(n)
        if chain is not None:
            if chain in previous:
                deps[n].add(previous[chain])
            previous[chain] = n
    users = {n: [] for n in nodes}
    for n, ds in deps.items():
        for d in ds:
            users[d].append(n)
    missing = {n: len(ds) for n, ds in deps.items()}
    ready, waits, order = [], [], []

    def push(n):
        if lazy_waits and n.target is _WAIT:
            heapq.heappush(waits, (position[n], n.name, n))
        else:
            heapq.heappush(ready, (rank(n), position[n], n.name, n))

    for n in nodes:
        if not missing[n]:
            push(n)
    while ready or waits:
        n = heapq.heappop(ready)[-1] if ready else heapq.heappop(waits)[-1]
        order.append(n)
        for u in users[n]:
            missing[u] -= 1
            if not missing[u]:
                push(u)
    assert len(order) == len(nodes), "the program's dependencies have a cycle"
    output = gm.graph.find_nodes(op="output")[0]
    for n in order:
        output.prepend(n)
    gm.graph.lint()
    gm.recompile()
    return gm


@dataclass(frozen=True)
class Overlap:
    op: str  # "all_reduce"
    node: str  # the fxpar collective it implements (the chunk graph's node)
    nbytes: int  # the bytes of its input on this rank
    hidden: tuple[Node, ...]  # the compute that runs while it is in flight (between its start and its wait)


def describe(program: GraphModule) -> list[str]:
    """One line per collective of a program: what it implements and the kernels that run while it is in flight
    (views and getitems, which launch nothing, left out)."""
    def op(n):
        return n.target.overloadpacket.__name__

    return [f"{o.op} of {o.node} ({o.nbytes} bytes): " + (", ".join(op(n) for n in o.hidden if _launches(n))
                                                           or "nothing, waited at once") for o in overlaps(program)]


def _launches(n: Node) -> bool:
    return isinstance(n.target, torch._ops.OpOverload) and not returns_view(n.target)


def overlaps(gm: GraphModule) -> list[Overlap]:
    """For each collective of a program, the compute nodes between its start and its wait, in program order."""
    order = list(gm.graph.nodes)
    out = []
    for i, n in enumerate(order):
        op = collective_op(n)
        if op is None:
            continue
        wait = next(u for u in n.users if u.target is _WAIT)
        between = order[i + 1:order.index(wait)]
        value = n.args[0].meta.get("val")
        nbytes = value.numel() * value.element_size() if isinstance(value, torch.Tensor) else 0
        out.append(Overlap(op, n.meta.get("custom", {}).get(FXPAR_NODE, ""), nbytes,
                           tuple(b for b in between if b.op == "call_function" and b.target is not _WAIT
                                 and collective_op(b) is None)))
    return out


def exposed_seconds(o: Overlap, t: int, cluster) -> tuple[float, float]:
    """(communication, compute hidden behind it) in seconds, estimated with the cost model's link and compute rates
    for `cluster` (fxpar.cost.cluster.Cluster): a ring collective over t ranks, and the GEMMs and elementwise ops
    between its start and its wait. What stays exposed is max(0, communication - hidden)."""
    whole = o.nbytes * (t if o.op == "all_gather" else 1)  # ring_seconds takes the whole tensor's bytes
    comm = ring_seconds(whole, t, False, cluster, steps_factor=2 if o.op == "all_reduce" else 1)
    return comm, sum(_compute_seconds(n, cluster) for n in o.hidden)


def _compute_seconds(n: Node, cluster) -> float:
    out = n.meta.get("val")
    if not isinstance(out, torch.Tensor):
        return 0.0
    if n.target in DECOMPOSED_GEMMS:
        a = n.args[-2].meta["val"]  # [.., m, k] @ [.., k, n]
        batch = a.shape[0] if a.dim() == 3 else 1
        return gemm_seconds(Gemm(n.name, a.shape[-2], out.shape[-1], a.shape[-1], batch), cluster)
    if not _launches(n) or not out.numel():
        return 0.0  # a getitem or a view launches nothing
    return elementwise_seconds(out.numel() * out.element_size(), 1, cluster)

