"""The shared IR: what every pass reads and writes besides the fx graph itself.

    meta.py           typed node metadata: GraphInput records, placement / collective / fusion tags, one resolver;
                      the collective kinds (Comm) and their one table
    placements.py     Replicate, Partial, Shard (with the head-interleaved layout)
    aliasing.py       which values may share storage and which ops write into it (from the ops' schemas); which
                      are memory nothing has written yet (`unwritten`)
    op_families.py    the op families every pass and rule recognises (views, layout, casts, softmax, GEMMs, ...);
                      a GEMM reading a node, a node's rows viewed as 2-D
    kernels.py        the fused ops passes/fusion inserts (plain functions over autograd Functions)
    pieces.py         how data-parallel gradients are laid out: DPReduce, ZeRO's pieces, dp buckets' handles
"""
