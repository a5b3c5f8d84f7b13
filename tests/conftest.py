"""Test set-up shared by every test module.

* Puts the repository root on ``sys.path`` so that ``tests.harness`` imports from any working
  directory and under either pytest import mode. Spawned ranks inherit this ``sys.path``, so they can
  import the test module that defines a scenario (``test_foo`` or ``tests.test_foo``) by name.
* After each test module, fails if it left child processes running (an unclosed ``RankPool``), other than the
  ranks of the pools the modules share (tests/harness.py shared_pool), which are closed at the end of the session.
* Sorts tests by cost with markers (pyproject.toml lists them): a test that takes a ``pool*`` fixture is marked
  ``gloo`` here; tests that start ranks, torchrun or long runs by other means are marked where they are written.
  ``make test-fast`` runs the rest: one process, seconds.
* Gives inductor (Config(compile=True)) a cache of the session's own per CPU-kernel setting: torch keys its compiled
  kernels without ATEN_CPU_CAPABILITY, and a kernel cached under one setting read an embedding out of bounds under
  another (test_compile under ATEN_CPU_CAPABILITY=avx2 after a run under the machine's own setting).
"""
from __future__ import annotations

import getpass
import os
import sys
import tempfile
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(
    tempfile.gettempdir(), f"fxpar-inductor-{getpass.getuser()}-{os.environ.get('ATEN_CPU_CAPABILITY') or 'native'}"))


def pytest_collection_modifyitems(config, items):
    for item in items:
        if any(name.startswith("pool") for name in getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.gloo)


def pytest_sessionfinish(session, exitstatus):
    from tests.harness import close_shared_pools

    close_shared_pools()


@pytest.fixture(scope="module", autouse=True)
def _no_leftover_processes(request):
    """Torn down after the module's own fixtures (it is set up first), so its pools are closed by then."""
    yield
    from tests.harness import leftover_children

    leftover = leftover_children()
    for proc in leftover:
        proc.kill()
        proc.join()
    if leftover:
        pytest.fail(f"{request.module.__name__} left {len(leftover)} child processes running "
                    f"({', '.join(p.name for p in leftover)}); close each RankPool (use `with` or "
                    "tests.harness.module_pool)", pytrace=False)
