"""The sharding analysis: which values can be split across the t ranks, proven op by op.

    rules.py             one sharding rule per ATen op family (Role says what a decision does)
    mixer_rules.py       the token mixers' rules: attention, einsum and batched matmuls, depthwise convolutions
    loss_rules.py        the losses over a vocabulary-sharded dim: cross-entropy, logsumexp, the target's gather
    view_rules.py        where a sharded dim lands when a tensor is viewed with a new shape
    rule_table.py        the rules by op, one read-only table (rule_for)
    fused_projections.py GEMMs whose output columns the model cuts into parts (Q|K|V, gate|up)
    analysis.py          regions of column- then row-parallel GEMMs, each proven with the rules
    shared_weights.py    a weight several GEMMs read (a looped block), sharded where all of them shard it alike
    vocab_analysis.py    the vocab-parallel embedding and LM head (one shard of the vocabulary)
    plan.py              every decision as data, with a printable table
    comm_audit.py        each layer's collectives in the rewritten graph, under the pass that runs each, against
                         Megatron's 2 + 2 (4 + 6 with sequence parallelism)
    sequence_analysis.py sequence parallelism: which dim is the sequence (a probe), what runs on its blocks
"""
