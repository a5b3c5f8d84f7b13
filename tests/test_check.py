"""`fxpar check` (fxpar/check.py, fxpar/cli/check_command.py): exact models pass, a refused one exits 2 with fxpar's
message, and a deliberately broken executable exits 1 naming the step and the parameter: a check that cannot fail checks
nothing. Each run starts its ranks as gloo processes."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.gloo
ROOT = Path(__file__).resolve().parents[1]


def _check(target: str, *flags: str) -> subprocess.CompletedProcess:
    """`fxpar check` as a user runs it: its own process, its exit status."""
    return subprocess.run([sys.executable, "-m", "fxpar.cli.main", "check", target, *flags], cwd=ROOT,
                          env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}, capture_output=True,
                          text=True, timeout=600)


def _check_here(capsys, target: str, *flags: str) -> subprocess.CompletedProcess:
    """The same command run from this process (its ranks are processes all the same): what it prints and returns."""
    from fxpar.cli.main import main

    capsys.readouterr()
    code = main(["check", target, *flags])
    out = capsys.readouterr()
    return subprocess.CompletedProcess(["fxpar", "check", target, *flags], code, out.out, out.err)


def test_the_example_gpt_is_exact_at_t2():
    out = _check("examples/gpt.py:lm", "--tp", "2", "--steps", "2")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "exact" in out.stdout and "MISMATCH" not in out.stdout, out.stdout
    ledger = out.stdout.split("communication per layer")[1]
    assert ledger.count("2 g") == 4 and ledger.count("2 f") == 4 and "ABOVE" not in ledger, ledger


def test_sequence_parallelism_is_checked_and_its_ledger_counted(capsys):
    out = _check_here(capsys, "examples/gpt.py:lm", "--tp", "2", "--steps", "2", "--sequence-parallel")
    assert out.returncode == 0, out.stdout + out.stderr
    ledger = out.stdout.split("communication per layer")[1]
    # each collective under the pass that runs it, against Megatron's 4 + 6 with sequence parallelism
    forward = "2 all-gather (seq_gather_linear), 2 reduce-scatter (seq_reduce_scatter)"
    backward = "2 all-gather again (seq_gather_linear), 2 reduce-scatter (seq_gather_linear), 2 all-gather " \
               "(seq_reduce_scatter)"
    assert ledger.count(forward) == 4 and ledger.count(backward) == 4 and ledger.count("4 + 6") == 4, ledger
    assert ledger.count("1 seq_weights") == 5 and "ABOVE" not in ledger and "2 + 2" not in ledger, ledger


@pytest.mark.slow
def test_the_example_gpt_is_exact_at_p2_t2():
    out = _check("examples/gpt.py:lm", "--tp", "2", "--pp", "2", "--steps", "2")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "t=2 p=2 d=1 v=1 m=4 1f1b" in out.stdout and "exact" in out.stdout, out.stdout


def test_a_hugging_face_llama_with_labels_is_exact(capsys):
    out = _check_here(capsys, "tests/check_targets.py:llama_labels", "--tp", "2", "--steps", "2")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "exact" in out.stdout and "model.layers.1" in out.stdout, out.stdout


def test_uneven_valid_targets_are_checked_against_the_whole_batch(capsys):
    """Labels with ignored targets: every microbatch draws its own mask, so their counts of valid targets differ,
    and step() must equal the model on the whole batch on one process (a mean over all its valid targets)."""
    out = _check_here(capsys, "tests/check_targets.py:llama_masked_labels", "--tp", "2", "--microbatches", "2",
                      "--steps", "2")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "exact" in out.stdout and "m=2" in out.stdout, out.stdout


def test_each_microbatch_draws_its_own_mask_of_ignored_targets():
    import torch

    from fxpar.check import batch

    ids = torch.randint(3, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    labels = ids.clone()
    labels[:, :4] = -100
    counts, masks = [], set()
    for step in range(8):
        (got,), kw = batch((ids,), {"labels": labels, "input_ids": ids}, 4, step, seed=0)
        assert kw["input_ids"] is got and kw["labels"] is not got  # the same tensor stays the same tensor
        assert set(got.unique().tolist()) == set(ids.unique().tolist())  # token ids: the example's, shuffled
        valid = kw["labels"] != -100
        assert valid.any() and set(kw["labels"][valid].tolist()) <= set(labels[labels != -100].tolist())
        counts += [int(v.sum()) for v in valid.chunk(4)]
        masks |= {tuple(v.flatten().tolist()) for v in valid.chunk(4)}
    # uneven counts, some microbatch with none, and masks drawn afresh (32 pieces: all but a few masks differ)
    assert len(set(counts)) > 4 and 0 in counts and len(masks) > 24, (counts, len(masks))
    # the same seed and step draw the same batch (every rank, and the reference, see it)
    assert all(torch.equal(a, b) for a, b in zip(batch((labels,), {}, 4, 3, 0)[0], batch((labels,), {}, 4, 3, 0)[0]))
    (none,), _ = batch((torch.full((1, 4), -100),), {}, 2, 0, 0)
    assert (none == -100).all()  # nothing valid to draw from: left as it is


def test_a_model_fxpar_refuses_exits_2_with_its_message():
    out = _check("tests/check_targets.py:refused", "--tp", "2")
    assert out.returncode == 2, out.stdout + out.stderr
    assert "refused by fxpar" in out.stdout and "custom autograd.Function GradReversal" in out.stdout, out.stdout
    assert "test_soundness.py" in out.stdout, out.stdout  # the user's line


def test_a_broken_executable_exits_1_naming_the_step_and_parameter():
    out = _check("tests/check_targets.py:broken", "--tp", "2", "--steps", "2")
    assert out.returncode == 1, out.stdout + out.stderr
    assert "MISMATCH: step 0:" in out.stdout, out.stdout


def _torch_runs_bf16_attention() -> bool:
    """torch's own bf16 attention, one process, no fxpar, at the example GPT's sequence length. torch 2.13 on a CPU
    with AMX, with ATEN_CPU_CAPABILITY forced to avx2, takes its AMX flash-attention path from the CPU's features and
    then raises "pack_vnni2 is only supported when avx512 is supported" (a machine without AMX does not take it)."""
    q = torch.randn(1, 2, 128, 16, dtype=torch.bfloat16, requires_grad=True)
    try:
        torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True).sum().backward()
    except RuntimeError as e:
        return "pack_vnni2" not in str(e)
    return True


@pytest.mark.skipif(not _torch_runs_bf16_attention(), reason="torch's bf16 attention fails on one process here "
                    "(AMX CPU with ATEN_CPU_CAPABILITY forced below avx512)")
def test_bf16_judges_its_losses_and_the_plan_in_fp32(capsys):
    out = _check_here(capsys, "examples/gpt.py:lm", "--tp", "2", "--steps", "2", "--precision", "bf16")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "bf16 against the same recipe on one process" in out.stdout and "exact" in out.stdout, out.stdout
    broken = _check_here(capsys, "tests/check_targets.py:broken", "--tp", "2", "--steps", "2", "--precision", "bf16")
    # its bf16 losses drift apart within two steps (5.6e-4, then 4.7e-3 here); the fp32 run would catch it at step 0
    assert broken.returncode == 1 and "MISMATCH: step" in broken.stdout, broken.stdout


def test_bad_flags_are_refused_before_any_rank_starts(capsys):
    from fxpar.cli.main import main

    assert main(["check", "examples/gpt.py:lm", "--tp", "0"]) == 2
    assert "--tp must be a positive integer, got 0" in capsys.readouterr().err
    assert main(["check", "examples/gpt.py:lm", "--tp", "1", "--pp", "2", "--vpp", "2", "--schedule", "1f1b"]) == 2
    assert "use schedule 'interleaved-1f1b' for v > 1" in capsys.readouterr().err


def test_expert_parallelism_is_checked_and_the_float64_arbiter_runs_hugging_face_experts(capsys):
    """`fxpar check --dp 2 --ep 2` on a Mixtral: exact; and its float64 arbiter runs the reference's experts as
    batched_mm (Hugging Face's grouped_mm refuses float64), agreeing to float64 rounding."""
    from fxpar.check import CheckSpec, _run

    out = _check_here(capsys, "tests/check_targets.py:mixtral", "--tp", "1", "--dp", "2", "--ep", "2", "--steps", "2")
    assert out.returncode == 0 and "t=1 p=1 d=2 e=2" in out.stdout and "exact" in out.stdout, out.stdout + out.stderr
    wide = _run(CheckSpec("tests/check_targets.py:mixtral", tp=1, dp=2, ep=2, precision="fp64", steps=2))
    assert wide.status == "exact" and max(s.gap for s in wide.steps) < 1e-12, wide
    assert "batched_mm experts (grouped_mm refuses float64)" in wide.reference_note, wide.reference_note
    # bf16: Hugging Face's experts call torch's _grouped_mm kernel, whose chain is split over ep the same way
    low = _run(CheckSpec("tests/check_targets.py:mixtral", tp=1, dp=2, ep=2, precision="bf16", steps=2))
    assert low.status == "exact" and "every rank holds every expert" not in low.message, low


def test_the_float64_arbiter_runs_a_hugging_face_loss_in_float64():
    """Hugging Face's loss upcasts with logits.float(); in the arbiter's run that keeps float64, so the run agrees to
    float64 rounding (a float32 loss would leave 1e-6 there, and the arbiter could clear nothing)."""
    from fxpar.check import CheckSpec, _run

    result = _run(CheckSpec("tests/check_targets.py:llama_labels", tp=2, precision="fp64", steps=2))
    assert result.status == "exact" and max(s.gap for s in result.steps) < 1e-12, result
