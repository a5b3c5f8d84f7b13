"""Programs keyed by what the trace froze: train/eval mode and non-tensor arguments.

[Note: the program includes its context]
    torch.export specializes a trace to the module's mode (dropout on or off, batch-norm statistics) and to the
    values of non-tensor arguments (a float scale, a flag that picks a branch, use_cache). The executable therefore
    keeps one compiled program per (mode, non-tensor arguments): a call whose mode or arguments differ from every
    program so far is compiled first (with the weights' sharding pinned to the first program's, and, for a
    pipeline, the same cut into chunks), never answered by a program traced for other values.
    A rewrite that relied on a buffer's value (a mask proven causal) is checked at each call: if the buffer changed,
    the program is compiled again from the new value.
"""
from __future__ import annotations

import dataclasses

import logging
import warnings

import torch
import torch.utils._pytree as pytree

from fxpar.compiler import Compiled, compile_model
from fxpar.programs import JointRequest
from fxpar.runtime.joint_runner import JointRunner
from fxpar.runtime.ownership import traceable

log = logging.getLogger("fxpar")
MANY_PROGRAMS = 8  # warn past this many: an argument that changes every call would recompile every call


def static_key(flat: list) -> tuple:
    """The non-tensor leaves of a call, with their types (True and 1 are different arguments)."""
    out = []
    for x in flat:
        if isinstance(x, torch.Tensor):
            continue
        try:
            hash(x)
            out.append((type(x).__name__, x))
        except TypeError:
            out.append((type(x).__name__, repr(x)))
    return tuple(out)


def describe_mismatch(example_call: tuple[list, pytree.TreeSpec], args, kwargs) -> str:
    """Which argument of a call differs in structure from the example call (flat inputs, spec), in words."""
    example = pytree.tree_unflatten(*example_call)
    want = {pytree.keystr(path): leaf for path, leaf in pytree.tree_flatten_with_path(example)[0]}
    got = {pytree.keystr(path): leaf for path, leaf in pytree.tree_flatten_with_path((tuple(args), kwargs or {}))[0]}
    for path, leaf in want.items():
        if path not in got:
            return f"argument {_name(path)} (traced as {_short(leaf)}) is missing from the call"
    for path, leaf in got.items():
        if path not in want:
            return f"argument {_name(path)} = {_short(leaf)} was not in the traced example"
    return "the arguments nest differently than the traced example's"


def _name(path: str) -> str:
    """pytree key paths of (args, kwargs) in words: [0][1] -> positional argument 1, [1]['use_cache'] -> use_cache."""
    head, rest = path[:3], path[3:]
    if head == "[1]":
        return rest.replace("']['", ".").strip("[]'")
    index, _, inner = rest[1:].partition("]")
    return f"positional argument {index}{inner}"


def _short(x) -> str:
    return f"a tensor of shape {tuple(x.shape)}" if isinstance(x, torch.Tensor) else repr(x)


class Programs:
    """The compiled programs of one executable, by (training, with the loss, non-tensor arguments)."""

    def __init__(self, first: Compiled, training: bool):
        self.first = first
        self.loss_fn, self.example_target = first.loss or (None, None)  # a pipeline sets them ([Note: the loss ...])
        self.by_key = {(training, first.traced.with_loss, static_key(first.traced.example_inputs)): first}
        self._seen: dict = {}  # GraphInput -> (id, _version) of the buffer last checked
        self._runners: dict = {}  # (id of a program, chunk index) -> (the program, its chunk's JointRunner)

    def example(self, with_loss: bool) -> tuple[list, pytree.TreeSpec]:
        """The flat inputs and spec of the example call: the model's own, or with its loss's target
        ([Note: the loss is traced] in fxpar/trace.py)."""
        first = self.first
        args = (*first.example_args, self.example_target) if with_loss else first.example_args
        return pytree.tree_flatten((tuple(args), first.example_kwargs))

    def runner(self, program: Compiled, index: int):
        """What runs chunk `index` of `program`: its callable, or the runtime's cache of its joint programs (one per
        input signature, fxpar/runtime/joint_runner.py), made at the first ask."""
        made = program.callables[index]
        if not isinstance(made, JointRequest):
            return made
        entry = self._runners.get((id(program), index))
        if entry is None or entry[0] is not program:
            chunk = next(c for c in program.partition.chunks if c.index == index)
            entry = self._runners[id(program), index] = (program, JointRunner(chunk.gm, made, program.config,
                                                                                 program.target.comm.rank))
        return entry[1]

    def get(self, training: bool, flat: list, live_state, buffer_values, with_loss: bool = False) -> Compiled:
        key = (training, with_loss, static_key(flat))
        program = self.by_key.get(key)
        if program is not None and not self._assumptions_hold(program, live_state):
            log.info("fxpar: a buffer a rewrite relied on changed; compiling again")
            del self.by_key[key]
            program = None
        if program is None:
            program = self.by_key[key] = self._compile(training, flat, buffer_values(), with_loss)
            if len(self.by_key) > MANY_PROGRAMS:
                warnings.warn(f"fxpar: {len(self.by_key)} programs compiled for different modes or non-tensor "
                              "arguments; an argument that changes every call recompiles every call (pass it as a "
                              "tensor instead)", stacklevel=4)
        return program

    def _assumptions_hold(self, program: Compiled, state) -> bool:
        for gi, proven in program.assumed.items():
            if gi.kind == "constant" or gi.key not in state:
                continue  # constants do not change; another pipeline stage holds (and checks) this buffer
            t = state[gi.key]
            mark = (id(t), t._version)
            if self._seen.get(gi) == mark:
                continue
            if t.shape != proven.shape or not torch.equal(t.detach().to(proven.device), proven):
                return False
            self._seen[gi] = mark
        return True

    def _compile(self, training: bool, flat: list, buffers: dict, with_loss: bool) -> Compiled:
        first = self.first
        example, spec = self.example(with_loss)
        leaves = [base if isinstance(base, torch.Tensor) else x for base, x in zip(example, flat)]
        args, kwargs = pytree.tree_unflatten(leaves, spec)
        loss = None
        if with_loss:
            *args, target = args
            loss = (self.loss_fn, target)
        target = first.target
        if target.pipelined:
            target = dataclasses.replace(target, pipelined=True,
                                         chunk_layers=tuple(c.layers for c in first.partition.chunks))
        model, was_training = first.model, first.model.training
        # a buffer this rank does not hold (another stage's, or one no chunk read) keeps the model's value
        buffers = {**dict(model.named_buffers(remove_duplicate=False)), **buffers}
        model.train(training)
        try:
            with traceable(model):  # the model's parameters were handed over ([Note: one copy of the truth])
                program = compile_model(model, args, kwargs, target, first.config, buffers, loss=loss)
        finally:
            model.train(was_training)
        if program.specs != first.specs:
            changed = sorted(set(program.specs.items()) ^ set(first.specs.items()), key=lambda kv: kv[0])[:3]
            raise ValueError(f"fxpar: the program for training={training}{' with the loss' * with_loss} and these "
                             "arguments shards the weights "
                             f"differently than the first one ({changed}); parallelize the model in that mode "
                             "instead")
        return program
