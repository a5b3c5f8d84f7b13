"""CLI targets: `path/file.py:factory` or `package.module:factory`, where factory() returns (model, example_args)
or (model, example_args, example_kwargs)."""
from __future__ import annotations

import importlib
import importlib.util
import os
import sys


def load_factory(spec: str):
    if ":" not in spec:
        raise ValueError(f"TARGET {spec!r} must be 'path/file.py:factory' or 'module:factory'")
    where, name = spec.rsplit(":", 1)
    if where.endswith(".py") or os.sep in where:
        path = os.path.abspath(where)
        if not os.path.exists(path):
            raise ValueError(f"target file {where!r} does not exist")
        sys.path.insert(0, os.path.dirname(path))  # so the file's sibling imports work
        mod_name = "fxpar_target_" + os.path.splitext(os.path.basename(path))[0]
        module_spec = importlib.util.spec_from_file_location(mod_name, path)
        module = importlib.util.module_from_spec(module_spec)
        sys.modules[mod_name] = module
        module_spec.loader.exec_module(module)
    else:
        module = importlib.import_module(where)
    factory = getattr(module, name, None)
    if not callable(factory):
        raise ValueError(f"TARGET {spec!r}: {where} has no callable {name!r}")
    return factory


def unpack_target(out, spec: str):
    """(model, example_args, example_kwargs) from what a factory returned: a 2- or 3-tuple."""
    if not isinstance(out, tuple) or len(out) not in (2, 3):
        raise ValueError(f"target {spec!r}: factory must return (model, example_args[, example_kwargs]), "
                         f"got {type(out).__name__}")
    model, args = out[0], out[1]
    args = tuple(args) if isinstance(args, (tuple, list)) else (args,)
    kwargs = out[2] if len(out) == 3 else {}
    return model, args, dict(kwargs or {})


def load_target(spec: str):
    """(model, example_args, example_kwargs) from a target spec."""
    return unpack_target(load_factory(spec)(), spec)
