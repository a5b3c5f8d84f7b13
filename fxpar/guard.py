"""Global state that a failing call must not leak, and the autograd semantics a trace would silently drop.

    preserve_global_state()   restores grad mode, autocast and the default random generators' states when the
                              body raises (a forward that fails inside its own no_grad region would otherwise leave
                              autograd off for the whole process).
    watch_trace()             records, while torch.export traces the model, every custom autograd.Function and
                              every tensor.register_hook the forward calls: the traced graph keeps neither backward,
                              so the compiler refuses such a model instead of returning wrong gradients. (A
                              registered custom op's autograd, `custom_op` + `register_autograd`, is not one: the op
                              stays one node, with its registered backward.)
    backward_hooks(model)     module backward hooks, which a trace drops as well.
"""
from __future__ import annotations

import contextlib
import functools
import os
import threading
import traceback

import torch

_PATCH_LOCK = threading.Lock()  # one trace patches torch's autograd classes at a time


def _autocast_state() -> list:
    state = []
    for device in ("cpu", "cuda"):
        state.append((device, torch.is_autocast_enabled(device), torch.get_autocast_dtype(device)))
    return state


@contextlib.contextmanager
def preserve_global_state():
    grad = torch.is_grad_enabled()
    autocast = _autocast_state()
    cpu_rng = torch.get_rng_state()
    cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    try:
        yield
    except BaseException:
        torch.set_grad_enabled(grad)
        for device, enabled, dtype in autocast:
            torch.set_autocast_enabled(device, enabled)
            torch.set_autocast_dtype(device, dtype)
        torch.set_rng_state(cpu_rng)
        if cuda_rng is not None:
            torch.cuda.set_rng_state_all(cuda_rng)
        raise


@functools.cache
def _library_dirs() -> tuple[str, ...]:
    """The folders of torch's and fxpar's own modules (fxpar's three packages), each ending in a separator. A frame
    is theirs by where its module lives, never by a word in its path: a user's clone may be a folder named fxpar."""
    import fxpar.cost
    import fxpar.passes

    return tuple(os.path.join(os.path.dirname(os.path.realpath(m.__file__)), "")
                 for m in (torch, fxpar, fxpar.passes, fxpar.cost))


def _where() -> str:
    """The user's line that made the call (the innermost frame outside torch and fxpar)."""
    ours = _library_dirs()
    for frame in reversed(traceback.extract_stack()[:-2]):
        if not os.path.realpath(frame.filename).startswith(ours):
            return f"{frame.filename}:{frame.lineno} ({frame.line})"
    return "?"


@contextlib.contextmanager
def watch_trace():
    """Yield a list that collects (what, where) for each custom autograd.Function applied and each
    tensor.register_hook called while the body runs.

    [Note: every Function seen]
        A Function is seen where its backward node is made, not where `apply` is looked up: `MyFn.apply` bound in
        `__init__`, at module level, through functools.partial, a decorator or a helper elsewhere is a method
        object made before the trace, which no patch of `Function.apply` reaches. Every application, however it
        is reached, constructs the class's backward node (a subclass of BackwardCFunction) from C++; patching that
        base class's `__init__` sees each one, with the user's line on the stack.
    """
    seen: list[tuple[str, str]] = []
    node, tensor = torch.autograd.function.BackwardCFunction, torch.Tensor
    tracing = threading.get_ident()  # other threads (ranks of a threaded group) may call Functions meanwhile
    with _PATCH_LOCK:
        had_init, init = "__init__" in node.__dict__, node.__init__
        register_hook = tensor.__dict__["register_hook"]  # the descriptor

        def watched_init(self, *args, **kwargs):
            cls = type(self)._forward_cls
            if threading.get_ident() == tracing and not _registered_op(cls):
                seen.append((f"custom autograd.Function {cls.__qualname__}", _where()))
            init(self, *args, **kwargs)

        def watched_hook(self, hook):
            if threading.get_ident() == tracing:
                seen.append((f"tensor.register_hook({getattr(hook, '__qualname__', hook)})", _where()))
            return register_hook(self, hook)

        node.__init__ = watched_init
        tensor.register_hook = watched_hook
        try:
            yield seen
        finally:
            tensor.register_hook = register_hook
            if had_init:
                node.__init__ = init
            else:
                del node.__init__


def _registered_op(cls) -> bool:
    """The autograd of a registered custom op (`register_autograd`): the trace keeps the op as one node, and the
    op's registered backward runs when the node does, so nothing is dropped."""
    return cls.__module__ == "torch._library.autograd"


def backward_hooks(model: torch.nn.Module) -> list[str]:
    """Paths of the modules that carry backward hooks (and the global ones)."""
    out = [name or "<root>" for name, m in model.named_modules() if m._backward_hooks or m._backward_pre_hooks]
    if torch.nn.modules.module._global_backward_hooks or torch.nn.modules.module._global_backward_pre_hooks:
        out.append("<global module backward hooks>")
    return out
