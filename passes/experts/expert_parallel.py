"""Expert parallelism, the rewrite: each expert chain (passes/experts/find.py) runs on the rows routed to this rank's
experts, on this rank's slice of the experts' weights.

    x [S, h], offs [E]  ->  dispatch (passes/experts/dispatch.py)  ->  x', offs' [E/ep], ids' (each row's local expert)
    the chain's ops, unchanged, on x' with offs'; W [E, ...] is this rank's [E/ep, ...]; b[ids] becomes b[ids']
    its last node y' [n, h]  ->  combine  ->  y [S, h], each result at the row of x it came from

Everything outside the chains (the router, the gather of token rows, the weighting and the sum over k, the shared
experts, the auxiliary losses) is untouched: it runs as traced, on this rank's own tokens, in the reference's order
and dtypes. Rank q holds experts [q * E/ep, (q + 1) * E/ep) of every chain, and every parameter of the chain
(`ExpertChain.params`) is sliced the same way along its expert dim (0): `expert_keys` lists them for the runtime,
which holds, loads, saves and reduces them accordingly.

The rows a rank receives depend on the routing, so the fake values of the chain's nodes keep their traced S rows:
the rows each rank computes when the routing is even. Nothing after this pass reads them but the partition's cost
estimate.
"""
from __future__ import annotations

import operator

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx import GraphModule

from fxpar.passes.experts.dispatch import CombineFromExperts, CombineUnsorted, DispatchToExperts, DispatchUnsorted
from fxpar.passes.experts.find import Experts
from fxpar.passes.tensor_parallel.collectives import TPComm

aten = torch.ops.aten


def check_experts(experts: Experts, ep: int) -> None:
    """Every chain's E divides by ep, or a clear error."""
    for c in experts.chains:
        if c.experts % ep:
            raise ValueError(
                f"fxpar expert parallelism: {c.module} has {c.experts} experts, which do not split over ep={ep} ranks. "
                f"Choose an ep that divides {c.experts}.")


def expert_keys(experts: Experts) -> set[str]:
    """The state keys split along their expert dim (0) over ep."""
    return {key for c in experts.chains for key in c.keys}


def expert_parallel_pass(gm: GraphModule, experts: Experts, comm: TPComm, how: str) -> GraphModule:
    if comm.size == 1 or not experts.chains:
        return gm
    check_experts(experts, comm.size)
    graph = gm.graph
    # the fake values this pass makes: in a mode of its own (the trace's may be another thread's, in one process
    # of threaded ranks, and a fake mode is not thread-safe)
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    for i, c in enumerate(experts.chains):
        local, params = c.experts // comm.size, c.params
        dispatch, combine = f"ep_dispatch_{i}", f"ep_combine_{i}"
        unsorted = c.offs is None  # batched_mm experts: the dispatcher sorts the rows by expert, the combiner back
        sender = (DispatchUnsorted if unsorted else DispatchToExperts)(comm, how, c.experts, c.module)
        gm.add_submodule(dispatch, sender)
        gm.add_submodule(combine, (CombineUnsorted if unsorted else CombineFromExperts)(comm, how, c.experts,
                                                                                        c.module, sender.ran))
        with graph.inserting_before(c.nodes[0]):
            d = graph.call_module(dispatch, (c.x, c.ids if unsorted else c.offs))
            x, offs, ids, routing, *perm = (graph.call_function(operator.getitem, (d, k))
                                            for k in range(4 + unsorted))
        dtype = torch.int64 if unsorted else c.offs.meta["val"].dtype
        with mode:
            x.meta["val"], offs.meta["val"] = c.x.meta["val"], torch.empty(local, dtype=dtype)
        gathers = {}
        for b in c.biases:
            with graph.inserting_before(c.nodes[0]):
                gathers[b] = graph.call_function(aten.index.Tensor, (b.args[0], [ids]))
            gathers[b].meta["val"] = b.meta["val"]
        swap = {c.x: x, c.offs: offs, **gathers}
        for n in c.nodes:
            n.args = torch.fx.map_arg(n.args, lambda a: swap.get(a, a))
            n.kwargs = torch.fx.map_arg(n.kwargs, lambda a: swap.get(a, a))
        outside = [u for u in c.out.users if u not in set(c.nodes)]
        with graph.inserting_after(c.out):
            y = graph.call_module(combine, (c.out, routing, int(c.x.meta["val"].shape[0]), *perm))
        y.meta["val"] = c.out.meta["val"]
        for u in outside:
            u.replace_input_with(c.out, y)
        for b in c.biases:
            if not b.users:
                graph.erase_node(b)
        for p in params:
            v = p.meta["val"]
            with mode:
                p.meta["val"] = torch.empty((local, *v.shape[1:]), dtype=v.dtype, device=v.device)
                for view in p.users:  # a transposed read (torch's _grouped_mm of W^T): its fake value follows
                    if view.target is aten.transpose.int:
                        view.meta["val"] = p.meta["val"].transpose(*view.args[1:])
    graph.lint()
    gm.recompile()
    return gm
