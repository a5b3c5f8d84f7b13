"""The benchmark matrix in one command (`make bench`): each case against the peer a user would otherwise pick, as
paired per-round ratios, into one table and one plot.

    case                          script            fxpar variant          peer
    GPT (sdpa), t=2               tp_step.py        fxpar                  hand-written Megatron layer, DTensor
    GPT (explicit attention), t=2 tp_step.py        fxpar                  hand-written Megatron layer, DTensor
    Llama (GQA, SwiGLU), t=2      llama_step.py     fxpar                  DTensor with Hugging Face's own plan
    GPT, p=2, m=4 and m=8         pp_step.py        fxpar 1f1b             torch.distributed.pipelining 1F1B
                                                    fxpar interleaved      torch's interleaved 1F1B (v=2)
    GPT, p=2 x t=2, m=4           hybrid_step.py    fxpar                  torch's pipelining over DTensor stages
                                  (4 ranks)
    GPT, t=2, compile             compile_step.py   fxpar compile (joint   fxpar eager (and torch.compile against
                                                    programs), fxpar       torch eager, the gain to match)
                                                    torch.compile
    GPT, t=2, compile, dropout    compile_step.py   the same with dropout 0.1 (fxpar compile: torch.compile per chunk)
    GPT, p=2, compile             compile_step.py   the same, fxpar at p=2 (1F1B, m=4)

Each script runs its own ranks (2 gloo ranks, 1 thread each), checks every variant against the unmodified model
before timing, and returns per-round times; a cell is the median over rounds of the ratio within a round (below
1: fxpar faster), with quartiles. The p=2 x t=2 case runs 4 ranks on this machine's cores.

    .venv/bin/python benchmarks/matrix.py [--rounds 8] [--readme benchmarks/README.md] [--plot benchmarks/matrix.png]
"""
from __future__ import annotations

import argparse
import os
import re
import sys
import time

if __package__:
    from benchmarks import common
else:
    import common

BEGIN, END = "<!-- bench-matrix:begin (make bench writes this) -->", "<!-- bench-matrix:end -->"
_TP_PEERS = (("fxpar", "hand-written"), ("fxpar", "DTensor"))
_COMPILE_PEERS = (("fxpar compile", "fxpar eager"), ("fxpar torch.compile", "fxpar eager"),
                  ("torch.compile", "torch eager"))
_PP_PEERS = (("fxpar 1f1b", "torch 1f1b"), ("fxpar interleaved", "torch interleaved"))
CASES = (  # (case, benchmark module, its arguments, (variant, peer) pairs)
    ("GPT (sdpa), t=2", "tp_step", [], _TP_PEERS),
    ("GPT (explicit attention), t=2", "tp_step", ["--attention", "explicit"], _TP_PEERS),
    ("Llama (GQA, SwiGLU), t=2", "llama_step", [], (("fxpar", "DTensor"),)),
    ("GPT, p=2, m=4", "pp_step", ["--microbatches", "4"], _PP_PEERS),
    ("GPT, p=2, m=8", "pp_step", ["--microbatches", "8"], _PP_PEERS),
    ("GPT, p=2 x t=2, m=4", "hybrid_step", [], (("fxpar", "torch pp + DTensor"),)),
    ("GPT, t=2, compile", "compile_step", [], _COMPILE_PEERS),
    ("GPT, t=2, compile, dropout 0.1", "compile_step", ["--dropout", "0.1"], _COMPILE_PEERS),
    ("GPT, p=2, compile", "compile_step", ["--pp"], _COMPILE_PEERS),
)


def run_case(module: str, argv: list[str]) -> dict:
    """The benchmark's result dict (its `main(argv)`: it spawns its ranks, prints its own table)."""
    import importlib

    return importlib.import_module(module).main(argv)


def rows_of(case: str, result: dict, pairs) -> list[list]:
    """[case, variant, peer, median ratio, q1, q3] per (variant, peer) pair."""
    rows = []
    for variant, peer in pairs:
        ratio, q1, q3 = common.paired_ratio(result["times"], variant, peer)
        rows.append([case, variant, peer, ratio, q1, q3])
    return rows


def markdown(rows: list[list], note: str) -> str:
    lines = [note, "", "| case | variant | against | ratio | (IQR) |", "|---|---|---|---|---|"]
    lines += [f"| {c} | {v} | {p} | {r:.3f} | {a:.3f}-{b:.3f} |" for c, v, p, r, a, b in rows]
    return "\n".join(lines)


def fill_readme(path: str, text: str) -> None:
    """Replace what lies between BEGIN and END in `path` with `text` (both markers must be there)."""
    with open(path) as f:
        old = f.read()
    if BEGIN not in old or END not in old:
        raise ValueError(f"{path} has no {BEGIN} ... {END} section for the matrix")
    new = re.sub(re.escape(BEGIN) + ".*?" + re.escape(END), lambda _: f"{BEGIN}\n{text}\n{END}", old, flags=re.S)
    with open(path, "w") as f:
        f.write(new)


def plot(rows: list[list], path: str) -> None:
    """One horizontal bar per row: the ratio, its IQR as an error bar, parity (1.0) marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"{c}: {v} / {p}" for c, v, p, *_ in rows]
    ratios = [r for *_, r, _, _ in rows]
    err = [[r - a for *_, r, a, _ in rows], [b - r for *_, r, _, b in rows]]
    fig, ax = plt.subplots(figsize=(9, 0.45 * len(rows) + 1.2))
    ax.barh(range(len(rows)), ratios, xerr=err, color="#4c72b0", capsize=3)
    ax.axvline(1.0, color="black", linewidth=0.8)
    ax.set_yticks(range(len(rows)), labels, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("step time ratio (median of per-round ratios; below 1: the first is faster)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv=None) -> list[list]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=8, help="interleaved rounds per case")
    p.add_argument("--readme", help="fill this file's bench-matrix section")
    p.add_argument("--plot", help="write the chart here (a PNG)")
    args = p.parse_args(argv)
    rows, start = [], time.time()
    for case, module, extra, pairs in CASES:
        print(f"== {case}", flush=True)
        rows += rows_of(case, run_case(module, [*extra, "--rounds", str(args.rounds)]), pairs)
    note = (f"`make bench` on {time.strftime('%Y-%m-%d')}, {args.rounds} rounds per case, 2 gloo ranks, 1 thread "
            f"each, {time.time() - start:.0f} s in all ({os.cpu_count()} cores, shared: compare within a row).")
    print(markdown(rows, note))
    if args.readme:
        fill_readme(args.readme, markdown(rows, note) + ("\n\n![the matrix](matrix.png)" if args.plot else ""))
    if args.plot:
        plot(rows, args.plot)
    return rows


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
