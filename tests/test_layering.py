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
    package = _module(path) if path.stem == "__init__" else _module(path).rpartition(".")[0]
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


PACKAGES = {"fxpar": "fxpar", "passes": "fxpar.passes", "cost": "fxpar.cost"}


def _module(path: Path) -> str:
    """The dotted name a source file imports as (passes/sharding/rules.py -> fxpar.passes.sharding.rules)."""
    folder, *rest = path.relative_to(ROOT).with_suffix("").parts
    if rest[-1] == "__init__":
        rest = rest[:-1]
    return ".".join([PACKAGES[folder], *rest])


def _sources(folder: str):
    """Every source file of a folder; the three code packages with their subpackages."""
    pattern = "**/*.py" if folder in PACKAGES else "*.py"
    return sorted(p for p in (ROOT / folder).glob(pattern) if "__pycache__" not in p.parts)


@pytest.mark.parametrize("path", _sources("cost"), ids=lambda p: str(p.relative_to(ROOT)))
def test_cost_imports_only_the_standard_library_and_itself(path):
    for name, line in _imports(path):
        top = name.split(".")[0]
        assert top in STDLIB or name.startswith("fxpar.cost"), f"{path.relative_to(ROOT)}:{line} imports {name}"


@pytest.mark.parametrize("path", _sources("passes"), ids=lambda p: str(p.relative_to(ROOT)))
def test_passes_never_import_upward(path):
    for name, line in _imports(path):
        if name.startswith("fxpar"):
            assert name.startswith(("fxpar.passes", "fxpar.cost")), f"{path.relative_to(ROOT)}:{line} imports {name}"


# the layers, lowest first: a module imports only from its own layer and those below it, at module level or inside
# a function alike (what both sides of a line need lives below both)
LAYERS = (
    ("fxpar.cost",),  # pure math
    ("fxpar.passes.ir",),  # node metadata, placements, op families
    ("fxpar.passes",),  # the graph passes
    ("fxpar.mixed_precision", "fxpar.config", "fxpar.mesh", "fxpar.guard", "fxpar.targets"),  # what the user gives
    ("fxpar.trace",),  # the frontend
    ("fxpar.stages",),  # the driver that runs a list of stages on a record
    ("fxpar.programs",),  # PROGRAM_STAGES: a chunk's joint program, per input signature
    ("fxpar.compiler", "fxpar.describe"),  # STAGES; the plan of what it made
    ("fxpar.runtime",),  # the executables: they run what the compiler made
    ("fxpar.verify", "fxpar.checkpoint", "fxpar.api"),  # over a parallel module
    ("fxpar.check",),  # the exactness proof, through parallelize
    ("fxpar.cli",),  # the command line
    ("fxpar",),  # the package's index of public names
)


def _layer(module: str) -> int:
    """The layer of a dotted module name: that of its longest prefix in LAYERS."""
    best = None
    for i, names in enumerate(LAYERS):
        for name in names:
            if (module == name or module.startswith(name + ".")) and (best is None or len(name) > len(best[1])):
                best = (i, name)
    assert best is not None, f"{module} is in no layer of LAYERS"
    return best[0]


@pytest.mark.parametrize("path", [p for folder in PACKAGES for p in _sources(folder)],
                         ids=lambda p: str(p.relative_to(ROOT)))
def test_imports_point_down_the_layers(path):
    me = _layer(_module(path))
    upward = [f"line {line}: {name} (layer {LAYERS[_layer(name)][0]})" for name, line in _imports(path)
              if name.split(".")[0] == "fxpar" and _layer(name) > me]
    assert not upward, f"{path.relative_to(ROOT)} (layer {LAYERS[me][0]}) imports upward: {upward}"


@pytest.mark.parametrize("module", ["fxpar.cost", "fxpar.cli.schedule_command"])
def test_import_loads_no_torch(module):
    """The cost model is pure math; `fxpar schedule` builds, lowers and proves schedules without torch."""
    code = f"import sys, {module}; assert 'torch' not in sys.modules, 'torch was imported'"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


def test_the_packages_resolve_from_a_plain_source_checkout(tmp_path):
    """Without the editable install's mapping (its finder removed): only the repository root on sys.path."""
    code = ("import sys; sys.meta_path[:] = [f for f in sys.meta_path if 'editable' not in repr(f)]; "
            "sys.path.insert(0, sys.argv[1]); import fxpar.passes.ir.meta, fxpar.cost.bubble; "
            "print(fxpar.passes.ir.meta.__file__, fxpar.cost.bubble.__file__)")
    out = subprocess.run([sys.executable, "-c", code, str(ROOT)], check=True, capture_output=True,
                         text=True, cwd=tmp_path).stdout
    assert str(ROOT / "passes" / "ir" / "meta.py") in out and str(ROOT / "cost" / "bubble.py") in out


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

    graph = nx.DiGraph()
    for folder in PACKAGES:
        for path in _sources(folder):
            if path.stem == "__init__":
                continue
            me = _module(path)
            graph.add_node(me)
            for imported in _module_level_imports(path):
                if imported.startswith("fxpar.") and imported != me:
                    graph.add_edge(me, imported)
    cycles = list(nx.simple_cycles(graph))
    assert not cycles, cycles


def test_no_cycles_between_packages():
    """Counting every import (inside functions too), no two packages import each other, directly or round a loop
    (a package and its own subpackages aside): fusion once read rng's streams while rng read fusion's kernels."""
    import networkx as nx

    def package_of(module: str) -> str:
        return module if (ROOT / module.replace("fxpar.passes", "passes").replace("fxpar.cost", "cost")
                          .replace(".", "/")).is_dir() or module == "fxpar" else module.rpartition(".")[0]

    graph = nx.DiGraph()
    for folder in PACKAGES:
        for path in _sources(folder):
            me = _module(path) if path.stem == "__init__" else _module(path).rpartition(".")[0]
            for name, line in _imports(path):
                if name.split(".")[0] != "fxpar":
                    continue
                other = package_of(name)
                if other != me and not other.startswith(me + ".") and not me.startswith(other + "."):
                    graph.add_edge(me, other, where=f"{path.relative_to(ROOT)}:{line}")
    cycles = [[(a, graph.edges[a, b]["where"]) for a, b in zip(c, c[1:] + c[:1])] for c in nx.simple_cycles(graph)]
    assert not cycles, cycles


def _packages():
    return [p.parent for folder in PACKAGES for p in _sources(folder) if p.name == "__init__.py"]


@pytest.mark.parametrize("package", _packages(), ids=lambda p: str(p.relative_to(ROOT)))
def test_each_package_index_names_every_module_and_subpackage(package):
    """A package's __init__ docstring is its index: it names each module (file.py) and subpackage (folder/)."""
    index = ast.get_docstring(ast.parse((package / "__init__.py").read_text())) or ""
    parts = [p.name for p in package.glob("*.py") if p.stem != "__init__"]
    parts += [f"{d.name}/" for d in package.iterdir() if (d / "__init__.py").is_file()]
    missing = [name for name in sorted(parts) if name not in index]
    assert not missing, f"{package.relative_to(ROOT)}/__init__.py's docstring does not list {missing}"


def test_no_two_modules_share_a_name():
    """Names say what a module holds: no module or subpackage name is used twice across fxpar/, passes/, cost/."""
    names = {}
    for folder in PACKAGES:
        for path in _sources(folder):
            name = path.parent.name if path.stem == "__init__" else path.stem
            if path.parent != ROOT / folder or path.stem != "__init__":
                names.setdefault(name, []).append(str(path.relative_to(ROOT)))
    shared = {name: where for name, where in names.items() if len(where) > 1}
    assert not shared, shared


def test_no_module_reads_the_executables_private_attributes():
    """A rank's state lives in pm.rank (fxpar/runtime/executable.py RankState: its weights, program cache, loss
    scaler, distributed optimizer, groups). Only the executable's own classes touch its private attributes."""
    own = {"executable.py", "pipeline_executable.py"}
    found = []
    for path in _sources("fxpar"):
        if path.name in own:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
                holder = node.value
                name = holder.id if isinstance(holder, ast.Name) else getattr(holder, "attr", "")
                if name == "pm":
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno} .{node.attr}")
            if isinstance(node, ast.Subscript) and isinstance(node.value, ast.Attribute) \
                    and node.value.attr == "__dict__" and getattr(node.value.value, "id", "") == "pm":
                found.append(f"{path.relative_to(ROOT)}:{node.lineno} pm.__dict__[...]")
    assert not found, found


def test_the_module_paths_named_in_sources_and_docs_exist():
    """A path like passes/fusion/dropout.py or a dotted name like fxpar.passes.ir.meta in a docstring, a message or a
    docs page names a module that exists (a renamed module leaves no stale name behind)."""
    import re

    files = _code_files() + _sources("cost") + sorted((ROOT / "docs").glob("*.md")) + [ROOT / "README.md"]
    stale = set()
    for path in files:
        text = path.read_text()
        for found in re.findall(r"\b((?:fxpar|passes|cost)/[\w/]+\.py)\b", text):
            if not (ROOT / found).is_file():
                stale.add(f"{path.relative_to(ROOT)}: {found}")
        for found in re.findall(r"\bfxpar\.(?:passes|cost|runtime|checkpoint|cli)(?:\.[a-z_]+)+", text):
            package, *rest = found.split(".")[1:]
            folder = ROOT / (package if package in ("passes", "cost") else f"fxpar/{package}")
            if not rest or (folder.joinpath(*rest) / "__init__.py").is_file():
                continue
            # a module, or an attribute of one (fxpar.cost.comm.ring_seconds); a package's missing module is stale
            if not any(folder.joinpath(*rest[:k]).with_suffix(".py").is_file() for k in range(1, len(rest) + 1)):
                stale.add(f"{path.relative_to(ROOT)}: {found}")
    assert not stale, sorted(stale)


def test_op_sets_live_in_op_families():
    """A set of ATen ops named at module level is an op family: it lives in passes/ir/op_families.py, where a family
    fixed is fixed for every pass (a table keyed by op, like rules' GEMM_WEIGHT_ARG, is a table, not a family)."""
    found = []
    for path in _code_files():
        if path.name == "op_families.py":
            continue
        for node in ast.parse(path.read_text()).body:
            value = node.value if isinstance(node, (ast.Assign, ast.AnnAssign)) else None
            if isinstance(value, ast.Call) and getattr(value.func, "id", "") in ("frozenset", "set") and value.args:
                value = value.args[0]
            if isinstance(value, (ast.Set, ast.Tuple, ast.List)) and value.elts and \
                    all("aten" in ast.unparse(e) for e in value.elts):
                found.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not found, found


# what the runtime may take from passes/ beyond the IR: data types and constants, none of them a graph rewrite
RUNTIME_FROM_PASSES = {
    "fxpar.passes.tensor_parallel.collectives": {"TPComm"},  # a rank's tp group: rank, size, collectives
    "fxpar.passes.sharding.plan": {"Plan", "WeightShard"},  # pm.plan's type (fxpar/describe.py builds it)
    "fxpar.passes.pipeline.lower": {"Program"},  # the lowered schedule the interpreter runs
    "fxpar.passes.pipeline.schedules": {"B", "F", "RECV_B", "RECV_F", "SEND_B", "SEND_F", "rank_of_chunk"},
}


@pytest.mark.parametrize("path", sorted((ROOT / "fxpar" / "runtime").glob("*.py")), ids=lambda p: p.name)
def test_the_runtime_calls_no_graph_pass(path):
    """The runtime runs what the compiler made: from passes/ it imports the IR (passes/ir/) and the data types above,
    never a pass (the joint programs and their dp buckets are asked of the compiler: fxpar/programs.py)."""
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("fxpar.passes") \
                and not node.module.startswith("fxpar.passes.ir"):
            names = {a.name for a in node.names}
            allowed = RUNTIME_FROM_PASSES.get(node.module, set())
            assert names <= allowed, f"fxpar/runtime/{path.name}:{node.lineno} imports {sorted(names - allowed)} " \
                                     f"from {node.module}"


def test_graph_passes_run_only_from_the_declared_stage_lists():
    """In fxpar/, only the compiler (STAGES) and fxpar/programs.py (PROGRAM_STAGES, HALF_STAGES) call a graph pass:
    a function of passes/ that rewrites a graph (the `*_pass` functions and the joint programs' passes)."""
    rewrites = {"with_dp_buckets", "distinct_outputs", "tag_nodes", "dead_code", "in_place_collectives",
                "early_collectives", "late_waits", "export_joint", "compile_joint", "unfuse"}
    hits = []
    for path in _sources("fxpar"):
        if path.relative_to(ROOT).as_posix() in ("fxpar/compiler.py", "fxpar/programs.py"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call):
                name = node.func.id if isinstance(node.func, ast.Name) else getattr(node.func, "attr", "")
                if name.endswith("_pass") or name in rewrites:
                    hits.append(f"{path.relative_to(ROOT)}:{node.lineno} {name}")
    assert not hits, hits
