"""The per-rank executable: the compiled chunks plus this rank's local weights.

Its parameters are registered under the original model's names (`transformer.h.0.attn.c_attn.weight`), holding the
local shards, so any torch.optim optimizer works on them. Tied parameters are one Parameter here too. The graphs'
inputs are resolved from their GraphInput records ([Note: one resolver] in passes/meta.py).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.utils._pytree as pytree

from fxpar.compiler import Compiled
from fxpar.passes.meta import resolve_inputs
from fxpar.passes.ops import TPComm
from fxpar.passes.placements import local_shard, unshard
from fxpar.passes.plan import Plan, WeightShard


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

    def __init__(self, model: nn.Module, compiled: Compiled, used_keys: set[str] | None = None):
        """used_keys: the state keys this rank's chunks read (a pipeline stage holds only its own); None: all."""
        super().__init__()
        self.__dict__["compiled"] = compiled
        self.__dict__["traced"] = compiled.traced
        self.__dict__["graph_module"] = compiled.callables[0]  # what runs the whole graph (not a submodule)
        self.comm: TPComm = compiled.target.comm
        originals = dict(model.named_parameters(remove_duplicate=False))
        originals.update(dict(model.named_buffers(remove_duplicate=False)))
        self._aliases: dict[str, str] = {}  # every original key -> the key its tensor is registered under
        by_id: dict[int, str] = {}
        for key, tensor in originals.items():
            by_id.setdefault(id(tensor), key)
            self._aliases[key] = by_id[id(tensor)]
        self._keys = list(model.state_dict(keep_vars=True))  # persistent keys, in the model's order
        self.specs = {self._aliases[k]: s for k, s in compiled.specs.items()}  # tied keys share one shard
        owned = None if used_keys is None else {self._aliases[k] for k in used_keys}
        for key, reg in self._aliases.items():
            if key != reg or (owned is not None and key not in owned):
                continue
            tensor = originals[key]
            local = tensor.detach()
            if key in self.specs:
                local = local_shard(local, self.specs[key], self.comm.rank, self.comm.size)
            local = local.clone()
            if isinstance(tensor, nn.Parameter):
                _register(self, key, nn.Parameter(local, requires_grad=tensor.requires_grad), buffer=False)
            else:
                _register(self, key, local, buffer=True, persistent=key in self._keys)
        registered = dict(self.named_parameters(remove_duplicate=False))
        registered.update(self.named_buffers(remove_duplicate=False))
        self._state = {key: registered[reg] for key, reg in self._aliases.items() if reg in registered}
        self.plan: Plan | None = None

    def chunk_inputs(self, chunk, flat_user: list, received: list = ()) -> list:
        """The values of `chunk`'s placeholders: this rank's weights, constants, user inputs, received values."""
        return resolve_inputs(chunk.inputs, self._state, self.traced.constants, flat_user, received)

    def graph_inputs(self, flat_user: list) -> list:
        """The inputs of the whole (unpartitioned) graph."""
        return self.chunk_inputs(self.compiled.partition.chunks[0], flat_user)

    def flatten_inputs(self, args, kwargs) -> list:
        return self.traced.flatten_call(args, kwargs)

    def forward(self, *args, **kwargs):
        flat = self.flatten_inputs(args, kwargs)
        out = self.graph_module(*self.graph_inputs(flat))
        return pytree.tree_unflatten(list(out), self.traced.out_spec)

    @torch.no_grad()
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Full tensors under the original state_dict keys, tied keys included (collective over the tp group).

        On a pipeline stage, only the keys the stage holds."""
        full = {}
        for key in self._keys:
            reg = self._aliases[key]
            if key not in self._state:
                continue
            if reg not in full:
                local = self._state[key].detach()
                spec = self.specs.get(reg)
                full[reg] = unshard(self.comm.all_gather(local), spec) if spec else local.clone()
            full[key] = full[reg]
        return full

    def weight_shards(self, model_state: dict[str, torch.Tensor]) -> list[WeightShard]:
        rows = []
        for key in self._keys:
            if key not in self._state:
                continue  # held by another pipeline stage
            spec = self.specs.get(self._aliases[key])
            rows.append(WeightShard(key, tuple(model_state[key].shape), str(spec) if spec else "R",
                                    tuple(self._state[key].shape)))
        return rows


def tp_comm(mesh) -> TPComm:
    """This rank's tensor-parallel context from a (pp, dp, tp) mesh."""
    if mesh is None or not dist.is_initialized():
        return TPComm(rank=0, size=1)
    group = mesh.get_group("tp")
    return TPComm(rank=mesh.get_local_rank("tp"), size=mesh.size(mesh.mesh_dim_names.index("tp")), group=group)
