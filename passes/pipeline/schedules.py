"""Pipeline schedules as data: the `Action` type, its text form, and the GPipe / 1F1B / interleaved-1F1B builders.

A schedule is plain data, `dict[rank, list[Action]]`: what each pipeline rank runs, in order. Builders are pure
functions of (p, m, v); `lower.lower` adds the send/recv actions; `simulate.simulate` replays a schedule
on a clock; the runtime only interprets the list, one handler per action kind.

Glossary
    p        pipeline-parallel size (number of pp ranks).
    v        virtual stages per rank (model chunks per rank); the model is cut into p*v chunks.
    m        microbatches per training step.
    chunk    a global chunk index c in 0..p*v-1. [Note: pipeline ownership] chunk c runs on pp rank c % p, so local
             chunk j of rank r is global chunk j*p + r.
    stage    v=1: a chunk. For v>1, "stage units" means the work of v chunks (one rank's share of the model).
    F, B     forward / backward of one chunk on one microbatch.
    SEND_F, RECV_F, SEND_B, RECV_B
             point-to-point ops added by lowering. The chunk of a SEND is the producing chunk; the chunk of a RECV is
             the consuming chunk (as in torch.distributed.pipelining's `_Action`), and both carry the peer rank.

Text form (round-trips through `Action.parse`):
    "0F1"          chunk 0, forward, microbatch 1
    "3B0"          chunk 3, backward, microbatch 0
    "0SEND_F1>1"   chunk 0 sends its forward output of microbatch 1 to rank 1
    "1RECV_F1<0"   chunk 1 receives the forward input of microbatch 1 from rank 0

Which (kind, p, m, v) can run is decided in one place, cost.bubble.check_schedule (SCHEDULES lists the kinds).

gpipe with v > 1 (our choice, not Megatron's): every rank runs all forwards of its chunks, chunk-major (local chunk
0 for microbatches 0..m-1, then local chunk 1, ...), then all backwards in reverse chunk order. It needs m >= p so
that chunk j*p of rank 0 never waits on the wrap-around from rank p-1; its bubble is then (p-1)/(v*m), as for
interleaved 1F1B, but it keeps all m microbatches in flight.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from enum import Enum
from fractions import Fraction

from fxpar.cost.bubble import check_schedule

class Kind(str, Enum):
    """What an Action does: compute a chunk's forward or backward, or move its activations or gradients to or from
    a peer. A str: a kind equals its name ("F" == Kind.F), and prints as it."""

    F = "F"
    B = "B"
    SEND_F = "SEND_F"
    RECV_F = "RECV_F"
    SEND_B = "SEND_B"
    RECV_B = "RECV_B"

    __str__ = str.__str__
    __format__ = str.__format__


F, B, SEND_F, RECV_F, SEND_B, RECV_B = Kind
COMPUTE_KINDS = (F, B)
P2P_KINDS = (SEND_F, RECV_F, SEND_B, RECV_B)
KINDS = COMPUTE_KINDS + P2P_KINDS

_ACTION_RE = re.compile(r"^(\d+)(SEND_F|RECV_F|SEND_B|RECV_B|F|B)(\d+)(?:(>|<)(\d+))?$")


@dataclass(frozen=True)
class Action:
    """One step of one pipeline rank: `kind` of global `chunk` on `microbatch`; p2p kinds also name the `peer`."""

    chunk: int
    kind: Kind
    microbatch: int
    peer: int | None = None

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"Action kind {self.kind!r} is unknown; use one of {', '.join(KINDS)}")
        object.__setattr__(self, "kind", Kind(self.kind))  # a kind given by its name is the Kind of that name
        for name in ("chunk", "microbatch"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 0:
                raise ValueError(f"Action {name} must be an int >= 0, got {value!r}")
        if self.is_p2p and (not isinstance(self.peer, int) or self.peer < 0):
            raise ValueError(f"Action {self.kind} of chunk {self.chunk} needs a peer rank >= 0, got {self.peer!r}")
        if not self.is_p2p and self.peer is not None:
            raise ValueError(f"Action {self.kind} is a compute action and takes no peer (got peer={self.peer})")

    @property
    def is_p2p(self) -> bool:
        return self.kind in P2P_KINDS

    @property
    def is_send(self) -> bool:
        return self.kind in (SEND_F, SEND_B)

    @property
    def direction(self) -> str:
        """Kind.F for forward traffic (F, SEND_F, RECV_F), Kind.B for backward traffic."""
        return F if self.kind in (F, SEND_F, RECV_F) else B

    def message(self) -> tuple[str, int, int, int]:
        """The message a p2p action moves, as (direction, producing chunk, consuming chunk, microbatch).

        A SEND and the RECV that must match it return the same tuple: forward data flows chunk c -> c+1, gradients
        flow chunk c -> c-1, and a SEND names the producer while a RECV names the consumer.
        """
        assert self.is_p2p, f"{self} is not a p2p action"
        step = 1 if self.direction == F else -1
        if self.is_send:
            return (self.direction, self.chunk, self.chunk + step, self.microbatch)
        return (self.direction, self.chunk - step, self.chunk, self.microbatch)

    def __str__(self) -> str:
        text = f"{self.chunk}{self.kind}{self.microbatch}"
        if self.is_p2p:
            text += (">" if self.is_send else "<") + str(self.peer)
        return text

    @staticmethod
    def parse(text: str) -> "Action":
        """Inverse of `str(action)`: "0F1", "1B0", "0SEND_F1>1", "1RECV_B0<2"."""
        match = _ACTION_RE.match(text.strip())
        if match is None:
            raise ValueError(f"cannot parse action {text!r}; expected e.g. '0F1', '1B0', '0SEND_F1>1', '1RECV_F1<0'")
        chunk, kind, microbatch, arrow, peer = match.groups()
        action = Action(int(chunk), kind, int(microbatch), None if peer is None else int(peer))
        if arrow is not None and arrow != (">" if action.is_send else "<"):
            raise ValueError(f"action {text!r}: a send points to its peer with '>', a receive with '<'")
        return action


Schedule = dict[int, list[Action]]  # pp rank -> its actions, in order


def format_schedule(schedule: dict[int, list[Action]]) -> dict[int, str]:
    """Each rank's actions as one space-separated line (the form `parse_schedule` reads back)."""
    return {rank: " ".join(str(a) for a in actions) for rank, actions in sorted(schedule.items())}


def parse_schedule(lines: dict[int, str]) -> dict[int, list[Action]]:
    """Inverse of `format_schedule`."""
    return {int(rank): [Action.parse(t) for t in line.split()] for rank, line in lines.items()}


def rank_of_chunk(chunk: int, p: int) -> int:
    """[Note: pipeline ownership] chunk c runs on pp rank c % p."""
    return chunk % p


def schedule_shape(schedule: dict[int, list[Action]]) -> tuple[int, int, int]:
    """(p, v, m) of a schedule, read from its ranks, chunks and microbatches."""
    p = len(schedule)
    if sorted(schedule) != list(range(p)) or p == 0:
        raise ValueError(f"a schedule needs ranks 0..p-1 as keys, got {sorted(schedule)}")
    compute = [a for actions in schedule.values() for a in actions if not a.is_p2p]
    chunks = 1 + max((a.chunk for a in compute), default=0)
    if chunks % p:
        raise ValueError(f"schedule uses {chunks} chunks on p={p} ranks; the chunk count must be a multiple of p")
    return p, chunks // p, 1 + max((a.microbatch for a in compute), default=0)


# ---------------------------------------------------------------- builders

def build_schedule(kind: str, p: int, m: int, v: int = 1) -> dict[int, list[Action]]:
    """The compute actions of every pp rank for `kind` in "gpipe", "1f1b", "interleaved-1f1b".

    Pure function of (p, m, v). "interleaved-1f1b" with v=1 is plain 1F1B (Megatron too runs the
    non-interleaved schedule when there is one chunk per rank). Raises ValueError on sizes the schedule can't run
    (the one rule, cost.bubble.check_schedule).
    """
    check_schedule(kind, p, m, v)
    builder = _BUILDERS["1f1b" if kind == "interleaved-1f1b" and v == 1 else kind]
    return {rank: builder(rank, p, m, v) for rank in range(p)}


def gpipe_actions(rank: int, p: int, m: int, v: int) -> list[Action]:
    """All forwards (local chunk 0 first, microbatch order), then all backwards (last local chunk first)."""
    chunks = [j * p + rank for j in range(v)]
    forwards = [Action(c, F, i) for c in chunks for i in range(m)]
    backwards = [Action(c, B, i) for c in reversed(chunks) for i in range(m)]
    return forwards + backwards


def one_f_one_b_actions(rank: int, p: int, m: int, v: int) -> list[Action]:
    """Megatron forward_backward_pipelining_without_interleaving: min(p-rank-1, m) warmup forwards, then pairs
    (forward i+warmup, backward i) in steady state, then the remaining backwards."""
    warmup = min(p - rank - 1, m)
    steady = m - warmup
    actions = [Action(rank, F, i) for i in range(warmup)]
    for i in range(steady):
        actions += [Action(rank, F, warmup + i), Action(rank, B, i)]
    return actions + [Action(rank, B, i) for i in range(steady, m)]


def interleaved_chunk(k: int, rank: int, p: int, v: int, forward: bool) -> int:
    """Global chunk of the k-th forward (or backward) of `rank`: Megatron's get_model_chunk_id, local id
    (k // p) % v, reversed for backward, mapped to the global chunk j*p + rank."""
    local = (k % (p * v)) // p
    return (local if forward else v - 1 - local) * p + rank


def interleaved_microbatch(k: int, p: int, v: int) -> int:
    """Microbatch of the k-th forward (or backward): Megatron's get_microbatch_id_in_model_chunk."""
    return (k // (p * v)) * p + k % p


def interleaved_actions(rank: int, p: int, m: int, v: int) -> list[Action]:
    """Megatron forward_backward_pipelining_with_interleaving: (p-rank-1)*2 + (v-1)*p warmup forwards (capped at
    m*v; all m*v when m == p, as Megatron does), then (forward k+warmup, backward k) pairs, then the backwards."""
    total = m * v
    warmup = total if m == p else min((p - rank - 1) * 2 + (v - 1) * p, total)

    def fwd(k):
        return Action(interleaved_chunk(k, rank, p, v, True), F, interleaved_microbatch(k, p, v))

    def bwd(k):
        return Action(interleaved_chunk(k, rank, p, v, False), B, interleaved_microbatch(k, p, v))

    actions = [fwd(k) for k in range(warmup)]
    for k in range(total - warmup):
        actions += [fwd(k + warmup), bwd(k)]
    return actions + [bwd(k) for k in range(total - warmup, total)]


_BUILDERS = {"gpipe": gpipe_actions, "1f1b": one_f_one_b_actions, "interleaved-1f1b": interleaved_actions}


# ---------------------------------------------------------------- checks and memory

def validate_actions(schedule: dict[int, list[Action]], p: int, m: int, v: int = 1) -> None:
    """Raise ValueError unless every (chunk, microbatch) has exactly one F and one B, on rank chunk % p, F first.

    p2p actions are ignored, so the check holds for lowered schedules too.
    """
    if sorted(schedule) != list(range(p)):
        raise ValueError(f"schedule ranks {sorted(schedule)} != 0..{p - 1} for p={p}")
    seen: dict[tuple[int, str, int], int] = {}
    for rank, actions in schedule.items():
        for pos, a in enumerate(x for x in actions if not x.is_p2p):
            where = f"rank {rank} step {pos} ({a})"
            if not (a.chunk < p * v and a.microbatch < m):
                raise ValueError(f"{where}: chunk or microbatch out of range for p={p}, v={v}, m={m}")
            if rank_of_chunk(a.chunk, p) != rank:
                raise ValueError(f"{where}: chunk {a.chunk} belongs to rank {a.chunk % p}, not rank {rank}")
            if (a.chunk, a.kind, a.microbatch) in seen:
                raise ValueError(f"{where}: duplicate {a.kind} of chunk {a.chunk} microbatch {a.microbatch}")
            if a.kind == B and (a.chunk, F, a.microbatch) not in seen:
                raise ValueError(f"{where}: backward before the forward of the same chunk and microbatch")
            seen[(a.chunk, a.kind, a.microbatch)] = pos
    missing = [f"{c}{k}{i}" for c in range(p * v) for k in COMPUTE_KINDS for i in range(m) if (c, k, i) not in seen]
    if missing:
        raise ValueError(f"schedule misses {len(missing)} compute actions, e.g. {missing[:4]}")


def peak_in_flight(schedule: dict[int, list[Action]], v: int) -> dict[int, Fraction]:
    """Per rank, the most microbatches whose forward is done and backward is not, in stage units.

    One (chunk, microbatch) holds 1/v of a stage's activations, so 1F1B rank r peaks at min(p - r, m) and GPipe at
    m whatever v is.
    """
    peaks = {}
    for rank, actions in schedule.items():
        live = peak = 0
        for a in actions:
            live += {F: 1, B: -1}.get(a.kind, 0)
            peak = max(peak, live)
        peaks[rank] = Fraction(peak, v)
    return peaks
