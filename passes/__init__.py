"""fxpar.passes: the compiler's middle layer (this folder, passes/, is installed as the package fxpar.passes).

The repository's three top-level code folders are three packages, mapped in pyproject.toml's package-dir:
fxpar/ -> fxpar, passes/ -> fxpar.passes, cost/ -> fxpar.cost (a source checkout resolves them the same way; see
fxpar/__init__.py). Imports only point down: fxpar -> passes -> cost; nothing here imports fxpar's own modules.

    meta.py            typed node metadata: GraphInput records, placement / collective / fusion tags, one resolver
    placements.py      Replicate, Partial, Shard (with the head-interleaved layout)
    aliasing.py        which values may share storage and which ops write into it (from the ops' schemas)
    op_families.py     the op families every pass and rule recognises (views, layout, casts, softmax, GEMMs, ...)
    canonicalize.py, gemm_forms.py, grouped_gemm.py
                       before the analysis: one placeholder per tensor, every weight contraction as linear / mm /
                       addmm, mixture-of-experts GEMMs as fxpar's grouped ops
    rules.py, rules_loss.py, rule_table.py, reshape.py, fused_projections.py
                       one sharding rule per ATen op family; the losses over a vocabulary-sharded dim; the table of
                       rules by op (rule_for); views; fused projections (Q|K|V, gate|up)
    analysis.py, vocab_analysis.py, plan.py, comm_audit.py
                       regions of column- then row-parallel GEMMs, the vocab-parallel embedding and head; the plan,
                       with each layer's collectives against Megatron's 2 + 2
    tp.py, collectives.py, vocab_kernels.py
                       the tensor-parallel rewrite and the collectives it inserts (f, g, gather, scatter); the
                       vocab-parallel losses' kernels
    merge_comm.py      fewer collectives: partial sums that meet share one all-reduce
    rng.py             random streams with Megatron's semantics, and the pass that puts each random op on one
    local_shapes.py    this rank's shapes on every node
    fusion.py (fuse_attention.py, fuse_dropout.py, fuse_gelu.py, fusion_match.py, fusion_kernels.py)
                       attention -> SDPA, bias+dropout+add, bias+GeLU
    recompute.py       activation recomputation (full, selective)
    in_place.py        f and g all-reduce in place where nothing else reads the tensor
    layers.py          what a transformer layer is (the repeated blocks of the module tree)
    partition.py       p*v pipeline chunks and their boundaries
    schedules.py, lower_schedule.py, simulate.py, proofs.py
                       schedules as data, lowering to the runtime's program, replay, the proofs run before every step
fxpar/compiler.py runs them, in order, as its STAGES.
"""
