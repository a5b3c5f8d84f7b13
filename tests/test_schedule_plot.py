"""The schedule chart (fxpar/cli/plot.py) and `fxpar schedule --png`: what the figure holds, the PNG it writes, and the
error when matplotlib is missing."""
from __future__ import annotations

import sys

import pytest
from matplotlib.image import imread

from fxpar.passes.pipeline.schedules import build_schedule
from fxpar.passes.pipeline.simulate import simulate
from fxpar.cli.plot import MatplotlibMissing, save_schedule_png, schedule_figure

from tests.test_simulate import run_cli

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
INTERLEAVED = ["--pp", "4", "--vpp", "2", "--microbatches", "8", "--schedule", "interleaved-1f1b"]


def replay(kind="interleaved-1f1b", p=4, m=8, v=2):
    """The replay `fxpar schedule` draws, with its default costs F=1, B=2."""
    return simulate(build_schedule(kind, p, m, v), {"F": 1, "B": 2})


def compute_actions(result):
    return [a for timeline in result.timelines.values() for _, _, a in timeline if not a.is_p2p]


@pytest.fixture(scope="module")
def interleaved():
    result = replay()
    return result, schedule_figure(result, title="interleaved-1f1b")


def test_one_row_per_rank_rank_0_on_top(interleaved):
    result, fig = interleaved
    ax = fig.axes[0]
    assert [t.get_text() for t in ax.get_yticklabels()] == [f"rank {r}" for r in range(result.p)]
    bottom, top = ax.get_ylim()
    assert top < bottom  # the y axis is inverted: rank 0 is the top row


def test_one_box_per_compute_action_with_its_microbatch(interleaved):
    result, fig = interleaved
    ax = fig.axes[0]
    actions = compute_actions(result)
    assert len(ax.patches) == len(actions) == 2 * result.p * result.v * result.m
    assert sorted(box.get_gid() for box in ax.patches) == sorted(str(a) for a in actions)
    assert sorted(t.get_text() for t in ax.texts) == sorted(str(a.microbatch) for a in actions)


def test_title_names_schedule_shape_and_bubble(interleaved):
    result, fig = interleaved
    title = fig.axes[0].get_title()
    assert str(result.bubble_fraction) == "3/16"
    assert title == "interleaved-1f1b  p=4 v=2 m=8  bubble 3/16 = 18.8%"


def test_colours_tell_direction_and_chunk_apart(interleaved):
    _, fig = interleaved
    face = {box.get_gid(): box.get_facecolor() for box in fig.axes[0].patches}
    assert face["0F0"] != face["0B0"]  # forward and backward of the same chunk
    assert face["0F0"] != face["4F0"] and face["0B0"] != face["4B0"]  # rank 0's local chunks 0 and 1
    assert face["0F0"] == face["1F3"]  # same direction and local chunk on another rank: same colour


def test_legend_has_an_entry_per_direction_and_chunk(interleaved):
    _, fig = interleaved
    (legend,) = fig.legends
    assert [t.get_text() for t in legend.get_texts()] == ["forward, chunk 0", "forward, chunk 1",
                                                          "backward, chunk 0", "backward, chunk 1"]
    assert "microbatch (from 0)" in legend.get_title().get_text()


def test_v1_legend_is_forward_and_backward():
    (legend,) = schedule_figure(replay("1f1b", 2, 4, 1), title="1f1b").legends
    assert [t.get_text() for t in legend.get_texts()] == ["forward", "backward"]


def test_save_writes_a_png(tmp_path):
    path = tmp_path / "chart.png"
    save_schedule_png(path, replay("gpipe", 2, 4, 1), title="gpipe")
    assert path.read_bytes()[:8] == PNG_SIGNATURE
    height, width = imread(path).shape[:2]
    assert width > 0 and height > 0


def test_cli_png(capsys, tmp_path):
    path = tmp_path / "timeline.png"
    code, out, err = run_cli(INTERLEAVED + ["--png", str(path)], capsys)
    assert code == 0 and err == "" and "bubble fraction: 3/16" in out
    assert path.read_bytes()[:8] == PNG_SIGNATURE


def test_cli_png_without_matplotlib(capsys, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # makes `import matplotlib...` raise ImportError
    with pytest.raises(MatplotlibMissing, match=r"pip install 'fxpar\[plot\]'"):
        schedule_figure(replay())
    path = tmp_path / "timeline.png"
    code, out, err = run_cli(INTERLEAVED + ["--png", str(path)], capsys)
    assert code == 2 and out == "" and not path.exists()
    assert err == "fxpar schedule: error: --png needs matplotlib: pip install 'fxpar[plot]'\n"
