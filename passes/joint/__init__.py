"""The joint program: each chunk's forward and backward as one FX graph, every collective a node.

    export.py      the joint export of a chunk graph (AOT autograd), one program per input signature
    reinplace.py   a functional all-reduce in place where nothing else can see its buffer (programs run as traced)
    overlap.py     early_collectives and late_waits: each collective in flight while independent compute runs
    dp_buckets.py  the dp gradient reduction as collectives of the last microbatch's backward program
    random_inputs.py  a dropout's noise as a program input, drawn before each call on its random stream
    comm_table.py  each layer's collectives read from the joint programs, with their exposed time estimated
"""
