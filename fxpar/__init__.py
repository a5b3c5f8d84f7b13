"""fxpar: Megatron-style parallelism for unmodified PyTorch Transformers, as torch.fx passes.

    mesh = fxpar.init_mesh(tp=2)
    pm = fxpar.parallelize(model, mesh, example_args=(ids,))
    fxpar.verify(model, pm, (ids,))

The package has three layers, each a top-level folder of the repository: fxpar/ (this package: API, compiler
driver, executables, runtime, CLI), passes/ (imported as fxpar.passes: placements, rules, the rewrite passes,
schedules, proofs) and cost/ (imported as fxpar.cost: the pure-math cost model and planner). Imports only point
down: fxpar -> passes -> cost. The public names below load lazily (PEP 562), so `import fxpar.cost` loads no torch.
"""
from __future__ import annotations

import importlib
import os

_HERE = os.path.dirname(os.path.abspath(__file__))
_ROOT = os.path.dirname(_HERE)
if not os.path.isdir(os.path.join(_HERE, "passes")) and os.path.isfile(os.path.join(_ROOT, "passes", "meta.py")):
    # A source checkout without installing: fxpar.passes and fxpar.cost are the sibling folders passes/ and cost/
    # (an install maps them the same way, through pyproject.toml's package-dir).
    __path__.append(_ROOT)  # noqa: F821 - the package's own __path__

_PUBLIC = {"parallelize": "fxpar.api", "Config": "fxpar.config", "init_mesh": "fxpar.mesh",
           "verify": "fxpar.verify", "VerifyError": "fxpar.verify", "MixedPrecision": "fxpar.precision",
           "save": "fxpar.checkpoint", "load": "fxpar.checkpoint"}
__all__ = sorted(_PUBLIC)


def __getattr__(name: str):
    if name in _PUBLIC:
        value = getattr(importlib.import_module(_PUBLIC[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'fxpar' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_PUBLIC))
