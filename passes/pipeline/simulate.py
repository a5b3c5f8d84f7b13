"""Replay a pipeline schedule on a clock: timelines, bubble fraction, deadlock detection, and a text grid.

Pattern: every rank runs its action list in order; an action starts when its rank is free and its inputs are
ready, through one handler per action kind. Ranks are swept round-robin until nothing can move; start times only
depend on actions already replayed, so the sweep order does not change the result. A rank left with actions when
nothing moves is a deadlock, reported with the grid and each stuck step.

Two modes, picked from the schedule itself:
    compute-only   a forward of chunk c, microbatch i waits for the forward of chunk c-1 (plus the p2p latency when
                   c-1 lives on another rank); a backward waits for its own forward and for the backward of chunk
                   c+1 (the last chunk's backward only for its forward).
    lowered        cross-rank inputs come only through messages, as the runtime runs them ([Note: p2p semantics] in
                   passes/pipeline/lower.py): a SEND never blocks and its message arrives p2p later; a RECV only posts
                   the receive and never blocks; a compute action waits until each of its cross-rank inputs has
                   been received, which needs its RECV posted earlier on this rank and its SEND run on the peer.
                   Messages are matched by what they carry (their tag), not by order.

Glossary
    costs      stage-level durations {"F": forward, "B": backward, "p2p": latency}; one chunk of an interleaved
               schedule costs 1/v of them, so the ideal compute time does not depend on v.
    ideal      the busiest rank's compute time (m*(F+B) for a balanced pipeline).
    bubble     (makespan - ideal) / ideal, the paper's bubble time fraction: (p-1)/m for GPipe and 1F1B,
               (p-1)/(v*m) for interleaved 1F1B.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Mapping

from fxpar.passes.pipeline.schedules import B, F, RECV_B, RECV_F, SEND_B, SEND_F, Action, rank_of_chunk, schedule_shape

DEFAULT_COSTS = {F: 1, B: 2, "p2p": 0}


class DeadlockError(RuntimeError):
    """No rank can make progress; the message holds the grid with the stuck steps marked."""


@dataclass(frozen=True)
class SimResult:
    """One replayed schedule. `spans` are per-rank (start, end, Action) in integer ticks of length `tick`;
    `timelines`, `makespan`, `ideal` and `bubble_fraction` are exact Fractions in the units of the costs."""

    p: int
    v: int
    m: int
    spans: dict  # rank -> list[(start tick, end tick, Action)], p2p actions as zero-length entries
    tick: Fraction

    def __post_init__(self):
        if self.tick <= 0:
            raise ValueError(f"tick must be > 0, got {self.tick}")

    @functools.cached_property
    def timelines(self) -> dict[int, list[tuple[Fraction, Fraction, Action]]]:
        """rank -> list of (start, end, Action) in cost units."""
        scale = self.tick
        return {r: [(s * scale, e * scale, a) for s, e, a in spans] for r, spans in self.spans.items()}

    @functools.cached_property
    def makespan(self) -> Fraction:
        return max((spans[-1][1] for spans in self.spans.values() if spans), default=0) * self.tick

    @functools.cached_property
    def ideal(self) -> Fraction:
        """The busiest rank's compute time."""
        busy = [sum(e - s for s, e, a in spans if not a.is_p2p) for spans in self.spans.values()]
        return max(busy) * self.tick

    @property
    def bubble_fraction(self) -> Fraction:
        if self.ideal <= 0:
            raise ValueError(f"ideal compute time must be > 0, got {self.ideal}; give F and B positive costs")
        return (self.makespan - self.ideal) / self.ideal


@dataclass
class _State:
    """Mutable replay state (internal): per-rank clocks and positions, finished compute, p2p FIFOs."""

    p: int
    v: int
    costs: dict  # kind -> duration in integer ticks
    lowered: bool
    clock: list = field(default_factory=list)
    pos: list = field(default_factory=list)
    done: dict = field(default_factory=dict)  # (chunk, kind, microbatch) -> end tick
    sent: dict = field(default_factory=dict)  # (src, dst, message) -> arrival tick
    posted: set = field(default_factory=set)  # (src, dst, message) whose receive the destination has posted
    consumed: set = field(default_factory=set)  # (src, dst, message) a compute action has used
    waiting: dict = field(default_factory=dict)  # rank -> why its next action is blocked


def _costs(costs: Mapping | None, v: int) -> tuple[dict, Fraction]:
    """Per-chunk durations in integer ticks (exact and fast), and the length of one tick."""
    merged = dict(DEFAULT_COSTS, **(costs or {}))
    unknown = set(merged) - set(DEFAULT_COSTS)
    if unknown:
        raise ValueError(f"unknown cost keys {sorted(unknown)}; use {sorted(DEFAULT_COSTS)}")
    for key, value in merged.items():
        if not isinstance(value, (int, float, Fraction)) or value < 0 or (key != "p2p" and value <= 0):
            raise ValueError(f"cost {key}={value} must be a number > 0 (p2p >= 0)")
    exact = {F: Fraction(merged[F]) / v, B: Fraction(merged[B]) / v, "p2p": Fraction(merged["p2p"])}
    ticks_per_unit = math.lcm(*(d.denominator for d in exact.values()))
    return {key: int(d * ticks_per_unit) for key, d in exact.items()}, Fraction(1, ticks_per_unit)


def simulate(schedule: dict[int, list[Action]], costs: Mapping | None = None) -> SimResult:
    """Replay `schedule` (compute-only or lowered) and return its timelines and bubble fraction.

    Args:
        schedule: dict[rank, list[Action]] from `build_schedule`, or from `lower.lower`.
        costs: stage-level {"F", "B", "p2p"} durations, default F=1, B=2, p2p=0 (see the module docstring).
    Raises:
        DeadlockError: when ranks are left with actions and none can start.
        ValueError: when a lowered schedule computes before posting the RECV of an input, or leaves a message
            unreceived or a receive unused.
    """
    p, v, m = schedule_shape(schedule)
    lowered = any(a.is_p2p for actions in schedule.values() for a in actions)
    ticks, tick = _costs(costs, v)
    state = _State(p, v, ticks, lowered, [0] * p, [0] * p)
    spans = {rank: [] for rank in range(p)}
    moved = True
    while moved:
        moved = False
        for rank in range(p):
            while state.pos[rank] < len(schedule[rank]):
                action = schedule[rank][state.pos[rank]]
                span = _HANDLERS[action.kind](state, rank, action)
                if span is None:
                    break
                spans[rank].append((span[0], span[1], action))
                state.clock[rank], state.pos[rank], moved = span[1], state.pos[rank] + 1, True
    result = SimResult(p, v, m, spans, tick)
    if any(state.pos[r] < len(schedule[r]) for r in range(p)):
        raise DeadlockError(_deadlock_report(schedule, state, result.timelines))
    _check_drained(state)
    return result


def check_deadlock_free(lowered: dict[int, list[Action]], costs: Mapping | None = None) -> SimResult:
    """Prove a lowered schedule runs to the end under [Note: p2p semantics], every message received and used.

    Raises DeadlockError or ValueError otherwise; returns the replay.
    """
    if not any(a.is_p2p for actions in lowered.values() for a in actions) and len(lowered) > 1:
        raise ValueError("check_deadlock_free needs a lowered schedule (passes/pipeline/lower.py lower); this one has no p2p")
    return simulate(lowered, costs)


# ---------------------------------------------------------------- handlers, one per action kind

def _inputs(action: Action, last_chunk: int) -> list[tuple[int, str, int]]:
    """The compute results `action` consumes: (chunk, kind, microbatch)."""
    c, i = action.chunk, action.microbatch
    if action.kind == F:
        return [(c - 1, F, i)] if c > 0 else []
    return [(c, F, i)] + ([(c + 1, B, i)] if c < last_chunk else [])


def _input_ready(state: _State, rank: int, action: Action, dep: tuple[int, str, int]) -> int | None:
    """When `dep` is usable by `action` on `rank`, or None while it is not."""
    chunk, kind, microbatch = dep
    if rank_of_chunk(chunk, state.p) == rank or not state.lowered:
        if dep not in state.done:
            state.waiting[rank] = f"waits for {chunk}{kind}{microbatch} on rank {rank_of_chunk(chunk, state.p)}"
            return None
        latency = state.costs["p2p"] if rank_of_chunk(chunk, state.p) != rank else 0
        return state.done[dep] + latency
    peer = rank_of_chunk(chunk, state.p)
    key = (peer, rank, (kind, chunk, action.chunk, microbatch))
    if key not in state.posted:
        raise ValueError(f"rank {rank} runs {action} before receiving the {kind} output of chunk {chunk} from rank "
                         f"{peer}: no RECV precedes it; lower the schedule first")
    if key not in state.sent:
        state.waiting[rank] = f"waits for {chunk}{kind}{microbatch} from rank {peer}"
        return None
    state.consumed.add(key)
    return state.sent[key]


def _run_compute(state: _State, rank: int, action: Action):
    """F or B: start once the rank is free and every input is ready."""
    start = state.clock[rank]
    for dep in _inputs(action, state.p * state.v - 1):
        ready = _input_ready(state, rank, action, dep)
        if ready is None:
            return None
        start = max(start, ready)
    end = start + state.costs[action.kind]
    state.done[(action.chunk, action.kind, action.microbatch)] = end
    return start, end


def _run_send(state: _State, rank: int, action: Action):
    """SEND_*: never blocks; the message arrives one p2p latency later."""
    now = state.clock[rank]
    state.sent[(rank, action.peer, action.message())] = now + state.costs["p2p"]
    return now, now


def _run_recv(state: _State, rank: int, action: Action):
    """RECV_*: posts the receive and never blocks; the compute action that needs the message waits for it."""
    now = state.clock[rank]
    state.posted.add((action.peer, rank, action.message()))
    return now, now


_HANDLERS = {F: _run_compute, B: _run_compute, SEND_F: _run_send, SEND_B: _run_send,
             RECV_F: _run_recv, RECV_B: _run_recv}


def _check_drained(state: _State) -> None:
    for src, dst, message in sorted(set(state.sent) - state.posted):
        raise ValueError(f"rank {src} sends {message} to rank {dst}, which never posts its receive: rank {src}'s "
                         "flush would wait forever")
    for src, dst, message in sorted(state.posted - state.consumed):
        raise ValueError(f"rank {dst} posts a receive of {message} from rank {src} that no compute action uses")


# ---------------------------------------------------------------- grid

def _slot(times: list[Fraction]) -> Fraction:
    """Largest time step dividing every time, so each action fills whole grid cells."""
    denominator = math.lcm(*(t.denominator for t in times)) if times else 1
    step = math.gcd(*(int(t * denominator) for t in times)) if times else 0
    return Fraction(step or 1, denominator)


def _label(action: Action, v: int) -> str:
    """"F3" / "B3"; with v > 1 the global chunk is marked in front: "4F3"."""
    return f"{action.kind}{action.microbatch}" if v == 1 else str(action)


def _grid_rows(timelines: dict, v: int, slot: Fraction, width: int) -> list[str]:
    rows = []
    for rank in sorted(timelines):
        cells, t = [], Fraction(0)
        for start, end, action in timelines[rank]:
            if action.is_p2p:
                continue
            cells += ["."] * int((start - t) / slot)
            cells += [_label(action, v)] + ["-"] * (int((end - start) / slot) - 1)
            t = end
        rows.append(f"rank {rank} | " + " ".join(c.ljust(width) for c in cells))
    return rows


def render_grid(timelines: dict, v: int = 1) -> list[str]:
    """Rank x time grid like Figure 4 of the PTD-P paper: one row per rank, one cell per time slot, the action in
    its first cell, "-" while it lasts, "." when idle. Works on partial timelines (deadlock reports)."""
    times = [t for tl in timelines.values() for s, e, a in tl if not a.is_p2p for t in (s, e)]
    labels = [_label(a, v) for tl in timelines.values() for s, e, a in tl if not a.is_p2p]
    return _grid_rows(timelines, v, _slot(times), max(map(len, labels), default=2))


def format_result(result: SimResult) -> str:
    """The grid and the bubble fraction, as the CLI prints them."""
    bubble = result.bubble_fraction
    lines = render_grid(result.timelines, result.v)
    lines.append(f"bubble fraction: {bubble} = {float(bubble):.4f} (makespan {result.makespan}, "
                 f"ideal {result.ideal}; p={result.p}, v={result.v}, m={result.m})")
    return "\n".join(lines)


def _deadlock_report(schedule: dict, state: _State, timelines: dict) -> str:
    rows = render_grid(timelines, state.v)
    for rank in range(state.p):
        if state.pos[rank] < len(schedule[rank]):
            stuck = schedule[rank][state.pos[rank]]
            rows[rank] += f"  [!{stuck}] step {state.pos[rank]} {state.waiting.get(rank, '')}"
    return "deadlock: no rank can make progress\n" + "\n".join(rows)
