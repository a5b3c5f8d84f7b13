"""Lowering a compute schedule into the program the pipeline runtime runs: sends, receives and message tags.

Pattern: walk each rank's actions once. After a compute action whose output goes to another rank, insert its SEND.
For a compute action whose input comes from another rank, insert its RECV as early as the rank allows: right after
the rank's previous SEND (or at the start), as torch.distributed.pipelining does, so that a peer's send never waits
for this rank's compute before a matching receive exists. Chunk c's forward input comes from chunk c-1 and its
output goes to chunk c+1; the backward runs the other way. Neighbours on the same rank exchange nothing (the runtime
hands the tensors over in memory). The compute order is left untouched.

[Note: p2p semantics] What the runtime does with each action, and what `passes.proofs.prove` checks:
  * SEND_*  posts a non-blocking isend; every send of a step is waited for at the end of the step (the flush);
  * RECV_*  posts a non-blocking irecv into fresh buffers;
  * F / B   first waits for the receives of its own inputs, then computes.
  Messages are matched by (source rank, destination rank, tag), never by order. The tag encodes the message:
  `Program.tag(action)` = ((microbatch * chunks + consuming chunk) * 2 + direction), unique for every message of a
  step, which `passes.proofs.prove` checks. So the order of the RECVs among themselves does not matter; a program
  deadlocks exactly when some compute action waits for a message whose SEND sits, on its peer, behind a compute
  action that waits (transitively) for this one.
"""
from __future__ import annotations

from dataclasses import dataclass

from fxpar.passes.pipeline.schedules import B, F, RECV_B, RECV_F, SEND_B, SEND_F, Action, rank_of_chunk

# compute kind -> (recv kind, chunk step to the producer; send kind, chunk step to the consumer)
_P2P_OF = {F: (RECV_F, -1, SEND_F, +1), B: (RECV_B, +1, SEND_B, -1)}
TAG_LIMIT = 2**31  # gloo and nccl take an int tag


@dataclass(frozen=True)
class Program:
    """A lowered schedule: every pipeline rank's actions, in order, over p ranks, v chunks each, m microbatches."""

    p: int
    v: int
    m: int
    actions: dict  # pp rank -> tuple[Action, ...]

    def __post_init__(self):
        if sorted(self.actions) != list(range(self.p)):
            raise ValueError(f"a program needs the actions of ranks 0..{self.p - 1}, got ranks {sorted(self.actions)}")

    @property
    def chunks(self) -> int:
        return self.p * self.v

    def tag(self, action: Action) -> int:
        """The message tag of a SEND or RECV; a SEND and the RECV that must match it get the same tag."""
        direction, _, consumer, microbatch = action.message()
        return (microbatch * self.chunks + consumer) * 2 + (direction == B)


def lower(schedule: dict[int, list[Action]], p: int, v: int) -> dict[int, list[Action]]:
    """Return a new schedule with a SEND_* after each compute action whose output crosses ranks and a RECV_* posted
    early (see the module docstring) for each compute action whose input crosses ranks.

    Args:
        schedule: compute-only schedule from `build_schedule` (p2p actions in it raise ValueError).
        p, v: pipeline size and chunks per rank; the chunks are 0..p*v-1.
    Returns:
        dict[rank, list[Action]] with the same compute order and the p2p actions interleaved.
    """
    last_chunk = p * v - 1
    lowered = {}
    for rank, actions in schedule.items():
        out, post_at = [], 0  # where the next RECV goes: right after the last SEND so far
        for a in actions:
            if a.is_p2p:
                raise ValueError(f"rank {rank}: schedule is already lowered (found {a}); lower a compute schedule")
            recv_kind, recv_step, send_kind, send_step = _P2P_OF[a.kind]
            producer, consumer = a.chunk + recv_step, a.chunk + send_step
            if 0 <= producer <= last_chunk and rank_of_chunk(producer, p) != rank:
                out.insert(post_at, Action(a.chunk, recv_kind, a.microbatch, rank_of_chunk(producer, p)))
                post_at += 1
            out.append(a)
            if 0 <= consumer <= last_chunk and rank_of_chunk(consumer, p) != rank:
                out.append(Action(a.chunk, send_kind, a.microbatch, rank_of_chunk(consumer, p)))
                post_at = len(out)
        lowered[rank] = out
    return lowered


def lower_program(schedule: dict[int, list[Action]], p: int, v: int, m: int) -> Program:
    """The Program of a compute schedule: `lower`, frozen per rank."""
    return Program(p, v, m, {rank: tuple(actions) for rank, actions in lower(schedule, p, v).items()})


def p2p_streams(lowered: dict[int, list[Action]]) -> dict[tuple[int, int], tuple[list, list]]:
    """For each ordered pair (src, dst): (messages src sends to dst, messages dst receives from src), in order."""
    streams: dict[tuple[int, int], tuple[list, list]] = {}
    for rank, actions in lowered.items():
        for a in actions:
            if not a.is_p2p:
                continue
            pair = (rank, a.peer) if a.is_send else (a.peer, rank)
            sends, recvs = streams.setdefault(pair, ([], []))
            (sends if a.is_send else recvs).append(a.message())
    return streams
