"""`fxpar plan` and `fxpar calibrate`: JSON keys, the table, errors, meta-device planning of GPT-3 175B."""
import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytest

from fxpar import cli_plan
from fxpar.cost.cluster import load_cluster
from fxpar.cost.planner import plan
from fxpar.cost.shape import ModelShape
from fxpar.cost.step import predict_step_seconds

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "gpt3_175b.py"
JSON_KEYS = {"tp", "pp", "dp", "microbatch", "vpp", "tflops_per_gpu", "percent_of_peak", "seconds_per_iteration",
             "memory_gib_per_gpu", "bubble_fraction"}
GPT3 = ["--layers", "96", "--hidden", "12288", "--heads", "96", "--batch", "1536", "--gpus", "1024"]


def run(argv):
    parser = argparse.ArgumentParser(prog="fxpar")
    cli_plan.add_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.func(args)


def test_both_subcommands_are_registered():
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="command")
    cli_plan.add_parser(sub)
    assert {"plan", "calibrate"} <= set(sub.choices)


def test_plan_json_for_pinned_tp_pp(capsys):
    assert run(["plan", *GPT3, "--tp", "8", "--pp", "8", "--recompute", "full", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert JSON_KEYS <= set(out)
    assert (out["tp"], out["pp"], out["dp"]) == (8, 8, 16) and out["microbatch"] >= 1 and out["vpp"] >= 1
    assert 0 < out["percent_of_peak"] < 100 and out["memory_gib_per_gpu"] < 80
    assert out["bubble_fraction"] == pytest.approx(7 / (out["vpp"] * out["microbatches"]))


def test_plan_table_rejections_and_training_days(capsys):
    assert run(["plan", *GPT3, "--tokens", "300e9", "--top", "3"]) == 0
    text = capsys.readouterr().out
    assert "TFLOP/s/GPU" in text and "rejected:" in text and "out of memory:" in text
    assert "does not fit in one node of 8 GPUs, so tp = 8" in text
    assert "days (Eq. 4" in text


def test_plan_errors_are_one_clear_line(capsys):
    assert run(["plan", "--layers", "24", "--hidden", "2048", "--heads", "32", "--batch", "64", "--gpus", "8",
                "--tp", "3"]) == 2
    assert "--tp 3: heads 32 not divisible by 3; nearby valid: 2, 4" in capsys.readouterr().err
    assert run(["plan", "--hidden", "2048", "--batch", "64", "--gpus", "8"]) == 2
    assert "give a TARGET or --layers, --heads" in capsys.readouterr().err


def test_plan_target_tiny(capsys):
    assert run(["plan", f"{EXAMPLE}:tiny", "--batch", "8", "--gpus", "2", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert (out["layers"], out["hidden"], out["heads"], out["seq"], out["vocab"]) == (4, 64, 4, 32, 128)


@pytest.mark.gloo
@pytest.mark.slow
def test_calibrate_quick_then_plan_locally(tmp_path, capsys):
    path = tmp_path / "local.json"
    assert run(["calibrate", "--quick", "--out", str(path)]) == 0
    out = capsys.readouterr().out
    assert str(path) in out and "layer fit rms error" in out
    local = load_cluster(path)
    assert local.name == "local" and local.gpus_per_node == 2 and local.dtype_bytes == 4
    assert 1e8 < local.peak_flops < 1e13 and local.intra_bandwidth > 1e6 and local.intra_latency < 0.1
    assert 0 < local.gemm_efficiency <= 1 and local.kernel_overhead >= 0 and local.sync_jitter >= 0
    measured = json.loads((tmp_path / "local.measurements.json").read_text())
    assert {"peak_flops", "memory_bandwidth", "layers", "allreduce", "sync"} <= set(measured)
    shape = ModelShape(layers=4, hidden=64, heads=4, seq=32, vocab=128, batch=8)
    one = predict_step_seconds(shape, 1, 1, 1, 8, cluster=local)
    assert 0 < one and plan(shape, 2, local).best.seconds > 0


@pytest.mark.slow
def test_plan_gpt3_175b_on_the_meta_device_under_60s_and_2gb():
    """The 175B factory really traced (96 layers, h = 12288), in a fresh process; RSS of that process only."""
    command = [sys.executable, "-m", "fxpar.cli", "plan", f"{EXAMPLE}:factory", "--batch", "1536", "--gpus",
               "1024", "--cluster", "selene", "--json"]
    wrapper = ("import json, resource, subprocess, sys, time\n"
               "start = time.perf_counter()\n"
               "done = subprocess.run(sys.argv[1:], capture_output=True, text=True)\n"
               "print(json.dumps({'rc': done.returncode, 'out': done.stdout, 'err': done.stderr[-2000:],\n"
               "                  'seconds': time.perf_counter() - start,\n"
               "                  'cpu_s': sum(resource.getrusage(resource.RUSAGE_CHILDREN)[:2]),\n"
               "                  'rss_kib': resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss}))\n")
    result = json.loads(subprocess.run([sys.executable, "-c", wrapper, *command], capture_output=True, text=True,
                                       cwd=ROOT, timeout=300, check=True).stdout)
    assert result["rc"] == 0, result["err"]
    out = json.loads(result["out"])
    assert (out["layers"], out["hidden"], out["heads"], out["seq"]) == (96, 12288, 96, 2048)
    assert out["params"] == pytest.approx(174.6e9, rel=1e-3) and out["tp"] == 8
    # CPU seconds of the planning process: what it costs here, whatever else shares the 2 cores
    assert result["cpu_s"] < 60, result
    assert result["rss_kib"] < 2 * 1024 * 1024, result
