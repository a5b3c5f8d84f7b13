"""The executable's weights: one source of truth, read live on every call, loaded under the original keys.

The executable registers this rank's shard of every weight under the model's own key (`h.0.attn.c_attn.weight`),
in small holder modules, so optimizers, `.to()`, `.double()` and `load_state_dict(assign=True)` act on them like on
any module. `LiveState` reads the tensors from the holders at call time, so the graph always runs on what the module
holds now; `check_state` then compares each with what the program was traced for (dtype, device, local shape) and
says what to do when they differ.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping

import torch
import torch.nn as nn

from fxpar.passes.ir.placements import Shard, local_shard
from fxpar.runtime.precision import Grads


def own_experts(full: torch.Tensor, ep) -> torch.Tensor:
    """This ep rank's experts of a tensor split along its expert dim (0): the ep.rank-th of ep.size equal blocks,
    as passes/experts/expert_parallel.py runs them."""
    return full.chunk(ep.size)[ep.rank]


def all_experts(local: torch.Tensor, ep) -> torch.Tensor:
    """Every ep rank's experts in rank order, own_experts' inverse (a collective over the ep group)."""
    return torch.cat(ep.all_gather(local))


def first_expert(local: torch.Tensor, ep) -> int:
    """Where this ep rank's experts (`local`, its own_experts) start along dim 0 of the full tensor."""
    return ep.rank * local.shape[0]


class LiveState(Mapping):
    """state_dict key (tied keys included) -> the tensor a holder module holds now."""

    def __init__(self, slots: dict[str, tuple[nn.Module, str]]):
        self.slots = slots

    def __getitem__(self, key: str) -> torch.Tensor:
        holder, leaf = self.slots[key]
        t = holder._parameters.get(leaf)
        return t if t is not None else holder._buffers[leaf]

    def __iter__(self):
        return iter(self.slots)

    def __len__(self) -> int:
        return len(self.slots)


@dataclass
class RankWeights:
    """This rank's weights, in one typed home (`pm.rank.weights`): what checkpoints, loading, optimizers, clipping
    and the replica check read, instead of the executable's own attributes.

    keys      the model's persistent state keys, in its order ([Note: state-dict hooks])
    aliases   every parameter and buffer key -> the key its tensor is registered under (tied keys share one)
    shapes    key -> the global shape
    specs     registered key -> its tensor-parallel sharding (absent: replicated)
    slots     key -> (holder module, attribute) of each tensor this rank holds (another stage's keys are absent)
    live      key -> the tensor its holder holds now
    unloaded  registered keys built on the meta device that no load has filled yet
    experts   registered keys split along their expert dim (0) over the ep group (`ep`: rank, size, group)
    grads     where each trainable parameter's gradient is (its .grad, or an fp32 main gradient)
    """

    keys: tuple[str, ...]
    aliases: dict[str, str]
    shapes: dict[str, tuple[int, ...]]
    specs: dict[str, Shard]
    slots: dict[str, tuple[nn.Module, str]]
    unloaded: set[str] = field(default_factory=set)
    grads: Grads | None = None
    experts: frozenset = frozenset()
    ep: object = None  # the ep group's TPComm where `experts` is not empty

    def expert(self, key: str) -> bool:
        """Whether key's tensor is split over the experts' ranks (this rank holds 1/ep of its experts)."""
        return self.aliases.get(key, key) in self.experts

    def __post_init__(self):
        self.live = LiveState(self.slots)

    def held_keys(self) -> list[str]:
        """The state keys this rank holds, in the model's order (tied keys included)."""
        return [k for k in self.keys if k in self.slots]

    def spec(self, key: str) -> Shard | None:
        """How key's tensor is sharded over tp (None: replicated)."""
        return self.specs.get(self.aliases[key])

    def held(self) -> dict[str, torch.Tensor]:
        """Each tensor this rank holds, once, under the key it is registered under (tied keys are one entry)."""
        return {key: self.live[key] for key in self.held_keys() if self.aliases[key] == key}

    def check_loaded(self, what: str = "would run on garbage") -> None:
        """Raise if a weight built on the meta device has not been filled by a load yet (`what` would go wrong)."""
        unloaded = [k for k in self.keys if self.aliases.get(k) in self.unloaded]
        if unloaded:
            raise RuntimeError(
                f"fxpar: the model was built on the meta device and {len(unloaded)} of this rank's weights "
                f"({unloaded[0]}, ...) hold no values yet, so it {what}. Fix: fill them first with "
                "fxpar.load(checkpoint, pm), or pm.load_state_dict(full_state_dict).")

    def mark_loaded(self, key: str | None = None) -> None:
        """key's tensor (every tensor, with None) now holds loaded values."""
        if key is None:
            self.unloaded.clear()
        else:
            self.unloaded.discard(self.aliases[key])


def check_state(state: Mapping, expected: dict[str, torch.Tensor]) -> None:
    """Raise ValueError naming the first weight whose dtype, device or shape differs from the traced program's."""
    for key, want in expected.items():
        got = state[key]
        if got.dtype != want.dtype or got.device != want.device or got.shape != want.shape:
            raise ValueError(
                f"fxpar: weight {key} is now {_describe(got)}, but the parallel program was compiled for "
                f"{_describe(want)}. The program's ops are specialized to the traced dtypes and devices. Fix: convert "
                "or move the model before fxpar.parallelize (model.to(...), then parallelize), and load full "
                "tensors with pm.load_state_dict, which shards them."
            )


def _describe(t: torch.Tensor) -> str:
    return f"{str(t.dtype).split('.')[-1]} {'x'.join(map(str, t.shape)) or 'scalar'} on {t.device}"


def load_full_or_local(pm, state_dict: Mapping[str, torch.Tensor], strict: bool, assign: bool):
    """pm.load_state_dict: full tensors under the original keys are sharded to this rank; tensors of this rank's
    local shape are taken as they are. Keys another pipeline stage holds are skipped."""
    from torch.nn.modules.module import _IncompatibleKeys

    known = set(pm.rank.weights.aliases)
    unexpected = [k for k in state_dict if k not in known]
    missing = [k for k in pm.rank.weights.keys if k in pm.rank.weights.slots and k not in state_dict]
    if strict and (unexpected or missing):
        raise RuntimeError(f"fxpar: load_state_dict: missing keys {missing[:5]}{'...' if len(missing) > 5 else ''}, "
                           f"unexpected keys {unexpected[:5]}{'...' if len(unexpected) > 5 else ''}")
    done = set()
    with torch.no_grad():
        for key, value in state_dict.items():
            if key not in pm.rank.weights.slots or pm.rank.weights.aliases[key] in done:
                continue  # another stage's, or a tied alias already loaded
            done.add(pm.rank.weights.aliases[key])
            pm.rank.weights.mark_loaded(key)
            if pm.rank.weights.expert(key) and value.shape[:1] == pm.rank.weights.shapes[key][:1]:
                value = own_experts(value, pm.rank.weights.ep)
            local = _local_value(key, value, pm.rank.weights.spec(key), pm.rank.weights.live[key], pm.rank.comm)
            holder, leaf = pm.rank.weights.slots[key]
            current = pm.rank.weights.live[key]
            if assign:
                if isinstance(current, nn.Parameter):
                    holder._parameters[leaf] = nn.Parameter(local, requires_grad=current.requires_grad)
                else:
                    holder._buffers[leaf] = local
            else:
                current.copy_(local)
    return _IncompatibleKeys(missing, unexpected)


def _local_value(key: str, value: torch.Tensor, spec: Shard | None, current: torch.Tensor, comm) -> torch.Tensor:
    if spec is not None and value.shape[spec.dim] == spec.size and tuple(value.shape) != tuple(current.shape):
        return local_shard(value.detach(), spec, comm.rank, comm.size).to(current.dtype)
    if tuple(value.shape) == tuple(current.shape):
        return value.detach().to(current.dtype)
    full = list(current.shape)
    if spec is not None:
        full[spec.dim] = spec.size
    raise ValueError(f"fxpar: load_state_dict: {key} has shape {tuple(value.shape)}; expected the full "
                     f"{tuple(full)} or this rank's shard {tuple(current.shape)}")


# ---- the model's own spelling of its state ([Note: state-dict hooks]) ------------------------------------------------
# [Note: state-dict hooks]
#     A module may rename or re-split its state when saved (a fused `wqkv` saved as `wq`, `wk`, `wv` by a state-dict
#     hook, and fused again by a load pre-hook). fxpar holds, shards and checkpoints the tensors under their own keys
#     (the paths of the parameters and persistent buffers: `tensor_keys`), and speaks the model's spelling at the
#     edges: `pm.full_state_dict()` returns what `model.state_dict()` returns (the hooks run on the full tensors), and
#     `pm.load_state_dict` takes that spelling back (the load pre-hooks run first), as torch's own calls do.

def _own_keys(module: nn.Module) -> list[str]:
    """The names of a module's own parameters and persistent buffers (not its children's), as it saves them."""
    return [k for k, p in module._parameters.items() if p is not None] + [
        k for k, b in module._buffers.items() if b is not None and k not in module._non_persistent_buffers_set]


def tensor_keys(model: nn.Module) -> list[str]:
    """The keys model.state_dict() has without its hooks: every parameter and persistent buffer under its module
    path, in the model's order (a tensor shared by two modules under both paths)."""
    modules = model.named_modules(remove_duplicate=False)  # the order state_dict visits them, shared ones twice
    return [_prefix(path) + k for path, module in modules for k in _own_keys(module)]


def _prefix(path: str) -> str:
    return path + "." if path else ""


def has_state_hooks(model: nn.Module) -> bool:
    """Whether any module of the model changes how its state is saved or loaded."""
    return any(m._state_dict_hooks or m._state_dict_pre_hooks or m._load_state_dict_pre_hooks
               for m in model.modules())


def to_model_spelling(model: nn.Module, state: dict) -> dict:
    """`state` (under tensor_keys) as model.state_dict() spells it: every module's state-dict pre-hooks and hooks
    run in torch's order (a module's hooks after its children's, on the dict built so far), on the full tensors;
    keys `state` lacks (another pipeline stage's) are left out."""
    def visit(module: nn.Module, prefix: str, destination: dict) -> dict:
        for hook in module._state_dict_pre_hooks.values():
            hook(module, prefix, False)
        destination.update((prefix + k, state[prefix + k]) for k in _own_keys(module) if prefix + k in state)
        for name, child in module._modules.items():
            if child is not None:
                visit(child, prefix + name + ".", destination)  # a child's returned dict is dropped, as in torch
        for hook in module._state_dict_hooks.values():
            result = hook(module, destination, prefix, {})
            destination = destination if result is None else result
        return destination

    return visit(model, "", {})


def from_model_spelling(model: nn.Module, state: Mapping) -> dict:
    """A state dict in the model's own spelling, under tensor_keys: every module's load pre-hooks run, parents first,
    as load_state_dict runs them."""
    state = dict(state)
    for path, module in model.named_modules(remove_duplicate=False):
        for hook in module._load_state_dict_pre_hooks.values():
            hook(state, _prefix(path), {}, True, [], [], [])
    return state
