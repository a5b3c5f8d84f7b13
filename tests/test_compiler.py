"""The compiler driver (fxpar/compiler.py): one ordered list of stages, one record of products, errors that name
the stage, and a traced program that no stage rewrites."""
from __future__ import annotations

import pytest
import torch

from fxpar.compiler import STAGES, Compiled, Target, compile_model
from fxpar.stages import PassError, run_stages
from fxpar.config import Config
from fxpar.passes.ir.meta import FXPAR_COMM, FXPAR_INPUT, FXPAR_PLACEMENT
from fxpar.passes.tensor_parallel.collectives import TPComm
from tests import models


def test_the_stage_list_is_the_whole_compiler():
    assert [name for name, _, _ in STAGES] == [
        "trace", "normalization", "statistics", "working_copy", "aliases", "merge_aliases", "context_regions",
        "drop_asserts", "view_as", "fresh_in_place", "cross_entropy", "gemm_forms", "unfuse",
        "analyze", "vocab", "check_divisible", "tensor_parallel", "merge_comm", "local_shapes", "sequence_analysis",
        "sequence_parallel", "sequence_shapes", "keep_tp_graph", "experts", "expert_parallel", "batch_statistics",
        "state_values", "joint", "attention_to_sdpa", "identity_dropout", "bias_dropout_add", "gelu", "assumed",
        "gathered_gemms", "random_streams", "recompute", "in_place",
        "partition", "schedule", "lower", "prove", "compile", "expected_state"]
    assert all(product is None or product in Compiled.__dataclass_fields__ for _, product, _ in STAGES)


def test_every_product_lands_in_the_record_and_the_trace_stays_untouched():
    model, args, kwargs = models.build("gpt")
    c = compile_model(model, args, kwargs, Target(TPComm(0, 2)))
    assert c.done == [name for name, _, _ in STAGES]
    traced_code = c.traced.gm.code
    assert "tp_g_0" not in traced_code and "tp_g_0" in c.gm.code  # the reference was never rewritten
    assert c.tp_graph is not c.gm and c.traced.gm is not c.gm
    assert c.partition.chunks[0].gm is c.gm and c.callables == {0: c.gm}  # no pipeline: one chunk, the graph
    assert c.schedule is None and c.program is None and c.proof is None
    assert all(FXPAR_INPUT in n.meta for n in c.gm.graph.nodes if n.op == "placeholder")
    assert all(FXPAR_PLACEMENT in n.meta for n in c.gm.graph.nodes if n.op != "output")
    comms = [n for n in c.gm.graph.nodes if n.op == "call_module" and FXPAR_COMM in n.meta]
    assert comms and all(isinstance(n.meta["val"], torch.Tensor) for n in comms)  # inserted nodes carry values


def test_a_pipelined_compile_proves_its_program():
    model, args, kwargs = models.build("gpt8")
    c = compile_model(model, args, kwargs, Target(TPComm(0, 2), pp=2, pipelined=True),
                      Config(microbatches=2, virtual_stages=2, schedule="interleaved-1f1b"))
    assert len(c.partition.chunks) == 4 and sorted(c.program.actions) == [0, 1]
    assert c.proof.bubble_fraction > 0


def test_bad_input_keeps_its_type_and_names_the_stage():
    model, args, kwargs = models.build("gpt")  # 4 heads
    with pytest.raises(ValueError, match=r"(?s)cannot split .* over t=3.*\(in fxpar compiler stage "
                                         r"'check_divisible', after trace, normalization, statistics, working_copy, "
                                         r"aliases, merge_aliases, "
                                         r"context_regions, drop_asserts, view_as, fresh_in_place, cross_entropy, "
                                         r"gemm_forms, unfuse, analyze, vocab\)"):
        compile_model(model, args, kwargs, Target(TPComm(0, 3)))
    with pytest.raises(ValueError, match=r"cannot cut 2 layers into p\*v = 4 chunks(?s:.*)stage 'partition'"):
        compile_model(model, args, kwargs, Target(TPComm(0, 1), pp=2, pipelined=True),
                      Config(microbatches=2, virtual_stages=2, schedule="interleaved-1f1b"))


def test_an_internal_failure_is_a_pass_error_naming_the_stage():
    def broken(c):
        raise KeyError("no such node")

    model, args, kwargs = models.build("gpt")
    c = Compiled(model, args, kwargs, Target(TPComm(0, 1)), Config())
    with pytest.raises(PassError, match=r"stage 'broken' failed \(after trace\): KeyError: 'no such node'"):
        run_stages(c, STAGES[:1] + (("broken", "gm", broken),))
    with pytest.raises(PassError, match=r"stage 'lost' failed \(after trace\): TypeError: a graph stage returned "
                                        r"NoneType, not a GraphModule"):
        run_stages(Compiled(model, args, kwargs, Target(TPComm(0, 1)), Config()),
                   STAGES[:1] + (("lost", "gm", lambda c: None),))


def test_dump_dir_writes_every_graph_stage_and_its_diff(tmp_path):
    model, args, kwargs = models.build("gpt")
    c = compile_model(model, args, kwargs, Target(TPComm(0, 2)), Config(dump_dir=str(tmp_path)))
    written = sorted(p.name for p in (tmp_path / "rank0").iterdir())
    graph_stages = [name for name, product, _ in STAGES if product == "gm"]
    assert [w.split("_", 1)[1] for w in written if w.endswith(".py")] == [f"{n}.py" for n in graph_stages]
    tp = next(p for p in (tmp_path / "rank0").iterdir() if p.name.endswith("_tensor_parallel.diff")).read_text()
    assert "+    tp_g_0 = self.tp_g_0(" in tp and "-" in tp  # what the rewrite inserted, against the graph before
    last = [w for w in written if w.endswith(".py")][-1]
    assert (tmp_path / "rank0" / last).read_text() == c.gm.code  # the graph the last graph stage left
