"""The package as users install it: a wheel built from the tree, installed into a fresh environment, outside the
repository. An editable install (what `make` does) maps the folders itself and would hide a subpackage the wheel
left out, so this builds and installs the wheel for real, and builds one from the sdist too."""
from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
import venv
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow

IMPORT_ALL = """
import importlib, pkgutil, fxpar
names = [m.name for m in pkgutil.walk_packages(fxpar.__path__, "fxpar.")]
for name in names:
    importlib.import_module(name)
for public in fxpar.__all__:
    getattr(fxpar, public)
assert "editable" not in repr(fxpar.__spec__) and "{root}" not in fxpar.__file__, fxpar.__file__
print(len(names), "modules from", fxpar.__file__)
"""


def _source_packages() -> set[str]:
    """Every package folder of the three code folders, as the import name an install gives it."""
    out = set()
    for prefix, folder in (("fxpar", "fxpar"), ("fxpar.passes", "passes"), ("fxpar.cost", "cost")):
        for init in (ROOT / folder).rglob("__init__.py"):
            rel = init.parent.relative_to(ROOT / folder).parts
            out.add(".".join((prefix, *rel)))
    return out


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("dist")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(out),
                    str(ROOT)], check=True, cwd=out)
    (built,) = out.glob("fxpar-*.whl")
    return built


def test_the_wheel_holds_every_package(wheel):
    with zipfile.ZipFile(wheel) as z:
        packaged = {os.path.dirname(n).replace("/", ".") for n in z.namelist() if n.endswith("/__init__.py")}
    assert packaged == _source_packages(), sorted(packaged ^ _source_packages())


def test_a_wheel_built_from_the_sdist_holds_every_package(tmp_path):
    """The source distribution (what an index serves where no wheel fits) carries every package, and the wheel pip
    builds from it does too."""
    subprocess.run([sys.executable, "setup.py", "-q", "sdist", "-d", str(tmp_path)], check=True, cwd=ROOT,
                   capture_output=True)
    (sdist,) = tmp_path.glob("fxpar-*.tar.gz")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                    str(tmp_path / "wheel"), str(sdist)], check=True, cwd=tmp_path)
    test_the_wheel_holds_every_package(next((tmp_path / "wheel").glob("fxpar-*.whl")))


def test_the_wheel_installs_imports_and_checks_outside_the_repo(wheel, tmp_path):
    """A fresh environment that borrows this one's torch (the folder, not its .pth files, so not the editable
    fxpar), with the wheel installed; every module imports and `fxpar check` proves the example GPT."""
    env_dir = tmp_path / "env"
    venv.create(env_dir, with_pip=False)
    python = env_dir / "bin" / "python"
    site = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          check=True, capture_output=True, text=True).stdout.strip()
    Path(site, "borrowed_torch.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "--no-index", "-q",
                    str(wheel)], check=True, cwd=tmp_path)
    work = tmp_path / "elsewhere"
    work.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    out = subprocess.run([python, "-c", IMPORT_ALL.replace("{root}", str(ROOT))], check=True, capture_output=True,
                         text=True, cwd=work, env=env).stdout
    assert "modules from" in out and str(env_dir) in out, out
    check = subprocess.run([env_dir / "bin" / "fxpar", "check", f"{ROOT}/examples/gpt.py:lm", "--tp", "2",
                            "--steps", "1"], capture_output=True, text=True, cwd=work, env=env, timeout=600)
    assert check.returncode == 0, check.stdout + check.stderr
    assert "exact" in check.stdout, check.stdout
