"""The proofs the compiler runs on every pipeline program before the runtime may run it.

`prove(program, chunks)` checks the lowered action lists the runtime executes, under the semantics it implements
([Note: p2p semantics] in passes/pipeline/lower.py), and raises ProofError, with every rank's actions printed and the
failing step marked [!...], unless all of these hold:

    compute     every (chunk, microbatch) has one F and one B, on rank chunk % p, F first
    tags        every message of a step has its own tag, within the backend's range, so matching by tag is
                matching by message
    matching    every SEND has exactly one RECV on its peer and every RECV one SEND (else a flush or a compute
                action waits forever)
    boundaries  what chunk c sends is what chunk c+1 receives (names, local shapes, dtypes, placements), and no
                partial sum crosses a boundary ([Note: boundaries carry placements])
    deadlock    replayed on a clock with the runtime's semantics (sends and receive posts never block, compute
                waits for its messages), every rank reaches its last action and every receive is used

Because the runtime interprets exactly `program.actions[rank]` and tags with `program.tag`, what is proven is what
runs.
"""
from __future__ import annotations

from dataclasses import dataclass

from fxpar.passes.pipeline.lower import TAG_LIMIT, Program, p2p_streams
from fxpar.passes.ir.placements import Partial
from fxpar.passes.pipeline.schedules import Action, validate_actions
from fxpar.passes.pipeline.simulate import DeadlockError, SimResult, check_deadlock_free, simulate


class ProofError(ValueError):
    """A pipeline program failed a proof; the message shows every rank's actions with the failing step marked."""


@dataclass(frozen=True)
class Violation:
    what: str
    marks: tuple[tuple[int, Action], ...] = ()  # (rank, action) to mark


def format_program(program: Program, marks=()) -> str:
    """Every rank's actions as one line, the marked ones as [!action]."""
    marked = set(marks)
    lines = []
    for rank in sorted(program.actions):
        cells = [f"[!{a}]" if (rank, a) in marked else str(a) for a in program.actions[rank]]
        lines.append(f"rank {rank} | " + " ".join(cells))
    return "\n".join(lines)


def _compute(program: Program) -> list[Violation]:
    compute = {r: [a for a in acts if not a.is_p2p] for r, acts in program.actions.items()}
    try:
        validate_actions(compute, program.p, program.m, program.v)
    except ValueError as e:
        return [Violation(f"compute: {e}")]
    return []


def _tags(program: Program) -> list[Violation]:
    out, seen = [], {}
    for rank, actions in program.actions.items():
        for a in actions:
            if not a.is_p2p:
                continue
            tag = program.tag(a)
            if not 0 <= tag < TAG_LIMIT:
                out.append(Violation(f"tags: {a} on rank {rank} has tag {tag}, outside [0, {TAG_LIMIT})",
                                     ((rank, a),)))
            key = (rank, a.peer, a.is_send, tag)
            if key in seen and seen[key] != a.message():
                out.append(Violation(f"tags: {a} and {seen[key]} on rank {rank} share tag {tag}", ((rank, a),)))
            seen.setdefault(key, a.message())
    return out


def _matching(program: Program) -> list[Violation]:
    out = []
    for (src, dst), (sends, recvs) in sorted(p2p_streams(program.actions).items()):
        for rank, messages, side in ((src, sends, "sends"), (dst, recvs, "receives")):
            for i, msg in enumerate(messages):
                if msg in messages[:i]:
                    out.append(Violation(f"matching: rank {rank} {side} {_describe(msg)} twice",
                                         _marks(program, rank, msg)))
        for msg in sends:
            if msg not in recvs:
                out.append(Violation(f"matching: rank {src} sends {_describe(msg)} to rank {dst}, which never "
                                     f"receives it (rank {src}'s flush would wait forever)",
                                     _marks(program, src, msg)))
        for msg in recvs:
            if msg not in sends:
                out.append(Violation(f"matching: rank {dst} receives {_describe(msg)} from rank {src}, which never "
                                     "sends it", _marks(program, dst, msg)))
    return out


def _marks(program: Program, rank: int, message) -> tuple:
    return tuple((rank, a) for a in program.actions[rank] if a.is_p2p and a.message() == message)


def _describe(message: tuple) -> str:
    direction, producer, consumer, microbatch = message
    what = "activation" if direction == "F" else "gradient"
    return f"the {what} of chunk {producer} -> {consumer} for microbatch {microbatch}"


def _boundaries(chunks) -> list[Violation]:
    out = []
    for prev, nxt in zip(chunks, chunks[1:]):
        if tuple(prev.boundary_out) != tuple(nxt.boundary_in):
            out.append(Violation(f"boundaries: chunk {prev.index} sends {list(map(str, prev.boundary_out))} but "
                                 f"chunk {nxt.index} receives {list(map(str, nxt.boundary_in))}"))
        for b in prev.boundary_out:
            if isinstance(b.placement, Partial):
                out.append(Violation(f"boundaries: {b} crosses from chunk {prev.index} to {nxt.index} as a partial "
                                     "sum; it must be reduced (g) inside its chunk"))
    return out


def prove(program: Program, chunks=None) -> SimResult:
    """Run every check of the module docstring on `program` (and the chunks it moves between); returns the replay.

    Args:
        program: the lowered program, as the runtime will run it.
        chunks: the partition's chunks in order (for the boundary check), or None.
    Raises:
        ProofError: the first failed check, with the program printed and the failing step marked.
    """
    violations = _compute(program) or _tags(program) or _matching(program) or _boundaries(chunks or ())
    if violations:
        first = violations[0]
        more = f" (and {len(violations) - 1} more)" if len(violations) > 1 else ""
        raise ProofError(f"fxpar pipeline proof failed: {first.what}{more}\n{format_program(program, first.marks)}")
    try:
        actions = dict(program.actions)
        return check_deadlock_free(actions) if program.p > 1 else simulate(actions)
    except (DeadlockError, ValueError) as e:
        raise ProofError(f"fxpar pipeline proof failed: {e}") from None
