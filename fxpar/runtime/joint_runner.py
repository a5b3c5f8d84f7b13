"""A chunk's joint program at run time: one compiled program per input signature, asked of the compiler.

The compiler decided what the program is (fxpar/programs.py JointRequest); the joint graph is specialized to its
inputs' signature ([Note: one program per input signature] in passes/joint/export.py), so a JointRunner asks
`compile_program` for the program of each signature the first time a call brings it, and runs it.
"""
from __future__ import annotations

from torch.fx import GraphModule

from fxpar.config import Config
from fxpar.programs import JointRequest, ProgramRecord, compile_program, expected_call, noise_of, signature


class JointRunner:
    """Runs a chunk as its joint program; called like the chunk graph itself."""

    def __init__(self, chunk_gm: GraphModule, request: JointRequest, config: Config, rank: int):
        self.chunk_gm, self.request, self.config, self.rank = chunk_gm, request, config, rank
        self.by_signature: dict[tuple, ProgramRecord] = {}
        self.last: tuple | None = None
        self.streams, self.noise = noise_of(chunk_gm)

    def __call__(self, *inputs):
        """inputs: the chunk graph's (and a dp variant's after them); each dropout's noise is drawn and appended."""
        inputs = (*inputs, *(draw.draw(self.streams) for draw in self.noise))
        key = signature(inputs)
        self.last = key
        return self._program(key, inputs).run(*inputs)

    @property
    def record(self) -> ProgramRecord:
        """The program of the last call's signature; before any call, that of a training call."""
        if self.last is None:
            mode, inputs = expected_call(self.chunk_gm, self.request)
            self.last = signature(inputs)
            self._program(self.last, inputs, mode)
        return self.by_signature[self.last]

    def _program(self, key: tuple, inputs, mode=None) -> ProgramRecord:
        record = self.by_signature.get(key)
        if record is None:
            record = self.by_signature[key] = compile_program(self.chunk_gm, self.request, inputs, self.config,
                                                              self.rank, len(self.by_signature), mode)
        return record
