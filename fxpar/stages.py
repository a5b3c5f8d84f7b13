"""The driver that runs a declared list of stages on a record: the compiler's STAGES (fxpar/compiler.py) and a chunk's
PROGRAM_STAGES (fxpar/programs.py) alike.

A stage is (name, product, function): the function reads the record and returns one product, which the driver
stores on the record under `product` (None: a check that returns nothing). The driver logs each stage; writes each
graph product the record names in `dumped_products` to Config.dump_dir after the stage that made it (`NN_name.py`,
and `NN_name.diff` against that product's previous dump); and re-raises any error with the stage's name and the
stages that ran before it: bad input (ValueError, TraceError) keeps its type, anything else becomes a PassError.
An error a nested run already named (a program stage inside torch's compile callback) passes through as it is.

A record provides: `config` (Config), `done` (the names of the stages run), `dumped` (product -> the code last
written), `dumped_products`, `what` (how an error names its stages: "compiler", "program ... of chunk 0") and
`dump_folder` (where its dumps go).
"""
from __future__ import annotations

import difflib
import logging
import os
import time
from typing import Callable

from torch.fx import GraphModule

from fxpar.trace import TraceError

log = logging.getLogger("fxpar")
NAMED = "fxpar_stage"  # attribute of an error the driver raised: the stage it names


class PassError(RuntimeError):
    """A stage failed on input it should have handled (a bug in fxpar); the message names the stage."""


Stage = tuple[str, "str | None", Callable]


def run_stages(c, stages: tuple[Stage, ...]):
    """Run `stages` in order on the record `c`; see the module docstring for the error contract."""
    for name, product, fn in stages:
        start = time.perf_counter()
        try:
            out = fn(c)
            if product in c.dumped_products and not isinstance(out, GraphModule):
                raise TypeError(f"a graph stage returned {type(out).__name__}, not a GraphModule")
            if product is not None:
                setattr(c, product, out)
            if product in c.dumped_products and c.config.dump_dir:
                _dump(c, name, product)
        except Exception as e:
            if getattr(e, NAMED, None) is not None:
                raise
            after = ", ".join(c.done) or "none"
            if isinstance(e, (ValueError, TraceError)):
                named = _same_kind(e, f"{e}\n(in fxpar {c.what} stage {name!r}, after {after})")
            else:
                named = PassError(f"fxpar {c.what} stage {name!r} failed (after {after}): {type(e).__name__}: {e}")
            setattr(named, NAMED, name)
            raise named from e
        c.done.append(name)
        log.debug("fxpar %s stage %s: %.3f s", c.what, name, time.perf_counter() - start)
    return c


def _dump(c, name: str, product: str) -> None:
    """Config.dump_dir: the product after stage `name` as `NN_name.py`, and `NN_name.diff` against the code this
    product last had (or nothing) in the record's folder."""
    folder = c.dump_folder()
    os.makedirs(folder, exist_ok=True)
    base = os.path.join(folder, f"{len(c.done):02d}_{name}")
    code = getattr(c, product).code
    before = c.dumped.get(product, "")
    with open(base + ".py", "w") as f:
        f.write(code)
    with open(base + ".diff", "w") as f:
        f.writelines(difflib.unified_diff(before.splitlines(True), code.splitlines(True), "before", name))
    c.dumped[product] = code


def _same_kind(e: Exception, message: str) -> Exception:
    """An exception of e's type with a new message (plain ValueError when its type takes other arguments)."""
    try:
        return type(e)(message)
    except TypeError:
        return ValueError(message)
