"""The differential fuzzer (tests/fuzz.py): a fixed batch of generated models, the frozen failures it found, and a
check that it catches a wrong rewrite. `make fuzz N=5000` runs the long mode."""
from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from tests.fuzz import BAD, Threaded, fuzz_jobs, run_one
from tests.fuzz_cli import report
from tests.fuzz_models import EXPECTED, generate

BATCH = 100  # the long mode (make fuzz) runs thousands; this batch guards every commit
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


JOINT_BATCH = 12
LOSS_BATCH = 16


@pytest.mark.slow
def test_a_fixed_batch_through_the_joint_programs(tmp_path, monkeypatch):
    """Seeds 0..11 with Config(joint_graph=True): every chunk as its joint forward+backward program."""
    monkeypatch.setattr("tests.fuzz.OPTIONS", {"joint_graph": True})  # the job processes get --joint-graph
    summary = fuzz_jobs(0, JOINT_BATCH, jobs=2, out_dir=str(tmp_path))
    counts, text = summary["counts"], report(summary, JOINT_BATCH, 0, 0.0)
    assert not summary["failures"] and sum(counts[k] for k in BAD) == 0, text
    assert counts["exact"] + counts["refused"] == JOINT_BATCH, text
    assert counts["exact, sharded"] >= JOINT_BATCH // 2 and counts["p=2 chained: exact"] >= JOINT_BATCH // 3, text


@pytest.mark.slow
def test_a_fixed_batch_trained_with_a_token_loss(tmp_path, monkeypatch):
    """Seeds 0..15 with --loss: pm.step at t=2 d=2 m=2 on uneven ignore masks, against one process."""
    monkeypatch.setattr("tests.fuzz.LOSS", {"dp": 2})  # the job processes get --loss --dp 2
    summary = fuzz_jobs(0, LOSS_BATCH, jobs=2, out_dir=str(tmp_path))
    counts, text = summary["counts"], report(summary, LOSS_BATCH, 0, 0.0)
    assert not summary["failures"] and sum(counts[k] for k in BAD) == 0, text
    assert counts["exact"] + counts["refused"] + counts["skipped"] == LOSS_BATCH, text
    assert counts["exact, sharded"] >= LOSS_BATCH // 2, text


EXPERT_BATCH = 10


@pytest.mark.slow
def test_a_fixed_batch_of_mixtures_of_experts_trained_over_ep(tmp_path, monkeypatch):
    """Seeds 0..9 with --loss --ep 2: every MLP a mixture of experts (router spellings, k, skew, shared experts,
    biases, gated or not), trained at t=2 d=2 ep=2 m=2 against one process; most with their experts split."""
    monkeypatch.setattr("tests.fuzz.LOSS", {"dp": 2, "ep": 2})  # the job processes get --loss --dp 2 --ep 2
    summary = fuzz_jobs(0, EXPERT_BATCH, jobs=2, out_dir=str(tmp_path))
    counts, text = summary["counts"], report(summary, EXPERT_BATCH, 0, 0.0)
    assert not summary["failures"] and sum(counts[k] for k in BAD) == 0, text
    assert counts["exact"] + counts["refused"] + counts["skipped"] == EXPERT_BATCH, text
    assert counts["exact, expert parallel"] >= EXPERT_BATCH // 2, text


@pytest.mark.parametrize("path", REGRESSIONS, ids=[p.stem for p in REGRESSIONS])
def test_a_failure_the_fuzzer_found_stays_fixed(path, monkeypatch):
    source = path.read_text()
    for name in ("OPTIONS", "LOSS"):  # the mode it was found in: Config fields, --loss (as tests/fuzz.py saves it)
        found = re.search(rf"^FUZZ_{name} = (.*)$", source, re.M)
        if found:
            monkeypatch.setattr(f"tests.fuzz.{name}", ast.literal_eval(found.group(1)))
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
                "torch.zeros_like(", "F.pad(", "], dim=-1).transpose(1, 2))", "EXPECT_REFUSAL = ",
                "transpose(0, 1)  # sequence-first"]
    missing = [f for f in features if not any(f in s for s in (generate(s) for s in range(60)))]
    assert not missing, missing
    experts = ["gmm(", "torch.histc(", ".softmax(-1)\n", ".sigmoid()", "[..., ::2]", ".add_(self.be", "[4.0, ",
               "index_add_(0", "stable=True", "torch.sigmoid(h", "torch.bmm(", "repeat_interleave("]
    sources = [generate(s, experts=True) for s in range(30)]
    assert not [f for f in experts if not any(f in s for s in sources)]
    assert sum("gmm(" in generate(s) for s in range(60)) >= 3  # the default grammar draws them too


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


# ---- the modes (tests/fuzz.py's docstring): one fixed seed each ---------------------------------------------------
def _config_of(seed: int) -> dict:
    return ast.literal_eval(re.search(r"^CONFIG = (.*)$", generate(seed), re.M).group(1))


LOSS_SEED = 15  # at d=2 m=2 its microbatches hold 0, 0, 0 and 5 valid targets


def test_a_token_loss_with_uneven_ignore_masks_trains_as_the_whole_batch(monkeypatch):
    monkeypatch.setattr("tests.fuzz.LOSS", {"dp": 2})
    with Threaded():
        result = run_one(generate(LOSS_SEED))
    assert result["outcome"] == "exact" and result.get("sharded"), result
    assert "valid targets per microbatch [0, 0, 0, 5]" in result["detail"], result["detail"]


def test_the_loss_mode_catches_microbatches_weighted_equally(monkeypatch):
    """Sabotage the whole-batch normalization (each microbatch's loss weighted 1/m, as before it): a mismatch."""
    from fxpar.runtime.pipeline_executable import PipelineModule

    monkeypatch.setattr("tests.fuzz.LOSS", {"dp": 2})
    monkeypatch.setattr(PipelineModule, "_loss_weights", lambda self, *args: None)
    with Threaded():
        result = run_one(generate(LOSS_SEED))
    assert result["outcome"] == "mismatch", result


def test_the_loss_mode_skips_a_model_whose_inputs_are_not_batch_first(monkeypatch):
    monkeypatch.setattr("tests.fuzz.LOSS", {"dp": 2})
    seed = next(s for s in range(100) if _config_of(s)["seq_first"])
    result = run_one(generate(seed))
    assert result["outcome"] == "skipped" and "not batch-first" in result["reason"], result


@pytest.mark.parametrize("way", ["init", "module", "partial"])
def test_a_custom_function_is_refused_as_expected(way):
    seed = next(s for s in range(1000) if (_config_of(s)["function"] or ("", ""))[1] == way)
    with Threaded():
        result = run_one(generate(seed))
    assert result["outcome"] == "refused" and result.get("expected") == EXPECTED, result


def test_a_custom_function_not_refused_is_a_failure(monkeypatch):
    """Undo [Note: every Function seen] (fxpar/guard.py): the Function's backward is dropped, and the fuzzer says so."""
    import contextlib

    import fxpar.trace as trace

    monkeypatch.setattr(trace, "watch_trace", lambda: contextlib.nullcontext([]))
    seed = next(s for s in range(1000) if (_config_of(s)["function"] or ("",))[0] == "ScaledGrad")
    with Threaded():
        result = run_one(generate(seed))
    assert result["outcome"] == "unrefused" and "unrefused" in BAD, result


@pytest.mark.parametrize("options", [{"recompute": "selective"}, {"recompute": "full"}, {"fuse": False},
                                     {"joint_graph": True, "overlap": ()}])
def test_a_config_mode_on_one_model(options, monkeypatch):
    monkeypatch.setattr("tests.fuzz.OPTIONS", options)
    with Threaded():
        result = run_one(generate(0))
    assert result["outcome"] == "exact" and result.get("pipeline") == "exact", result


def test_the_config_options_parse_as_their_fields_and_back(monkeypatch):
    import argparse

    from tests.fuzz import mode_argv
    from tests.fuzz_cli import config_option

    given = ["recompute=full", "fuse=false", "overlap=early_collectives,dp_buckets", "seed=none", "bucket_mb=0.5",
             "scatter_gather=auto", "overlap="]
    parsed = dict(config_option(text) for text in given)
    assert parsed == {"recompute": "full", "fuse": False, "overlap": (), "seed": None, "bucket_mb": 0.5,
                      "scatter_gather": "auto"}
    monkeypatch.setattr("tests.fuzz.OPTIONS", parsed)
    monkeypatch.setattr("tests.fuzz.LOSS", {"dp": 2})
    argv = mode_argv()
    assert dict(config_option(v) for v in argv[1:-3:2]) == parsed and argv[-3:] == ["--loss", "--dp", "2"]
    for bad in ["fuse=maybe", "mixed_precision=bfloat16", "nothing=1", "recompute"]:
        with pytest.raises(argparse.ArgumentTypeError):
            config_option(bad)
