"""Pipeline parallelism: chunks, schedules as data, and the proofs run before any step.

    partition.py      p*v pipeline chunks cut at transformer-layer boundaries, and what crosses each boundary
    schedules.py      the Action type (Kind), its text form, GPipe / 1F1B / interleaved-1F1B builders
    lower.py          a compute schedule lowered to the runtime's program: sends, receives, message tags
    simulate.py       replay on a clock: timelines, bubble fraction, deadlock detection, a text grid
    proofs.py         the proofs every program passes before the runtime may run it
"""
