"""Communication volumes and times: tensor-parallel all-reduces, pipeline sends, data-parallel all-reduce.

Glossary (PTD-P): p pipeline stages, t tensor-parallel degree, d data-parallel degree, b microbatch,
m = B / (d b) microbatches per pipeline, v model chunks per device (interleaved schedule).

Collectives are rings: an all-reduce of S bytes over n ranks sends 2 (n-1)/n S bytes per rank in 2 (n-1)
steps, each step paying the link latency. Across nodes it is hierarchical (NCCL's tree/ring mix is close):
reduce-scatter inside the node, all-reduce of the 1/g shard between the N nodes over each rank's own NIC
share, all-gather inside the node.
"""
from __future__ import annotations

from .cluster import Cluster


def tp_allreduce_elements(b: int, s: int, h: int, t: int) -> float:
    """Elements each device sends for tensor parallelism, per layer per microbatch: 8 b s h (t-1)/t.

    Four all-reduces of a [b, s, h] tensor (two forward: after attention and after the MLP; two backward:
    their conjugates), each sending 2 (t-1)/t of it per device (PTD-P section 3.2). Full recomputation
    repeats the two forward ones. Multiply by the dtype size for bytes.
    """
    return 8.0 * b * s * h * (t - 1) / t


def pp_boundary_elements(b: int, s: int, h: int, t: int, scatter_gather: bool) -> float:
    """Elements sent across one pipeline boundary per microbatch per direction: b s h, or b s h / t.

    With the scatter/gather optimization each of the t tensor-parallel ranks sends only its 1/t slice over
    the inter-node link and the receiving node all-gathers it over NVLink (PTD-P section 4.1).
    """
    return b * s * h / (t if scatter_gather else 1)


def ep_dispatch_elements(b: int, s: int, h: int, k: int, ep: int) -> float:
    """Elements each rank sends for expert parallelism, per MoE layer per microbatch: 4 k b s h (ep-1)/ep.

    The all-to-all dispatcher sends each of its k b s routed rows [h] to its expert's rank (a share (ep-1)/ep of them
    leaves the rank on average), and the combine sends the results back; backward sends the gradients both ways.
    (The all-gather dispatcher moves (ep-1) k b s h each way instead: every rank's rows to every rank.)
    """
    return 4.0 * k * b * s * h * (ep - 1) / ep


def alltoall_seconds(nbytes: float, ranks: int, inter_node: bool, cluster: Cluster) -> float:
    """An all-to-all in which each rank sends `nbytes` in all, spread evenly over the others: (n-1) latencies (one
    exchange per peer) + nbytes / bandwidth."""
    if ranks <= 1 or nbytes <= 0:
        return 0.0
    latency, bandwidth = cluster.link(inter_node)
    return (ranks - 1) * latency + nbytes / bandwidth


def ring_seconds(nbytes: float, ranks: int, inter_node: bool, cluster: Cluster, *, steps_factor: int = 2) -> float:
    """A ring collective over `ranks` ranks on one kind of link.

    all-reduce (steps_factor=2): 2 (n-1) latency + 2 (n-1)/n S / bandwidth; reduce-scatter or all-gather
    (steps_factor=1): half of it. S is the full tensor size in bytes.
    """
    if ranks <= 1 or nbytes <= 0:
        return 0.0
    latency, bandwidth = cluster.link(inter_node)
    steps = steps_factor * (ranks - 1)
    return steps * latency + steps / ranks * nbytes / bandwidth


def allreduce_seconds(nbytes: float, ranks: int, ranks_per_node: int, cluster: Cluster) -> float:
    """All-reduce of `nbytes` over `ranks` ranks, `ranks_per_node` of which share each node.

    Hierarchical: g = ranks_per_node, N = ranks / g nodes.
      T = [2(g-1) a_intra + 2(g-1)/g S / B_intra] + [2(N-1) a_inter + 2(N-1)/N (S/g) / B_inter]
    Overlap assumption: none; the two phases run one after the other.
    """
    g = max(1, min(ranks_per_node, ranks))
    if ranks % g:
        raise ValueError(f"allreduce over {ranks} ranks with {g} per node does not tile whole nodes")
    nodes = ranks // g
    intra = ring_seconds(nbytes, g, inter_node=False, cluster=cluster)
    inter = ring_seconds(nbytes / g, nodes, inter_node=True, cluster=cluster)
    return intra + inter


def p2p_seconds(nbytes: float, inter_node: bool, cluster: Cluster) -> float:
    """One point-to-point send of `nbytes`: latency + bytes / bandwidth."""
    if nbytes <= 0:
        return 0.0
    latency, bandwidth = cluster.link(inter_node)
    return latency + nbytes / bandwidth
