"""A chunk's joint program as declared stages (fxpar/programs.py PROGRAM_STAGES and HALF_STAGES), run by the
compiler's driver (fxpar/stages.py): each stage named in errors with the stages before it, each graph dumped, and
the partition's chunk graph never edited. On a simulated rank: the programs are traced, not run."""
from __future__ import annotations

import os

import pytest
import torch
import torch.nn as nn

from tests import models
from fxpar import programs
from fxpar.compiler import Target, compile_model
from fxpar.config import Config
from fxpar.passes.tensor_parallel.collectives import TPComm
from fxpar.programs import HALF_STAGES, PROGRAM_STAGES, JointRequest
from fxpar.runtime.joint_runner import JointRunner
from fxpar.stages import PassError


def _chunk(model=None, args=None, **config):
    if model is None:
        model, args, kwargs = models.build("gpt")
    c = compile_model(model, args, {}, Target(TPComm(0, 2)), Config(joint_graph=True, **config))
    chunk = c.partition.chunks[0]
    assert isinstance(c.callables[chunk.index], JointRequest)
    return c, chunk


def test_the_declared_lists():
    assert [name for name, _, _ in PROGRAM_STAGES] == [
        "copy", "distinct_outputs", "dp_buckets", "noise_inputs", "tag_nodes", "export", "joint", "partition"]
    assert [name for name, _ in HALF_STAGES] == ["dead_code", "reinplace", "early_collectives", "late_waits"]


def test_every_stage_ran_in_order():
    c, chunk = _chunk()
    record = JointRunner(chunk.gm, c.callables[chunk.index], c.config, 0).record
    halves = [f"{half}_{name}" for half in ("forward", "backward") for name, _ in HALF_STAGES]
    assert record.done == [name for name, _, _ in PROGRAM_STAGES[:-1]] + halves + ["partition"]


class _Aliasing(nn.Module):
    """Returns a view of its input beside a GEMM: the program copies the view ([Note: an output that aliases])."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        return x.transpose(0, 1), self.lin(x)


def test_the_chunk_graph_is_not_edited():
    c, chunk = _chunk(_Aliasing(), (torch.randn(2, 3, 8, requires_grad=True),))
    before = chunk.gm.code
    record = JointRunner(chunk.gm, c.callables[chunk.index], c.config, 0).record
    assert chunk.gm.code == before
    assert "clone" in record.gm.code and "clone" not in before  # the program's copy has the output's copy


def test_a_failing_program_stage_is_named_with_the_stages_before_it(monkeypatch):
    def broken(r):
        raise KeyError("no such node")

    stages = tuple((name, product, broken if name == "tag_nodes" else fn) for name, product, fn in PROGRAM_STAGES)
    monkeypatch.setattr(programs, "PROGRAM_STAGES", stages)
    c, chunk = _chunk()
    with pytest.raises(PassError, match=r"fxpar chunk 0 program stage 'tag_nodes' failed \(after copy, "
                                        r"distinct_outputs, dp_buckets, noise_inputs\): KeyError: 'no such node'"):
        JointRunner(chunk.gm, c.callables[chunk.index], c.config, 0).record


def test_a_failing_half_stage_is_named_inside_torchs_compile(monkeypatch):
    def broken(gm, request):
        raise ValueError("late waits went wrong")

    stages = tuple((name, broken if name == "late_waits" else fn) for name, fn in HALF_STAGES)
    monkeypatch.setattr(programs, "HALF_STAGES", stages)
    c, chunk = _chunk()
    with pytest.raises(ValueError, match=r"(?s)late waits went wrong\n\(in fxpar chunk 0 program stage "
                                         r"'forward_late_waits', after copy, distinct_outputs, dp_buckets, "
                                         r"noise_inputs, tag_nodes, export, joint, forward_dead_code, forward_reinplace, "
                                         r"forward_early_collectives\)$"):
        JointRunner(chunk.gm, c.callables[chunk.index], c.config, 0).record


def test_dump_dir_holds_each_program_stage(tmp_path):
    c, chunk = _chunk(dump_dir=str(tmp_path))
    record = JointRunner(chunk.gm, c.callables[chunk.index], c.config, 0).record
    folder = tmp_path / "rank0" / "chunk0_program0"
    names = sorted(os.listdir(folder))
    graphs = [n for n in names if n.endswith(".py")]
    assert graphs[0] == "00_copy.py" and "06_joint.py" in graphs
    assert any(n.endswith("_forward_late_waits.py") for n in graphs)
    assert any(n.endswith("_backward_late_waits.py") for n in graphs)
    assert len(graphs) == sum(n.endswith(".diff") for n in names)
    last_backward = max(n for n in graphs if "_backward_" in n)
    assert (folder / last_backward).read_text() == record.backward.code
    # the compiler's own stages sit beside the programs, as before
    assert (tmp_path / "rank0" / "00_working_copy.py").exists() or any(
        n.endswith("_working_copy.py") for n in os.listdir(tmp_path / "rank0"))


class _Dropping(nn.Module):
    def __init__(self, p: float, noise: bool = False):
        super().__init__()
        self.up, self.drop, self.down, self.noise = nn.Linear(8, 32), nn.Dropout(p), nn.Linear(32, 8), noise

    def forward(self, x):
        h = self.drop(torch.relu(self.up(x)))
        return self.down(h + torch.rand_like(h) if self.noise else h)


@pytest.mark.parametrize("p, noise, joint_graph, on", [
    (0.0, False, None, True), (0.1, False, None, True),  # dropout's noise is a program input: the joint programs
    (0.1, True, None, False),  # another random op in training: torch.compile of each chunk, and the plan says why
    (0.0, False, False, False)])  # asked off
def test_compile_takes_the_joint_programs_where_they_apply(p, noise, joint_graph, on):
    c = compile_model(_Dropping(p, noise).train(), (torch.randn(2, 3, 8),), {}, Target(TPComm(0, 2)),
                      Config(compile=True, joint_graph=joint_graph))
    assert c.joint.on == on
    assert all(isinstance(made, JointRequest) == on for made in c.callables.values())
    if joint_graph is None:
        assert ("joint forward+backward program" if on else "draws random numbers in training") in c.joint.why
    if joint_graph is None and not on:
        assert "node rand_like (the root module, aten.rand_like.default)" in c.joint.why, c.joint.why
    if joint_graph is False:
        assert c.joint.why == ""


def test_joint_graph_none_without_compile_is_off():
    c = compile_model(_Dropping(0.0), (torch.randn(2, 3, 8),), {}, Target(TPComm(0, 2)), Config())
    assert not c.joint.on and c.joint.why == "" and not isinstance(c.callables[0], JointRequest)
