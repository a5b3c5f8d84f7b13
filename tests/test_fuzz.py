"""The differential fuzzer (tests/fuzz.py): a fixed batch of generated models, the frozen failures it found, and a
check that it catches a wrong rewrite. `make fuzz N=5000` runs the long mode."""
from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from tests.fuzz import BAD, Threaded, fuzz_jobs, report, run_one
from tests.fuzz_models import generate

BATCH = 300
REGRESSIONS = sorted((Path(__file__).parent / "fuzz_regressions").glob("*.py"))


@pytest.mark.slow
def test_a_fixed_batch_is_exact_or_refused(tmp_path):
    summary = fuzz_jobs(0, BATCH, jobs=2, out_dir=str(tmp_path))
    counts = summary["counts"]
    text = report(summary, BATCH, 0, 0.0)
    assert not summary["failures"], text  # each failing model is saved in tmp_path as a reproduction
    assert sum(counts[k] for k in BAD) == 0 and counts["exact"] + counts["refused"] == BATCH, text
    # the batch tests something: most models shard and are exact, most with layers also through the p=2 cut
    assert counts["exact, sharded"] >= BATCH // 2 and counts["p=2 chained: exact"] >= BATCH // 3, text
    assert counts["exact, float64 arbiter"] <= BATCH // 20, text  # arbitration stays the exception


JOINT_BATCH = 40


@pytest.mark.slow
def test_a_fixed_batch_through_the_joint_programs(tmp_path, monkeypatch):
    """Seeds 0..39 with Config(joint_graph=True): every chunk as its joint forward+backward program."""
    monkeypatch.setattr("tests.fuzz.OPTIONS", {"joint_graph": True})  # the job processes get --joint-graph
    summary = fuzz_jobs(0, JOINT_BATCH, jobs=2, out_dir=str(tmp_path))
    counts, text = summary["counts"], report(summary, JOINT_BATCH, 0, 0.0)
    assert not summary["failures"] and sum(counts[k] for k in BAD) == 0, text
    assert counts["exact"] + counts["refused"] == JOINT_BATCH, text
    assert counts["exact, sharded"] >= JOINT_BATCH // 2 and counts["p=2 chained: exact"] >= JOINT_BATCH // 3, text


@pytest.mark.parametrize("path", REGRESSIONS, ids=[p.stem for p in REGRESSIONS])
def test_a_failure_the_fuzzer_found_stays_fixed(path, monkeypatch):
    source = path.read_text()
    options = re.search(r"^FUZZ_OPTIONS = (.*)$", source, re.M)  # the Config fields it was found with
    if options:
        monkeypatch.setattr("tests.fuzz.OPTIONS", ast.literal_eval(options.group(1)))
    with Threaded():
        result = run_one(source)
    assert result["outcome"] in ("exact", "refused"), result


def test_the_generator_is_deterministic_and_varied():
    assert generate(7) == generate(7)
    sources = {generate(s) for s in range(20)}
    assert len(sources) == 20
    features = ["einsum", "addmm", "alpha=", "transpose(-2, -1)).transpose", "def call", "repeat_interleave",
                "scaled_dot_product_attention", "masked_fill", "self.head", "nn.Embedding", "F.dropout",
                "self.training", "unbind", "rsqrt", ".var(", "enable_gqa=True", "[:, :, None].expand",
                ".split([", "'bhij,bhjd->bhid'", "torch.autocast('cpu', enabled=False)", "nn.Conv1d(",
                "torch.zeros_like(", "F.pad(", "], dim=-1).transpose(1, 2))"]
    missing = [f for f in features if not any(f in s for s in (generate(s) for s in range(60)))]
    assert not missing, missing


def test_the_fuzzer_catches_a_wrong_rewrite(monkeypatch):
    """Sabotage the tensor-parallel pass (the row-parallel all-reduce g becomes the identity f): the fuzzer must
    report a mismatch, not exact."""
    import fxpar.passes.tensor_parallel.rewrite as tp

    with Threaded():  # a model the unsabotaged pass shards exactly
        seed = next(s for s in range(50) if ("F.gelu" in generate(s) or "F.relu" in generate(s))
                    and run_one(generate(s)).get("sharded"))
    real = tp.call_comm
    monkeypatch.setattr(tp, "call_comm", lambda gm, kind, *a, **k: real(gm, "f" if kind == "g" else kind, *a, **k))
    with Threaded():
        result = run_one(generate(seed))
    assert result["outcome"] == "mismatch", result


def test_the_fuzzer_catches_inputs_traced_as_one_value(monkeypatch):
    """Undo [Note: inputs are traced distinct] (fxpar/trace.py): a model traced with its second input the same
    tensor as its first and called with another must come out a mismatch."""
    import fxpar.trace as trace

    monkeypatch.setattr(trace, "distinct_inputs", lambda tree, model=None: tree)
    seed = next(s for s in range(200) if "    aux = inp\n" in generate(s).split("def call")[0])
    with Threaded():
        result = run_one(generate(seed))
    assert result["outcome"] == "mismatch", result
