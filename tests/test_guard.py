"""fxpar/guard.py: which stack frames are the user's. A frame belongs to torch or fxpar by where its module lives,
never by a word in its path, so the suite passes from a clone in a folder named `fxpar` (the natural name)."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]

USER_MODEL = '''
import torch


class Reverse(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return -grad


class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(16, 16)

    def forward(self, x):
        return Reverse.apply(self.fc(x))  # the line the refusal names
'''


def test_a_user_file_under_a_folder_named_fxpar_is_the_users(tmp_path, monkeypatch):
    from fxpar.api import build
    from fxpar.passes.tensor_parallel.collectives import TPComm
    from fxpar.trace import TraceError

    folder = tmp_path / "fxpar" / "models"
    folder.mkdir(parents=True)
    (folder / "user_model_fxpar_guard.py").write_text(USER_MODEL)
    monkeypatch.syspath_prepend(str(folder))
    from user_model_fxpar_guard import Model

    with pytest.raises(TraceError, match=r"custom autograd.Function Reverse at .*/fxpar/models/"
                                         r"user_model_fxpar_guard.py:\d+ \(return Reverse.apply"):
        build(Model(), TPComm(0, 2), (torch.randn(2, 16),))


@pytest.mark.slow
def test_the_suite_passes_from_a_clone_in_a_folder_named_fxpar(tmp_path):
    """The refusals that name the user's line, run by pytest from a copy of the repository in tmp/fxpar."""
    files = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                           capture_output=True, text=True, check=True)
    clone = tmp_path / "fxpar"
    for name in filter(None, files.stdout.split("\0")):
        if (ROOT / name).is_file():
            (clone / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, clone / name)
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_soundness.py",
                          "tests/test_guard.py", "-k", "autograd_a_trace_would_drop or registered_custom_op or "
                          "user_file_under"],
                         cwd=clone, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "4 passed" in out.stdout, out.stdout
