"""Lowering a compute schedule: add the point-to-point sends and receives between pipeline ranks.

Pattern: walk each rank's actions once; before a compute action whose input comes from another rank, insert the
RECV; after a compute action whose output goes to another rank, insert the SEND. Chunk c's forward input comes from
chunk c-1 and its output goes to chunk c+1; the backward runs the other way. Neighbours on the same rank (p=1)
exchange nothing. The compute order is left untouched.

[Note: p2p semantics] The runtime posts a SEND as a non-blocking isend and waits for a RECV at its place in the
list (irecv + wait, or the same ops batched). Under "sends never block, receives block until matched":
  * no deadlock: every RECV waits only for a SEND that sits right after a compute action on the peer, so a lowered
    schedule deadlocks exactly when its compute dependencies do (`simulate.check_deadlock_free` replays it);
  * no mismatched message: gloo matches messages between two ranks in posting order, so for every ordered pair
    (a, b) the SENDs on a to b and the RECVs on b from a must move the same messages in the same order.
    `check_p2p_matching` proves it for a given lowered schedule, and names the pair and the first difference.
"""
from __future__ import annotations

from .schedules import B, F, RECV_B, RECV_F, SEND_B, SEND_F, Action, rank_of_chunk

# compute kind -> (recv kind, chunk step to the producer; send kind, chunk step to the consumer)
_P2P_OF = {F: (RECV_F, -1, SEND_F, +1), B: (RECV_B, +1, SEND_B, -1)}


def lower(schedule: dict[int, list[Action]], p: int, v: int) -> dict[int, list[Action]]:
    """Return a new schedule with RECV_* before and SEND_* after each compute action that crosses ranks.

    Args:
        schedule: compute-only schedule from `build_schedule` (p2p actions in it raise ValueError).
        p, v: pipeline size and chunks per rank; the chunks are 0..p*v-1.
    Returns:
        dict[rank, list[Action]] with the same compute order and the p2p actions interleaved.
    """
    last_chunk = p * v - 1
    lowered = {}
    for rank, actions in schedule.items():
        out = []
        for a in actions:
            if a.is_p2p:
                raise ValueError(f"rank {rank}: schedule is already lowered (found {a}); lower a compute schedule")
            recv_kind, recv_step, send_kind, send_step = _P2P_OF[a.kind]
            producer, consumer = a.chunk + recv_step, a.chunk + send_step
            if 0 <= producer <= last_chunk and rank_of_chunk(producer, p) != rank:
                out.append(Action(a.chunk, recv_kind, a.microbatch, rank_of_chunk(producer, p)))
            out.append(a)
            if 0 <= consumer <= last_chunk and rank_of_chunk(consumer, p) != rank:
                out.append(Action(a.chunk, send_kind, a.microbatch, rank_of_chunk(consumer, p)))
        lowered[rank] = out
    return lowered


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


def check_p2p_matching(lowered: dict[int, list[Action]]) -> None:
    """Raise ValueError unless, for every pair (a, b), a's sends to b and b's receives from a agree in order.

    See [Note: p2p semantics]: gloo pairs the n-th send with the n-th receive between two ranks, so any difference
    in order would hand a tensor to the wrong microbatch or chunk.
    """
    for (src, dst), (sends, recvs) in sorted(p2p_streams(lowered).items()):
        for n, (sent, received) in enumerate(zip(sends, recvs)):
            if sent != received:
                raise ValueError(f"p2p order mismatch from rank {src} to rank {dst} at message {n}: rank {src} sends "
                                 f"{_describe(sent)} but rank {dst} expects {_describe(received)}; reorder the "
                                 f"receives on rank {dst} to follow rank {src}'s sends")
        if len(sends) != len(recvs):
            raise ValueError(f"rank {src} sends {len(sends)} messages to rank {dst}, which receives {len(recvs)}")


def _describe(message: tuple[str, int, int, int]) -> str:
    direction, producer, consumer, microbatch = message
    what = "activation" if direction == F else "gradient"
    return f"the {what} of chunk {producer} -> {consumer} for microbatch {microbatch}"

