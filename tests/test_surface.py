"""The user's surface of the parallel module is frozen: what pm offers beyond nn.Module's own (call, parameters,
named_parameters, state_dict / load_state_dict, train / eval, ...). Everything else a rank holds is on `pm.rank`
(fxpar/runtime/executable.py RankState), for fxpar's own modules, or behind an underscore."""
from __future__ import annotations

import torch.nn as nn

from examples.gpt import factory
from fxpar.api import build
from fxpar.passes.tensor_parallel.collectives import TPComm
from fxpar.runtime.executable import RankState
from fxpar.runtime.pipeline_executable import PipelineModule

SURFACE = ["check_replicas", "clip_grad_norm_", "compiled", "config", "full_state_dict", "manual_seed", "optimizer",
           "plan", "rank", "step"]


def _public(pm) -> list[str]:
    module = set(dir(nn.Module())) | set(pm._modules)  # nn.Module's members, and the model's submodule names
    return sorted(n for n in set(dir(pm)) | set(dir(PipelineModule)) if not n.startswith("_") and n not in module)


def test_the_parallel_modules_public_members_are_frozen():
    model, args = factory()[:2]
    pm = build(model, TPComm(rank=0, size=2), args, {})
    assert _public(pm) == SURFACE
    assert isinstance(pm.rank, RankState) and pm.rank.weights.held() and pm.rank.comm.size == 2
    assert {"load_state_dict", "state_dict", "named_parameters", "train", "eval"} <= set(dir(pm))
