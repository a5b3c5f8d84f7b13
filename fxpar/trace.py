"""Frontend: trace an unmodified model with torch.export (non-strict) into an ATen-level fx graph.

The traced graph takes its parameters, buffers and lifted constants as placeholders, followed by the flattened user
inputs; `Traced` records which placeholder is which, under the model's own state_dict names.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
import torch.utils._pytree as pytree
from torch.export.graph_signature import InputKind, OutputKind
from torch.fx import GraphModule, Node

USER_INPUT = "fxpar_user_input"  # node.meta key: this placeholder is a user input


class TraceError(RuntimeError):
    pass


@dataclass
class Traced:
    gm: GraphModule
    inputs: list[tuple[str, str, str]]  # per placeholder: (placeholder name, kind, state_dict key or "")
    in_spec: pytree.TreeSpec
    out_spec: pytree.TreeSpec
    example_inputs: list  # flattened user inputs of the example
    constants: dict

    def placeholders(self) -> dict[str, Node]:
        return {n.name: n for n in self.gm.graph.nodes if n.op == "placeholder"}

    def param_nodes(self) -> set[Node]:
        ph = self.placeholders()
        return {ph[name] for name, kind, _ in self.inputs if kind == "parameter"}


_KINDS = {
    InputKind.PARAMETER: "parameter", InputKind.BUFFER: "buffer", InputKind.CONSTANT_TENSOR: "constant",
    InputKind.USER_INPUT: "user", InputKind.CUSTOM_OBJ: "custom", InputKind.TOKEN: "token",
}


def trace(model: torch.nn.Module, args: tuple, kwargs: dict | None = None) -> Traced:
    """Export `model` on (args, kwargs); raises TraceError with export's own reason if it cannot be traced."""
    kwargs = kwargs or {}
    try:
        ep = torch.export.export(model, tuple(args), kwargs, strict=False)
    except Exception as e:  # export raises many types; show its reason whole
        raise TraceError(
            f"fxpar could not trace {type(model).__name__} with torch.export (non-strict). export said:\n"
            f"  {type(e).__name__}: {e}\n"
            "Fix: make the forward traceable (no data-dependent Python control flow on tensor values); for Hugging "
            "Face causal LMs pass use_cache=False."
        ) from e
    sig = ep.graph_signature
    for out in sig.output_specs:
        if out.kind != OutputKind.USER_OUTPUT:
            raise TraceError(
                f"{type(model).__name__}.forward mutates state ({out.kind.name} of {out.target}); fxpar supports "
                "forwards that only read their parameters and buffers."
            )
    inputs = []
    for spec in sig.input_specs:
        kind = _KINDS[spec.kind]
        if kind in ("custom", "token"):
            raise TraceError(f"unsupported graph input {spec.arg.name} of kind {kind}")
        inputs.append((spec.arg.name, kind, spec.target or ""))
    gm = copy.deepcopy(ep.graph_module)
    names = {name for name, kind, _ in inputs if kind == "user"}
    for n in gm.graph.nodes:
        if n.op == "placeholder" and n.name in names:
            n.meta[USER_INPUT] = True
    flat, in_spec = pytree.tree_flatten((tuple(args), kwargs))
    return Traced(gm, inputs, in_spec, ep.call_spec.out_spec, flat, dict(ep.constants))
