"""Time per iteration against the papers: PTD-P Table 1 (A100) and Megatron-LM's weak scaling (V100).

One set of assumptions for every row: the cluster data in fxpar.cost.cluster, the paper's (t, p) and
setting (interleaved schedule where p > 1, scatter/gather, full recomputation), and b, v chosen by the
planner exactly as it would for any user. Nothing per row.
"""
import dataclasses
import json
import re
from pathlib import Path

import pytest

from fxpar.cost.cluster import builtin_clusters, get_cluster
from fxpar.cost.planner import SearchSpace, plan
from fxpar.cost.shape import ModelShape
from fxpar.cost.step import ParallelConfig, estimate, predict_step_seconds

REFERENCE = Path(__file__).resolve().parent / "data" / "megatron.json"  # the papers' numbers (tests/data/README.md)
TOLERANCE = 0.10


def reference() -> dict:
    return json.loads(REFERENCE.read_text())


def setting_number(setting: str, pattern: str) -> float:
    match = re.search(pattern, setting)
    assert match, f"pattern {pattern!r} not found in the reference setting {setting!r}"
    return float(match.group(1))


def table1_rows():
    table = reference()["ptdp_table1"]
    setting = table["setting"]
    seq = int(setting_number(setting, r"sequence (\d+)"))
    vocab = int(setting_number(setting, r"vocab (\d+)"))
    for row in table["rows"]:
        r = dict(zip(table["columns"], row))
        shape = ModelShape(layers=r["layers"], hidden=r["hidden"], heads=r["heads"], seq=seq, vocab=vocab,
                           batch=r["batch"])
        yield r, shape


def paper_configuration(shape, r, cluster):
    """The paper's (t, p) with full recomputation; the planner picks b and v (interleaving allowed)."""
    space = SearchSpace(tp=r["tp"], pp=r["pp"], recompute=("full",), scatter_gather=True)
    return plan(shape, r["gpus"], cluster, space).best


def test_cluster_peaks_match_the_papers_settings():
    ref = reference()
    clusters = builtin_clusters()
    a100 = setting_number(ref["ptdp_table1"]["setting"], r"peak (\d+) TFLOP/s")
    v100 = setting_number(ref["paper1"]["setting"], r"peak (\d+) TFLOP/s")
    assert clusters["selene"].peak_flops == a100 * 1e12 and clusters["dgx2h"].peak_flops == v100 * 1e12
    assert clusters["selene"].gpus_per_node == setting_number(ref["ptdp_table1"]["setting"], r"\((\d+) GPUs per node")
    assert clusters["dgx2h"].gpus_per_node == setting_number(ref["paper1"]["setting"], r"\((\d+) GPUs per node")


def test_table1_tflops_per_gpu_within_10_percent():
    selene = get_cluster("selene")
    report = []
    for r, shape in table1_rows():
        best = paper_configuration(shape, r, selene)
        error = best.tflops_per_gpu / r["tflops_per_gpu"] - 1
        report.append(f"{r['params_billion']}B {best.config.describe()}: {best.tflops_per_gpu:.1f} vs "
                      f"{r['tflops_per_gpu']} ({100 * error:+.1f}%)")
        assert best.config.dp == r["gpus"] // (r["tp"] * r["pp"])
        assert best.fits
    errors = [float(line.rsplit("(", 1)[1].rstrip("%)")) for line in report]
    assert all(abs(e) <= 100 * TOLERANCE for e in errors), "\n".join(report)


def test_table1_percent_of_peak_is_consistent():
    selene = get_cluster("selene")
    r, shape = next(iter(table1_rows()))
    best = paper_configuration(shape, r, selene)
    assert best.percent_of_peak == pytest.approx(100 * best.tflops_per_gpu * 1e12 / selene.peak_flops)


def test_v100_model_parallel_scaling_efficiency_within_10_points():
    paper1 = reference()["paper1"]
    setting = paper1["setting"]
    seq, vocab = int(setting_number(setting, r"sequence (\d+)")), int(setting_number(setting, r"vocab (\d+)"))
    batch = int(setting_number(setting, r"batch (\d+) per model-parallel group"))
    table = paper1["weak_scaling"]
    rows = [dict(zip(table["columns"], row)) for row in table["rows"]]
    dgx2h = get_cluster("dgx2h")

    def throughput(r):
        shape = ModelShape(layers=r["layers"], hidden=r["hidden"], heads=r["heads"], seq=seq, vocab=vocab,
                           batch=batch)
        t = r["model_parallel_gpus"]
        return plan(shape, t, dgx2h, SearchSpace(tp=t, pp=1, recompute=("full",))).best.tflops_per_gpu

    base = throughput(next(r for r in rows if r["model_parallel_gpus"] == 1))
    for r in rows:
        efficiency = 100 * throughput(r) / base
        assert abs(efficiency - r["mp_scaling_efficiency_percent"]) <= 10, (r, efficiency)
    assert any(r["model_parallel_gpus"] == 8 for r in rows)


def test_predict_step_seconds_matches_estimate_and_its_parts():
    selene = get_cluster("selene")
    shape = ModelShape(layers=96, hidden=12288, heads=96, seq=2048, vocab=51200, batch=1536)
    config = ParallelConfig(tp=8, pp=8, dp=16, microbatch=1, vpp=2)
    est = estimate(shape, config, selene)
    assert predict_step_seconds(shape, 8, 8, 16, 1, 2, cluster=selene) == est.seconds
    assert est.seconds == pytest.approx(sum(est.parts.values()))
    assert est.bubble == pytest.approx(7 / (2 * 96))
    assert est.parts["bubble"] == pytest.approx(est.bubble * (est.parts["compute"] + est.parts["tp_comm"]
                                                              + est.parts["p2p"]))


def test_more_recomputation_is_slower_and_smaller():
    selene = get_cluster("selene")
    shape = ModelShape(layers=24, hidden=2304, heads=24, seq=2048, vocab=51200, batch=64)
    runs = {mode: estimate(shape, ParallelConfig(tp=1, dp=8, microbatch=2, recompute=mode), selene)
            for mode in ("none", "selective", "full")}
    assert runs["none"].seconds < runs["selective"].seconds < runs["full"].seconds
    assert runs["none"].memory.total > runs["selective"].memory.total > runs["full"].memory.total


def test_scatter_gather_reduces_pipeline_time():
    selene = get_cluster("selene")
    shape = ModelShape(layers=96, hidden=12288, heads=96, seq=2048, vocab=51200, batch=1536)
    on = estimate(shape, ParallelConfig(tp=8, pp=16, dp=8, vpp=2), selene)
    off = estimate(shape, ParallelConfig(tp=8, pp=16, dp=8, vpp=2, scatter_gather=False), selene)
    assert on.parts["p2p"] < off.parts["p2p"] / 2


@pytest.mark.parametrize("config,message", [
    (ParallelConfig(tp=3), r"--tp 3: heads 32 not divisible by 3; nearby valid: 2, 4"),
    (ParallelConfig(tp=2, pp=8, vpp=4), r"layers 24 < pp\*vpp = 32"),
    (ParallelConfig(tp=1, dp=3), r"--batch 64 not divisible by dp\*microbatch = 3\*1"),
    (ParallelConfig(tp=1, pp=4, dp=1, microbatch=2, vpp=2), r"multiple of pp: m=33, p=4; use m=32 or m=36"),
])
def test_bad_configurations_name_the_constraint(config, message):
    shape = ModelShape(layers=24, hidden=2048, heads=32, seq=2048, vocab=51200, batch=64)
    if config.pp == 4:
        shape = shape.with_batch(66)
    with pytest.raises(ValueError, match=message):
        estimate(shape, config, get_cluster("selene"))


def test_vpp_needs_a_pipeline():
    with pytest.raises(ValueError, match="needs pipeline parallelism"):
        ParallelConfig(tp=1, pp=1, vpp=2)


@pytest.mark.parametrize("config", [ParallelConfig(tp=2, recompute="none"), ParallelConfig(tp=1, pp=2, microbatch=2),
                                    ParallelConfig(tp=1, dp=2, microbatch=4)])
def test_sync_wait_is_the_jitter_times_the_rank_compute(config):
    """Ranks drifting apart by sync_jitter of their compute cost that much once per step, on any mesh; one device
    never waits, and the GPU clusters have no jitter (Table 1 is priced without it)."""
    shape = ModelShape(layers=4, hidden=128, heads=8, seq=128, vocab=256, batch=8)
    jittery = dataclasses.replace(get_cluster("selene"), sync_jitter=0.15)
    est = estimate(shape, config, jittery)
    assert est.parts["sync_wait"] == pytest.approx(0.15 * est.parts["compute"])
    assert est.seconds == pytest.approx(sum(est.parts.values()))
    assert estimate(shape, ParallelConfig(tp=1, microbatch=8), jittery).parts["sync_wait"] == 0.0
    assert estimate(shape, config, get_cluster("selene")).parts["sync_wait"] == 0.0
