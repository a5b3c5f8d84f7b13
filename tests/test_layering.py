"""The architecture, read from the sources: imports only point down (fxpar -> passes -> cost), cost/ is pure math,
and stages talk through typed metadata, never through names."""
from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
STDLIB = set(sys.stdlib_module_names)


def _imports(path: Path, tree=None):
    """(module imported, line) of every import in a file (or in `tree`, a part of it); relative imports resolved
    against its package, `from . import x` as the submodule x."""
    package = {"fxpar": "fxpar", "passes": "fxpar.passes", "cost": "fxpar.cost"}[path.parent.name]
    for node in ast.walk(tree or ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, node.lineno
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                name = ".".join(base + ([node.module] if node.module else []))
            else:
                name = node.module
            if node.level and not node.module:
                for alias in node.names:
                    yield f"{name}.{alias.name}", node.lineno
            else:
                yield name, node.lineno


def _sources(folder: str):
    return sorted((ROOT / folder).glob("*.py"))


@pytest.mark.parametrize("path", _sources("cost"), ids=lambda p: p.name)
def test_cost_imports_only_the_standard_library_and_itself(path):
    for name, line in _imports(path):
        top = name.split(".")[0]
        assert top in STDLIB or name.startswith("fxpar.cost"), f"cost/{path.name}:{line} imports {name}"


@pytest.mark.parametrize("path", _sources("passes"), ids=lambda p: p.name)
def test_passes_never_import_upward(path):
    for name, line in _imports(path):
        if name.startswith("fxpar"):
            assert name.startswith(("fxpar.passes", "fxpar.cost")), f"passes/{path.name}:{line} imports {name}"


@pytest.mark.parametrize("module", ["fxpar.cost", "fxpar.cli_schedule"])
def test_import_loads_no_torch(module):
    """The cost model is pure math; `fxpar schedule` builds, lowers and proves schedules without torch."""
    code = f"import sys, {module}; assert 'torch' not in sys.modules, 'torch was imported'"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


def test_the_packages_resolve_from_a_plain_source_checkout(tmp_path):
    """Without the editable install's mapping (its finder removed): only the repository root on sys.path."""
    code = ("import sys; sys.meta_path[:] = [f for f in sys.meta_path if 'editable' not in repr(f)]; "
            "sys.path.insert(0, sys.argv[1]); import fxpar.passes.meta, fxpar.cost.pipeline; "
            "print(fxpar.passes.meta.__file__, fxpar.cost.pipeline.__file__)")
    out = subprocess.run([sys.executable, "-c", code, str(ROOT)], check=True, capture_output=True,
                         text=True, cwd=tmp_path).stdout
    assert str(ROOT / "passes" / "meta.py") in out and str(ROOT / "cost" / "pipeline.py") in out


def _code_files():
    return [p for folder in ("fxpar", "passes") for p in _sources(folder)]


@pytest.mark.parametrize("needle", ['"tp_f_', '"tp_g_', "'tp_", 'startswith(("tp_', "fxpar_user_input",
                                    "for name, kind, key in", '"embedding" in'])
def test_no_stage_recognises_anything_by_name(needle):
    """Collectives are tagged (meta[FXPAR_COMM]); graph inputs are GraphInput records resolved in one place."""
    hits = [f"{p.relative_to(ROOT)}:{i}" for p in _code_files()
            for i, line in enumerate(p.read_text().splitlines(), 1) if needle in line]
    assert not hits, f"{needle!r} found in {hits}"


def test_no_file_over_600_lines():
    long = {str(p.relative_to(ROOT)): n for folder in ("fxpar", "passes", "cost", "tests", "benchmarks", "examples")
            for p in _sources(folder) if (n := len(p.read_text().splitlines())) > 600}
    assert not long, long


def _module_level_imports(path: Path):
    """The modules a file imports when it is imported (its top-level statements; not imports inside functions)."""
    tree = ast.parse(path.read_text())
    top = ast.Module(body=[n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom, ast.If, ast.Try))],
                     type_ignores=[])
    return [name for name, _ in _imports(path, top)]


def test_no_import_cycles():
    """Module-level imports among fxpar's own modules form no cycle (rules <-> rules_loss and ops <-> vocab_ops
    once did, each closed by an import at the bottom of a module)."""
    import networkx as nx

    package = {"fxpar": "fxpar", "passes": "fxpar.passes", "cost": "fxpar.cost"}
    graph = nx.DiGraph()
    for folder, name in package.items():
        for path in _sources(folder):
            if path.stem == "__init__":
                continue
            me = f"{name}.{path.stem}"
            graph.add_node(me)
            for imported in _module_level_imports(path):
                if imported.startswith("fxpar.") and imported != me:
                    graph.add_edge(me, imported)
    cycles = list(nx.simple_cycles(graph))
    assert not cycles, cycles


def test_the_passes_index_names_every_module():
    index = (ROOT / "passes" / "__init__.py").read_text()
    missing = [p.name for p in _sources("passes") if p.stem != "__init__" and p.name not in index]
    assert not missing, f"passes/__init__.py's docstring does not list {missing}"


def test_no_module_reads_the_executables_private_attributes():
    """A rank's weights live in pm.weights (fxpar/weights.py RankWeights); the program cache, config, loss scaler
    and distributed optimizer are properties. Only the executable's own classes touch its private attributes."""
    own = {"executable.py", "pipeline.py"}
    found = []
    for path in _sources("fxpar"):
        if path.name in own:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
                holder = node.value
                name = holder.id if isinstance(holder, ast.Name) else getattr(holder, "attr", "")
                if name == "pm":
                    found.append(f"fxpar/{path.name}:{node.lineno} .{node.attr}")
            if isinstance(node, ast.Subscript) and isinstance(node.value, ast.Attribute) \
                    and node.value.attr == "__dict__" and getattr(node.value.value, "id", "") == "pm":
                found.append(f"fxpar/{path.name}:{node.lineno} pm.__dict__[...]")
    assert not found, found
