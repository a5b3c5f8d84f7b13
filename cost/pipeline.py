"""Pipeline schedules in closed form: bubble, microbatches in flight, and the split of layers into stages.

Glossary (PTD-P): p pipeline stages, m microbatches per pipeline per iteration, v model chunks per device
(interleaved schedule; each device holds v chunks of about l/(p v) layers), l layers.
  gpipe              all forwards, then all backwards: every microbatch's activations are live at once
  1f1b               PipeDream-Flush: p - i - 1 warm-up forwards on stage i, then one forward one backward
  interleaved-1f1b   1f1b over v chunks per device; needs m % p == 0
"""
from __future__ import annotations

SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b")


def default_schedule(v: int) -> str:
    """1f1b for one chunk per device, interleaved-1f1b for more."""
    return "1f1b" if v == 1 else "interleaved-1f1b"


def check_schedule(schedule: str, p: int, m: int, v: int) -> None:
    """Raise ValueError naming the rule if (schedule, p, m, v) is not a valid combination."""
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule must be one of {', '.join(SCHEDULES)}; got {schedule!r}")
    if p < 1 or m < 1 or v < 1:
        raise ValueError(f"pipeline stages p={p}, microbatches m={m} and chunks v={v} must all be >= 1")
    if schedule != "interleaved-1f1b" and v != 1:
        raise ValueError(f"schedule {schedule} runs one chunk per device; got vpp={v} (use interleaved-1f1b)")
    if schedule == "interleaved-1f1b" and m % p:
        lower, upper = (m // p) * p, (m // p + 1) * p
        near = ", ".join(str(x) for x in (lower, upper) if x > 0)
        raise ValueError(f"interleaved-1f1b needs microbatches m % p == 0; m={m}, p={p}; nearby valid m: {near}")


def bubble_fraction(schedule: str, p: int, m: int, v: int = 1) -> float:
    """Pipeline bubble as a fraction of ideal compute time (PTD-P section 2.2).

    gpipe and 1f1b: (p-1)/m. interleaved-1f1b: (p-1)/(v m), which needs m % p == 0.
    """
    check_schedule(schedule, p, m, v)
    return (p - 1) / (v * m)


def chunks_in_flight(schedule: str, p: int, m: int, v: int, stage: int) -> int:
    """Most (microbatch, chunk) forwards whose activations stage `stage` holds at once.

    gpipe: all m. 1f1b: p - stage (warm-up + 1). interleaved: 2 (p - stage - 1) + (v - 1) p + 1, Megatron's
    warm-up count plus one; on stage 0 that is p v (1 + (p-1)/(p v)), Korthikanti et al.'s factor. Capped
    at m v (every chunk of every microbatch).
    """
    check_schedule(schedule, p, m, v)
    if schedule == "gpipe":
        return m
    warmup = p - stage - 1 if schedule == "1f1b" else 2 * (p - stage - 1) + (v - 1) * p
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
