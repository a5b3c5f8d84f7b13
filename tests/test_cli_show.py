"""`fxpar show` dumps one simulated rank's rewritten graph, with no torchrun."""
import subprocess
import sys

import pytest

from fxpar.cli import main


def test_show_code_marks_collectives_and_local_shapes(capsys):
    assert main(["show", "examples/gpt.py:factory", "--tp", "2", "--rank", "1"]) == 0
    out = capsys.readouterr().out
    assert "tp rank 1 of 2" in out
    assert "g: all-reduce" in out and "f: all-reduce in backward" in out and "vocab lookup + all-reduce" in out
    assert "2x64x2x16" in out  # (B, T, heads/t, hd) after the localized view
    assert "h.0.attn.c_attn.weight" in out and "S(0, 3x[64]x1)" in out  # head-interleaved QKV rows


@pytest.mark.parametrize("fmt,needle", [("table", "column-parallel"), ("dot", "digraph fxpar")])
def test_show_formats(capsys, fmt, needle):
    assert main(["show", "examples/gpt.py:factory", "--tp", "2", "--format", fmt]) == 0
    assert needle in capsys.readouterr().out


def test_show_console_script():
    out = subprocess.run([sys.executable, "-m", "fxpar.cli", "show", "examples/gpt.py:factory", "--tp", "4",
                          "--format", "table"], capture_output=True, text=True, check=True).stdout
    assert "lm_head.weight" in out and "64x64" in out  # 256 vocab rows / 4


def test_show_bad_rank(capsys):
    assert main(["show", "examples/gpt.py:factory", "--tp", "2", "--rank", "2"]) == 2


def test_show_one_pipeline_chunk(capsys):
    assert main(["show", "examples/gpt.py:factory", "--tp", "2", "--pp", "2", "--vpp", "2", "--chunk", "3"]) == 0
    out = capsys.readouterr().out
    assert "# chunk 3 of 4 (pipeline rank 1): layers [3] of block 'h'" in out
    assert "tp_gather" in out  # the last chunk holds the LM head
    assert main(["show", "examples/gpt.py:factory", "--pp", "2", "--chunk", "5"]) == 2
