"""Device-agnostic runtime: every tensor the executables allocate lives on the parameters' (or the mesh's) device.
Checked on the source: a torch factory call in fxpar/ (torch.empty, zeros, ones, full, tensor, arange, ...) names
its device, or derives it from another tensor (empty_like, new_zeros, ...), which this test does not flag."""
from __future__ import annotations

import ast
import pathlib

FACTORIES = {"empty", "zeros", "ones", "full", "tensor", "arange", "rand", "randn", "randint", "linspace"}
ROOT = pathlib.Path(__file__).resolve().parents[1] / "fxpar"


def _undeviced(path: pathlib.Path) -> list[str]:
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in FACTORIES \
                and isinstance(node.func.value, ast.Name) and node.func.value.id == "torch" \
                and not any(k.arg == "device" for k in node.keywords):
            out.append(f"{path.relative_to(ROOT.parent)}:{node.lineno}: torch.{node.func.attr}(...) without device=")
    return out


def test_no_runtime_allocation_omits_the_device():
    found = [line for path in sorted(ROOT.rglob("*.py")) if path.name not in ("calibrate.py", "measure.py")
             for line in _undeviced(path)]
    assert not found, "\n".join(found)
