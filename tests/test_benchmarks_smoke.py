"""Smoke tests of benchmarks/: each runs end to end at tiny sizes with one repeat and prints its table.

No timing is asserted (the numbers mean nothing at these sizes, and the machine is shared); what is asserted is that
the table comes out and that every tensor-parallel variant of the train step is exact before it is timed.
"""
from __future__ import annotations

import pytest

from benchmarks import parallelize_time, tp_step

pytestmark = [pytest.mark.gloo, pytest.mark.slow]

TINY_GPT = ["--layers", "1", "--hidden", "32", "--heads", "4", "--seq", "8", "--vocab", "64"]


def test_tp_step_runs_and_is_exact(capsys):
    result = tp_step.main([*TINY_GPT, "--batch", "2", "--rounds", "1", "--steps", "1", "--warmup", "0",
                           "--timeout", "60"])  # spawns 2 gloo ranks
    out = capsys.readouterr().out
    assert "median ms" in out and "vs hand-written" in out and "vs DTensor" in out
    for name in tp_step.VARIANTS:
        assert name in out
        loss_err, grad_err = result["errors"][name]
        assert loss_err <= tp_step.TOL and grad_err <= tp_step.TOL, (name, loss_err, grad_err)
        assert len(result["times"][name]) == 1


def test_tp_step_table_from_samples():
    times = {"fxpar": [0.10, 0.12], "hand-written": [0.10, 0.11], "DTensor": [0.15, 0.14]}
    result = {"times": times, "cpu": times, "errors": {},
              "config": {"t": 2, "layers": 1, "hidden": 32, "heads": 4, "seq": 8, "batch": 2, "vocab": 64,
                         "attention": "sdpa", "rounds": 2, "steps": 1}}
    table = tp_step.format_table(result).splitlines()
    fxpar_row = next(line for line in table if line.startswith("fxpar"))
    assert "1.045" in fxpar_row  # median of the per-round ratios 1.0 and 1.0909


def test_head_interleaved_layout():
    import torch

    full = torch.arange(12.0)  # Q = 0..3, K = 4..7, V = 8..11, two heads each
    assert tp_step._head_interleaved(full, 2).tolist() == [0, 1, 4, 5, 8, 9, 2, 3, 6, 7, 10, 11]


def test_parallelize_time_runs(capsys):
    results = parallelize_time.main(["--layers", "1", "2", "--repeats", "1", *TINY_GPT[2:]])
    out = capsys.readouterr().out
    assert "2/1 ratio" in out and "trace s" in out and "build s" in out
    assert set(results) == {1, 2}
    assert results[2]["sharded regions"] > results[1]["sharded regions"] > 0
    assert results[2]["nodes"] > results[1]["nodes"]


@pytest.mark.parametrize("name", ["wte.weight", "h.0.attn.c_attn.weight", "h.0.attn.c_attn.bias",
                                  "h.0.attn.c_proj.weight", "h.0.mlp.c_fc.bias", "ln_f.weight"])
def test_megatron_shards_tile_the_full_parameter(name):
    """Rank blocks of the hand-written model's layout are disjoint and cover the full tensor."""
    import torch

    from benchmarks.megatron_gpt import shard

    GPT, GPTConfig = tp_step.GPT, tp_step.GPTConfig  # examples/gpt.py
    cfg = GPTConfig(vocab=64, seq=8, layers=1, hidden=32, heads=4)
    full = dict(GPT(cfg).named_parameters())[name].detach()
    blocks = [shard(name, full, cfg, r, 2) for r in range(2)]
    if blocks[0].shape == full.shape:  # replicated
        assert all(torch.equal(b, full) for b in blocks)
    else:
        got = torch.cat([b.flatten() for b in blocks]).sort().values
        assert torch.equal(got, full.flatten().sort().values)


def test_fusion_benchmark_runs(capsys):
    from benchmarks import fusion

    fusion.main(["--seq", "16", "--hidden", "32", "--layers", "2", "--rounds", "1", "--steps", "1", "--warmup", "0",
                 "--no-memory"])
    assert "fused" in capsys.readouterr().out


def test_overlap_benchmark_runs_every_variant_exact(capsys):
    from benchmarks import overlap

    overlap.main([*TINY_GPT, "--batch", "2", "--rounds", "1", "--steps", "1", "--warmup", "0", "--timeout", "120"])
    out = capsys.readouterr().out  # raises before timing if any variant is not exact
    assert all(name in out for name in overlap.VARIANTS) and "vs joint" in out


def test_overlap_benchmark_at_d2_runs_every_variant_exact(capsys):
    from benchmarks import overlap

    overlap.main([*TINY_GPT, "--batch", "2", "--rounds", "1", "--steps", "1", "--warmup", "0", "--timeout", "120",
                  "--dp", "--bucket-mb", "0.001"])
    out = capsys.readouterr().out  # raises before timing if any variant is not exact
    assert all(name in out for name in overlap.DP_VARIANTS) and "d=2" in out


def test_hybrid_step_runs_and_is_exact(capsys):
    from benchmarks import hybrid_step

    result = hybrid_step.main(["--layers", "2", "--hidden", "32", "--heads", "4", "--seq", "8", "--vocab", "64",
                               "--batch", "8", "--rounds", "1", "--steps", "1", "--warmup", "0", "--timeout", "120"])
    assert all(max(result["errors"][name]) <= hybrid_step.TOL for name in hybrid_step.VARIANTS), result["errors"]
    assert "fxpar/torch" in capsys.readouterr().out


def test_llama_step_runs_and_is_exact(capsys):
    from benchmarks import llama_step

    result = llama_step.main(["--layers", "1", "--hidden", "32", "--heads", "4", "--kv-heads", "2", "--intermediate",
                              "64", "--seq", "8", "--vocab", "64", "--batch", "2", "--rounds", "1", "--steps", "1",
                              "--warmup", "0", "--timeout", "120"])
    assert all(max(result["errors"][name]) <= llama_step.TOL for name in llama_step.VARIANTS), result["errors"]
    assert "vs DTensor" in capsys.readouterr().out


def test_pp_step_runs_and_matches_torch_pipelining(capsys):
    from benchmarks import pp_step

    pp_step.main(["--layers", "4", "--hidden", "32", "--heads", "4", "--seq", "8", "--vocab", "64", "--batch", "8",
                  "--rounds", "1", "--steps", "1", "--warmup", "0"])  # raises if any variant is not exact
    out = capsys.readouterr().out
    assert "fxpar interleaved" in out and "torch interleaved" in out


def test_spearman_with_ties_and_inversions():
    from benchmarks import fidelity

    assert fidelity.ranks([3.0, 1.0, 3.0, 2.0]) == [3.5, 1.0, 3.5, 2.0]
    assert fidelity.spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert fidelity.spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
    assert fidelity.spearman([1, 2, 3], [1, 3, 2]) == pytest.approx(0.5)
    with pytest.raises(ValueError, match="equal-length"):
        fidelity.spearman([1], [1])


def test_fidelity_runs_end_to_end(capsys, tmp_path):
    from benchmarks import fidelity

    rows = fidelity.main([*TINY_GPT, "--batch", "4", "--worlds", "1", "--rounds", "1", "--passes", "1",
                          "--warmup", "0", "--quick-calibrate", "--clusters", str(tmp_path)])
    out = capsys.readouterr().out
    assert "Spearman" in out and "`fxpar calibrate --world 2`" in out and (tmp_path / "local-2.json").is_file()
    assert [r["config"] for r in rows] == [fidelity.describe(c) for c in fidelity.CONFIGS[1]]
    assert all(r["measured"] > 0 and r["predicted"] > 0 for r in rows)


def test_checkpoint_io_runs(capsys):
    from benchmarks import checkpoint_io

    result = checkpoint_io.main([*TINY_GPT, "--rounds", "1", "--timeout", "120"])
    out = capsys.readouterr().out
    assert "save MiB/s/rank" in out and "fxpar t=2" in out and "torch DCP" in out and "t=2:" in out
    assert result["bytes"]["fxpar t=2"] > 0 and set(result["meta"]["by_t"]) == {1, 2}


def test_matrix_table_readme_and_plot_from_samples(tmp_path):
    from benchmarks import matrix

    result = {"times": {"fxpar": [1.0, 2.0, 3.0], "hand-written": [1.0, 2.5, 2.0], "DTensor": [2.0, 4.0, 6.0]}}
    rows = matrix.rows_of("GPT, t=2", result, matrix._TP_PEERS)
    assert [r[:4] for r in rows] == [["GPT, t=2", "fxpar", "hand-written", 1.0], ["GPT, t=2", "fxpar", "DTensor", 0.5]]
    readme = tmp_path / "README.md"
    readme.write_text(f"# B\n{matrix.BEGIN}\nold\n{matrix.END}\nafter\n")
    matrix.fill_readme(str(readme), matrix.markdown(rows, "note"))
    text = readme.read_text()
    assert "| GPT, t=2 | fxpar | DTensor | 0.500 |" in text and "old" not in text and text.endswith("after\n")
    matrix.plot(rows, str(tmp_path / "m.png"))
    assert (tmp_path / "m.png").read_bytes()[:4] == b"\x89PNG"


def test_moe_step_runs_every_variant_exact(capsys):
    from benchmarks import moe_step

    result = moe_step.main(["--layers", "1", "--hidden", "32", "--heads", "4", "--ffn", "32", "--experts", "4",
                            "--seq", "8", "--vocab", "64", "--batch", "2", "--rounds", "1", "--warmup", "2",
                            "--timeout", "60"])  # spawns 2 gloo ranks
    out = capsys.readouterr().out
    assert all(name in out for name in moe_step.VARIANTS) and "expert weights + Adam MiB/rank" in out
    assert result["gap"] <= moe_step.TOL
    e = result["experts"]
    assert e["dp=2 ep=2 alltoall"] * 2 == e["dp=2"] == e["dp=2 ep=2 allgather"] * 2  # half the experts per rank
