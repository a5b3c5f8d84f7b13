"""fxpar.passes: the compiler's middle layer (this folder, passes/, is installed as the package fxpar.passes).

The repository's three top-level code folders are three packages, mapped in pyproject.toml's package-dir:
fxpar/ -> fxpar, passes/ -> fxpar.passes, cost/ -> fxpar.cost (a source checkout resolves them the same way; see
fxpar/__init__.py). Imports only point down: fxpar -> passes -> cost; nothing here imports fxpar's own modules.

One subpackage per part of the pipeline, in the order data flows (each __init__ is that part's index):

    ir/               the shared IR: typed node metadata, placements, aliasing, op families
    frontend/         the traced graph in canonical form: one placeholder per tensor, GEMM forms, grouped GEMMs, layers
    sharding/         the analysis: one rule per op family, regions of column- then row-parallel GEMMs, fused
                      projections, the vocabulary, the plan and its per-layer communication audit
    tensor_parallel/  the rewrite: f/g and the other collectives, merged and in place, random streams, local shapes
    experts/          expert parallelism: each MoE layer's expert chain found, its rows sent to the ranks of their experts
    data_parallel/    what a loss needs from every dp rank: its statistics over the batch's rows, all-reduced
    fusion/           fused kernels (attention -> SDPA, bias+dropout+add, bias+GeLU) and activation recomputation
    pipeline/         p*v chunks, schedules as data, lowering to the runtime's program, replay, proofs
    joint/            each chunk's forward+backward as one graph, every collective a node; the collectives it runs

fxpar/compiler.py runs them, one pass per stage, in order, as its STAGES.
"""
