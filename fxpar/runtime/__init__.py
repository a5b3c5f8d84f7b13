"""The runtime: what a rank holds and runs after compilation. It interprets programs; it decides nothing.

    executable.py           the per-rank executable (tensor / data parallel): programs plus local weights
    pipeline_executable.py  the pipeline-parallel executable: this rank's chunks, its proven program, step()
    interpreter.py          runs one rank's lowered action list, one handler per action kind
    buckets.py              the step's dp gradient reduction: by the last microbatch's program, or in buckets here
    program_cache.py        programs keyed by what the trace froze (train/eval, non-tensor arguments)
    joint_runner.py         a chunk's joint programs, one per input signature, asked of the compiler
    weights.py              RankWeights: keys, aliases, shapes, shardings, live tensors, gradients, what is unloaded
    optim.py                pm.optimizer: a torch.optim optimizer over what a rank steps
    zero.py                 the distributed optimizer (ZeRO-1) over the dp group
    precision.py            mixed precision: low-precision compute, fp32 main gradients and parameters, loss scaling
    clip.py                 clipping by the global norm of the whole (p, t, d) model
    replicas.py             pm.check_replicas(): replicas are checked, not hoped for
    measure.py              the bytes autograd saves for backward
    ownership.py            parallelize consumes the model: its parameters released, one copy of the weights
"""
