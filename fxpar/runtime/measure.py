"""Measuring what a step keeps: the bytes autograd saves for backward (tests and benchmarks; the runtime does not
measure, so a step pays no saved-tensor hook).

Glossary: *saved bytes*, the distinct storages that autograd keeps for backward while a forward runs, weights and
buffers excluded; checkpointed regions count their inputs, which checkpoint saves through the same hooks.
"""
from __future__ import annotations

import torch


def saved_activation_bytes(fn, exclude=()) -> tuple[object, int]:
    """(fn(), bytes of the distinct storages autograd saves for backward while fn runs), `exclude`'s storages
    (the weights and buffers) left out."""
    skip = {t.untyped_storage().data_ptr() for t in exclude}
    storages: dict[int, int] = {}

    def pack(t):
        s = t.untyped_storage()
        if s.data_ptr() not in skip:
            storages[s.data_ptr()] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, sum(storages.values())
