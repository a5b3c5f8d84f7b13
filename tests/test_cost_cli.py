"""`fxpar plan` and `fxpar calibrate`: JSON keys, the table, errors, meta-device planning of GPT-3 175B."""
import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytest

from fxpar.cli import plan_command as cli_plan
from fxpar.cost.cluster import load_cluster
from fxpar.cost.planner import plan
from fxpar.cost.shape import ModelShape
from fxpar.cost.step import predict_step_seconds
from tests.harness import module_pool

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "gpt3_175b.py"
JSON_KEYS = {"tp", "pp", "dp", "microbatch", "vpp", "tflops_per_gpu", "percent_of_peak", "seconds_per_iteration",
             "memory_gib_per_gpu", "bubble_fraction"}
pool1 = module_pool(1)
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
    command = [sys.executable, "-m", "fxpar.cli.main", "plan", f"{EXAMPLE}:factory", "--batch", "1536", "--gpus",
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


def _steps_with(ready: dict) -> list[float]:
    """Three AdamW steps of the tiny GPT on the mesh and Config `fxpar plan --json` printed."""
    import torch

    import fxpar
    from examples.gpt3_175b import tiny

    model, (ids,) = tiny()
    ids = torch.randint(0, 128, (ready["batch"], ids.shape[1]), generator=torch.Generator().manual_seed(0))
    pm = fxpar.parallelize(model, fxpar.init_mesh(**ready["mesh"]), example_args=(ids,),
                           config=fxpar.Config.from_dict(ready["config"]),
                           loss_fn=lambda out, y: torch.nn.functional.cross_entropy(out.flatten(0, 1), y.flatten()))
    opt = pm.optimizer(torch.optim.AdamW, lr=1e-2)
    losses = []
    for _ in range(3):
        opt.zero_grad()
        losses.append(pm.step(ids, target=ids).item())
        opt.step()
    return losses


@pytest.mark.gloo
@pytest.mark.parametrize("precision,zero", [("bf16", "0"), ("fp32", "auto")])
def test_plan_json_is_a_config_that_runs(pool1, capsys, precision, zero):
    """--json's "fxpar" entry builds the mesh and Config it planned; the tiny GPT parallelizes and trains with it."""
    import torch

    import fxpar

    assert run(["plan", f"{EXAMPLE}:tiny", "--batch", "4", "--gpus", "1", "--precision", precision, "--zero", zero,
                "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    ready = out["fxpar"]
    assert ready["mesh"] == {"tp": 1, "pp": 1, "dp": 1} and ready["batch"] == 4
    assert out["precision"] == precision and out["zero"] == ready["config"]["zero"] == 0  # zero=1 needs d > 1
    config = fxpar.Config.from_dict(ready["config"])
    assert config.to_dict() | ready["config"] == config.to_dict()  # every planned key kept as planned
    assert (config.mixed_precision is None) == (precision == "fp32")
    if config.mixed_precision is not None:
        assert config.mixed_precision.param_dtype == torch.bfloat16
    (losses,) = pool1.run(_steps_with, ready)
    assert losses[-1] < losses[0], losses


def test_plan_counts_the_model_states_by_precision_and_zero(capsys):
    """Model states per parameter: fp32 16, bf16 18 (fp32 main gradients), the paper's fp16 20; zero=1 over d."""
    gib = {}
    for precision, zero in [("fp32", "0"), ("bf16", "0"), ("paper", "0"), ("bf16", "1")]:
        assert run(["plan", *GPT3, "--tp", "8", "--pp", "8", "--microbatch", "1", "--vpp", "1", "--recompute",
                    "full", "--precision", precision, "--zero", zero, "--json"]) == 0
        gib[precision, zero] = json.loads(capsys.readouterr().out)["memory_gib_per_gpu"]
    states = {k: v - gib["fp32", "0"] for k, v in gib.items()}  # only the model states differ
    params = states["paper", "0"] / 4  # 20 - 16 bytes per parameter
    assert states["bf16", "0"] == pytest.approx(2 * params) and params > 0
    assert states["bf16", "1"] == pytest.approx((6 + 16 / 16 - 16) * params)  # d = 16


def test_config_from_dict_refuses_unknown_keys_and_dtypes():
    import fxpar

    with pytest.raises(ValueError, match="unknown keys \\['microbatch'\\]"):
        fxpar.Config.from_dict({"microbatch": 2})
    with pytest.raises(ValueError, match="'bf16' is not a torch dtype name"):
        fxpar.Config.from_dict({"mixed_precision": {"param_dtype": "bf16"}})


def test_plan_searches_sequence_parallelism_and_the_json_config_carries_it(capsys):
    """--sequence-parallel: a column says which setting each row has; it only saves memory (the bytes on the wire
    are tensor parallelism's: the same step time), and the JSON's Config carries it."""
    import fxpar

    args = ["plan", *GPT3, "--tp", "8", "--pp", "16", "--recompute", "selective", "--microbatch", "1", "--vpp", "1"]
    assert run([*args, "--sequence-parallel", "auto", "--top", "3"]) == 0
    assert "seq-par" in capsys.readouterr().out.splitlines()[1]
    out = {}
    for setting in ("off", "on"):
        assert run([*args, "--sequence-parallel", setting, "--json"]) == 0
        out[setting] = json.loads(capsys.readouterr().out)
    assert out["on"]["sequence_parallel"] and out["on"]["fxpar"]["config"]["sequence_parallel"]
    assert fxpar.Config.from_dict(out["on"]["fxpar"]["config"]).sequence_parallel
    assert out["on"]["memory_gib_per_gpu"] < out["off"]["memory_gib_per_gpu"]
    assert out["on"]["seconds_per_iteration"] == out["off"]["seconds_per_iteration"]
