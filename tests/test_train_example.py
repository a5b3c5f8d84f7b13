"""The training example under real torchrun: two "nodes" on loopback with c10d rendezvous, and `fxpar run`."""
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.torchrun, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[1]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]
SMALL = ["--steps", "3", "--layers", "2", "--hidden", "32", "--seq", "16", "--batch", "8"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env():
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def test_two_nodes_on_loopback():
    port = _free_port()
    nodes = [
        subprocess.Popen(TORCHRUN + ["--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "c10d",
                                     "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "fxpar-test",
                                     "examples/train_gpt.py", "--pp", "2", *SMALL],
                         cwd=ROOT, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for _ in range(2)
    ]
    outs = [n.communicate(timeout=300)[0] for n in nodes]
    assert all(n.returncode == 0 for n in nodes), "\n----\n".join(outs)
    log = "".join(outs)
    assert "training on 2 ranks: p=2 t=1 d=1" in log and "step    2  loss" in log


def test_fxpar_run_any_ptdv():
    out = subprocess.run([sys.executable, "-m", "fxpar.cli.main", "run", "--standalone", "--nproc-per-node", "4",
                          "examples/train_gpt.py", "--tp", "2", "--pp", "2", *SMALL], cwd=ROOT, env=_env(),
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "p=2 t=2 d=1 v=1 m=4 1f1b" in out.stdout and "step    2  loss" in out.stdout


def test_elastic_restart_resumes_from_the_last_checkpoint(tmp_path):
    """A rank SIGKILLed at step 7 of 12 under torchrun --max-restarts 1 (through fxpar run): the restarted workers
    load the step-5 checkpoint and end with the uninterrupted run's final loss, to the last bit (fp32, same
    layout)."""
    def train(*extra):  # fxpar run: torchrun, with the restart-safe rendezvous store (fxpar/cli/run_command.py)
        out = subprocess.run([sys.executable, "-m", "fxpar.cli.main", "run", "--standalone", "--nproc-per-node", "2",
                              "--max-restarts", "1", "examples/train_gpt.py", "--tp", "2", "--precision", "fp32",
                              "--steps", "12", "--layers", "2", "--hidden", "32", "--seq", "16", "--batch", "8",
                              "--save-every", "5", *extra],
                             cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stdout + out.stderr
        return out.stdout

    straight = train()
    restarted = train("--checkpoint", str(tmp_path / "ckpt"), "--kill-at-step", "7")
    assert "resumed from" in restarted and "step-000005 at step 5" in restarted, restarted
    final = [line for line in straight.splitlines() if line.startswith("final loss")]
    assert final and final[-1] in restarted.splitlines(), (final, restarted)
    assert sorted(os.listdir(tmp_path / "ckpt")) == ["step-000005", "step-000010", "step-000012"]
