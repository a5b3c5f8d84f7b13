"""The tensor-parallel rewrite: apply the analysis to the graph, then make its communication minimal.

    rewrite.py        shard the weights, insert f / g / gather / scatter, keep what is unproven replicated
    collectives.py    the collectives the rewrite inserts, as autograd-aware modules, one per Comm kind
    vocab_kernels.py  the vocab-parallel losses' kernels (cross-entropy, logsumexp, the target's gather)
    merge_comm.py     partial sums that meet share one all-reduce; f moves up to the fork it guards
    in_place.py       f and g all-reduce in place where nothing else reads the tensor
    rng.py            random streams with Megatron's semantics; every random op put on one
    local_shapes.py   this rank's shapes on every node
    sequence_parallel.py  g -> reduce-scatter and f -> all-gather along the sequence; the ops between on blocks
"""
