"""One copy of the truth: after `parallelize`, the parallel module owns the weights.

[Note: one copy of the truth]
    The parallel module holds this rank's shards. Had the model kept its own parameters, there would be two
    copies that drift apart in silence: an edit or a `model.load_state_dict(pretrained)` after `parallelize`
    would never reach training (the common mistake: build, parallelize, then load the weights), and a full copy of
    every weight would stay alive beside the shards, the memory tensor parallelism is meant to save. So
    `parallelize` consumes the model: each parameter is replaced by a `ReleasedParameter` (its shape, dtype and
    requires_grad, on the meta device: no memory), and the original tensors are freed. Anything that would read or
    write a released parameter (calling the model, load_state_dict, state_dict, an in-place edit, `.to()`) raises
    an error that names the key and points to the parallel module. Metadata (shape, dtype, numel) still answers,
    so counting parameters works. Buffers stay: they are small, and fxpar reads them to compile a program for
    another mode.

    fxpar itself traces the consumed model again for a new mode or non-tensor argument: `traceable(model)` gives
    it plain parameters for that, and puts the released ones back after.
"""
from __future__ import annotations

import contextlib
import threading

import torch
import torch.nn as nn

_T = torch.Tensor
METADATA = frozenset({
    _T.shape.__get__, _T.dtype.__get__, _T.device.__get__, _T.requires_grad.__get__, _T.is_leaf.__get__,
    _T.ndim.__get__, _T.is_meta.__get__, _T.layout.__get__, _T.grad.__get__, _T.size, _T.dim, _T.numel,
    _T.nelement, _T.element_size, _T.is_floating_point, _T.is_complex, _T.__len__, _T.__hash__,
})
_SWAP_LOCK = threading.Lock()


class ReleasedParameter(nn.Parameter):
    """A parameter the model handed to `parallelize` ([Note: one copy of the truth]): metadata only."""

    def __new__(cls, like: torch.Tensor, key: str, owner: str):
        p = super().__new__(cls, torch.empty(like.shape, dtype=like.dtype, device="meta"), like.requires_grad)
        p.fxpar_key, p.fxpar_owner, p.fxpar_device = key, owner, like.device
        return p

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func in METADATA:
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **(kwargs or {}))
        released = next(a for a in (*args, *(kwargs or {}).values()) if isinstance(a, ReleasedParameter))
        raise RuntimeError(released.message(getattr(func, "__name__", str(func))))

    def message(self, what: str) -> str:
        return (f"fxpar: {self.fxpar_owner}'s parameter {self.fxpar_key} was handed to fxpar.parallelize, and the "
                f"parallel module it returned owns the weights now (this rank's shards), so `{what}` on the model "
                "would not reach training. Use the parallel module: pm(...) to run it, pm.load_state_dict(state) or "
                "fxpar.load(path, pm) to load weights, pm.full_state_dict() to read them. To keep an unmodified "
                "copy, copy.deepcopy(model) before parallelize.")

    def __repr__(self) -> str:
        return f"ReleasedParameter({self.fxpar_key}, shape={tuple(self.shape)}, dtype={self.dtype}: owned by pm)"

    def __reduce_ex__(self, protocol):
        raise RuntimeError(self.message("copy or pickle"))


def release(model: nn.Module) -> None:
    """Replace every parameter of `model` by a ReleasedParameter (tied ones by one) and free the originals."""
    owner, made = type(model).__name__, {}
    for path, module in model.named_modules(remove_duplicate=False):
        for name, p in list(module._parameters.items()):
            if p is None or isinstance(p, ReleasedParameter):
                continue
            if id(p) not in made:
                made[id(p)] = (p, ReleasedParameter(p, f"{path}.{name}" if path else name, owner))
            module._parameters[name] = made[id(p)][1]
    with torch.no_grad():
        for original, _ in made.values():  # a reference the caller kept (an optimizer made before) frees too
            original.data = torch.empty(0, dtype=original.dtype, device=original.device)
    _refuse_state_calls(model)


def _refuse_state_calls(model: nn.Module) -> None:
    """load_state_dict of the model or any of its modules raises at once, before it copies or assigns anything
    (assign=True would otherwise put real tensors back in silence). Instance attributes: the modules' own hooks stay
    as they were."""
    for module in model.modules():
        first = next((p for p in module.parameters() if isinstance(p, ReleasedParameter)), None)
        if first is not None:
            module.__dict__["load_state_dict"] = _refusal(first)


def _refusal(released: ReleasedParameter):
    def load_state_dict(*args, **kwargs):
        raise RuntimeError(released.message("load_state_dict"))
    return load_state_dict


def is_released(model: nn.Module) -> bool:
    return any(isinstance(p, ReleasedParameter) for p in model.parameters())


@contextlib.contextmanager
def traceable(model: nn.Module):
    """The consumed model as fxpar traces it again (a program for another mode): plain parameters in the released
    ones' places while the body runs, uninitialized on the device each was on (a trace reads shapes, dtypes and
    devices, never a weight's values; the memory is what the model held before parallelize, for the length of
    one trace), then the released ones back."""
    with _SWAP_LOCK:
        swapped, plain = [], {}
        for module in model.modules():
            for name, p in module._parameters.items():
                if isinstance(p, ReleasedParameter):
                    if id(p) not in plain:
                        blank = torch.empty(p.shape, dtype=p.dtype, device=p.fxpar_device)
                        plain[id(p)] = nn.Parameter(blank, p.requires_grad)
                    swapped.append((module, name, p))
        for module, name, p in swapped:
            module._parameters[name] = plain[id(p)]
        try:
            yield model
        finally:
            for module, name, p in swapped:
                module._parameters[name] = p
