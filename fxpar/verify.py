"""verify(model, pm, example_args): run the original and the parallel graph side by side, node by node.

Every node the tensor-parallel rewrite kept has a placement; this rank's value must equal the matching block of the
original's value (Shard), or all of it (Replicate). Row-parallel GEMM outputs are partial sums and are checked after
g, through their users. All tp ranks agree on the first diverging node and raise the same VerifyError. The passes after tensor
parallelism (fusion, recompute) change nodes rather than placements: their result is checked on the outputs.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.fx as fx

from fxpar.passes.analysis import module_path
from fxpar.passes.placements import Shard, local_shard


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
    """Raise VerifyError at the first node whose value diverges beyond tol; returns the largest error seen."""
    compiled, comm = pm.compiled, pm.comm
    flat = pm.flatten_inputs(example_args, example_kwargs)
    state = dict(model.named_parameters(remove_duplicate=False)) | dict(model.named_buffers(remove_duplicate=False))
    ref_inputs = [
        state[key] if kind in ("parameter", "buffer") else compiled.traced.constants[key] if kind == "constant"
        else None for _, kind, key in compiled.traced.inputs
    ]
    it = iter(flat)
    ref_inputs = [next(it) if x is None and kind == "user" else x
                  for x, (_, kind, _) in zip(ref_inputs, compiled.traced.inputs)]
    ref = _Recorder(compiled.reference)
    ref_out = ref.run(*ref_inputs)
    par = _Recorder(compiled.tp_graph)  # after tensor parallelism, before the passes that rename and fuse
    par.run(*pm.graph_inputs(flat))
    decisions = {n.name: d for n, d in compiled.analysis.decisions.items()}
    placements = {n.name: p for n, p in compiled.analysis.placements.items()}
    by_name = {n.name: n for n in compiled.reference.graph.nodes}
    ok = len(by_name) + 1  # index meaning "no divergence"; len(by_name) stands for the final outputs
    first, worst, detail = ok, 0.0, ""
    for i, (name, want) in enumerate(ref.values.items()):
        node = by_name[name]
        d = decisions.get(name)
        if node.op in ("placeholder", "output") or name not in par.values or (
                d is not None and d.role is not None and d.role != "column"):
            continue
        placement = placements.get(name)
        err = _max_err(par.values[name], _expected(want, placement, comm))
        worst = max(worst, err)
        if err > tol:
            first, detail = i, f"node {name} ({node.target}, module {module_path(node) or '<root>'}), " \
                               f"placement {placement or 'R'}: max relative error {err:.3g} > {tol}"
            break
    if first == ok:
        err = _max_err(list(pm.graph_module(*pm.graph_inputs(flat))), list(ref_out))
        worst = max(worst, err)
        if err > tol:
            first, detail = len(by_name), f"the outputs after fusion/recompute: max relative error {err:.3g} > {tol}"
    if comm.size > 1 and not comm.simulated:
        t = torch.tensor([first])
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=comm.group)
        if t.item() < first:
            first = t.item()
            name = list(ref.values)[first] if first < len(by_name) else "the outputs"
            detail = f"{name} diverge(s) on another tp rank"
    if first < ok:
        raise VerifyError(f"fxpar.verify: tp rank {comm.rank}: {detail}")
    return worst
