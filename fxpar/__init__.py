"""fxpar: Megatron-style parallelism for unmodified PyTorch Transformers, as torch.fx passes.

    mesh = fxpar.init_mesh(tp=2)
    pm = fxpar.parallelize(model, mesh, example_args=(ids,))
    fxpar.verify(model, pm, (ids,))

The package has three layers, each a top-level folder of the repository: fxpar/ (this package: the public API,
the compiler driver and its trace, with runtime/, checkpoint/ and cli/ beneath), passes/ (imported as
fxpar.passes: the IR, frontend, sharding analysis, tensor-parallel rewrite, fusion and pipeline passes) and cost/
(imported as fxpar.cost: the pure-math cost model and planner). Imports only point down: fxpar -> passes -> cost.
The public names below load lazily (PEP 562), so `import fxpar.cost` loads no torch.

    api.py        parallelize(model, mesh, example_args): input checks, the executable it returns
    mixed_precision.py  fxpar.MixedPrecision and the casts the trace applies
    config.py     fxpar.Config, validated on construction
    mesh.py       the device mesh (pp, dp, tp), tp fastest
    trace.py      the frontend: torch.export (non-strict) into an ATen fx graph, inputs traced distinct
    guard.py      global state a failing call must not leak; autograd semantics a trace would drop
    stages.py     the driver: runs a declared list of stages on a record, logged, dumped, errors named
    compiler.py   the compiler: every stage, one pass each, in one ordered list (STAGES)
    programs.py   a chunk's joint program per input signature: the second list (PROGRAM_STAGES)
    describe.py   pm.plan: the compiler's decisions, the weights a rank holds, the collectives of its programs
    verify.py     fxpar.verify: the original and the parallel graph side by side, node by node
    targets.py    loading TARGET (`file.py:factory` or `package.module:factory`) for the CLI and `fxpar check`
    check.py      the exactness proof behind `fxpar check`: K optimizer steps against the unmodified model
    runtime/      the executables, programs, weights, optimizers, mixed precision, clipping, replicas
    checkpoint/   DCP checkpoints with resharding, safetensors
    cli/          the `fxpar` command and one module per subcommand
"""
from __future__ import annotations

import importlib
import os

_HERE = os.path.dirname(os.path.abspath(__file__))
_ROOT = os.path.dirname(_HERE)
if not os.path.isdir(os.path.join(_HERE, "passes")) and os.path.isfile(os.path.join(_ROOT, "passes", "__init__.py")):
    # A source checkout without installing: fxpar.passes and fxpar.cost are the sibling folders passes/ and cost/
    # (an install maps them the same way, through pyproject.toml's package-dir).
    __path__.append(_ROOT)  # noqa: F821 - the package's own __path__

_PUBLIC = {"parallelize": "fxpar.api", "Config": "fxpar.config", "init_mesh": "fxpar.mesh",
           "verify": "fxpar.verify", "VerifyError": "fxpar.verify", "MixedPrecision": "fxpar.mixed_precision",
           "save": "fxpar.checkpoint.dcp", "load": "fxpar.checkpoint.dcp",
           "register_rule": "fxpar.passes.sharding.rule_table"}
__all__ = sorted(_PUBLIC)


def __getattr__(name: str):
    if name in _PUBLIC:
        value = getattr(importlib.import_module(_PUBLIC[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'fxpar' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_PUBLIC))
