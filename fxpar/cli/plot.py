"""Draw a replayed pipeline schedule as a Gantt chart, in the style of Figure 4 of the PTD-P paper.

One row per pipeline rank (rank 0 on top), one box per forward or backward, time on the x axis. Forwards are blue
and backwards orange; with v > 1 each rank's local model chunk gets its own shade (darker for chunk 0, as the paper
draws it). The number in a box is its microbatch, counted from 0 like the text grid of `fxpar schedule`. The title
names the schedule, its shape and the bubble fraction.

matplotlib is optional (`pip install 'fxpar[plot]'`) and imported only when a chart is drawn; a Figure is built
directly on the Agg canvas, so no pyplot state or display is involved.
"""
from __future__ import annotations

from fxpar.passes.pipeline.schedules import B, F
from fxpar.passes.pipeline.simulate import SimResult

INSTALL_HINT = "pip install 'fxpar[plot]'"
_COLORMAPS = {F: "Blues", B: "Oranges"}
_KIND_NAMES = {F: "forward", B: "backward"}
_BOX_HEIGHT = 0.8  # of one rank's row


class MatplotlibMissing(ImportError):
    """matplotlib, needed to draw a schedule, is not installed."""


def _matplotlib():
    """The matplotlib pieces the chart uses, imported here so that fxpar runs without matplotlib."""
    try:
        from matplotlib import colormaps
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.colors import to_rgb
        from matplotlib.figure import Figure
        from matplotlib.patches import Patch
    except ImportError as e:
        raise MatplotlibMissing(f"drawing a schedule needs matplotlib: {INSTALL_HINT}") from e
    return colormaps, FigureCanvasAgg, to_rgb, Figure, Patch


def _shade(colormaps, kind: str, local_chunk: int, v: int):
    """Face colour of a `kind` box of local chunk `local_chunk`: dark for chunk 0, lighter for later chunks."""
    depth = 0.7 if v == 1 else 0.85 - 0.45 * local_chunk / (v - 1)
    return colormaps[_COLORMAPS[kind]](depth)


def _text_color(to_rgb, face) -> str:
    """Black on light boxes, white on dark ones, so the microbatch number stays readable."""
    r, g, b = to_rgb(face)
    return "black" if 0.299 * r + 0.587 * g + 0.114 * b > 0.55 else "white"


def _compute_spans(result: SimResult) -> list[tuple[int, float, float, object]]:
    """(rank, start, end, Action) of every forward and backward; p2p actions take no time and are not drawn."""
    return [(rank, float(start), float(end), action) for rank, timeline in sorted(result.timelines.items())
            for start, end, action in timeline if not action.is_p2p]


def _size(result: SimResult, spans: list) -> tuple[float, float, float]:
    """Figure width and height in inches, and the font size of the box labels.

    The width grows with the number of the shortest boxes that fit in the makespan, so each box keeps room for its
    number; it is capped so that long schedules stay a reasonable image (their labels get smaller).
    """
    makespan = float(result.makespan) or 1.0
    shortest = min((end - start for _, start, end, _ in spans), default=makespan)
    width = min(32.0, max(6.0, 0.3 * makespan / shortest + 2.0))
    box_points = 72 * (width - 2.0) * shortest / makespan
    digits = len(str(max(result.m - 1, 0)))
    return width, 0.45 * result.p + 1.8, min(9.0, max(4.0, box_points / (0.75 * digits + 0.6)))


def _heading(result: SimResult, title: str | None) -> str:
    """"interleaved-1f1b  p=4 v=2 m=8  bubble 3/16 = 18.8%": the exact bubble fraction as `fxpar schedule` prints it."""
    bubble = result.bubble_fraction
    return (f"{title or 'pipeline schedule'}  p={result.p} v={result.v} m={result.m}  "
            f"bubble {bubble} = {float(bubble):.1%}")


def _legend_handles(Patch, colormaps, v: int) -> list:
    """One entry per (direction, local chunk); with v = 1 just forward and backward."""
    return [Patch(facecolor=_shade(colormaps, kind, chunk, v), edgecolor="black", linewidth=0.5,
                  label=_KIND_NAMES[kind] + (f", chunk {chunk}" if v > 1 else ""))
            for kind in (F, B) for chunk in range(v)]


def schedule_figure(result: SimResult, title: str | None = None):
    """A matplotlib Figure of `result`'s timelines. `title` names the schedule (e.g. "interleaved-1f1b"); the shape
    and the bubble fraction are always appended to it. Raises MatplotlibMissing without matplotlib."""
    colormaps, FigureCanvasAgg, to_rgb, Figure, Patch = _matplotlib()
    spans = _compute_spans(result)
    width, height, fontsize = _size(result, spans)
    fig = Figure(figsize=(width, height), layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    for rank, start, end, action in spans:
        face = _shade(colormaps, action.kind, action.chunk // result.p, result.v)
        (box,) = ax.barh(rank, end - start, left=start, height=_BOX_HEIGHT, color=face, edgecolor="black",
                         linewidth=0.5)
        box.set_gid(str(action))
        ax.text((start + end) / 2, rank, str(action.microbatch), ha="center", va="center", fontsize=fontsize,
                color=_text_color(to_rgb, face))
    ax.set_yticks(range(result.p), labels=[f"rank {rank}" for rank in range(result.p)])
    ax.set_ylim(result.p - 0.5, -0.5)  # rank 0 on top
    ax.set_xlim(0, float(result.makespan) or 1.0)
    ax.set_xlabel("time (cost units)")
    ax.grid(axis="x", alpha=0.3)
    ax.set_axisbelow(True)
    ax.set_title(_heading(result, title))
    fig.legend(handles=_legend_handles(Patch, colormaps, result.v), loc="outside lower center", ncol=2 * result.v,
               fontsize="small", title="number in a box: microbatch (from 0)", title_fontsize="small")
    return fig


def save_schedule_png(path, result: SimResult, title: str | None = None, dpi: int = 150) -> None:
    """Write `schedule_figure(result, title)` to `path` as a PNG, whatever the file's extension."""
    schedule_figure(result, title).savefig(path, format="png", dpi=dpi)
