"""`fxpar show` dumps one simulated rank's rewritten graph, with no torchrun: every node's real placement, local
shape and role, in the format asked for."""
import subprocess
import sys

import pytest

from fxpar.cli.main import build_parser, main

LLAMA = "tests/show_targets.py:llama"


def test_show_table_marks_collectives_and_local_shapes(capsys):
    assert main(["show", "examples/gpt.py:factory", "--tp", "2", "--rank", "1"]) == 0
    out = capsys.readouterr().out
    assert "tp rank 1 of 2" in out
    assert "g: all-reduce" in out and "f: all-reduce in backward" in out and "vocab lookup + all-reduce" in out
    assert "2x64x2x16" in out  # (B, T, heads/t, hd) after the localized view
    assert "h.0.attn.c_attn.weight" in out and "S(0, 3x[64]x1)" in out  # head-interleaved QKV rows
    assert "column-parallel" in out  # the plan follows the node table


def test_show_llama_prints_partial_and_the_vocab_shard(capsys):
    """Row-parallel GEMM outputs are partial sums (P) before g; the LM head's logits are the vocabulary shard."""
    assert main(["show", LLAMA, "--tp", "2"]) == 0
    rows = {line.split()[0]: line for line in capsys.readouterr().out.splitlines() if line.strip()}
    o_proj = next(r for r in rows.values() if "model.layers.0.self_attn.o_proj" in r and "linear.default" in r)
    down = next(r for r in rows.values() if "model.layers.0.mlp.down_proj" in r and "linear.default" in r)
    head = next(r for r in rows.values() if " lm_head " in f" {r} " and "linear.default" in r)
    assert " P " in o_proj and " P " in down, (o_proj, down)
    assert " S(2) " in head and "2x8x32" in head, head  # vocabulary 64 over t=2, logits (b, s, V/t)
    gather = next(r for r in rows.values() if "all-gather" in r)
    assert " R " in gather and "2x8x64" in gather
    assert "model.layers.0.self_attn.q_proj" in "\n".join(rows.values())  # the plan names GEMMs by module path


def test_show_code_is_annotated_python(capsys):
    assert main(["show", "examples/gpt.py:factory", "--tp", "2", "--format", "code"]) == 0
    out = capsys.readouterr().out
    assert "def forward(self" in out and 'view: "f32[2, 64, 2, 16]"' in out  # local shapes on every value
    assert "fxpar plan" not in out  # code prints code


def test_show_dot_has_a_legend(capsys):
    assert main(["show", "examples/gpt.py:factory", "--tp", "2", "--format", "dot"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("digraph fxpar") and "cluster_legend" in out
    assert 'label="partial sum (P)"' in out and "fillcolor=orange" in out  # the legend's colours are used


def test_show_console_script():
    out = subprocess.run([sys.executable, "-m", "fxpar.cli.main", "show", "examples/gpt.py:factory", "--tp", "4",
                          "--format", "table"], capture_output=True, text=True, check=True).stdout
    assert "lm_head.weight" in out and "64x64" in out  # 256 vocab rows / 4


def test_show_bad_rank(capsys):
    assert main(["show", "examples/gpt.py:factory", "--tp", "2", "--rank", "2"]) == 2


def test_show_one_pipeline_chunk_in_each_format(capsys):
    base = ["show", "examples/gpt.py:factory", "--tp", "2", "--pp", "2", "--vpp", "2", "--chunk", "3"]
    assert main(base) == 0
    out = capsys.readouterr().out
    assert "chunk 3 of 4 (pipeline rank 1): layers h.3 of 'h'" in out
    assert "receives: " in out and ": R 2x64x64 float32" in out  # the boundary, as data
    assert "all-gather" in out  # the last chunk holds the LM head
    assert main(base + ["--format", "code"]) == 0
    assert "def forward(self" in capsys.readouterr().out
    assert main(base + ["--format", "dot"]) == 0
    assert capsys.readouterr().out.startswith("digraph fxpar")
    assert main(["show", "examples/gpt.py:factory", "--pp", "2", "--chunk", "5"]) == 2


def test_show_pipeline_prints_the_proven_program(capsys):
    assert main(["show", "examples/gpt.py:factory", "--tp", "1", "--pp", "2"]) == 0
    out = capsys.readouterr().out
    assert "pipeline chunks" in out and "proven deadlock-free" in out
    assert "rank 1 | 1RECV_F0<0 1F0" in out


def test_every_flag_has_help():
    parser = build_parser()
    for sub in parser._subparsers._group_actions[0].choices.values():
        for action in sub._actions:
            if action.option_strings and action.dest != "help":
                assert action.help, f"{sub.prog} {action.option_strings} has no help text"


@pytest.mark.parametrize("target", ["examples/gpt.py:factory", LLAMA])
def test_plan_accepts_the_show_targets(target, capsys):
    assert main(["plan", target, "--batch", "8", "--gpus", "8", "--cluster", "selene"]) == 0
    assert "GPUs of selene" in capsys.readouterr().out


def test_show_joint_graph_lists_what_each_collective_overlaps(capsys):
    assert main(["show", "examples/gpt.py:factory", "--tp", "2", "--joint-graph"]) == 0
    out = capsys.readouterr().out
    assert "collectives per layer in the joint programs" in out
    assert "h.0..3              2 all_reduce                2 all_reduce                         4" in out
    backward = out.split("chunk 0, backward program")[1].splitlines()[1:]
    # f's all-reduce of the input gradient runs beside its layer's weight-gradient GEMMs
    assert backward[1:] == [f"all_reduce of tp_f_{i} (32768 bytes): sum, mm, mm, sum" for i in range(7, -1, -1)]
