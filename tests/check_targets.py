"""Factories for tests/test_check.py (`fxpar check tests/check_targets.py:NAME`)."""
from __future__ import annotations

import torch

from tests import models


def llama_labels():
    """A Hugging Face Llama trained through its own loss, labels= the same tensor as input_ids (its convention)."""
    model, (ids,), kwargs = models.build("llama")
    return model, (ids,), {**kwargs, "labels": ids}


def llama_masked_labels():
    """A Hugging Face Llama trained through its own loss on labels with ignored (-100) targets, a tensor of its own:
    `fxpar check` draws a fresh mask of them for every microbatch and dp slice."""
    model, (ids,), kwargs = models.build("llama")
    labels = ids.clone()
    labels[:, : ids.shape[1] // 2] = -100  # an instruction-tuning batch: the prompt's targets ignored
    return model, (ids,), {**kwargs, "labels": labels}


def mixtral():
    """A tiny Hugging Face Mixtral (grouped experts) trained through its own loss."""
    from tests.hf_sweep import build

    model, (ids,), kwargs = build("mixtral", "MixtralForCausalLM")
    return model, (ids,), {**kwargs, "labels": ids}


def refused():
    """A custom autograd.Function, whose backward a trace would drop: fxpar refuses it."""
    from tests.test_soundness import Reversed

    return Reversed(), (torch.randn(2, 16),)


def broken():
    """The example GPT with fxpar sabotaged in this rank: the row-parallel all-reduce g becomes the identity f."""
    import fxpar.passes.tensor_parallel.rewrite as tp
    from gpt import lm  # examples/ is on sys.path (tests/models.py)

    real = tp.call_comm
    tp.call_comm = lambda gm, kind, *a, **k: real(gm, "f" if kind == "g" else kind, *a, **k)
    return lm()
