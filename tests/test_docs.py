"""Every fenced code block in README.md and docs/*.md runs here, or says that it does not.

The convention, by the fence's language:

* ```python: executed, in a fresh namespace whose `__name__` is "__main__", with the working directory a
  temporary folder (below). Alone, in this process; or, where the line right above the fence is an HTML comment
  `<!-- docs-test: ranks=N -->` (N = 2 or 4), on every rank of an N-rank gloo pool (tests/harness.py), so that
  `fxpar.init_mesh(...)` finds its process group as under torchrun. `file=NAME` in the comment also writes the
  block into the folder as NAME before any block runs, so that a later block imports it and a console block
  names it (the README's quickstart is `quickstart.py`). `slow` marks the test slow.
* ```console: each line that starts with `$ ` is a command, `fxpar ...` or `python ...`, run as a subprocess in
  the folder (the installed `fxpar`, this interpreter); it must exit 0. The other lines are what it prints: each one
  (its numbers replaced by `#` and its spacing folded; a line holding `...` is skipped) must be a line of the real
  output, so the docs keep its shape without pinning the digits. A command shown on two pages runs once.
* ```text: not run. Pictures, listings, and commands this machine does not run here (make, torchrun on several
  nodes, a GPU). `<!-- docs-test: stages -->` above one marks the compiler's stage list, checked against
  fxpar.compiler.STAGES.
* Any other fence (none, sh, bash, ...) fails test_every_block_is_run_or_text.

The folder is the same for every block of a session: a temporary directory with `examples` linked to the
repository's, so that commands read as from the repository root (`fxpar show examples/gpt.py:factory --tp 2`).
A block's traceback names the page and the page's line. Markers (pyproject.toml): a block on ranks is `gloo`
(tests/conftest.py marks every test that takes a pool), a console block that runs `fxpar check` is `gloo` and
`slow` (it starts its own gloo ranks). Links between the pages (a file, and a heading's anchor) must resolve too.
"""
from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.harness import module_pool

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
KINDS = ("python", "console", "text")
COMMANDS = ("fxpar", "python")
FENCE = re.compile(r"^(`{3,})([\w-]*)\s*$")
MARK = re.compile(r"^<!--\s*docs-test:(.*?)-->\s*$")
NUMBER = re.compile(r"[-+]?\d+(?:\.\d+)?(?:e[-+]?\d+)?")

pool2 = module_pool(2, timeout_s=120)
pool4 = module_pool(4, timeout_s=120)


@dataclass(frozen=True)
class Block:
    page: str  # relative to the repository root
    line: int  # the opening fence's, 1-based
    kind: str
    code: str
    ranks: int = 0  # 0: one process
    file: str = ""
    slow: bool = False
    stages: bool = False

    @property
    def where(self) -> str:
        return f"{self.page}:{self.line}"


def _marker(text: str, where: str) -> dict:
    out = {}
    for word in text.split():
        key, _, value = word.partition("=")
        if key == "ranks" and value in ("2", "4"):
            out["ranks"] = int(value)
        elif key == "file" and value:
            out["file"] = value
        elif key in ("slow", "stages") and not value:
            out[key] = True
        else:
            raise ValueError(f"{where}: unknown docs-test word {word!r}")
    return out


def read_blocks(path: Path) -> list[Block]:
    """Every fenced block of one page, with the docs-test comment right above it, if any."""
    page, lines = str(path.relative_to(ROOT)), path.read_text().splitlines()
    out, i = [], 0
    while i < len(lines):
        mark = MARK.match(lines[i].strip())
        if mark:
            if i + 1 >= len(lines) or not FENCE.match(lines[i + 1].strip()):
                raise ValueError(f"{page}:{i + 1}: a docs-test comment must stand right above a fence")
            options = _marker(mark.group(1), f"{page}:{i + 1}")
            i += 1
        else:
            options = {}
        fence = FENCE.match(lines[i].strip())
        if fence:
            start, body = i, []
            i += 1
            while i < len(lines) and lines[i].strip() != fence.group(1):
                body.append(lines[i])
                i += 1
            if i == len(lines):
                raise ValueError(f"{page}:{start + 1}: the fence is never closed")
            out.append(Block(page, start + 1, fence.group(2), "\n".join(body) + "\n", **options))
        i += 1
    return out


BLOCKS = [b for page in PAGES for b in read_blocks(page)]


def _params(keep) -> list:
    return [pytest.param(b, id=b.where, marks=[pytest.mark.slow] if b.slow else []) for b in BLOCKS if keep(b)]


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> str:
    """The folder every block runs in: `examples` linked, and the blocks marked file=NAME written."""
    folder = tmp_path_factory.mktemp("docs")
    (folder / "examples").symlink_to(ROOT / "examples")
    for b in BLOCKS:
        if b.file:
            (folder / b.file).write_text(b.code)
    return str(folder)


def test_every_block_is_run_or_text():
    assert BLOCKS, "no code blocks found"
    for b in BLOCKS:
        assert b.kind in KINDS, f"{b.where}: a ```{b.kind or '(no language)'} block; use one of {KINDS} (see tests/test_docs.py)"
        assert not b.ranks or b.kind == "python", f"{b.where}: ranks= goes on a python block"
        assert not b.stages or b.kind == "text", f"{b.where}: stages goes on a text block"
        if b.kind == "console":
            commands = [line for line in b.code.splitlines() if line.startswith("$ ")]
            assert commands, f"{b.where}: a console block without a `$ ` command"
            for c in commands:
                assert shlex.split(c[2:])[0] in COMMANDS, f"{b.where}: {c!r} is none of {COMMANDS}"
    names = [b.file for b in BLOCKS if b.file]
    assert len(names) == len(set(names)), f"two blocks write the same file: {names}"


def run_block(code: str, filename: str, workdir: str) -> None:
    """Scenario: run one python block on this rank (or process), from `workdir`, as a script would run (with this
    environment's `fxpar` on PATH, as in an activated virtual environment)."""
    bin_dir = str(Path(sys.executable).parent)
    if bin_dir not in os.environ["PATH"].split(os.pathsep):
        os.environ["PATH"] = bin_dir + os.pathsep + os.environ["PATH"]
    cwd = os.getcwd()
    os.chdir(workdir)
    sys.path.insert(0, workdir)
    try:
        exec(compile(code, filename, "exec"), {"__name__": "__main__"})
    finally:
        sys.path.remove(workdir)
        os.chdir(cwd)


def _source(b: Block) -> tuple[str, str]:
    """The block's code padded so that a traceback's line numbers are the page's."""
    return "\n" * b.line + b.code, str(ROOT / b.page)


@pytest.mark.parametrize("block", _params(lambda b: b.kind == "python" and not b.ranks))
def test_python_block(block, workdir):
    run_block(*_source(block), workdir)


@pytest.mark.parametrize("block", _params(lambda b: b.kind == "python" and b.ranks == 2))
def test_python_block_on_2_ranks(pool2, block, workdir):
    pool2.run(run_block, *_source(block), workdir)


@pytest.mark.parametrize("block", _params(lambda b: b.kind == "python" and b.ranks == 4))
def test_python_block_on_4_ranks(pool4, block, workdir):
    pool4.run(run_block, *_source(block), workdir)


_RUNS: dict[str, subprocess.CompletedProcess] = {}  # a command shown on two pages runs once


def _run(command: str, workdir: str) -> subprocess.CompletedProcess:
    if command not in _RUNS:
        argv = shlex.split(command)
        program = Path(sys.executable).with_name("fxpar") if argv[0] == "fxpar" else sys.executable
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
        _RUNS[command] = subprocess.run([str(program), *argv[1:]], cwd=workdir, env=env, capture_output=True,
                                        text=True, timeout=600)
    return _RUNS[command]


def _shape(line: str) -> str:
    """A printed line with its numbers, dotted names and rule widths aside: which parameter's difference is the largest
    (and so the width of its column) is the last bit of rounding, which differs between CPU kernels."""
    line = NUMBER.sub("#", line)
    line = re.sub(r"[A-Za-z_][\w#]*(?:\.[\w#]+)+", "<name>", line)
    return " ".join(re.sub(r"-{2,}", "--", line).split())


def _console(b: Block) -> list[tuple[str, list[str]]]:
    """(command, the output lines shown after it) for each `$ ` line."""
    out = []
    for line in b.code.splitlines():
        if line.startswith("$ "):
            out.append((line[2:], []))
        elif out and line.strip() and "..." not in line:
            out[-1][1].append(line)
    return out


def _console_params() -> list:
    marks = lambda b: ([pytest.mark.gloo, pytest.mark.slow] if "fxpar check" in b.code  # it starts gloo ranks
                       else [pytest.mark.slow] if b.slow else [])
    return [pytest.param(b, id=b.where, marks=marks(b)) for b in BLOCKS if b.kind == "console"]


@pytest.mark.parametrize("block", _console_params())
def test_console_block(block, workdir):
    for command, shown in _console(block):
        run = _run(command, workdir)
        printed = run.stdout + run.stderr
        assert run.returncode == 0, f"{block.where}: `{command}` exited {run.returncode}:\n{printed}"
        real = {_shape(line) for line in printed.splitlines()}
        missing = [line for line in shown if _shape(line) not in real]
        assert not missing, (f"{block.where}: `{command}` no longer prints these lines (numbers and names aside):\n"
                             + "\n".join(missing) + f"\n--- it printed:\n{printed}")


def test_the_stage_list_is_the_compilers():
    from fxpar.compiler import STAGES

    listed = [b for b in BLOCKS if b.stages]
    assert listed, "no block marked <!-- docs-test: stages -->"
    for b in listed:
        names = [line.split()[0] for line in b.code.splitlines() if line[:1].strip()]
        assert names == [name for name, _, _ in STAGES], f"{b.where}: the stage list differs from STAGES"


LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _prose(path: Path) -> list[str]:
    """The page's lines outside fenced blocks."""
    out, fence = [], None
    for line in path.read_text().splitlines():
        match = FENCE.match(line.strip())
        if fence is None and match:
            fence = match.group(1)
        elif fence is not None and line.strip() == fence:
            fence = None
        elif fence is None:
            out.append(line)
    return out


def test_every_link_between_the_pages_resolves():
    for page in PAGES:
        for line in _prose(page):
            for target in LINK.findall(line):
                if re.match(r"[a-z]+:", target):
                    continue  # http(s), mailto: not checked here
                path, _, anchor = target.partition("#")
                resolved = (page.parent / path).resolve() if path else page
                assert resolved.exists(), f"{page.relative_to(ROOT)}: link to {target!r}: no such file"
                if anchor and resolved.suffix == ".md":
                    slugs = {_slug(h.lstrip("#")) for h in _prose(resolved) if h.startswith("#")}
                    assert anchor in slugs, f"{page.relative_to(ROOT)}: link to {target!r}: no such heading"
