"""Pipeline schedules in closed form: bubble, microbatches in flight, and the split of layers into stages.

Glossary (PTD-P): p pipeline stages, m microbatches per pipeline per iteration, v model chunks per device
(interleaved schedule; each device holds v chunks of about l/(p v) layers), l layers.
  gpipe              all forwards, then all backwards: every microbatch's activations are live at once
  1f1b               PipeDream-Flush: p - i - 1 warm-up forwards on stage i, then one forward one backward
  interleaved-1f1b   1f1b over v chunks per device; needs m % p == 0 when v > 1
`check_schedule` is the one rule of which (schedule, p, m, v) run; passes/pipeline/schedules.py builds them.
"""
from __future__ import annotations

SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b")


def default_schedule(v: int) -> str:
    """1f1b for one chunk per device, interleaved-1f1b for more."""
    return "1f1b" if v == 1 else "interleaved-1f1b"


def check_schedule(schedule: str, p: int, m: int, v: int = 1) -> None:
    """Raise ValueError naming the bad number and the fix unless `schedule` can run p stages, m microbatches and
    v chunks per device. This is the one validity rule: Config, the compiler's schedule builder and the planner
    all call it, so `fxpar plan` accepts exactly what `parallelize` runs.

      1f1b              one chunk per device (v = 1)
      interleaved-1f1b  m a multiple of p when v > 1 (Megatron's rule); with v = 1 it is plain 1f1b
      gpipe             any v; with v > 1 it needs m >= p, so that the first device's next chunk never waits on
                        the wrap-around from the last device
    """
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown pipeline schedule {schedule!r}; use one of {', '.join(SCHEDULES)}")
    for name, value in (("pp (p)", p), ("microbatches (m)", m), ("vpp (v)", v)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{schedule} needs {name} to be an int >= 1, got {value!r}")
    if schedule == "1f1b" and v > 1:
        raise ValueError(f"1f1b runs one chunk per device, got v={v}; use schedule 'interleaved-1f1b' for v > 1 "
                         f"or set v=1")
    if schedule == "interleaved-1f1b" and v > 1 and m % p:
        lower, upper = (m // p) * p, (m // p + 1) * p
        fix = f"use m={lower} or m={upper}" if lower else f"use m={upper}"
        raise ValueError(f"interleaved-1f1b needs microbatches to be a multiple of pp: m={m}, p={p}; {fix}")
    if schedule == "gpipe" and v > 1 and m < p:
        raise ValueError(f"gpipe with v={v} chunks per device needs microbatches >= pp: m={m}, p={p}; use m>={p} "
                         f"or v=1")


def bubble_fraction(schedule: str, p: int, m: int, v: int = 1) -> float:
    """Pipeline bubble as a fraction of ideal compute time (PTD-P section 2.2): (p-1)/(v m).

    gpipe and 1f1b with one chunk per device: (p-1)/m; interleaved-1f1b, and gpipe over v chunks: (p-1)/(v m).
    """
    check_schedule(schedule, p, m, v)
    return (p - 1) / (v * m)


def chunks_in_flight(schedule: str, p: int, m: int, v: int, stage: int) -> int:
    """Most (microbatch, chunk) forwards whose activations stage `stage` holds at once.

    gpipe: all m v. 1f1b (and interleaved with v = 1): p - stage (warm-up + 1). interleaved: 2 (p - stage - 1) +
    (v - 1) p + 1, Megatron's warm-up count plus one; on stage 0 that is p v (1 + (p-1)/(p v)), Korthikanti et
    al.'s factor. Capped at m v (every chunk of every microbatch).
    """
    check_schedule(schedule, p, m, v)
    if schedule == "gpipe":
        return m * v
    warmup = p - stage - 1 if v == 1 else 2 * (p - stage - 1) + (v - 1) * p
    return min(warmup + 1, m * v)


def split_layers(layers: int, p: int, v: int = 1, head_layers: float = 0.0) -> tuple[int, ...]:
    """Layers per stage, balancing the LM head on the last stage (fxpar balances uneven splits).

    The last stage gets k layers plus the head, worth `head_layers` layers of time; the other p - 1
    stages share the rest as evenly as possible (earlier stages take the remainder). k minimizes the
    heaviest stage; ties keep the most even split. Every stage gets at least v layers (one per chunk).
    """
    if p < 1 or v < 1:
        raise ValueError(f"pipeline stages p={p} and chunks v={v} must be >= 1")
    if layers < p * v:
        raise ValueError(f"layers {layers} < pp*vpp = {p}*{v} = {p * v}: every chunk needs a layer; "
                         f"nearby valid: pp*vpp <= {layers}")
    if p == 1:
        return (layers,)
    best = None
    for k in range(v, layers - (p - 1) * v + 1):
        heaviest = max(k + head_layers, -(-(layers - k) // (p - 1)))
        key = (heaviest, abs(k - layers / p))
        if best is None or key < best[0]:
            best = (key, k)
    k = best[1]
    rest, extra = divmod(layers - k, p - 1)
    return tuple(rest + (1 if i < extra else 0) for i in range(p - 1)) + (k,)
