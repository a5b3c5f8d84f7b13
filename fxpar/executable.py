"""The per-rank executable: the rewritten graph plus this rank's local weights.

Its parameters are registered under the original model's names (`transformer.h.0.attn.c_attn.weight`), holding the
local shards, so any torch.optim optimizer works on them. Tied parameters are one Parameter here too.
"""
from __future__ import annotations

import warnings

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.utils._pytree as pytree
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.fx import GraphModule
from torch.fx.passes.fake_tensor_prop import FakeTensorProp

from fxpar.passes.ops import TPComm
from fxpar.passes.placements import Shard, local_shard, unshard
from fxpar.passes.plan import Plan, WeightShard
from fxpar.trace import Traced


def _register(root: nn.Module, key: str, value, buffer: bool, persistent: bool = True) -> None:
    *path, leaf = key.split(".")
    mod = root
    for p in path:
        if p not in mod._modules:
            mod.add_module(p, nn.Module())
        mod = mod._modules[p]
    if buffer:
        mod.register_buffer(leaf, value, persistent=persistent)
    else:
        mod.register_parameter(leaf, value)


class ParallelModule(nn.Module):
    """`pm(*args)` returns what `model(*args)` returns; its parameters are this rank's shards."""

    def __init__(self, model: nn.Module, traced: Traced, gm: GraphModule, specs: dict[str, Shard], comm: TPComm,
                 used_keys: set[str] | None = None):
        """used_keys: the state keys this rank's graphs read (a pipeline stage holds only its own); None: all."""
        super().__init__()
        self.__dict__["graph_module"] = gm  # not a submodule: parameters live under their original names
        self.__dict__["traced"] = traced
        self.comm = comm
        originals = dict(model.named_parameters(remove_duplicate=False))
        originals.update(dict(model.named_buffers(remove_duplicate=False)))
        self._aliases: dict[str, str] = {}  # every original key -> the key its tensor is registered under
        by_id: dict[int, str] = {}
        for key, tensor in originals.items():
            by_id.setdefault(id(tensor), key)
            self._aliases[key] = by_id[id(tensor)]
        self._keys = list(model.state_dict(keep_vars=True))  # persistent keys, in the model's order
        shared_specs = {self._aliases[k]: s for k, s in specs.items()}  # tied keys share one shard
        self.specs = shared_specs
        owned = None if used_keys is None else {self._aliases[k] for k in used_keys}
        for key, reg in self._aliases.items():
            if key != reg or (owned is not None and key not in owned):
                continue
            tensor = originals[key]
            local = tensor.detach()
            if key in shared_specs:
                local = local_shard(local, shared_specs[key], comm.rank, comm.size)
            local = local.clone()
            if isinstance(tensor, nn.Parameter):
                _register(self, key, nn.Parameter(local, requires_grad=tensor.requires_grad), buffer=False)
            else:
                _register(self, key, local, buffer=True, persistent=key in self._keys)
        self._state = dict(self.named_parameters(remove_duplicate=False))
        self._state.update(dict(self.named_buffers(remove_duplicate=False)))
        self.plan: Plan | None = None

    def graph_inputs(self, flat_user: list) -> list:
        """The graph's placeholders in order: weights, buffers, constants, then the user's flattened inputs."""
        out, user = [], iter(flat_user)
        for name, kind, key in self.traced.inputs:
            if kind in ("parameter", "buffer"):
                out.append(self._state[self._aliases[key]])
            elif kind == "constant":
                out.append(self.traced.constants[key])
            else:
                out.append(next(user))
        return out

    def flatten_inputs(self, args, kwargs) -> list:
        flat, spec = pytree.tree_flatten((tuple(args), kwargs or {}))
        if spec != self.traced.in_spec:
            raise ValueError(
                f"fxpar: the call's arguments have a different structure than the traced example.\n"
                f"  traced: {self.traced.in_spec}\n  called: {spec}\nFix: call with the same arguments as example_args/"
                "example_kwargs, or parallelize again with a matching example."
            )
        for i, (got, want) in enumerate(zip(flat, self.traced.example_inputs)):
            if isinstance(want, torch.Tensor) and (not isinstance(got, torch.Tensor) or got.shape != want.shape):
                got_shape = tuple(got.shape) if isinstance(got, torch.Tensor) else type(got).__name__
                raise ValueError(
                    f"fxpar: input {i} has shape {got_shape}, but the model was traced with {tuple(want.shape)}. "
                    "The parallel graph is specialized to the example's shapes (its view sizes are constants).\n"
                    f"Fix: pass inputs of shape {tuple(want.shape)}, or call fxpar.parallelize again with an example "
                    "of the new shape."
                )
        return flat

    def compile_graphs(self, compile_fn) -> None:
        """Config(compile=True): run the graph through compile_fn (torch.compile)."""
        self.__dict__["graph_module"] = compile_fn(self.graph_module)

    def forward(self, *args, **kwargs):
        flat = self.flatten_inputs(args, kwargs)
        out = self.graph_module(*self.graph_inputs(flat))
        return pytree.tree_unflatten(list(out), self.traced.out_spec)

    def propagate_local_shapes(self, flat_user: list) -> None:
        """Set node.meta["val"] of the rewritten graph to this rank's local shapes (fake tensors, no communication)."""
        propagate_local_shapes(self.graph_module, self.graph_inputs(flat_user))

    @torch.no_grad()
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Full tensors under the original state_dict keys, tied keys included (collective over the tp group).

        On a pipeline stage, only the keys the stage holds."""
        full = {}
        for key in self._keys:
            reg = self._aliases[key]
            if reg not in self._state:
                continue
            if reg not in full:
                local = self._state[reg].detach()
                spec = self.specs.get(reg)
                full[reg] = unshard(self.comm.all_gather(local), spec) if spec else local.clone()
            full[key] = full[reg]
        return full

    def weight_shards(self, model_state: dict[str, torch.Tensor]) -> list[WeightShard]:
        rows = []
        for key in self._keys:
            reg = self._aliases[key]
            if reg not in self._state:
                continue  # held by another pipeline stage
            spec = self.specs.get(reg)
            rows.append(WeightShard(key, tuple(model_state[key].shape), str(spec) if spec else "R",
                                    tuple(self._state[reg].shape)))
        return rows


def propagate_local_shapes(gm: GraphModule, inputs: list, mode: FakeTensorMode | None = None) -> None:
    """FakeTensorProp over gm with its comm modules simulated (shapes kept, collectives skipped)."""
    saved = {}
    for name, mod in gm.named_children():
        if isinstance(getattr(mod, "comm", None), TPComm):
            saved[name] = mod.comm
            mod.comm = TPComm(mod.comm.rank, mod.comm.size)
    mode = mode or FakeTensorMode(allow_non_fake_inputs=True)
    inputs = [mode.from_tensor(x) if isinstance(x, torch.Tensor) and not isinstance(x, FakeTensor) else x
              for x in inputs]
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            FakeTensorProp(gm, mode).propagate(*inputs)
    finally:
        for name, comm in saved.items():
            gm.get_submodule(name).comm = comm


def local_fake_inputs(model: nn.Module, traced: Traced, specs: dict[str, Shard], t: int, mode) -> list:
    """The graph's inputs with each weight a fake tensor of its local shape: shapes without copying weights."""
    state = dict(model.named_parameters(remove_duplicate=False)) | dict(model.named_buffers(remove_duplicate=False))
    user, out = iter(traced.example_inputs), []
    for _, kind, key in traced.inputs:
        if kind in ("parameter", "buffer"):
            shape = list(state[key].shape)
            if key in specs:
                shape[specs[key].dim] //= t
            with mode:
                out.append(torch.empty(shape, dtype=state[key].dtype, device=state[key].device))
        else:
            out.append(traced.constants[key] if kind == "constant" else next(user))
    return out


def tp_comm(mesh) -> TPComm:
    """This rank's tensor-parallel context from a (pp, dp, tp) mesh."""
    if mesh is None or not dist.is_initialized():
        return TPComm(rank=0, size=1)
    group = mesh.get_group("tp")
    return TPComm(rank=mesh.get_local_rank("tp"), size=mesh.size(mesh.mesh_dim_names.index("tp")), group=group)
