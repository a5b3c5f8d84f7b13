"""verify(model, pm, example_args): run the original and the parallel graph side by side, node by node.

Every node of the graph right after the tensor-parallel rewrite that computes a value of the traced program says
which (meta[FXPAR_ORIGIN]) and how it is placed (meta[FXPAR_PLACEMENT]); this rank's value must equal the matching
block of the original's value (Shard), or all of it (Replicate). Partial values (row-parallel GEMM outputs) are sums
of all ranks' values and are checked after g, through their users. All tp ranks agree on the first diverging node
and raise the same VerifyError. The passes after tensor parallelism (fusion, recompute) change nodes rather than
placements: their result is checked on the outputs. A value that is memory nothing has written yet (an
`empty_like` before the op that fills it, passes/ir/aliasing.py `unwritten`) holds whatever the allocator left on
each process: it is not compared, and what the program reads after writing it is.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.fx as fx

from fxpar.passes.ir.aliasing import unwritten
from fxpar.passes.ir.meta import module_path
from fxpar.passes.ir.meta import FXPAR_ORIGIN, FXPAR_PLACEMENT, graph_inputs, resolve_inputs
from fxpar.passes.ir.placements import Partial, Shard, local_shard
from fxpar.runtime.executable import call_inputs, full_tensors
from fxpar.runtime.ownership import is_released


class VerifyError(AssertionError):
    pass


class _Recorder(fx.Interpreter):
    def __init__(self, gm):
        super().__init__(gm)
        self.values = {}

    def run_node(self, n):
        out = super().run_node(n)
        self.values[n.name] = out
        return out


def _expected(ref, placement, comm):
    if isinstance(placement, tuple):
        return [_expected(r, p, comm) for r, p in zip(ref, placement)]
    if isinstance(placement, Shard) and isinstance(ref, torch.Tensor):
        return local_shard(ref, placement, comm.rank, comm.size)
    return ref


def _max_err(got, want) -> float:
    if isinstance(want, (list, tuple)):
        return max((_max_err(g, w) for g, w in zip(got, want)), default=0.0)
    if not isinstance(want, torch.Tensor) or not want.is_floating_point():
        return 0.0 if not isinstance(want, torch.Tensor) or torch.equal(got, want) else float("inf")
    if got.shape != want.shape:
        return float("inf")
    return (got - want).abs().max().item() / max(1.0, want.abs().max().item()) if want.numel() else 0.0


@torch.no_grad()
def verify(model, pm, example_args: tuple, example_kwargs: dict | None = None, tol: float = 1e-5) -> float:
    """Raise VerifyError at the first node whose value diverges beyond tol; returns the largest error seen.

    The original program runs on `model`'s weights: an unmodified copy made before parallelize
    (`reference = copy.deepcopy(model)`), which also checks the shards pm holds; or, where `model` is the one
    parallelize consumed ([Note: one copy of the truth] in fxpar/runtime/ownership.py), on pm's own weights
    gathered, which checks the rewrite."""
    compiled, comm = pm.compiled, pm.rank.comm
    flat, inputs = call_inputs(pm, example_args, example_kwargs)
    reference = compiled.traced.gm
    if is_released(model):  # the consumed model keeps its buffers (non-persistent ones pm does not gather)
        state = dict(model.named_buffers(remove_duplicate=False)) | full_tensors(pm)
    else:
        state = dict(model.named_parameters(remove_duplicate=False)) | dict(model.named_buffers(remove_duplicate=False))
    ref = _Recorder(reference)
    ref_out = ref.run(*resolve_inputs(graph_inputs(reference), state, compiled.traced.constants, flat))
    par = _Recorder(compiled.tp_graph)  # after tensor parallelism, before the passes that rename and fuse
    par.run(*inputs)
    by_origin = {n.meta[FXPAR_ORIGIN]: n for n in compiled.tp_graph.graph.nodes if FXPAR_ORIGIN in n.meta}
    blank = unwritten(reference.graph)  # allocated, not yet written: nothing to compare
    order = [n.name for n in reference.graph.nodes if n.op not in ("placeholder", "output") and n not in blank]
    first, worst, detail = len(order) + 1, 0.0, ""  # len(order) stands for the final outputs
    for i, name in enumerate(order):
        node = by_origin.get(name)
        if node is None or node.name not in par.values:
            continue  # rewritten away (the vocab lookup became one collective)
        placement = node.meta.get(FXPAR_PLACEMENT)
        if isinstance(placement, Partial):
            continue  # a partial sum: its users see the reduced value
        err = _max_err(par.values[node.name], _expected(ref.values[name], placement, comm))
        worst = max(worst, err)
        if err > tol:
            first, detail = i, f"node {name} ({node.target}, module {module_path(node) or '<root>'}), " \
                               f"placement {placement or 'R'}: max relative error {err:.3g} > {tol}"
            break
    if first > len(order):
        run = pm.rank.programs.runner(compiled, 0)
        err = _max_err(list(run(*call_inputs(pm, example_args, example_kwargs)[1])), list(ref_out))
        worst = max(worst, err)
        if err > tol:
            first, detail = len(order), f"the outputs after fusion/recompute: max relative error {err:.3g} > {tol}"
    if comm.size > 1 and not comm.simulated:
        device = next((x.device for x in flat if isinstance(x, torch.Tensor)), torch.device("cpu"))
        t = torch.tensor([first], device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=comm.group)
        if t.item() < first:
            first = t.item()
            name = order[first] if first < len(order) else "the outputs"
            detail = f"{name} diverge(s) on another tp rank"
    if first <= len(order):
        raise VerifyError(f"fxpar.verify: tp rank {comm.rank}: {detail}")
    return worst
