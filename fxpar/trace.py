"""Frontend: trace an unmodified model with torch.export (non-strict) into an ATen-level fx graph.

The traced graph takes its parameters, buffers and lifted constants as placeholders, followed by the flattened user
inputs. Every placeholder is stamped with the GraphInput it stands for (passes/ir/meta.py), under the model's own
state_dict names, and every node with its own name as FXPAR_ORIGIN, so rewritten copies still say which value of the
traced program they compute. The traced graph itself is never rewritten: the compiler works on a copy, and verify
runs this one as the reference.

[Note: the loss is traced]
    With a loss_fn, the program the pipeline trains is loss_fn(model(*args, **kwargs), target), traced as one graph:
    the analysis then sees the loss, so a cross-entropy over the vocabulary-parallel logits becomes Megatron's
    vocab-parallel cross-entropy (passes/tensor_parallel/vocab_kernels.py) and the logits are never gathered. The target is one more
    user input, after the positional arguments. The model's own call (`pm(x)`) is another program, traced without
    the loss. A loss_fn that cannot be traced (Python on tensor values, a non-scalar result) is called on the
    gathered output instead, and the plan says why.
"""
from __future__ import annotations

import types
from dataclasses import dataclass

import torch
import torch.utils._pytree as pytree
from torch.export.graph_signature import InputKind, OutputKind
from torch.fx import GraphModule

from fxpar.guard import backward_hooks, preserve_global_state, watch_trace
from fxpar.passes.ir.meta import (BUFFER, CONSTANT, FXPAR_INPUT, FXPAR_ORIGIN, PARAMETER, USER, GraphInput, module_path,
                                  resolve_inputs)
from fxpar.mixed_precision import cast_inputs, cast_outputs


class TraceError(RuntimeError):
    pass


NO_TARGET = object()  # Traced.flatten of a call without a target (the model's own call)


_KINDS = {InputKind.PARAMETER: PARAMETER, InputKind.BUFFER: BUFFER, InputKind.CONSTANT_TENSOR: CONSTANT,
          InputKind.USER_INPUT: USER}


@dataclass
class Traced:
    gm: GraphModule  # the traced program, never rewritten
    inputs: tuple[GraphInput, ...]  # one per placeholder, in call order
    in_spec: pytree.TreeSpec
    out_spec: pytree.TreeSpec
    example_inputs: list  # flattened user inputs of the example
    constants: dict
    model_name: str = ""
    kwarg_order: tuple[str, ...] = ()
    with_loss: bool = False  # the program is loss_fn(model(*args), target): its one output is the loss
    loss_note: str = ""  # a loss_fn was given but not traced with the model: why (the plan says it)

    def flatten(self, args, kwargs, target=NO_TARGET) -> tuple[list, pytree.TreeSpec]:
        """Flatten a call like the example: keyword arguments in the traced order, however they were passed. The
        call of a program traced with its loss takes the target after the positional arguments ([Note: the loss
        is traced])."""
        kwargs = kwargs or {}
        if set(kwargs) == set(self.kwarg_order):
            kwargs = {k: kwargs[k] for k in self.kwarg_order}
        args = tuple(args) if target is NO_TARGET else (*args, target)
        return pytree.tree_flatten((args, kwargs))

    def flatten_call(self, args, kwargs, where: str = "fxpar") -> list:
        """The call's user inputs, flattened and checked against the traced example (structure and shapes)."""
        flat, spec = self.flatten(args, kwargs)
        if spec != self.in_spec:
            raise ValueError(
                f"{where}: the call's arguments have a different structure than the traced example.\n"
                f"  traced: {self.in_spec}\n  called: {spec}\nFix: call with the same arguments as example_args/"
                "example_kwargs, or parallelize again with a matching example."
            )
        self.check_shapes(flat, where)
        return flat

    def check_shapes(self, flat: list, where: str = "fxpar", rows: str = "", example: list | None = None) -> None:
        """Raise ValueError unless every tensor input has the shape of the traced example (or of `example`, the
        flat inputs of another call of the model). `rows` adds a hint."""
        for i, (got, want) in enumerate(zip(flat, self.example_inputs if example is None else example)):
            if isinstance(want, torch.Tensor) and (not isinstance(got, torch.Tensor) or got.shape != want.shape):
                got_shape = tuple(got.shape) if isinstance(got, torch.Tensor) else type(got).__name__
                raise ValueError(
                    f"{where}: input {i} has shape {got_shape}, but the model was traced with {tuple(want.shape)}. "
                    "The parallel graph is specialized to the example's shapes (its view sizes are constants).\n"
                    f"Fix: pass inputs of shape {tuple(want.shape)}{rows}, or call fxpar.parallelize again with an "
                    "example of the new shape."
                )

    def values(self, state: dict) -> dict[GraphInput, torch.Tensor]:
        """Concrete tensors of the buffer and constant inputs (what the fusion pass may evaluate at compile time)."""
        kept = [gi for gi in self.inputs if gi.kind in (BUFFER, CONSTANT) and (gi.kind == CONSTANT or gi.key in state)]
        return dict(zip(kept, resolve_inputs(kept, state, self.constants)))


def _refuse_data_dependent(name: str, gm: torch.fx.GraphModule) -> None:
    """Raise TraceError at the first node whose size or value depends on tensor data (`.item()`, `nonzero`): the
    compiler's stages work on static shapes, one program per traced example."""
    from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

    for n in gm.graph.nodes:
        symbols = free_unbacked_symbols(n.meta.get("val"))
        if symbols:
            raise TraceError(
                f"{name}: node {n.name} ({n.target}, module {module_path(n) or '<root>'}) has a size or value that "
                f"depends on tensor data ({', '.join(map(str, sorted(symbols, key=str)))}); fxpar compiles programs "
                "of static shapes. Fix: "
                "compute it without .item() / nonzero / boolean indexing (a fixed capacity, masks instead of gathers)."
            )


def trace(model: torch.nn.Module, args: tuple, kwargs: dict | None = None, loss: tuple | None = None,
          compute_dtype: torch.dtype | None = None) -> Traced:
    """Export `model` on (args, kwargs); raises TraceError with export's own reason if it cannot be traced.

    loss: (loss_fn, example_target): trace loss_fn(model(*args, **kwargs), target) as one program ([Note: the loss
    is traced]); if that cannot be traced but the model can, the trace is the model's and `loss_note` says why.
    compute_dtype: mixed precision ([Note: mixed precision] in fxpar/runtime/precision.py): the model's floating inputs
    are cast to it and its floating outputs to fp32, inside the program."""
    if loss is None:
        return _trace(model, args, kwargs, compute_dtype=compute_dtype)
    loss_fn, target = loss
    try:
        traced = _trace(model, (*args, target), kwargs, loss_fn, compute_dtype)
        _check_scalar(traced)
        return traced
    except TraceError as e:
        traced = _trace(model, args, kwargs, compute_dtype=compute_dtype)  # the model's own error if it cannot either
        lines = str(e).splitlines()
        reason = lines[1].strip() if len(lines) > 1 and "export said" in lines[0] else lines[0]
        traced.loss_note = f"loss_fn is called on the gathered output, not traced with the model: {reason}"
        return traced


def _check_scalar(traced: Traced) -> None:
    out = [n for n in traced.gm.graph.nodes if n.op == "output"][0].args[0]
    val = out[0].meta.get("val") if len(out) == 1 and isinstance(out[0], torch.fx.Node) else None
    if traced.out_spec != pytree.treespec_leaf() or not isinstance(val, torch.Tensor) or val.dim() \
            or not val.is_floating_point():
        raise TraceError(f"loss_fn does not return one floating-point scalar tensor (it returns {traced.out_spec})")


def _program(model: torch.nn.Module, loss_fn, compute_dtype):
    """model.forward for the trace of loss_fn(model(*args), target) (the target is the last positional argument)
    and/or of the model in mixed precision (inputs cast to compute_dtype, outputs to fp32)."""
    forward = type(model).forward

    def program(self, *args, **kwargs):
        if loss_fn is not None:
            *args, target = args
        if compute_dtype is not None:
            args, kwargs = cast_inputs((args, kwargs), compute_dtype)
        out = forward(self, *args, **kwargs)
        if compute_dtype is not None:
            out = cast_outputs(out)
        return out if loss_fn is None else loss_fn(out, target)

    return types.MethodType(program, model)


def distinct_inputs(tree, model: torch.nn.Module | None = None):
    """`tree` (of args, kwargs) with every tensor that shares storage with an earlier one, or with a parameter or
    buffer of `model`, replaced by a copy of the same shape, strides and value ([Note: inputs are traced
    distinct])."""
    state = () if model is None else (*model.parameters(), *model.buffers())
    seen = {_storage(t) for t in state} - {None}

    def distinct(x):
        storage = _storage(x)
        if storage is None:
            return x
        if storage not in seen:
            seen.add(storage)
            return x
        return _copy(x)

    return pytree.tree_map(distinct, tree)


def _storage(x):
    """The identity of x's storage; None for a non-tensor or a tensor without one (sparse)."""
    if not isinstance(x, torch.Tensor):
        return None
    try:
        return x.untyped_storage()._cdata
    except (RuntimeError, NotImplementedError):
        return None


def _copy(x: torch.Tensor) -> torch.Tensor:
    """x in storage of its own, strides kept where they address each element once (not an expand's zeros)."""
    with torch.no_grad():
        try:
            out = torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device=x.device).copy_(x)
        except RuntimeError:  # overlapping strides (an expanded tensor) cannot be written: a dense copy
            out = x.clone(memory_format=torch.contiguous_format)
    return out.requires_grad_(x.requires_grad)


def _trace(model: torch.nn.Module, args: tuple, kwargs: dict | None, loss_fn=None, compute_dtype=None) -> Traced:
    args, kwargs = distinct_inputs((tuple(args), kwargs or {}), model)
    name = type(model).__name__
    hooked = backward_hooks(model)
    if hooked:
        raise TraceError(f"{name}: modules {', '.join(hooked)} have backward hooks, which a trace cannot keep. Fix: "
                         "remove them before fxpar.parallelize (gradients would silently differ).")
    try:
        with preserve_global_state(), watch_trace() as dropped:
            patched = loss_fn is not None or compute_dtype is not None
            if patched:
                model.forward = _program(model, loss_fn, compute_dtype)  # an instance attribute, deleted right after
            try:
                ep = torch.export.export(model, tuple(args), kwargs, strict=False)
            finally:
                if patched:
                    del model.forward
    except Exception as e:  # export raises many types; show its reason whole
        raise TraceError(
            f"fxpar could not trace {name} with torch.export (non-strict). export said:\n"
            f"  {type(e).__name__}: {e}\n"
            "Fix: make the forward traceable (no data-dependent Python control flow on tensor values); for Hugging "
            "Face causal LMs pass use_cache=False."
        ) from e
    if dropped:
        calls = list(dict.fromkeys(dropped))
        what, where = calls[0]
        raise TraceError(
            f"{name}.forward calls {what} at {where}. A trace keeps its forward only, so the gradients would "
            f"silently differ from the model's ({len(calls)} such call site(s)). Fix: write the operation with "
            "differentiable torch ops, or apply it outside the parallelized model."
        )
    _refuse_data_dependent(name, ep.graph_module)
    sig = ep.graph_signature
    for out in sig.output_specs:
        if out.kind != OutputKind.USER_OUTPUT:
            raise TraceError(
                f"{name}.forward mutates state ({out.kind.name} of {out.target}); fxpar supports forwards that only "
                "read their parameters and buffers."
            )
    inputs, users = [], 0
    for spec in sig.input_specs:
        if spec.kind not in _KINDS:
            raise TraceError(f"{name}: unsupported graph input {spec.arg.name} of kind {spec.kind.name}")
        kind = _KINDS[spec.kind]
        inputs.append(GraphInput(kind, index=users) if kind == USER else GraphInput(kind, spec.target))
        users += kind == USER
    gm = ep.graph_module
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for n, gi in zip(placeholders, inputs):
        n.meta[FXPAR_INPUT] = gi
    for n in gm.graph.nodes:
        n.meta[FXPAR_ORIGIN] = n.name
    flat, in_spec = pytree.tree_flatten((tuple(args), kwargs))
    return Traced(gm, tuple(inputs), in_spec, ep.call_spec.out_spec, flat, dict(ep.constants), name, tuple(kwargs),
                  with_loss=loss_fn is not None)
